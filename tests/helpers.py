"""Helpers shared by several test files: the small training recipe, the model builder, and
what a distributed training run returns. Test files import from here, never from each other.

tests/fsdp_models.py is the other shared module: the tiny models (``Net``, a two-block GPT-2)
and the parity loop behind tests/test_fsdp.py's engine-level FSDP cases.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from meshpar.config import recipe as recipelib
from meshpar.models import get_family
from meshpar.models.gpt2 import GPT2, GPT2_SIZES
from meshpar.models.llama import LLAMA_SIZES, QWEN2_SIZES, QWEN3_SIZES, Transformer
from meshpar.train import train

ROOT = Path(__file__).resolve().parents[1]  # the repository: recipes/ lives here
# Overrides that make any shipped recipe a seconds-long run: 2 blocks, byte tokenizer (256
# tokens, no BPE training), 8 sequences of 64 per step, a metrics record every step.
SMALL = ["--model.n_layers=2", "--train.seq_len=64", "--train.global_batch=8", "--train.micro_batch=2",
         "--train.log_every=1", "--train.eval_every=0", "--data.tokenizer=byte", "--model.vocab_size=256",
         "--metrics.progress=off", "--optim.warmup_steps=2"]

FAMILIES = {"llama": (Transformer, LLAMA_SIZES), "qwen2": (Transformer, QWEN2_SIZES),
            "qwen3": (Transformer, QWEN3_SIZES), "gpt2": (GPT2, GPT2_SIZES)}  # family -> (class, sizes)


def load_recipe(name: str, out: Path, *extra: str) -> recipelib.Recipe:
    """recipes/``name`` with the SMALL overrides, writing to ``out``, then ``extra`` overrides
    (command-line syntax: ``"--train.steps=4"``), which win."""
    return recipelib.load(ROOT / "recipes" / name, [*SMALL, f"--train.output_dir={out}", *extra])


def train_losses(records: list[dict]) -> list[float]:
    """The training loss of every logged step, from ``train(...).records`` (eval records skipped)."""
    return [r["loss"] for r in records if "loss" in r]


def train_on_rank(recipe: recipelib.Recipe) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """``meshpar train`` on one rank, for ``run_distributed(..., init_process_group=False)``
    (train sets up its own process group): (metric records, the whole gathered state dict)."""
    result = train(recipe, return_state=True)
    return result.records, result.state_dict


def merged_state(results: list[tuple[object, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """The whole model's parameters from every rank's ``(records, state)`` (each rank gathers its
    own pipeline stages); fails if two ranks hold different values for one name."""
    merged: dict[str, torch.Tensor] = {}
    for _, state in results:
        for name, value in state.items():
            if name in merged:
                assert torch.equal(merged[name], value), f"ranks disagree on {name}"
            merged[name] = value
    assert merged, "no rank returned any state"
    return merged


def build_model(family: str, size: str = "debug", seed: int = 0, **overrides) -> nn.Module:
    """``family``'s ``size`` model (args ``overrides`` replaced) on CPU, initialized from ``seed``."""
    if family in FAMILIES:
        cls, sizes = FAMILIES[family]
    else:  # the mixture-of-experts families, from the registry (not in FAMILIES' parametrizations)
        registered = get_family(family)
        cls, sizes = registered.model_cls, registered.sizes
    model = cls(dataclasses.replace(sizes[size], **overrides))
    torch.manual_seed(seed)
    model.init_weights()
    return model


class CpRank:
    """The two methods ``context_parallel.layout.SequenceLayout`` asks of a cp mesh, for rank ``rank`` of ``size``:
    a cp rank's layout computed in one process."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


@torch.no_grad()
def randomize_deepseek(model: nn.Module) -> None:
    """Every tensor of a transformers DeepSeek-V3 random (norms near 1, the routing bias too), in place:
    its own init leaves norms at 1 and the bias at 0, which would hide a norm or bias mapped wrong."""
    for name, p in model.named_parameters():
        p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.08)
    for name, b in model.named_buffers():
        if "e_score_correction_bias" in name:
            b.normal_(0.0, 0.1)
