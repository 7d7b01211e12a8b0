"""Context parallelism's step time, memory per rank, K/V traffic and attention balance.

    python -m tests.benchmarks.bench_cp [--lengths 2048,4096,8192] [--cp 2,4] [--warmup 1] [--steps 2]
                                        [--json runs/bench_cp.json] [--smoke]

At each sequence length T, the debug Llama (4 blocks, dim 256, 8 query heads and 4 kv heads of 32,
SwiGLU 768, vocabulary 2048; max_seq_len raised to T), fp32, trains one sequence per step on one
process and on cp 2 and cp 4 gloo ranks (``tests/distributed.py``, 1 thread per rank), each cp
rank holding T / cp tokens (``apply_context_parallel`` + ``shard_sequence``), both with the
balanced split and with contiguous slices ([Note: balanced sequence split]). A step is forward,
cross-entropy over the rank's tokens, backward, the gradients averaged over cp by one all-reduce
(``meshpar.parallel.data_parallel.all_reduce_gradients``: the parameters are replicated here, the same bytes in
every layout, where ``meshpar train`` shards them with FSDP over dp_shard x cp), fused AdamW.
The full run takes minutes (docs/performance.md#memory-and-balance-per-rank). Per layout it prints

- step time: median over the timed steps (after warmup) of the slowest rank's step, ranks starting
  each step together at a barrier; its ratio to one process;
- peak memory per rank: the largest rank's peak of live tensor bytes over one more step
  (``probes.PeakMemory``, the allocation tracker: [Note: peak memory on CPU]);
- peak activation memory per rank: that peak minus the bytes live when the step starts, which are
  the parameters, the gradients (kept allocated between steps: ``zero_grad(set_to_none=False)``, so
  they are live, and constant, throughout the step), the AdamW state, the RoPE tables and the
  batch's token ids. It is everything the step itself adds at its worst moment: the activations
  saved for backward, the gathered K/V, masks, temporaries, gradients in flight; its ratio to one
  process (the goal: at most 0.3 at cp 4);
- K/V traffic per step and rank on the ``cp`` dim as ``meshpar.distributed.comm_record.count()`` recorded it, next to
  the analytic figure: per layer the forward all-gathers K and V, each a [B, Hkv, T, Dh] buffer of
  which a rank receives (cp - 1) / cp ([Note: all-gather of K and V]), and the backward
  reduce-scatters their gradients, the same volume ([Note: bytes counted]), so each direction is
  L x 2 x B x Hkv x T x Dh x 4 bytes x (cp - 1) / cp, in 2L calls; the gradient all-reduce over cp
  is 2 x params x 4 bytes x (cp - 1) / cp in one call. "=" means byte for byte, every rank and step;
- attention work per rank: the causal (query, key) pairs each rank's query chunks attend
  (``SequenceLayout.query_chunks``: n queries over the ``keys`` up to their chunk's end, the last n
  causally, n x (keys - n) + n (n + 1) / 2 pairs), max / min over ranks; and the measured time of one
  layer's attention calls per rank (forward + backward, the same calls ``_attend`` makes, each rank's
  in turn in this process on one thread, best of 2 after one untimed run), max / min over ranks.

``--smoke`` (tests/test_bench_cp.py): 2 blocks, T 1024, no warmup and 1 timed step.

[Note: masks on CPU]
``_attend`` hands each query chunk ``causal_lower_right(n, keys)``. On CUDA the flash or
memory-efficient kernel applies that mask without building it (torch/nn/attention/bias.py); on
the CPU torch materializes it (a bool [n, keys]), SDPA turns it into a float [n, keys] and the
flash kernel saves it for backward (32 MiB for 1024 queries over 8192 keys, against 1 MiB of
output). A square chunk (rank 0's first) runs ``is_causal``, unmasked. So a rank keeps,
per layer, n x keys x 4 bytes per other chunk: with the balanced split about (2cp + 1) c^2 x 4
(c = T / 2cp), quadratic in T where all else it keeps is linear, and the kernel computes every
pair of those rectangles, the masked ones too. ``kept_bytes`` gives the figure per rank; the
acceptance lines print it next to the measured ratio.

[Note: CausalBias under a dispatch mode]
``causal_lower_right`` builds a ``CausalBias``, a Tensor subclass, and torch 2.13 refuses to create
one while a TorchDispatchMode is active ("the raw Tensor object is already associated to a python
object of type Tensor"): under the allocation tracker (MemTracker) and under FakeTensorMode alike
(the planner leaves the mask out: [Note: context parallel attention on fake tensors] in
meshpar/planner/simulate.py). While the tracker runs, this benchmark builds
the bias (an empty tensor holding three numbers) with the modes suspended; the attention itself,
including the mask the CPU kernel materializes from it, still runs under the tracker.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils._python_dispatch import _disable_current_modes

from meshpar.distributed import comm_record
from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.llama.args import ModelArgs
from meshpar.parallel.context_parallel import gather as cp_module
from meshpar.parallel.context_parallel.apply import apply_context_parallel
from meshpar.parallel.context_parallel.layout import SequenceLayout, shard_sequence
from meshpar.parallel.context_parallel.ulysses import kv_repeats
from meshpar.parallel.data_parallel import all_reduce_gradients
from tests.benchmarks.probes import PeakMemory
from tests.distributed import run_distributed
from tests.helpers import CpRank

MiB = 2**20
BATCH = 1  # sequences per step (each cp rank holds T / cp tokens of it)
ITEMSIZE = 4  # fp32
# on cp: K/V, their gradients, ring hops, Ulysses' exchanges, gradients
OPS = ("all_gather", "reduce_scatter", "send_recv", "all_to_all", "all_reduce")
ATTENTIONS = ("allgather", "ring", "ulysses")  # parallel.cp_attention
SPLITS = {True: "balanced", False: "contiguous", None: "-"}


def model_args(seq_len: int, n_layers: int = 4) -> ModelArgs:
    return dataclasses.replace(LLAMA_SIZES["debug"], n_layers=n_layers, max_seq_len=seq_len)


# --- on each rank ----------------------------------------------------------------------------------

class _Run:
    """One layout's model, AdamW and this rank's tokens; ``step()`` is one training step."""

    def __init__(self, args: ModelArgs, seq_len: int, mesh: DeviceMesh | None, balanced: bool | None,
                 attention: str = "allgather") -> None:
        torch.manual_seed(0)
        self.model, self.mesh = Transformer(args), mesh
        self.model.init_weights()  # the same values on every rank and in every layout
        tokens = torch.randint(0, args.vocab_size, (BATCH, seq_len + 1), generator=torch.Generator().manual_seed(1))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if mesh is not None:
            apply_context_parallel(self.model, mesh, balanced=balanced, attention=attention)
            inputs, targets = (shard_sequence(x, mesh, balanced=balanced) for x in (inputs, targets))
        self.inputs, self.targets = inputs.contiguous(), targets.contiguous()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        self.times: list[float] = []

    def step(self) -> None:
        # the logits are not kept: backward needs the loss's saved tensors only (as meshpar.training.step)
        F.cross_entropy(self.model(self.inputs).flatten(0, 1), self.targets.flatten()).backward()
        if self.mesh is not None:  # the cp ranks are replicas: gradients averaged over them
            all_reduce_gradients(self.model, self.mesh)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)  # gradients stay allocated: constant persistent bytes

    def timed_step(self) -> None:
        dist.barrier()  # every rank starts together; the step's time is the slowest rank's
        start = time.perf_counter()
        self.step()
        self.times.append(time.perf_counter() - start)

    def probe(self) -> dict:
        """One more step under the allocation tracker and the collective counter."""
        dist.barrier()
        with comm_record.count() as counted, _causal_bias_outside_modes(), \
                PeakMemory(self.model, self.opt, self.inputs, self.targets) as memory:
            start = memory.current()["Total"]
            self.step()
        return {"times": self.times, "peak": memory.peak_bytes, "start": start,
                "calls": {op: counted.calls[(op, "cp")] for op in OPS},
                "bytes": {op: counted.bytes[(op, "cp")] for op in OPS}}


@contextlib.contextmanager
def _causal_bias_outside_modes() -> Iterator[None]:
    """[Note: CausalBias under a dispatch mode]."""
    original = cp_module.causal_lower_right

    def build(*args: int) -> torch.Tensor:
        with _disable_current_modes():
            return original(*args)

    cp_module.causal_lower_right = build
    try:
        yield
    finally:
        cp_module.causal_lower_right = original


def layouts(cp: int, attentions: tuple[str, ...]) -> list[tuple[str, bool | None]]:
    """(attention, split) of each run at ``cp``: one process's alone, else each attention's balanced
    and contiguous splits."""
    return [("-", None)] if cp == 1 else [(a, balanced) for a in attentions for balanced in (True, False)]


def measure_rank(args: ModelArgs, seq_len: int, warmup: int, steps: int, attentions: tuple[str, ...]) -> list[dict]:
    """On one gloo rank: one process's run, or at cp = world size each of ``layouts``, each with its
    step times and the probed step's memory and collectives."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)) if world > 1 else None
    records = []
    for attention, balanced in layouts(world, attentions):
        run = _Run(args, seq_len, mesh, balanced, attention)
        for i in range(warmup + steps):
            (run.timed_step if i >= warmup else run.step)()
        records.append(run.probe())
        del run
        gc.collect()
    return records


# --- analytic figures and the attention probe (in this process) ------------------------------------

def analytic_bytes(args: ModelArgs, seq_len: int, cp: int, params: int, attention: str = "allgather") -> dict[str,
                                                                                                            Fraction]:
    """Per step and rank, as [Note: bytes counted] counts them (see the module docstring); the ring
    sends, per layer, (cp - 1) hops of one K/V chunk, 2 x B x Hkv x T/cp x Dh elements, in forward,
    and in backward (cp - 1) of K/V again and (cp - 1) of dK/dV ([Note: ring attention]); Ulysses
    sends (cp - 1) / cp of q, k, v (kv heads repeated r times) and the output, B x T/cp x Dh x
    (2H + 2 Hkv r) elements, each way ([Note: Ulysses with grouped-query attention])."""
    out = dict.fromkeys(OPS, Fraction(0))
    if cp == 1:
        return out
    kv = args.n_layers * 2 * BATCH * args.n_kv_heads * seq_len * args.resolved_head_dim * ITEMSIZE
    share = Fraction(cp - 1, cp)
    if attention == "ring":
        out["send_recv"] = 3 * kv * share  # (cp - 1) hops of kv / cp, three times
    elif attention == "ulysses":
        heads = 2 * args.n_heads + 2 * args.n_kv_heads * kv_repeats(args.n_heads, args.n_kv_heads, cp)
        per_layer = BATCH * seq_len // cp * args.resolved_head_dim * heads * ITEMSIZE
        out["all_to_all"] = 2 * args.n_layers * per_layer * share
    else:
        out["all_gather"] = out["reduce_scatter"] = kv * share
    out["all_reduce"] = 2 * params * ITEMSIZE * share
    return out


def query_chunks(seq_len: int, cp: int, rank: int, balanced: bool) -> list[tuple[int, int, int]]:
    """(first local query, queries, keys) per attention call rank ``rank`` makes: meshpar's layout."""
    return SequenceLayout(CpRank(cp, rank), balanced).query_chunks(seq_len // cp)


def causal_pairs(seq_len: int, cp: int, rank: int, balanced: bool) -> int:
    """(query, key) pairs rank ``rank`` attends per head: a chunk of n queries sees the keys before
    it and the n of its own chunk causally."""
    return sum(n * (keys - n) + n * (n + 1) // 2 for _, n, keys in query_chunks(seq_len, cp, rank, balanced))


def kept_bytes(args: ModelArgs, seq_len: int, cp: int, rank: int, balanced: bool,
               attention: str = "allgather") -> dict[str, int]:
    """What rank ``rank`` keeps for backward that one process's activations / cp do not hold: the
    gathered K and V in sequence order (per layer 2 x [B, Hkv, T, Dh]), and the masks: a chunk with
    more keys than queries reaches the CPU kernel as a materialized lower-right causal mask, which
    SDPA turns into a float [n, keys] and saves for backward ([Note: masks on CPU]). The ring keeps
    neither: its own K/V chunk and the log-sum-exp ([Note: ring attention]). Ulysses keeps its heads'
    share of q, k, v and the output over the whole sequence, the size of its own tokens' (plus the
    repeated kv heads), and no mask (one causal call)."""
    if attention == "ring":
        return {"kv": 0, "masks": 0}
    if attention == "ulysses":
        r = kv_repeats(args.n_heads, args.n_kv_heads, cp)
        extra = 2 * BATCH * args.n_kv_heads * (r - 1) * seq_len // cp * args.resolved_head_dim * ITEMSIZE
        return {"kv": args.n_layers * extra, "masks": 0}
    kv = 2 * BATCH * args.n_kv_heads * seq_len * args.resolved_head_dim * ITEMSIZE
    masks = sum(n * keys * ITEMSIZE for _, n, keys in query_chunks(seq_len, cp, rank, balanced) if keys > n)
    return {"kv": args.n_layers * kv, "masks": args.n_layers * masks}


def attention_seconds(args: ModelArgs, seq_len: int, cp: int, rank: int, balanced: bool, reps: int = 2) -> float:
    """Best of ``reps``: forward + backward of the attention calls rank ``rank`` makes in one layer
    (queries [B, H, T/cp, Dh] over the gathered keys [B, Hkv, T, Dh]), without the gathers."""
    h, hkv, dh = args.n_heads, args.n_kv_heads, args.resolved_head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, h, seq_len // cp, dh, generator=g, requires_grad=True)
    k, v = (torch.randn(BATCH, hkv, seq_len, dh, generator=g, requires_grad=True) for _ in range(2))
    times = []
    for _ in range(reps + 1):  # the first run warms up
        start = time.perf_counter()
        for first, n, keys in query_chunks(seq_len, cp, rank, balanced):
            out = F.scaled_dot_product_attention(q[:, :, first:first + n], k[:, :, :keys], v[:, :, :keys],
                                                 attn_mask=cp_module.causal_lower_right(n, keys), enable_gqa=True)
            out.sum().backward()
        times.append(time.perf_counter() - start)
    return min(times[1:])


# --- one length ------------------------------------------------------------------------------------

def summarize(args: ModelArgs, seq_len: int, cp: int, attention: str, balanced: bool | None, records: list[dict],
              params: int) -> dict:
    """One layout's row from every rank's record."""
    step_s = statistics.median(max(ts) for ts in zip(*(r["times"] for r in records), strict=True))
    analytic = analytic_bytes(args, seq_len, cp, params, attention)
    row = {"seq_len": seq_len, "cp": cp, "split": SPLITS[balanced], "attention": attention, "step_s": step_s,
           "step_s_per_step": [max(ts) for ts in zip(*(r["times"] for r in records), strict=True)],
           "peak_bytes": max(r["peak"] for r in records),
           "activation_bytes": max(r["peak"] - r["start"] for r in records),
           "activation_bytes_per_rank": [r["peak"] - r["start"] for r in records],
           "persistent_bytes": max(r["start"] for r in records),
           "calls": records[0]["calls"], "bytes": records[0]["bytes"],
           "analytic_bytes": {op: float(b) for op, b in analytic.items()},
           # every term is a whole number of bytes (T cuts into 2cp chunks), so the float sums are exact
           "bytes_equal": all(r["bytes"][op] == float(analytic[op]) for r in records for op in OPS)}
    if cp > 1:
        pairs = [causal_pairs(seq_len, cp, r, balanced) if attention != "ulysses"
                 else seq_len * (seq_len + 1) // 2 // cp for r in range(cp)]  # Ulysses: every query, H / cp heads
        kept = [kept_bytes(args, seq_len, cp, r, balanced, attention) for r in range(cp)]
        row.update(pairs_per_rank=pairs, pairs_imbalance=max(pairs) / min(pairs),
                   kv_kept_bytes=kept[0]["kv"], mask_bytes=max(k["masks"] for k in kept))
    return row


def measure_length(args: ModelArgs, seq_len: int, degrees: list[int], warmup: int, steps: int,
                   attention_reps: int, attentions: tuple[str, ...] = ATTENTIONS) -> list[dict]:
    with torch.device("meta"):
        params = sum(p.numel() for p in Transformer(args).parameters())
    rows = []
    for cp in [1, *degrees]:
        per_rank = run_distributed(measure_rank, cp, args, seq_len, warmup, steps, attentions, timeout=1800)
        for i, (attention, balanced) in enumerate(layouts(cp, attentions)):
            rows.append(summarize(args, seq_len, cp, attention, balanced, [records[i] for records in per_rank],
                                  params))
    one = rows[0]
    for row in rows:
        row["step_vs_1"] = row["step_s"] / one["step_s"]
        row["activation_vs_1"] = row["activation_bytes"] / one["activation_bytes"]
        if row["cp"] > 1 and attention_reps and row["attention"] == "allgather":
            balanced = row["split"] == "balanced"
            seconds = [attention_seconds(args, seq_len, row["cp"], r, balanced, attention_reps)
                       for r in range(row["cp"])]
            row.update(attention_s_per_rank=seconds, attention_imbalance=max(seconds) / min(seconds))
    return rows


# --- output ----------------------------------------------------------------------------------------

KV_OPS = ("all_gather", "reduce_scatter", "send_recv", "all_to_all")  # attention's traffic on cp, any attention


def _label(r: dict) -> str:
    return f"{r['seq_len']:>6} {r['cp']:>3} {r['attention']:<9} {r['split']:<10}"


HEAD = f"{'T':>6} {'cp':>3} {'attention':<9} {'split':<10}"


def memory_table(rows: list[dict]) -> list[str]:
    """Step time and memory per layout; K/V kept and masks are ``kept_bytes``'s analytic figures."""
    lines = [f"{HEAD} {'step s':>7} {'vs 1':>5} {'peak MiB':>9} {'act MiB':>8} {'vs 1':>6}"
             f"  {'K/V kept':>8} {'masks':>6} {'(act - masks) vs 1':>18}"]
    for r in rows:
        one = next(o for o in rows if o["seq_len"] == r["seq_len"] and o["cp"] == 1)["activation_bytes"]
        kv, masks = r.get("kv_kept_bytes", 0), r.get("mask_bytes", 0)
        lines.append(f"{_label(r)} {r['step_s']:>7.2f} {r['step_vs_1']:>5.2f} "
                     f"{r['peak_bytes'] / MiB:>9.1f} {r['activation_bytes'] / MiB:>8.1f} {r['activation_vs_1']:>6.3f}"
                     f"  {kv / MiB:>8.1f} {masks / MiB:>6.1f} {(r['activation_bytes'] - masks) / one:>18.3f}")
    return lines


def traffic_table(rows: list[dict]) -> list[str]:
    """Bytes on the cp dim against the analytic figures, and attention work per rank."""
    lines = [f"{HEAD} {'AG/RS/P2P/A2A':>15} {'K/V MiB':>8} {'analytic':>8} {'AR MiB':>7} {'analytic':>8} "
             f"{'bytes':>6}  {'pairs max/min':>13} {'attn ms per rank':>17} {'max/min':>7}"]
    for r in rows:
        if r["cp"] == 1:
            continue
        got, want, calls = r["bytes"], r["analytic_bytes"], r["calls"]
        attention = r.get("attention_s_per_rank")
        attention_ms = "-" if attention is None else "/".join(f"{1e3 * s:.0f}" for s in attention)
        lines.append(f"{_label(r)} {'/'.join(str(calls[op]) for op in KV_OPS):>15} "
                     f"{sum(got[op] for op in KV_OPS) / MiB:>8.2f} {sum(want[op] for op in KV_OPS) / MiB:>8.2f} "
                     f"{got['all_reduce'] / MiB:>7.2f} {want['all_reduce'] / MiB:>8.2f} "
                     f"{'equal' if r['bytes_equal'] else 'DIFFER':>6}  {r['pairs_imbalance']:>13.3f} "
                     f"{attention_ms:>17} {r.get('attention_imbalance', float('nan')):>7.2f}")
    return lines


def ring_vs_allgather(rows: list[dict]) -> list[dict]:
    """Per (T, cp, split) measured with both attentions: the ring's step time, peak activation per
    rank and K/V bytes per step over the all-gather's."""
    pairs = {}
    for r in rows:
        if r["cp"] > 1:
            pairs.setdefault((r["seq_len"], r["cp"], r["split"]), {})[r["attention"]] = r
    return [{"seq_len": t, "cp": cp, "split": split,
             "step": both["ring"]["step_s"] / both["allgather"]["step_s"],
             "activation": both["ring"]["activation_bytes"] / both["allgather"]["activation_bytes"],
             "kv_bytes": sum(both["ring"]["bytes"][op] for op in KV_OPS)
             / sum(both["allgather"]["bytes"][op] for op in KV_OPS)}
            for (t, cp, split), both in pairs.items() if {"ring", "allgather"} <= set(both)]


def ratio_table(ratios: list[dict]) -> list[str]:
    lines = [f"{'T':>6} {'cp':>3} {'split':<10} {'step':>6} {'activation':>10} {'K/V bytes':>9}"]
    lines += [f"{r['seq_len']:>6} {r['cp']:>3} {r['split']:<10} {r['step']:>6.2f} {r['activation']:>10.3f} "
              f"{r['kv_bytes']:>9.2f}" for r in ratios]
    return lines


def acceptance(rows: list[dict]) -> list[str]:
    """The goal: peak activation per rank at cp 4 at most 0.3 x one process's, per length."""
    return [f"  T {r['seq_len']}, cp 4 {r['attention']} {r['split']}: {r['activation_vs_1']:.3f} (goal <= 0.3)  "
            f"{'met' if r['activation_vs_1'] <= 0.3 else 'NOT MET'}" for r in rows if r["cp"] == 4]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,4096,8192", help="sequence lengths, comma-separated")
    ap.add_argument("--cp", default="2,4", help="cp degrees, comma-separated (one process always runs)")
    ap.add_argument("--layers", type=int, default=4, help="transformer blocks")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2, help="timed steps")
    ap.add_argument("--attention", default="allgather,ring,ulysses", help="cp attentions, comma-separated")
    ap.add_argument("--attention-reps", type=int, default=2, help="attention probe repeats; 0 skips it")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--smoke", action="store_true", help="2 blocks, T 1024, 1 timed step (for a test)")
    opts = ap.parse_args(argv)
    if opts.smoke:
        opts.lengths, opts.layers, opts.warmup, opts.steps, opts.attention_reps = "1024", 2, 0, 1, 1
    torch.set_num_threads(1)
    lengths = [int(x) for x in opts.lengths.split(",")]
    degrees = [int(x) for x in opts.cp.split(",")]
    attentions = tuple(opts.attention.split(","))
    args = model_args(max(lengths), opts.layers)
    print(f"llama debug, {args.n_layers} blocks: dim {args.dim}, {args.n_heads} heads / {args.n_kv_heads} kv heads "
          f"x {args.resolved_head_dim}, ffn {args.ffn_dim}, vocab {args.vocab_size}; fp32, {BATCH} sequence per "
          f"step; {opts.warmup} warmup + {opts.steps} timed steps", flush=True)
    rows: list[dict] = []
    for seq_len in lengths:
        start = time.perf_counter()
        rows += measure_length(args, seq_len, degrees, opts.warmup, opts.steps, opts.attention_reps, attentions)
        print(f"[T {seq_len}: {time.perf_counter() - start:.0f} s]", flush=True)
    print("\nstep time and memory per rank (act: peak minus the bytes live at the step's start; K/V kept, "
          "masks: analytic, [Note: masks on CPU])")
    print("\n".join(memory_table(rows)))
    print("\nper step and rank: K/V and their gradients on cp (all-gather AG and reduce-scatter RS, the ring's "
          "hops P2P, or Ulysses' all-to-alls A2A of q, k, v and the output) against the analytic figure; gradient "
          "all-reduce (AR); attention: causal pairs per rank, one layer's measured all-gather attention per rank")
    print("\n".join(traffic_table(rows)))
    ratios = ring_vs_allgather(rows)
    if ratios:
        print("\nring / all-gather: step time, peak activation per rank, K/V bytes per step")
        print("\n".join(ratio_table(ratios)))
    print("peak activation per rank at cp 4 / one process:\n" + "\n".join(acceptance(rows)))
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"args": dataclasses.asdict(args), "rows": rows, "ring_vs_allgather": ratios},
                                        indent=1, default=str))
    if not all(r["bytes_equal"] for r in rows):
        raise SystemExit("cp bytes differ from the analytic figure")


if __name__ == "__main__":
    main()
