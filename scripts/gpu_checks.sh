#!/usr/bin/env bash
# Issue 19's GPU checks in one call on a lent GPU machine (the device tool runs it from the repo
# root with $OUT set; elsewhere results go to runs/gpu):
#
#     bash scripts/gpu_checks.sh [tests|streams|bench|moe|cp|float8|all]...
#
# 1. tests/test_cuda.py (the CUDA-marked tests; on a machine without a GPU they skip);
# 2. tests/benchmarks/bench_gpu_streams.py (the collective path forced on one GPU: streams on
#    and off against no collectives; memory growth; one traced step's NCCL overlap);
# 3. tests/benchmarks/bench_gpu.py (tokens/s and MFU, meshpar beside plain PyTorch, and the
#    profile summary of one step);
# 4. tests/benchmarks/bench_grouped_mm.py (issue 17: the experts' grouped kernel against the loop
#    in bf16, at one ep-8 rank's share of Qwen3-30B-A3B and 235B-A22B layers), then
#    tests/benchmarks/bench_moe_layer.py (issue 33: a DeepSeek-V3 debug and 16B sparse layer's step,
#    MLA and shared experts included, on each kernel, with TFLOP/s and the share of peak);
# 5. float8 (issue 29): bench_gpu --float8, torchao's tensorwise float8 against bf16 in both
#    engines at 1B (4096, 8192) and 3B, compiled: the float8/bf16 and meshpar/plain ratios.
# 6. cp (issue 31): tests/test_cuda.py's flex tests (the all-gather's attention and the ring on
#    flex_attention, forward and backward against float64), then bench_cp_attention --flex at the
#    128k recipes' shapes (gather-flex and ring-flex beside the others: the ring/gather ratio).
# Each part has its own time limit and writes its log under $OUT, so one that fails or runs out
# of time leaves the others' results. The machine's python3 is its own PyTorch (not this
# repository's .venv), so the package is used from the source tree.
set -u
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
parts=${*:-all}
want() { [[ " $parts " == *" all "* || " $parts " == *" $1 "* ]]; }
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} 2>&1 | tee "$out/gpu.txt"
if want tests; then
  timeout "${TESTS_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/test_cuda.log"
fi
if want streams; then
  for dtype in ${STREAMS_DTYPES:-bfloat16}; do
    timeout "${STREAMS_S:-80}" python3 -m tests.benchmarks.bench_gpu_streams --dtype "$dtype" \
      --json "$out/streams_$dtype.json" 2>&1 | grep -v "^USDT" | tee "$out/streams_$dtype.log"
  done
fi
if want bench; then
  timeout "${BENCH_S:-200}" python3 -m tests.benchmarks.bench_gpu --json "$out/bench_gpu.json" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^USDT" | tee "$out/bench_gpu.log"
  if [ -n "${BENCH2_ARGS:-}" ]; then  # a second set, e.g. other cases at another batch
    timeout "${BENCH2_S:-120}" python3 -m tests.benchmarks.bench_gpu --json "$out/bench_gpu2.json" $BENCH2_ARGS 2>&1 \
      | grep -v "^USDT" | tee "$out/bench_gpu2.log"
  fi
fi
if want moe; then
  timeout "${MOE_S:-120}" python3 -m tests.benchmarks.bench_grouped_mm --device cuda --dtypes bfloat16 \
    --cases "debug,qwen3_30b_a3b/ep8,qwen3_235b_a22b/ep8" --json "$out/grouped_mm.json" 2>&1 | tee "$out/grouped_mm.log"
  timeout "${MOE_LAYER_S:-150}" python3 -m tests.benchmarks.bench_moe_layer --device cuda --sizes debug,16b \
    --seq 4096 --hardware auto --json "$out/moe_layer.json" 2>&1 | tee "$out/moe_layer.log"
fi
if want float8; then  # issue 29. The GPU machine reaches no index: carry the wheel, fetched here with
  # pip download --no-deps "torchao>=0.18,<0.19" -d runs/wheels   (and carry=["runs/wheels"])
  python3 -c "import torchao" 2>/dev/null || python3 -m pip install --quiet --no-deps --no-index runs/wheels/torchao-*.whl \
    2>&1 | tail -2
  timeout "${FLOAT8_S:-300}" python3 -m tests.benchmarks.bench_gpu --float8 --budget "${FLOAT8_S:-300}" \
    --json "$out/bench_float8.json" 2>&1 | grep -v "^USDT" | tee "$out/bench_float8.log"
fi
if want cp; then
  # issue 31: the gather and the ring on flex (forward and backward against float64), then their rates
  timeout "${CP_TESTS_S:-120}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py -k flex 2>&1 \
    | tee "$out/cp_flex_tests.log"
  timeout "${CP_S:-150}" python3 -m tests.benchmarks.bench_cp_attention --hardware h200 --flex \
    --json "$out/cp_attention.json" 2>&1 | grep -v "^USDT" | tee "$out/cp_attention.log"
fi
echo "gpu_checks: done"
