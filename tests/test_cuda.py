"""One GPU: the CUDA paths the CPU suite cannot reach, each compared with a reference.

Skipped without an NVIDIA GPU; on a machine with one (sized for about 2 minutes)::

    .venv/bin/python -m pytest tests/test_cuda.py -q -rs

Context parallelism's attention per query chunk on the fused kernels, every virtual rank's rows
against one causal attention (in-process: the collectives are the CPU suite's).

Two spawned one-rank jobs (tests/distributed.py's ``CaseSet``), each with a deadline:

- ``RUNS``: ``meshpar train`` on cuda, the SMALL debug Llama of tests/helpers.py: bf16 compute
  with fp32 reduction (one rank's FSDP units, ``parallelize.one_device_fsdp``) against float32
  on the CPU; then in float32, activation checkpointing, ``torch.compile`` per block, a
  checkpoint carried cuda -> cpu -> cuda, and the allocator's memory snapshots with the
  out-of-memory observer, against one plain run on cuda (``_reference``: 4 steps, saving at
  steps 2 and 4) that the cases share.
- ``ENGINE``: meshpar's FSDP engine on a one-rank NCCL mesh, in float64 on a fixed batch:
  pinned CPU offload, and every collective forced through NCCL on the engine's CUDA streams
  (``comm_record.force_collectives``: [Note: forcing the collectives of one rank]), against the same
  model trained on the CPU without FSDP.

[Note: no host sync inside an engine run]
``_fit`` keeps each step's loss on the device and reads the losses back only after the last
step, so the host never waits for the GPU between microbatches and steps: a missing wait
between the engine's streams (an all-gather read before it lands, a reduce-scatter input
reused) shows up as wrong numbers instead of being hidden by a synchronization.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from meshpar import CPUOffloadPolicy, fully_shard
from meshpar import train as trainlib
from meshpar.distributed import comm_record
from meshpar.distributed import mesh as meshlib
from meshpar.models.attention import BY_DEVICE
from meshpar.parallel import activation_checkpoint as aclib
from meshpar.runtime.process import init_process_group, rank_info
from meshpar.training import loop as looplib
from meshpar.training import step as steplib
from meshpar.training.loss import cross_entropy
from tests.distributed import CaseSet
from tests.fsdp_models import gather_params, shard_units
from tests.helpers import CpRank, build_model, load_recipe, train_losses
from tests.parity import TOL, default_dtype

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

STEPS = 4  # optimizer steps of every run
BLOCKS, MICROBATCHES = 2, 4  # SMALL: 2 blocks; 8 sequences per step in microbatches of 2
LLAMA = dict(n_layers=2, vocab_size=256)  # the engine cases' model: debug Llama, as SMALL shapes it
ENGINE_LR = 3e-3  # AdamW's, on one fixed batch


@dataclasses.dataclass(frozen=True)
class Job:
    tmp: Path  # shared by the job's cases
    device: str  # "cuda"; "cpu" lets the cases' logic be tried on a machine without a GPU


# --- RUNS: meshpar train on cuda -----------------------------------------------------------------
def _setup_runs(tmp: Path, device: str = "cuda") -> Job:
    """Each case runs ``meshpar train``, which makes its own process group: the harness's gloo
    group goes, and without MASTER_ADDR train puts its group on an in-memory store
    (meshpar.runtime.process.init_process_group), so one run after another never reuses the job's port."""
    dist.destroy_process_group()
    os.environ.pop("MASTER_ADDR")
    return Job(tmp, device)


def _run(job: Job, name: str, *extra: str, device: str | None = None) -> trainlib.RunResult:
    """``meshpar train`` of the SMALL debug Llama for STEPS steps into ``job.tmp / name``."""
    recipe = load_recipe("llama_debug.toml", job.tmp / name, f"--train.steps={STEPS}",
                         f"--train.device={device or job.device}", *extra)
    return trainlib.train(recipe, return_state=True)


@functools.cache
def _reference(job: Job) -> trainlib.RunResult:
    """The plain float32 run on cuda that the RUNS cases compare with; it saves at steps 2 and 4."""
    return _run(job, "reference", "--checkpoint.every=2")


def _case_bf16(job: Job):
    """param_dtype bfloat16, reduce_dtype float32 on one GPU, and the same run in float32 on the CPU.
    What the run computes in is watched from outside: every Linear's weight and output as it
    runs, the logits the loss gets, and the parameters and gradients the optimizer steps."""
    seen: dict[str, set] = {"linear": set(), "logits": set(), "optimizer": set()}

    def linear(module, args, out):
        if isinstance(module, nn.Linear):
            seen["linear"].add((module.weight.dtype, out.dtype))

    def loss(logits, targets):
        seen["logits"].add(logits.dtype)
        return cross_entropy(logits, targets)

    def optimizer(opt, args, kwargs):
        seen["optimizer"].update((type(p).__name__, p.dtype, p.grad.dtype) for g in opt.param_groups
                                 for p in g["params"])

    hooks = [register_module_forward_hook(linear), register_optimizer_step_pre_hook(optimizer)]
    try:
        with mock.patch.object(steplib, "cross_entropy", loss):
            run = _run(job, "bf16", '--parallel.param_dtype="bfloat16"', '--parallel.reduce_dtype="float32"')
    finally:
        for hook in hooks:
            hook.remove()
    fp32_on_cpu = _run(job, "fp32-cpu", device="cpu")
    seen["state"] = {v.dtype for v in run.state_dict.values()}
    return train_losses(run.records), train_losses(fp32_on_cpu.records), seen


def _case_activation_checkpoint(job: Job):
    with mock.patch.object(aclib, "checkpoint", wraps=aclib.checkpoint) as spy:  # proof that it recomputes
        run = _run(job, "ac", "--parallel.activation_checkpoint=full")
    return train_losses(run.records), train_losses(_reference(job).records), spy.call_count


def _case_compile(job: Job):
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    run = _run(job, "compile", "--parallel.compile=true")
    return train_losses(run.records), train_losses(_reference(job).records), counters["stats"]["unique_graphs"] - before


def _differing(got: trainlib.RunResult, want: trainlib.RunResult) -> tuple[int, list[str]]:
    """How many parameters and optimizer tensors were compared, and those not bitwise equal."""
    got_all, want_all = {**got.state_dict, **got.optim_state}, {**want.state_dict, **want.optim_state}
    names = sorted(got_all.keys() | want_all.keys())
    return len(names), [n for n in names if n not in got_all or n not in want_all
                        or not torch.equal(got_all[n], want_all[n])]


def _case_checkpoint(job: Job):
    """The reference's checkpoints (saved on cuda) loaded on the CPU, one of them trained on there
    and saved again, and that loaded back on cuda. A run whose train.steps is the checkpoint's step
    trains nothing and returns the state as loaded."""
    reference, saved = _reference(job), job.tmp / "reference" / "checkpoints"
    on_cpu = _run(job, "cpu-load", f"--checkpoint.load_from={saved / 'step_4'}", device="cpu")
    resumed = _run(job, "cpu-resume", f"--checkpoint.load_from={saved / 'step_2'}", "--checkpoint.every=2",
                   device="cpu")
    back = _run(job, "cuda-load", f"--checkpoint.load_from={job.tmp / 'cpu-resume' / 'checkpoints' / 'step_4'}")
    return {"cuda->cpu": _differing(on_cpu, reference), "cpu->cuda": _differing(back, resumed),
            "trained after a load": len(on_cpu.records) + len(back.records),
            "resumed steps": [r["step"] for r in resumed.records if "loss" in r],
            "losses": (train_losses(resumed.records), train_losses(reference.records)[2:])}


def _snapshot_summary(path: Path) -> dict:
    with path.open("rb") as f:
        snapshot = pickle.load(f)
    return {"keys": sorted(snapshot), "segments": len(snapshot["segments"]),
            "actions": sorted({e["action"] for trace in snapshot.get("device_traces", []) for e in trace})}


def _case_memory_snapshot(job: Job):
    """profile.profile_memory on cuda, with a real out-of-memory error in the first recorded step
    (profile wait 1, warmup 1, active 2: steps 3-4). Last of the job: the profiler leaves the
    allocator's history recording and its observer attached for the rest of the process."""
    caught, step_fn = [], looplib.train_step

    def step_after_running_out_of_memory(*args, **kwargs):
        if comm_record.current_step() == 3:
            try:
                torch.empty(2**40, device=job.device)  # 4 TiB of float32: more than any GPU holds
            except torch.cuda.OutOfMemoryError:
                caught.append(comm_record.current_step())
        return step_fn(*args, **kwargs)

    with mock.patch.object(looplib, "train_step", step_after_running_out_of_memory):
        run = _run(job, "memory", "--profile.enable=true", "--profile.profile_memory=true")
    traces = job.tmp / "memory" / "traces"
    return {"caught": caught, "snapshots": {p.name: _snapshot_summary(p) for p in traces.glob("*.pickle")},
            "memory records": sorted(p.name for p in traces.glob("*.memory.json")),
            "losses": (train_losses(run.records), train_losses(_reference(job).records))}


RUNS = CaseSet({"bf16": (_case_bf16, 1), "activation_checkpoint": (_case_activation_checkpoint, 1),
                "compile": (_case_compile, 1),
                "checkpoint": (_case_checkpoint, 1), "memory_snapshot": (_case_memory_snapshot, 1)},
               setup=_setup_runs, timeout=270)


# --- ENGINE: fully_shard on a one-rank NCCL mesh ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Engine:
    device: torch.device
    mesh: meshlib.Mesh  # every dim 1, on the default group: CUDA tensors over NCCL, CPU ones over gloo


def _setup_engine(tmp: Path, device: str = "cuda") -> Engine:
    """The harness's gloo group is replaced by training's own (meshpar.runtime.process: "cpu:gloo,cuda:nccl"
    on cuda:0, on an in-memory store), and the one-rank mesh of every dim is built on it."""
    dist.destroy_process_group()
    os.environ.pop("MASTER_ADDR")
    if device == "cuda":
        torch.cuda.set_device(0)
    init_process_group(torch.device(device), rank_info())
    return Engine(torch.device(device), meshlib.build(meshlib.Layout(1, 1, 1, 1, 1), device))


def _tokens() -> torch.Tensor:
    """The one batch every step trains on: [8, 65] byte ids (inputs [:, :-1], targets [:, 1:])."""
    return torch.randint(0, LLAMA["vocab_size"], (8, 65), generator=torch.Generator().manual_seed(0))


def _fit(model: nn.Module, device: torch.device, accumulate: int = 1) -> list[float]:
    """STEPS AdamW steps on ``_tokens()`` in ``accumulate`` microbatches (gradient sync on the last
    only); the loss of each step, read back after the last ([Note: no host sync inside an engine run])."""
    opt = torch.optim.AdamW(model.parameters(), lr=ENGINE_LR)
    tokens = _tokens().to(device)
    losses = []
    for _ in range(STEPS):
        total = torch.zeros((), device=device)
        for i, mb in enumerate(tokens.chunk(accumulate)):
            if accumulate > 1:
                model.set_requires_gradient_sync(i == accumulate - 1)
            loss = cross_entropy(model(mb[:, :-1]), mb[:, 1:]) / accumulate
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return [t.item() for t in losses]


@functools.cache
def _cpu_reference(dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain model (no FSDP) trained on the CPU in ``dtype``: its losses and final parameters."""
    with default_dtype(dtype):
        model = build_model("llama", **LLAMA)
        losses = _fit(model, torch.device("cpu"))
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def _max_param_diff(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    full = gather_params(model)
    assert full.keys() == reference.keys() and full, sorted(full.keys() ^ reference.keys())
    return max((full[name].cpu() - want).abs().max().item() for name, want in reference.items())


def _case_offload(engine: Engine):
    """Pinned CPU offload (a unit per block, then the root) on the one-rank path, in float64."""
    with default_dtype():
        model = build_model("llama", **LLAMA).to(engine.device)
        shard_units(model, fully_shard, mesh=engine.mesh["dp_shard"], offload_policy=CPUOffloadPolicy())
        locals_ = [p.to_local() for p in model.parameters()]
        where = ({t.device.type for t in locals_}, {t.is_pinned() for t in locals_})
        losses = _fit(model, engine.device)
    ref_losses, ref_params = _cpu_reference(torch.float64)
    return losses, ref_losses, _max_param_diff(model, ref_params), where


def _case_forced_collectives(engine: Engine):
    """Every FSDP unit takes the collective path on the one-rank mesh (all-gather and reduce-scatter
    through NCCL, the engine's streams, implicit prefetch, reshard after forward), in float64:
    plainly, with two microbatches and sync on the second only, and with pinned CPU offload."""
    out = {}
    with default_dtype(), comm_record.force_collectives():
        for name, (accumulate, kwargs) in {"reshard": (1, {}), "accumulate": (2, {}),
                                           "offload": (1, dict(offload_policy=CPUOffloadPolicy()))}.items():
            model = build_model("llama", **LLAMA).to(engine.device)
            units = shard_units(model, fully_shard, mesh=engine.mesh["dp_shard"], **kwargs)
            with comm_record.count() as counted:
                losses = _fit(model, engine.device, accumulate)
            ref_losses, ref_params = _cpu_reference(torch.float64)
            out[name] = (losses, ref_losses, _max_param_diff(model, ref_params), dict(counted.calls), units)
    return out


ENGINE = CaseSet({"offload": (_case_offload, 1),
                  "forced_collectives": (_case_forced_collectives, 1)}, setup=_setup_engine, timeout=180)


# --- the tests ---------------------------------------------------------------------------------------
def test_bf16_compute_with_fp32_reduction_on_one_gpu_tracks_fp32_on_cpu(data_cache):
    """Tolerance: bf16 keeps 8 significant bits, so each rounding of a weight or activation is up
    to 2^-9 = 2e-3 relative; a logit sums such roundings over 256-768 products (in fp32) and the
    loss averages 512 tokens, so the loss moves by a few 1e-3 relative at most (5e-4 measured
    with bf16 on this CPU): rtol 2e-2 holds that with room, while the loss falls by far more
    over the steps (asserted)."""
    losses, reference, seen = RUNS.check("bf16", 1)[0]
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, reference, rtol=2e-2, atol=0)
    assert losses[0] - losses[-1] > 10 * 2e-2 * losses[0], losses  # the tolerance is small beside learning
    assert seen == {"linear": {(torch.bfloat16, torch.bfloat16)},  # unsharded parameters: compute
                    "logits": {torch.float32},  # the root casts its output back for the loss
                    "optimizer": {("DTensor", torch.float32, torch.float32)},  # sharded, reduced in fp32
                    "state": {torch.float32}}


@pytest.mark.parity
def test_pinned_cpu_offload_matches_the_cpu_model():
    """float64, so TOL (tests/parity.py [Note: parity in float64]) holds on the GPU too: it adds
    in other orders than the CPU, ~1e-16 relative per operation."""
    losses, reference, diff, (devices, pinned) = ENGINE.check("offload", 1)[0]
    assert (devices, pinned) == ({"cpu"}, {True})
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, reference, rtol=TOL, atol=TOL)
    assert diff <= TOL


@pytest.mark.parity
def test_forced_collectives_on_cuda_streams_match_the_cpu_model():
    """float64 against the CPU, to TOL as above: a race between the engine's streams (a buffer
    read before its collective lands, or reused while it runs) moves numbers by far more."""
    results = ENGINE.check("forced_collectives", 1)[0]
    assert results.keys() == {"reshard", "accumulate", "offload"}
    for name, (losses, reference, diff, calls, units) in results.items():
        assert len(losses) == STEPS, name
        torch.testing.assert_close(losses, reference, rtol=TOL, atol=TOL, msg=name)
        assert diff <= TOL, (name, diff)
        # the collective path ran (the one-rank shortcut makes none): a reduce-scatter per unit and
        # step (sync on the last microbatch only); per microbatch an all-gather per unit in forward
        # and per block again in backward (the root keeps its parameters)
        accumulate = 2 if name == "accumulate" else 1
        assert units == BLOCKS + 1 and calls[("reduce_scatter", "dp_shard")] == units * STEPS, (name, calls)
        assert calls[("all_gather", "dp_shard")] == (units + BLOCKS) * accumulate * STEPS, (name, calls)


def test_activation_checkpointing_on_cuda_matches_no_checkpointing(data_cache):
    """Both float32 on cuda. Recomputation runs the same kernels on the same inputs, so only CUDA's
    run-to-run order of atomic additions (embedding and attention backward) differs, ~1e-7
    relative; AdamW turns noise on near-zero gradient elements into moves of at most lr on a
    few of them, which shifts a mean over 512 tokens by well under 1e-6 (tests/test_train.py's
    launch test): rtol 1e-5."""
    losses, reference, recomputed = RUNS.check("activation_checkpoint", 1)[0]
    assert recomputed == BLOCKS * MICROBATCHES * STEPS  # every block's forward, checkpointed
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)


def test_compiled_blocks_on_cuda_match_eager(data_cache):
    """float32 on cuda. tests/test_compile.py derives 1e-5 relative on the loss of one forward and
    backward (inductor's fused kernels add each reduction over K <= 768 in another order: ~K *
    2^-24); the steps between add AdamW's amplification of that noise: rtol 1e-4."""
    losses, reference, graphs = RUNS.check("compile", 1)[0]
    assert graphs >= 1  # dynamo compiled the blocks
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, reference, rtol=1e-4, atol=0)


def test_checkpoint_from_cuda_loads_on_cpu_and_back(data_cache):
    """Loading copies tensors, no arithmetic: bitwise equal parameters and AdamW state, both ways.
    The CPU's steps 3-4 after the cuda step-2 checkpoint are compared with the cuda run's: float32
    on two devices, each sum in its own order (K <= 768 terms: <= K * 2^-24 = 5e-5 relative on a
    logit, a few 1e-6 on a mean of 512 losses) plus AdamW's noise: rtol 1e-4."""
    out = RUNS.check("checkpoint", 1)[0]
    for direction in ("cuda->cpu", "cpu->cuda"):
        compared, differing = out[direction]
        assert compared > 2 * 2 * BLOCKS and not differing, (direction, differing)
    assert out["trained after a load"] == 0  # train.steps = the checkpoint's step: loaded only
    assert out["resumed steps"] == [3, 4]
    torch.testing.assert_close(*out["losses"], rtol=1e-4, atol=0)


def test_memory_snapshots_and_the_out_of_memory_observer_on_cuda(data_cache):
    """The window's snapshot and the one the out-of-memory observer dumps are the allocator's
    (memory_viz's pickles, with the history recorded from the first step, and the oom in it);
    training goes on after the failed allocation with the reference's losses (rtol 1e-5, as for
    activation checkpointing: profiling changes no kernel)."""
    out = RUNS.check("memory_snapshot", 1)[0]
    assert out["caught"] == [3]
    snapshots = out["snapshots"]
    assert snapshots.keys() == {"rank0.steps3-4.cuda_memory_snapshot.pickle", "rank0.oom_memory_snapshot.pickle"}
    for name, snapshot in snapshots.items():
        assert {"segments", "device_traces"} <= set(snapshot["keys"]) and snapshot["segments"] > 0, name
        assert "alloc" in snapshot["actions"], name
    assert "oom" in snapshots["rank0.oom_memory_snapshot.pickle"]["actions"]
    assert out["memory records"] == ["rank0.steps3-4.memory.json"]
    torch.testing.assert_close(*out["losses"], rtol=1e-5, atol=0)


# --- context parallelism's fused attention ([Note: attention per query chunk]) ---------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_chunks_on_the_fused_kernel_equal_causal_attention(cp, dtype):
    """What each cp rank computes after gathering K and V: its query chunks over the keys up to each
    chunk's end with ``causal_lower_right``, which on CUDA the flash / memory-efficient kernels apply
    without building the mask (the only cp code that differs on a GPU; the CPU suite checks the
    collectives). Every virtual rank's rows, forward and backward, against one causal attention in
    float64 on the CPU. Tolerance: the kernels' dtype rounding over 512 keys (fp32 ~1e-5, bf16 2^-8)."""
    from meshpar.parallel.context_parallel import gather as gatherlib
    from meshpar.parallel.context_parallel import layout as cplib

    b, h, hkv, t, d = 2, 8, 4, 512, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=gen, dtype=torch.float64) for n in (h, hkv, hkv))
    grad = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    ref.backward(grad)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    assert BY_DEVICE.fuses_causal(q.cuda())
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        layout = cplib.SequenceLayout(CpRank(cp, rank), balanced=True)
        idx = cplib.sequence_indices(t, cp, rank)
        ql = q[:, :, idx].to("cuda", dtype).requires_grad_()
        kc, vc = (x.to("cuda", dtype).requires_grad_() for x in (k, v))
        outs = [gatherlib.chunk_attention(ql[:, :, first:first + n], kc[:, :, :keys], vc[:, :, :keys])
                for first, n, keys in layout.query_chunks(t // cp)]
        out = torch.cat(outs, dim=2)
        out.backward(grad[:, :, idx].to("cuda", dtype))
        scale = ref.abs().max().item()
        assert (out.double().cpu() - ref[:, :, idx]).abs().max().item() <= tol * scale, rank
        gq = ref_in[0].grad[:, :, idx]
        assert (ql.grad.double().cpu() - gq).abs().max().item() <= tol * gq.abs().max().item(), rank
        dk += kc.grad.double().cpu()
        dv += vc.grad.double().cpu()
    for got, want in ((dk, ref_in[1].grad), (dv, ref_in[2].grad)):  # every rank's share, summed (the reduce-scatter)
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_document_chunks_on_cuda_equal_document_attention_and_avoid_the_math_kernel(dtype):
    """Document-causal attention per cp query chunk on CUDA ([Note: documents under context
    parallelism]; [Note: masked grouped-query attention on CUDA]): every virtual rank of cp 4 against
    one document-masked attention in float64 on the CPU, forward and backward, and the masked GQA
    call runs a fused kernel (memory-efficient or cuDNN), not the math fallback that keeps
    [B, H, n, keys] scores. Tolerance as in the causal test above."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshpar.models.attention import document_ids, document_mask
    from meshpar.parallel.context_parallel import gather as gatherlib
    from meshpar.parallel.context_parallel import layout as cplib

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(str(func))
            return func(*args, **(kwargs or {}))

    b, h, hkv, t, d, cp = 2, 8, 4, 512, 64, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=gen, dtype=torch.float64) for n in (h, hkv, hkv))
    grad = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    tokens = torch.ones(b, t, dtype=torch.long)
    tokens[0, [40, 200, 255, 300]] = 0  # documents ending inside chunks, one at a chunk's end (64 x 4 - 1)
    tokens[1, [63, 64]] = 0
    doc, _ = document_ids(tokens, eos=0)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=document_mask(tokens, 0)[0],
                                                           enable_gqa=True)
    ref.backward(grad)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    doc = doc.cuda()
    for rank in range(cp):
        layout = cplib.SequenceLayout(CpRank(cp, rank), balanced=True)
        idx = cplib.sequence_indices(t, cp, rank)
        ql = q[:, :, idx].to("cuda", dtype).requires_grad_()
        kc, vc = (x.to("cuda", dtype).requires_grad_() for x in (k, v))
        positions = idx.cuda()
        with Ops() as ops:
            outs = [gatherlib.chunk_attention(ql[:, :, first:first + n], kc[:, :, :keys], vc[:, :, :keys],
                                           doc[:, positions[first:first + n]], doc[:, :keys])
                    for first, n, keys in layout.query_chunks(t // cp)]
        assert any("efficient" in o or "cudnn" in o for o in ops.names), sorted(ops.names)
        out = torch.cat(outs, dim=2)
        out.backward(grad[:, :, idx].to("cuda", dtype))
        assert (out.double().cpu() - ref[:, :, idx]).abs().max().item() <= tol * ref.abs().max().item(), rank
        gq = ref_in[0].grad[:, :, idx]
        assert (ql.grad.double().cpu() - gq).abs().max().item() <= tol * gq.abs().max().item(), rank


def _flex_reference(documents: bool):
    """The flex tests' case: (T, q, k, v, dO, doc or None, the float64 inputs holding their
    gradients, the output) of one masked attention in float64 on the CPU, GQA 8 / 4 heads of 64
    over 1024 tokens, causal or by documents that end inside tiles and at a tile's edge."""
    from meshpar.models.attention import document_ids, document_mask

    b, h, hkv, t, d = 2, 8, 4, 1024, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, t, d, generator=gen, dtype=torch.float64) for n in (h, hkv, hkv))
    grad = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    tokens = torch.ones(b, t, dtype=torch.long)
    tokens[0, [40, 300, 511, 700]] = 0
    tokens[1, [127, 128]] = 0
    doc = document_ids(tokens, eos=0)[0] if documents else None
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    mask = document_mask(tokens, 0)[0] if documents else None
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, attn_mask=mask, is_causal=not documents,
                                                           enable_gqa=True)
    ref.backward(grad)
    return t, q, k, v, grad, doc, ref_in, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp", [2, 4])
def test_gather_on_flex_equals_masked_attention(cp, documents, dtype):
    """The all-gather's attention on compiled flex_attention ([Note: cp attention on flex_attention];
    the CPU suite checks its forward and its tiles, not its backward): every virtual rank's queries
    of the balanced split over the gathered K and V under ``flex.block_mask``, forward and backward,
    against one masked attention in float64 on the CPU; dK and dV summed over the ranks (the
    reduce-scatter) against the whole sequence's. Tolerance as in the chunk tests above."""
    from meshpar.parallel.context_parallel import flex as flexlib
    from meshpar.parallel.context_parallel import layout as cplib

    t, q, k, v, grad, doc, ref_in, ref = _flex_reference(documents)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        idx = cplib.sequence_indices(t, cp, rank)
        block = flexlib.block_mask(idx.cuda(), t, None if doc is None else doc.cuda())
        ql = q[:, :, idx].to("cuda", dtype).requires_grad_()
        kc, vc = (x.to("cuda", dtype).requires_grad_() for x in (k, v))
        out = flexlib.attend(ql, kc, vc, block)
        out.backward(grad[:, :, idx].to("cuda", dtype))
        assert (out.double().cpu() - ref[:, :, idx]).abs().max().item() <= tol * ref.abs().max().item(), rank
        gq = ref_in[0].grad[:, :, idx]
        assert (ql.grad.double().cpu() - gq).abs().max().item() <= tol * gq.abs().max().item(), rank
        dk += kc.grad.double().cpu()
        dv += vc.grad.double().cpu()
    for got, want in ((dk, ref_in[1].grad), (dv, ref_in[2].grad)):
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_on_flex_equals_masked_attention(cp, balanced, documents, dtype):
    """The ring on compiled flex_attention ([Note: the ring on flex]; the CPU suite runs it on gloo
    ranks with flex's eager reference): each virtual rank's ``_FlexRing`` over a ring held in one
    process (``_OneProcessRing``: every rank's K/V chunk at hand, the dK/dV a rank computes for the
    others' chunks kept), forward and backward, against one masked attention in float64 on the CPU;
    dK and dV summed over the ranks. Tolerance as in the gather's test above."""
    from meshpar.models.attention import Kernels
    from meshpar.parallel.context_parallel import layout as cplib
    from meshpar.parallel.context_parallel import ring as ringlib
    from meshpar.parallel.context_parallel import ring_flex

    class _OneProcessRing(ringlib.Ring):
        def __init__(self, rank: int, kv: list[torch.Tensor]) -> None:
            self.cp, self.rank, self.balanced, self.kernels = cp, rank, balanced, Kernels(flex=True)
            self.kv, self.dkv = kv, [torch.zeros_like(x) for x in kv]

        def forward(self, kv, attend):
            for step in range(self.cp):
                src = (self.rank - step) % self.cp
                attend(src, kv if src == self.rank else self.kv[src])

        def backward(self, kv, grads):
            for step in range(self.cp):
                src = (self.rank - step) % self.cp
                self.dkv[src] += grads(src, kv if src == self.rank else self.kv[src]).to(kv.dtype)
            return self.dkv[self.rank]

    t, q, k, v, grad, doc, ref_in, ref = _flex_reference(documents)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    every_rank = torch.stack([cplib.sequence_indices(t, cp, r, balanced=balanced) for r in range(cp)])
    chunks = [torch.stack([x[:, :, every_rank[r]] for x in (k, v)]).to("cuda", dtype) for r in range(cp)]
    rings = [_OneProcessRing(rank, chunks) for rank in range(cp)]
    for rank, ring in enumerate(rings):
        idx = every_rank[rank]
        masks = ring_flex.step_masks(ring, every_rank.cuda(), None if doc is None else doc[:, every_rank].cuda())
        ql = q[:, :, idx].to("cuda", dtype).requires_grad_()
        out = ring_flex.flex_ring_attention(ql, *chunks[rank].unbind(0), ring, masks)
        out.backward(grad[:, :, idx].to("cuda", dtype))
        assert (out.double().cpu() - ref[:, :, idx]).abs().max().item() <= tol * ref.abs().max().item(), rank
        gq = ref_in[0].grad[:, :, idx]
        assert (ql.grad.double().cpu() - gq).abs().max().item() <= tol * gq.abs().max().item(), rank
    for i, want in ((0, ref_in[1].grad), (1, ref_in[2].grad)):
        got = torch.cat([sum(ring.dkv[r] for ring in rings)[i].double().cpu() for r in range(cp)], dim=2)
        want = want[:, :, every_rank.flatten()]
        assert (got - want).abs().max().item() <= tol * want.abs().max().item()
