"""Convert a checkpoint from a script: the same as ``meshpar convert`` (see meshpar/convert/).

    python tools/convert.py runs/llama/checkpoints/step_200 out/llama-hf --to hf --verify
    python tools/convert.py out/llama-hf ckpt/step_0 --to dcp
    python tools/convert.py ckpt/step_200 ckpt8/step_200 --to dcp --layout dp_shard=4,tp=2
"""

from __future__ import annotations

import argparse
import sys

from meshpar.cli import CONVERT_HELP, add_convert_arguments, run_convert


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/convert.py", description=CONVERT_HELP)
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
