"""Training speed on one GPU: meshpar's step next to the same step in plain PyTorch .

    python -m tests.benchmarks.bench_gpu [--cases a,b,...] [--steps 6] [--warmup 3] [--batch 1]
                                         [--budget 220] [--profile [CASES]] [--dtype auto]
                                         [--json runs/bench_gpu.json]
    python -m tests.benchmarks.bench_gpu --smoke [--profile]      # every code path on CPU, < 2 min

A case is ``engine/size/seq_len/mode``, mode one of ``eager``, ``compile``, ``eager+ac``,
``compile+ac`` (torch.compile per block; full activation checkpointing per block), each
optionally ``+f8``: torchao's tensorwise float8 linears in both engines, the layers
meshpar/parallel/float8.py picks (``--float8`` runs the float8 pairs: issue 29's GPU check).
Engines:

- ``meshpar``: meshpar's own training path on a 1-rank process group (NCCL on CUDA, gloo on
  CPU): a recipe's ``[parallel]`` (param_dtype bfloat16, reduce_dtype float32, compile,
  activation_checkpoint) and ``[optim]``, the model from ``meshpar.parallel.parallelize.build`` as
  ``meshpar train`` builds it (on meta; AC -> compile -> fully_shard per block, then root ->
  to_empty + init_weights), meshpar.training.optim's fused AdamW and meshpar.training.step.train_step
  (forward, backward, clip, step). FSDP on one rank aliases
  ([Note: one data-parallel rank] in meshpar/fsdp/param_group.py): no collectives, so the
  engine's own per-step overhead is what is measured. See [Note: bf16 on one rank] below.
- ``plain``: the same model class and initial values, fp32 parameters, forward under
  ``torch.autocast(bfloat16)``, ``torch.compile`` of each block's forward and
  ``torch.utils.checkpoint`` per block as meshpar does them, the same loss, gradient clipping
  (``torch.nn.utils.clip_grad_norm_``) and fused ``torch.optim.AdamW``; no meshpar parallel code.

Every case trains on one fixed random batch of ``--batch`` sequences from the same initial
values ([Note: initial values]); compilation happens in the warmup steps. Per case: the median
step time over the timed steps (the device synchronized around each), tokens/s, MFU, peak
memory (``torch.cuda.max_memory_allocated``), the losses (equal between the engines in fp32,
to bf16 rounding in bf16). MFU = ``flops_per_token(seq_len)`` x tokens/s / peak: the model
FLOPs ``meshpar train`` and ``meshpar plan`` use (meshpar/models/llama/args.py), 6 x matmul
weights (output head included) + 12 x n_layers x H x Dh x T per token, attention without the
causal halving (PaLM's convention; ``mfu_causal`` in the JSON halves it); the peak is the
compute dtype's entry in the hardware profile ``meshpar.config.hardware`` picks for the device
(profiles/h100_sxm.toml, h200.toml: 989.4 TFLOP/s bf16). Then meshpar/plain tokens/s per pair
and the goals as facts. ``--profile`` traces one more step of some cases (default: the first
compiled meshpar case and its plain pair): the top kernels by device time and the step's
shares in matmul, attention, elementwise/norm, optimizer (clipping + AdamW), copies/casts/
communication and idle. The JSON is rewritten after every case; a case that fails is recorded
(``oom``, ``error: ...``) and the run goes on; a case that would end past ``--budget`` seconds,
judged by the longest earlier case of its kind (compiled or eager), is recorded as skipped.

Default cases, most important first, so that a run cut short still answers the goals (MFU >=
45% for 1B, meshpar within 3% of plain): meshpar and plain at 1b/4096/compile, 1b/4096/eager,
1b/2048/eager, 3b/4096/compile+ac, then meshpar 1b/4096/compile+ac, then both at
1b/2048/compile. Compiling dominates a run: every compiled case compiles its own block graph
(bf16 parameters vs autocast, AC, shapes differ), so with the default ``--budget`` slower compiles
drop the last cases first. Results: docs/performance.md#gpu-speed-against-plain-pytorch.

[Note: bf16 on one rank]
meshpar's mixed precision acts through FSDP. ``parallelize_transformer`` gives a one-rank run
with a lower param_dtype FSDP units (``one_device_fsdp``); when ``build`` returns no FSDP module
(a meshpar that makes no unit at ``dp_shard = 1``) the engine applies ``apply_fsdp`` on the
1-rank ``dp_shard`` mesh itself (after compile and AC, as the fixed order has it: both replace a
block's ``forward`` and FSDP's hooks wrap ``__call__``, so the module is the same).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from meshpar.config import recipe as recipelib
from meshpar.config.hardware import load_profile
from meshpar.distributed import mesh as meshlib
from meshpar.fsdp import FSDPModule
from meshpar.models import get_family
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.llama.args import ModelArgs
from meshpar.parallel.float8 import apply_float8
from meshpar.parallel.parallelize import apply_fsdp, build
from meshpar.runtime.process import RankInfo, init_process_group
from meshpar.training.optim import build_optimizer
from meshpar.training.step import GradSync, Model, train_step

GiB = 2**30

# Llama 3.2 3B's public configuration (not a named meshpar size): 3,212,749,824 parameters,
# tied embeddings counted once; RoPE as the 1B (theta 500000, Llama 3.1 scaling with factor 32)
SIZES: dict[str, ModelArgs] = {
    "debug": LLAMA_SIZES["debug"],
    "1b": LLAMA_SIZES["1b"],
    "3b": LLAMA_SIZES.get("3b", dataclasses.replace(LLAMA_SIZES["1b"], dim=3072, n_layers=28, n_heads=24,
                                                    n_kv_heads=8, ffn_dim=8192)),
}
ENGINES = ("meshpar", "plain")
MODES = ("eager", "compile", "eager+ac", "compile+ac")  # each also with "+f8": model.float8 = "tensorwise"

DEFAULT_CASES = [f"{e}/{c}" for c in ("1b/4096/compile", "1b/4096/eager", "1b/2048/eager") for e in ENGINES] + \
    [f"{e}/3b/4096/compile+ac" for e in ENGINES] + ["meshpar/1b/4096/compile+ac"] + \
    [f"{e}/1b/2048/compile" for e in ENGINES]
SMOKE_CASES = [f"{e}/debug/64/{m}" for m in ("eager", "compile+ac", "eager+f8") for e in ENGINES]
FLOAT8_CASES = [f"{e}/{size}/{seq}/{mode}{f8}" for size, seq, mode in (("1b", 4096, "compile"), ("1b", 8192, "compile"),
                                                                       ("3b", 4096, "compile+ac"))
                for f8 in ("", "+f8") for e in ENGINES]


@dataclass(frozen=True)
class Case:
    engine: str
    size: str
    seq_len: int
    compile: bool
    ac: bool  # full activation checkpointing of every block
    float8: bool = False  # torchao's tensorwise float8 linears in both engines (meshpar/parallel/float8.py's choice)

    @classmethod
    def parse(cls, name: str) -> Case:
        try:
            engine, size, seq, mode = name.strip().split("/")
            float8 = mode.endswith("+f8")
            mode = mode.removesuffix("+f8")
            if engine not in ENGINES or size not in SIZES or mode not in MODES:
                raise ValueError
            return cls(engine, size, int(seq), mode.startswith("compile"), mode.endswith("+ac"), float8)
        except ValueError:
            raise SystemExit(f"bench_gpu: case '{name}': write engine/size/seq_len/mode with engine in "
                             f"{ENGINES}, size in {tuple(SIZES)}, mode in {MODES} (each optionally +f8), e.g. "
                             f"meshpar/1b/4096/compile+f8") from None

    @property
    def name(self) -> str:
        return f"{self.engine}/{self.size}/{self.seq_len}/{self.mode}"

    @property
    def mode(self) -> str:
        return ("compile" if self.compile else "eager") + ("+ac" if self.ac else "") + ("+f8" if self.float8 else "")

    @property
    def pair(self) -> str:
        """The name without the engine: meshpar and plain cases of one pair share it."""
        return self.name.split("/", 1)[1]


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype  # compute dtype: bf16 on GPU
    batch: int
    warmup: int
    steps: int


# [Note: initial values]
# meshpar's layout-independent init draws every value on the CPU (docs/performance.md#initialization:
# seconds per case at 1B and 3B, a large share of the run's budget). The
# comparison needs identical values in both engines, not layout independence, so both build
# this subclass, whose init draws the same scheme (normal, std 0.02, 0.02 / sqrt(2 L) for the
# projections into the residual stream; norms 1) on the device from the same seed, parameter
# by parameter in the same order. meshpar's build() calls it as it calls Transformer's.

class DeviceInit(Transformer):
    @torch.no_grad()
    def init_weights(self) -> None:
        self.tie_weights()
        self._init_rope()
        out_std = 0.02 / math.sqrt(2 * self.args.n_layers)
        for name, param in self.named_parameters():
            local = param._local_tensor if isinstance(param, DTensor) else param  # 1 rank: the whole
            if param.ndim < 2:
                local.fill_(1.0)
            else:
                local.normal_(0.0, out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02)


# --- the two engines ----------------------------------------------------------------------------

def _recipe(case: Case, s: Settings) -> recipelib.Recipe:
    """[parallel] and [optim] for meshpar (the model's args come from SIZES: 3b is no named size)."""
    dtype = str(s.dtype).removeprefix("torch.")
    return recipelib.load(None, [f'--parallel.param_dtype="{dtype}"', '--parallel.reduce_dtype="float32"',
                                 f"--parallel.compile={str(case.compile).lower()}",
                                 f'--parallel.activation_checkpoint="{"full" if case.ac else "none"}"'])


def _meshpar(case: Case, s: Settings, mesh: meshlib.Mesh, batch: tuple[torch.Tensor, torch.Tensor]):
    """meshpar's model, optimizer and step; ``step()`` returns the loss tensor."""
    recipe = _recipe(case, s)
    p = recipe.parallel
    family = get_family("llama")
    # meshpar train passes family.model_cls (Transformer): [Note: initial values]
    [(_, model)] = build(DeviceInit, SIZES[case.size], family.tp_plan, mesh, p, s.device, seed=0,
                         float8="tensorwise" if case.float8 else "none", float8_emulate=s.device.type == "cpu")
    if not isinstance(model, FSDPModule):  # a meshpar without FSDP at one rank: [Note: bf16 on one rank]
        apply_fsdp(model, mesh, p)
    stages = Model(nn.ModuleList([model]), None, False)
    optimizer = build_optimizer(stages.stages, recipe.optim)
    sync = GradSync.of(mesh, p, recipe.optim)

    def step() -> torch.Tensor:
        return train_step(stages, lambda: [batch], 1, sync, s.device, optimizer).loss

    return model, optimizer, step


def _plain(case: Case, s: Settings, batch: tuple[torch.Tensor, torch.Tensor]):
    """The same model in plain PyTorch: autocast, per-block checkpoint and compile, fused AdamW."""
    optim = recipelib.OptimConfig()  # the same hyperparameters as meshpar's
    with torch.device("meta"):
        model = DeviceInit(SIZES[case.size])
    model.to_empty(device=s.device)
    torch.manual_seed(0)
    model.init_weights()  # the values meshpar's engine starts from: [Note: initial values]
    if case.float8:  # the same layers as meshpar's (its filter), converted by torchao before AC and compile
        apply_float8(model, "tensorwise", emulate=s.device.type == "cpu", fsdp_all_gather=False)
    for block in model.layers.values():  # AC, then compile around it, as meshpar/parallel/parallelize.py orders them
        if case.ac:
            forward = block.forward
            block.forward = lambda *a, f=forward: checkpoint(f, *a, use_reentrant=False, preserve_rng_state=False)
        if case.compile:
            block.forward = torch.compile(block.forward)
    params = list(model.parameters())
    groups = [{"params": [q for q in params if q.ndim >= 2], "weight_decay": optim.weight_decay},
              {"params": [q for q in params if q.ndim < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, fused=True)
    inputs, targets = batch
    autocast = s.dtype != torch.float32

    def step() -> torch.Tensor:
        with torch.autocast(s.device.type, dtype=s.dtype, enabled=autocast):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        with record_function("plain::optimizer"):  # as meshpar labels its phase, for --profile
            torch.nn.utils.clip_grad_norm_(params, optim.grad_clip, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, optimizer, step


# --- one case -----------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_case(case: Case, s: Settings, mesh: meshlib.Mesh, peak_flops: float,
              profile_top: int | None, cpu_profile: bool = False) -> dict[str, Any]:
    """Build, warm up, time; with ``profile_top``, trace one more step; with ``cpu_profile``, run
    three more under cProfile (where the host's time goes when the GPU waits for it)."""
    args = SIZES[case.size]
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, args.vocab_size, (s.batch, case.seq_len + 1), generator=g).to(s.device)
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(s.device)
    # what earlier cases left allocated (tens of GiB after several cases): the case's peak is
    # counted above it
    before = torch.cuda.memory_allocated(s.device) if s.device.type == "cuda" else 0
    t0 = time.perf_counter()
    if case.engine == "meshpar":
        model, optimizer, step = _meshpar(case, s, mesh, batch)
    else:
        model, optimizer, step = _plain(case, s, batch)
    _sync(s.device)
    row: dict[str, Any] = dict(case=case.name, **dataclasses.asdict(case), batch=s.batch,
                               build_s=time.perf_counter() - t0)
    warmup_s, times, losses = [], [], []
    for i in range(s.warmup + s.steps):
        _sync(s.device)
        start = time.perf_counter()
        losses.append(step())
        _sync(s.device)
        (warmup_s if i < s.warmup else times).append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens_per_s = s.batch * case.seq_len / step_s
    flops_per_token = args.flops_per_token(case.seq_len)
    attention = flops_per_token - 6.0 * args.matmul_params()
    row.update(status="ok", warmup_s=warmup_s, times_ms=[1e3 * t for t in times], step_ms=1e3 * step_s,
               tokens_per_s=tokens_per_s, mfu=flops_per_token * tokens_per_s / peak_flops,
               mfu_causal=(flops_per_token - attention / 2) * tokens_per_s / peak_flops,
               peak_gib=(torch.cuda.max_memory_allocated(s.device) - before) / GiB if s.device.type == "cuda" else None,
               left_by_earlier_gib=before / GiB,
               loss=losses[-1].item(), losses=[x.item() for x in losses])
    if profile_top is not None:
        try:
            row["profile"] = _profile(step, s.device, step_s, profile_top)
        except Exception as e:  # noqa: BLE001 - the case's measurement stands without its profile
            row["profile_error"] = f"{type(e).__name__}: {e}"
    if cpu_profile:
        row["cpu_profile"] = _cpu_profile(step, s.device)
    del model, optimizer, step
    return row


def _cpu_profile(step: Callable[[], torch.Tensor], device: torch.device, steps: int = 3) -> str:
    """The host's own time over ``steps`` steps, by function (cProfile, sorted by own time): with the
    device synchronized only after the last, a step's host time is what it costs to launch it."""
    import cProfile
    import io
    import pstats

    _sync(device)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    launched = time.perf_counter() - start
    _sync(device)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return (f"host time to launch {steps} steps: {1e3 * launched / steps:.1f} ms a step "
            f"(all {1e3 * (time.perf_counter() - start) / steps:.1f} ms a step with the device's)\n" + out.getvalue())


# --- the profile of one step --------------------------------------------------------------------

# Kernel (CUDA) or op (CPU) names by category, the first match wins; whatever runs under a
# ``*::optimizer`` label (meshpar::optimizer, plain::optimizer: clipping and AdamW) is
# "optimizer" whatever its name. Inductor's kernels are named after the ops they fuse
# (triton_poi_fused__to_copy_mul_...), so they are elementwise unless matmul templates (triton_tem_).
CATEGORIES = (
    ("matmul", re.compile(r"^triton_tem|gemm|xmma|cutlass|nvjet|cublas|sm90_|sm80_|aten::(mm|addmm|bmm|matmul)$")),
    ("attention", re.compile(r"flash|fmha|sdpa|scaled_dot_product|cudnn|attention|efficient")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach")),
    ("copy/cast/comm", re.compile(r"^(?!triton_).*(nccl|memcpy|memset|copy|aten::cat|all_gather|reduce_scatter"
                                  r"|all_reduce|gloo)")),
)
SHARES = ("matmul", "attention", "elementwise/norm", "optimizer", "copy/cast/comm", "idle")


def _category(name: str) -> str:
    low = name.lower()
    return next((c for c, pattern in CATEGORIES if pattern.search(low)), "elementwise/norm")


def _kernel_times(prof, cuda: bool) -> tuple[dict[str, tuple[float, int]], dict[str, float]]:
    """({kernel (CPU: aten op): (ms, calls)}, {the same: ms under an optimizer label}). On CUDA the
    device's own events, less user annotations (a record_function's span on the GPU timeline,
    which would count its kernels twice: the rule of torch.profiler's table total)."""
    total: dict[str, tuple[float, int]] = {}
    optimizer: dict[str, float] = {}
    for e in prof.events():
        if cuda and e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            us = e.time_range.elapsed_us()
        elif not cuda and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            us = e.self_cpu_time_total  # labels (meshpar::*) and autograd nodes run no op themselves
        else:
            us = 0
        if us > 0:
            ms, calls = total.get(e.name, (0.0, 0))
            total[e.name] = (ms + us / 1e3, calls + 1)
        if e.device_type != DeviceType.CPU:
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.endswith("::optimizer"):
            parent = parent.cpu_parent
        if parent is None:
            continue
        for name, kernel_us in ([(k.name, k.duration) for k in e.kernels] if cuda else [(e.name, us)]):
            optimizer[name] = optimizer.get(name, 0.0) + kernel_us / 1e3
    return total, optimizer


def _profile(step: Callable[[], torch.Tensor], device: torch.device, step_s: float, top: int) -> dict[str, Any]:
    """One step under torch.profiler: the top kernels (CPU: aten ops) by self device time and the
    share of the median step time per category; idle is the median step time no kernel covers."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        _sync(device)
    total, optimizer = _kernel_times(prof, cuda)
    step_ms, busy = 1e3 * step_s, sum(ms for ms, _ in total.values())
    shares = dict.fromkeys(SHARES, 0.0)
    for name, (ms, _) in total.items():
        in_optimizer = min(ms, optimizer.get(name, 0.0))
        shares["optimizer"] += in_optimizer / step_ms
        shares[_category(name)] += (ms - in_optimizer) / step_ms
    shares["idle"] = max(0.0, 1 - busy / step_ms)
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(what="CUDA kernels" if cuda else "aten ops, CPU self time", busy_ms=busy, step_ms=step_ms,
                shares=shares, top=[dict(name=n, ms=ms, calls=c, share=ms / step_ms,
                                         category="optimizer" if optimizer.get(n, 0) > ms / 2 else _category(n))
                                    for n, (ms, c) in ranked])


def _print_profile(case: str, p: dict[str, Any]) -> None:
    print(f"\n== profile of one step of {case}: {p['what']}, busy {p['busy_ms']:.1f} ms of a "
          f"{p['step_ms']:.1f} ms median step")
    print("   " + " | ".join(f"{c} {100 * v:.1f}%" for c, v in p["shares"].items()))
    for t in p["top"]:
        print(f"   {t['ms']:9.2f} ms {100 * t['share']:5.1f}% {t['calls']:6d}x  {t['category']:<17} {t['name'][:90]}")


# --- output -------------------------------------------------------------------------------------

HEAD = (f"{'engine':<8}{'size':<6}{'seq':>6} {'mode':<11}{'step ms':>9} {'tokens/s':>10} {'MFU %':>6} "
        f"{'peak GiB':>9} {'loss':>8}  {'compile+warmup s':>16}")


def _line(r: dict[str, Any]) -> str:
    left = f"{r['engine']:<8}{r['size']:<6}{r['seq_len']:>6} {r['mode']:<11}"
    if r["status"] != "ok":
        return left + f"  {r['status']}"
    peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
    return left + (f"{r['step_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {100 * r['mfu']:>6.1f} {peak:>9} "
                   f"{r['loss']:>8.4f}  {sum(r['warmup_s']):>16.1f}")


def _goals(rows: list[dict[str, Any]]) -> list[str]:
    """meshpar / plain tokens/s for every pair measured, and the issue's two goals, as facts."""
    ok = {(r["engine"], r["pair"]): r for r in rows if r["status"] == "ok"}
    lines = []
    for (engine, pair), r in ok.items():
        plain = ok.get(("plain", pair))
        if engine == "meshpar" and plain:
            ratio = r["tokens_per_s"] / plain["tokens_per_s"]
            lines.append(f"  meshpar/plain tokens/s {pair:<22} {ratio:6.3f}  (goal >= 0.97)  "
                         f"{'met' if ratio >= 0.97 else 'NOT MET'}")
    for (engine, pair), r in ok.items():
        if r["size"] == "1b" and not r["float8"]:
            lines.append(f"  MFU {engine:<8} {pair:<31} {100 * r['mfu']:5.1f}%  (goal >= 45%)  "
                         f"{'met' if r['mfu'] >= 0.45 else 'NOT MET'}")
    for (engine, pair), r in ok.items():  # issue 29: float8 / bf16 tokens/s on the same engine and case
        high = ok.get((engine, pair.removesuffix("+f8"))) if pair.endswith("+f8") else None
        if high:
            ratio = r["tokens_per_s"] / high["tokens_per_s"]
            lines.append(f"  float8/bf16 tokens/s {engine:<8} {pair:<22} {ratio:6.3f}  (goal >= 1.20)  "
                         f"{'met' if ratio >= 1.2 else 'NOT MET'}")
    return lines


def _environment(device: torch.device, profile_name: str, peak: float) -> dict[str, Any]:
    env: dict[str, Any] = dict(torch=torch.__version__, device=str(device), peak_profile=profile_name,
                               peak_tflops=peak / 1e12)
    if device.type == "cuda":
        driver = getattr(torch._C, "_cuda_getDriverVersion", lambda: None)()
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, cuda_driver_api=driver,
                   memory_gib=torch.cuda.get_device_properties(device).total_memory / GiB)
    return env


def _free(device: torch.device) -> None:
    """Between cases: compiled graphs, cached blocks and the collected models go."""
    torch.compiler.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=None, help="comma-separated engine/size/seq_len/mode "
                        f"(default: {','.join(DEFAULT_CASES)})")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--budget", type=float, default=220, help="seconds: a case that would end later, by "
                        "the longest earlier case of its kind (compiled or eager), is skipped; 0: no limit")
    parser.add_argument("--profile", nargs="?", const="", default=None, metavar="CASES",
                        help="trace one more step of each of these comma-separated cases (default: the "
                             "first compiled meshpar case and its plain pair)")
    parser.add_argument("--top", type=int, default=15, help="kernels listed by --profile")
    parser.add_argument("--cpu-profile", default="", metavar="CASES",
                        help="comma-separated cases whose host time is profiled (cProfile) over 3 more steps")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="compute dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--json", default="runs/bench_gpu.json", help="results, rewritten after every case")
    parser.add_argument("--float8", action="store_true", help="the float8 cases: 1B at 4096 and 8192 compiled, 3B "
                        "at 4096 compiled with AC, each with and without +f8, both engines")
    parser.add_argument("--smoke", action="store_true", help="debug size, seq 64, on CPU, 1 warmup + 2 "
                        "steps, every engine: the code paths of a GPU run, here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    warmup, steps = (1, 2) if args.smoke else (args.warmup, args.steps)
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32}[args.dtype]
    s = Settings(device, dtype, args.batch, warmup, steps)
    cases = [Case.parse(c) for c in (args.cases.split(",") if args.cases else SMOKE_CASES if args.smoke
                                     else FLOAT8_CASES if args.float8 else DEFAULT_CASES)]
    profiled: set[str] = set()
    if args.profile:
        profiled = {Case.parse(c).name for c in args.profile.split(",")}
    elif args.profile is not None:  # the first compiled meshpar case and its plain pair
        first = next((c for c in cases if c.engine == "meshpar" and c.compile), cases[0])
        profiled = {first.name, f"plain/{first.pair}"}

    cpu_profiled = {Case.parse(c).name for c in args.cpu_profile.split(",") if c}
    profile = load_profile("auto", device.type)
    peak = profile.peak_flops(s.dtype)
    init_process_group(device, RankInfo(0, 1, 0, 1))
    mesh = meshlib.build(meshlib.resolve(recipelib.ParallelConfig(), 1), device.type)
    report: dict[str, Any] = dict(_environment(device, profile.name, peak), settings=dict(
        dtype=str(s.dtype), batch=s.batch, warmup=warmup, steps=steps), rows=[])
    print(f"bench_gpu: torch {torch.__version__} | {report.get('gpu', 'cpu')} | CUDA {report.get('cuda')} | "
          f"peak {peak / 1e12:g} TFLOP/s {str(s.dtype).removeprefix('torch.')} from '{profile.name}' | "
          f"batch {s.batch} | {warmup} warmup + {steps} timed steps", flush=True)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    longest: dict[bool, float] = {}  # compiled or not -> the longest case so far, seconds
    print(HEAD)
    try:
        for case in cases:
            elapsed = time.perf_counter() - started
            print(f"[{elapsed:.0f} s] {case.name}", file=sys.stderr, flush=True)
            if args.budget and elapsed + longest.get(case.compile, 0.0) > args.budget:
                row = dict(case=case.name, **dataclasses.asdict(case), status=f"skipped (budget at {elapsed:.0f} s)")
            else:
                t0 = time.perf_counter()
                try:
                    row = _run_case(case, s, mesh, peak, args.top if case.name in profiled else None,
                                    case.name in cpu_profiled)
                except torch.cuda.OutOfMemoryError:
                    row = dict(case=case.name, **dataclasses.asdict(case), status="oom")
                except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
                    row = dict(case=case.name, **dataclasses.asdict(case), status=f"error: {type(e).__name__}: {e}",
                               traceback=traceback.format_exc())
                _free(device)
                row["wall_s"] = time.perf_counter() - t0
                longest[case.compile] = max(longest.get(case.compile, 0.0), row["wall_s"])
            row.update(mode=case.mode, pair=case.pair)
            report["rows"].append(row)
            print(_line(row), flush=True)
            if "traceback" in row:
                print(row["traceback"], flush=True)
            report["wall_s"] = time.perf_counter() - started
            path.write_text(json.dumps(report, indent=1, default=str))
    finally:
        dist.destroy_process_group()
    for r in report["rows"]:
        if "profile" in r:
            _print_profile(r["case"], r["profile"])
        if "profile_error" in r:
            print(f"\nprofile of {r['case']} failed: {r['profile_error']}")
        if "cpu_profile" in r:
            print(f"\n== host profile of {r['case']}: {r['cpu_profile']}")
    report["goals"] = _goals(report["rows"])
    print("\ngoals:\n" + ("\n".join(report["goals"]) or "  no pair measured"))
    report["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {path} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
