#!/usr/bin/env bash
# Set up ./.venv with meshpar (editable) and its dev tools. Idempotent: a second run takes seconds.
#
# torch first, on purpose: with no torch present, a bare `torch` requirement pulls the newest
# CUDA build (several GB) even on a machine without a GPU. So on a machine without an NVIDIA
# GPU this installs the CPU build of torch 2.13 (a local wheel where the machine provides one,
# else PyTorch's CPU index); with a GPU, the default CUDA build. An existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
# --no-compile: pip would byte-compile every module of every package (torch's thousands, most never
# imported); Python writes the bytecode of what is imported at its first import instead (the
# difference: docs/performance.md#test-suite-and-set-up).
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing torch 2.13.0 (CUDA build)"
    "${pip[@]}" "torch==2.13.0"
  else
    echo "setup: installing torch 2.13.0 (CPU build)"
    "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
      || "${pip[@]}" "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

echo "setup: installing meshpar and its dependencies"
"${pip[@]}" -e ".[dev]"
.venv/bin/python -c "import torch, meshpar; print(f'setup: ready (torch {torch.__version__}, meshpar {meshpar.__version__})')"
