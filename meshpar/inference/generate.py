"""``meshpar generate``: text from a meshpar checkpoint (any layout) or a Hugging Face folder, in one
process (CPU or one GPU), greedy or sampled, with a KV cache (meshpar/models/decode.py).

    meshpar generate CHECKPOINT_OR_HF_FOLDER --prompt "..." [--max-new-tokens 64]
                     [--temperature 0] [--top-p 1.0] [--seed 0] [--device cpu|cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

from meshpar.models.decode import generate, prompt_ids


def load_model(path: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of a meshpar checkpoint folder (saved at any layout) or a Hugging Face folder, in one
    process, read one tensor at a time (meshpar/convert)."""
    from meshpar.convert.spec import ConvertError
    from meshpar.convert.stream import open_checkpoint
    from meshpar.models import get_family

    source = open_checkpoint(path)
    spec = source.spec
    family = get_family(spec.family)
    if family.generate_refusal is not None:
        raise ConvertError(f"{path}: `meshpar generate` is not built for model family '{family.name}' "
                           f"({family.generate_refusal})")
    with torch.device("meta"):
        model = family.model_cls(spec.args)
    model.to_empty(device=device)
    model.init_weights()  # derived buffers (RoPE tables); every parameter is then read
    state = model.state_dict()
    with torch.no_grad():
        for name, value in state.items():
            value.copy_(source.read(f"model.{name}"))
    return model.to(dtype)


def load_tokenizer_for(path: str | Path):
    """The tokenizer a checkpoint or Hugging Face folder carries (tokenizer.json), or the byte tokenizer
    its recipe names."""
    from meshpar.config import recipe as recipelib
    from meshpar.data.tokenizer import ByteTokenizer, load_tokenizer

    path = Path(path)
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(str(path))
    recipe = path / "recipe.toml"
    if recipe.is_file() and recipelib.load(recipe, []).data.tokenizer == "byte":
        return ByteTokenizer()
    raise ValueError(f"{path}: no tokenizer.json, and no recipe.toml naming data.tokenizer = \"byte\"; "
                     "generate from a folder that holds its tokenizer")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="meshpar generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("path", help="a checkpoint folder <output_dir>/checkpoints/step_<N>, or a Hugging Face folder")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0: nucleus sampling's mass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    return ap


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from meshpar.convert.spec import ConvertError

    try:
        model = load_model(args.path, device=args.device, dtype=getattr(torch, args.dtype))
        tokenizer = load_tokenizer_for(args.path)
        prompt = prompt_ids(tokenizer, args.prompt)
        start = time.perf_counter()
        out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, stop=getattr(tokenizer, "eos_id", None))
        seconds = time.perf_counter() - start
        text = tokenizer.decode(out)
    except (ConvertError, ValueError) as e:
        print(f"meshpar: error: {e}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    print(f"meshpar: {len(out)} tokens in {seconds:.2f} s ({len(out) / seconds:,.1f} tokens/s)", file=sys.stderr)
    return 0
