"""GPT-2 family (124M to 1.5B) with Hugging Face module names."""

from meshpar.models.gpt2.model import GPT2, GPT2_SIZES, GPT2Args

__all__ = ["GPT2", "GPT2_SIZES", "GPT2Args"]
