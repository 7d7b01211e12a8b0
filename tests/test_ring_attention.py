"""Ring attention (meshpar/parallel/context_parallel/ring.py) against one process and against the all-gather.

At cp 2 and cp 4, with the balanced and the contiguous split, float64: the ring alone (q, k, v
of 8 query heads over 2 kv heads, chunks cut into score blocks of a few queries so that
partial blocks and diagonals meet) gives one process's causal attention output and q, k, v
gradients at this rank's tokens, and with packed documents its document-causal ones; the debug
Llama with ``attention="ring"`` gives one process's logits and every parameter's gradient, and
the all-gather path's. One planted bug (the online-softmax merge without its rescaling of what
was merged before) must fail the comparison. ``meshpar train`` with ``parallel.cp_attention =
"ring"`` is a layout of tests/test_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from meshpar.models.attention import Kernels, document_ids, document_mask
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel import ring as ringlib
from meshpar.parallel.context_parallel import ring_flex
from meshpar.parallel.context_parallel.apply import apply_context_parallel
from meshpar.parallel.context_parallel.layout import sequence_indices
from meshpar.planner import cost as costlib
from tests.distributed import CaseSet
from tests.parity import TOL, must_fail
from tests.test_context_parallel import T, reference_model, run_cp
from tests.test_plan import RECIPES, _plan_cli, _run, planlib

H, HKV, DH, SEQ = 8, 2, 16, 48  # the ring alone: 48 tokens cut into 2cp chunks of 12 (cp 2) or 6 (cp 4)


def _setup(tmp):
    torch.set_default_dtype(torch.float64)
    return init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("cp",))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _unrescaled_merge(out, lse, part, part_lse):
    """The planted bug: O + o exp(l - L) without rescaling O by exp(L_old - L)."""
    merged = torch.logaddexp(lse, part_lse)
    out.add_(part * torch.exp(part_lse - merged).unsqueeze(-1))
    lse.copy_(merged)


# Documents for the ring alone: ends (EOS) at 2, 13, 30 in row 0 and 23, 24 in row 1, so blocks of
# queries meet key chunks holding none of their document (rows that merge nothing) and a one-token one
DOCUMENT_ENDS = ((2, 13, 30), (23, 24))


def _ring_alone(mesh, balanced: bool, documents: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, H, SEQ, DH, generator=g) for _ in range(2))
    k, v = (torch.randn(2, HKV, SEQ, DH, generator=g) for _ in range(2))
    tokens = torch.ones(2, SEQ, dtype=torch.long)
    for row, ends in enumerate(DOCUMENT_ENDS if documents else ()):
        tokens[row, list(ends)] = 0
    doc, _ = document_ids(tokens, eos=0)
    mask = document_mask(tokens, eos=0)[0] if documents else None
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=mask is None, enable_gqa=True).backward(dout)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    idx = sequence_indices(SEQ, mesh.size(), mesh.get_local_rank(), balanced=balanced)
    local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    cp = mesh.size()
    every_rank = torch.stack([sequence_indices(SEQ, cp, r, balanced=balanced) for r in range(cp)])
    docs = doc[:, every_rank] if documents else None  # [B, cp, T/cp]: each rank's tokens' documents
    out = ringlib.ring_attention(*local, mesh, balanced=balanced, documents=docs)
    out.backward(dout[:, :, idx])
    diff = {"out": _rel(out, want[:, :, idx])}
    diff.update({f"d{n}": _rel(x.grad, r.grad[:, :, idx]) for n, x, r in zip("qkv", local, ref, strict=True)})
    merge, ringlib._merge = ringlib._merge, _unrescaled_merge
    try:
        bug = _rel(ringlib.ring_attention(*local, mesh, balanced=balanced, documents=docs), want[:, :, idx])
    finally:
        ringlib._merge = merge
    return {"diff": diff, "bug": bug}


def _case_ring(mesh) -> dict:
    # score blocks of 480 / (2 x 8 heads x m keys) queries: 5 per chunk of m = 6 (cp 4, balanced: a partial
    # block follows), 2 of 12, 1 of 24; diagonals starting inside a chunk
    budget, ringlib.SCORE_ELEMENTS = ringlib.SCORE_ELEMENTS, 480
    alone = {balanced: _ring_alone(mesh, balanced) for balanced in (True, False)}
    documents = {balanced: _ring_alone(mesh, balanced, documents=True) for balanced in (True, False)}
    ringlib.SCORE_ELEMENTS = budget
    ref, tokens, logits = reference_model()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for balanced in (True, False):
        idx = sequence_indices(T, mesh.size(), mesh.get_local_rank(), balanced=balanced)
        ring, ring_grads, calls = run_cp(ref, inputs, targets, mesh, balanced, attention="ring")
        gathered, gathered_grads, _ = run_cp(ref, inputs, targets, mesh, balanced)
        vs_one = {"logits": _rel(ring, logits[:, idx])}
        vs_one.update({name: _rel(ring_grads[name], p.grad) for name, p in ref.named_parameters()})
        vs_gather = {"logits": _rel(ring, gathered)}
        vs_gather.update({name: _rel(ring_grads[name], gathered_grads[name]) for name in ring_grads})
        out[balanced] = {**alone[balanced], "vs_one": vs_one, "vs_gather": vs_gather, "calls": calls,
                         "documents": documents[balanced]}
    return out


def _flex_ring_alone(mesh, balanced: bool, documents: bool) -> dict:
    """[Note: the ring on flex] alone: q, k, v of 8 query heads over 2 kv heads, a rank holding two
    chunks of one tile (128 tokens) each (or one of 256), with documents whose ends fall inside tiles
    and at a chunk's edge; out and the q, k, v gradients against one process's; and the same with
    the planted bug, the steps' log-sum-exp given no gradient."""
    cp = mesh.size()
    seq = flexlib.BLOCK * 2 * cp
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, H, seq, DH, generator=g) for _ in range(2))
    k, v = (torch.randn(2, HKV, seq, DH, generator=g) for _ in range(2))
    tokens = torch.ones(2, seq, dtype=torch.long)
    if documents:  # row 0: ends inside the first tile and at a chunk's last token; row 1: one long document
        tokens[0, [40, flexlib.BLOCK - 1, seq // 2 + 7]] = 0
        tokens[1, [seq - 200]] = 0
    doc, _ = document_ids(tokens, eos=0)
    mask = document_mask(tokens, eos=0)[0] if documents else None
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    F.scaled_dot_product_attention(*ref, attn_mask=mask, is_causal=mask is None, enable_gqa=True).backward(dout)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    every_rank = torch.stack([sequence_indices(seq, cp, r, balanced=balanced) for r in range(cp)])
    idx = every_rank[mesh.get_local_rank()]
    ring = ringlib.Ring(mesh, balanced, Kernels(flex=True))
    masks = ring_flex.step_masks(ring, every_rank, doc[:, every_rank] if documents else None)

    def run():
        local = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
        out = ring_flex.flex_ring_attention(*local, ring, masks)
        out.backward(dout[:, :, idx])
        diff = {"out": _rel(out, want[:, :, idx])}
        diff.update({f"d{n}": _rel(x.grad, r.grad[:, :, idx]) for n, x, r in zip("qkv", local, ref, strict=True)})
        return diff

    diff = run()
    upstream = ring_flex._upstream
    ring_flex._upstream = lambda *a: (upstream(*a)[0], torch.zeros_like(a[1]))
    try:
        bug = run()
    finally:
        ring_flex._upstream = upstream
    return {"diff": diff, "bug": {k: bug[k] for k in ("dq", "dk")}, "skipped": masks.count(None)}


def _case_flex(mesh) -> dict:
    """The ring on flex alone, and in the debug Llama (``attention="ring"``, ``flex=True``; balanced,
    contiguous, balanced under selective checkpointing) at a sequence of one tile per chunk: logits
    and every gradient against one process's."""
    alone = {(balanced, documents): _flex_ring_alone(mesh, balanced, documents)
             for balanced in (True, False) for documents in (False, True)}
    t = flexlib.BLOCK * 2 * mesh.size()
    ref, tokens, logits = reference_model(seq_len=t)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model, attend = {}, flexlib.attend_lse
    for balanced, checkpoint in ((True, "none"), (False, "none"), (True, "selective")):
        idx = sequence_indices(t, mesh.size(), mesh.get_local_rank(), balanced=balanced)
        flex_calls = []
        flexlib.attend_lse = lambda *a, n=flex_calls: n.append(1) or attend(*a)  # counts the flex calls
        try:
            local, grads, calls = run_cp(ref, inputs, targets, mesh, balanced, attention="ring", flex=True,
                                         checkpoint=checkpoint)
        finally:
            flexlib.attend_lse = attend
        diff = {"logits": _rel(local, logits[:, idx])}
        diff.update({name: _rel(grads[name], p.grad) for name, p in ref.named_parameters()})
        model[balanced, checkpoint] = {"diff": diff, "calls": calls, "flex_calls": len(flex_calls)}
    return {"alone": alone, "model": model}


JOBS = CaseSet({"ring": (_case_ring, (2, 4)), "flex": (_case_flex, (2, 4))}, setup=_setup, timeout=240)


def _within(diff: dict[str, float], what) -> None:
    assert max(diff.values()) <= TOL, (what, {k: v for k, v in diff.items() if v > TOL})


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_one_process_and_the_all_gather(world):
    """Every rank's (contiguous rank 0 merges nothing: its one pair is its own diagonal)."""
    ranks = JOBS.check("ring", world)
    for balanced in (True, False):
        for rank, case in enumerate(r[balanced] for r in ranks):
            _within(case["diff"], ("ring alone", balanced, rank))
            _within(case["documents"]["diff"], ("ring alone with documents", balanced, rank))
            _within(case["vs_one"], ("debug Llama against one process", balanced, rank))
            _within(case["vs_gather"], ("debug Llama against the all-gather", balanced, rank))
            # per layer (2): forward cp - 1 hops of K/V; backward cp - 1 of K/V and cp - 1 of dK/dV
            assert case["calls"] == {("send_recv", "cp"): 2 * 3 * (world - 1)}, case["calls"]
        for docs in (False, True):
            bug = {"out": max((r[balanced]["documents"] if docs else r[balanced])["bug"] for r in ranks)}
            must_fail(lambda bug=bug: _within(bug, "unrescaled merge"), "the merge left unrescaled")


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_ring_on_flex_matches_one_process(world):
    """[Note: the ring on flex], flex run by its eager reference (float64): every rank's output and q,
    k, v gradients equal one process's, balanced and contiguous (whose later ranks' steps are skipped),
    causal and by document; the debug Llama's logits and every gradient too, with the ring's hops and
    nothing else, and under selective checkpointing, which recomputes the ring's forward; giving the
    steps' log-sum-exp no gradient breaks dQ and dK."""
    for rank, r in enumerate(JOBS.check("flex", world)):
        for (balanced, documents), case in r["alone"].items():
            _within(case["diff"], ("flex ring alone", balanced, documents, rank))
            must_fail(lambda case=case: _within(case["bug"], "no lse gradient"), "the steps' lse left without gradient")
            assert case["skipped"] == (0 if balanced else world - 1 - rank), (balanced, rank, case["skipped"])
        for (balanced, checkpoint), case in r["model"].items():
            _within(case["diff"], ("debug Llama, ring on flex", balanced, checkpoint, rank))
            # per layer, a flex call for each step that sees keys, forward and again in backward; selective
            # checkpointing keeps none of the steps' outputs and runs the ring's forward once more, hops too
            steps, again = world if balanced else rank + 1, checkpoint == "selective"
            assert case["flex_calls"] == 2 * (2 + again) * steps, (balanced, checkpoint, rank, case["flex_calls"])
            assert case["calls"] == {("send_recv", "cp"): 2 * (3 + again) * (world - 1)}, case["calls"]


def test_cp_attention_is_checked():
    with pytest.raises(ValueError, match="parallel.cp_attention"):
        apply_context_parallel(torch.nn.Module(), None, attention="rings")


@pytest.mark.parametrize("flex", [False, True], ids=["explicit", "flex"])
def test_plan_prices_the_ring(flex):
    """``meshpar plan`` of recipes/llama_debug_cp.toml (cp 2, H100 links) with selective checkpointing,
    the ring against the all-gather ([Note: the ring's overlap] in meshpar/planner/cost.py): K/V on cp
    in four passes of cp - 1 hops (forward, its recomputation, backward's K/V and dK/dV) where the
    gather makes three, all hidden but each block's last dK/dV hop per microbatch, and one more
    attention forward per block computed (selective checkpointing keeps nothing of the ring's). Its
    attention at the measured slowdown, or on flex (``parallel.cp_flex``) at the predicted 9 / 7."""
    recipe = str(RECIPES / "llama_debug_cp.toml")
    argv = ["--hardware=h100_sxm", '--parallel.activation_checkpoint="selective"', "--model.n_layers=2",
            f"--parallel.cp_flex={str(flex).lower()}"]
    gather, ring = (_run(recipe, *argv, f'--parallel.cp_attention="{a}"')[3] for a in ("allgather", "ring"))
    cp_gather, cp_ring = (next(c for c in p.time.comm if c.dim == "cp") for p in (gather, ring))
    assert cp_ring.bytes_per_step == pytest.approx(4 / 3 * cp_gather.bytes_per_step, rel=1e-12)
    a, t, layout = ring.args, ring.recipe.train, ring.layout
    hop = 2 * t.micro_batch * a.n_kv_heads * t.seq_len // layout.cp * a.resolved_head_dim * 4  # fp32
    last = a.n_layers * ring.accum * hop / (cp_ring.gbps * 1e9)  # each block's last dK/dV hop, per microbatch
    assert cp_gather.hidden_s == 0 and cp_ring.seconds - cp_ring.hidden_s == pytest.approx(last, rel=1e-9, abs=1e-12)
    tokens = t.global_batch * t.seq_len / (layout.dp * layout.cp)
    attention = a.n_layers * 12 * a.n_heads * a.resolved_head_dim * t.seq_len * tokens  # forward + backward
    recomputed = attention / 3
    flops = planlib.load_hardware("h100_sxm")[0].peak_flops(torch.float32) * ring.time.efficiency
    # on a GPU every attention FLOP of the ring, the recomputed forward's too, counts the slowdown's times
    # ([Note: the ring on a GPU]; on flex [Note: the ring on flex])
    slowdown = 9 / 7 if flex else costlib.RING_ATTENTION_SLOWDOWN["cuda"]
    extra = recomputed + (slowdown - 1) * (attention + recomputed)
    assert ring.time.compute_s - gather.time.compute_s == pytest.approx(extra / flops, rel=1e-9)
    # and the plan says so, where the gather's says nothing of it
    ring_text, gather_text = (_run(recipe, *argv, f'--parallel.cp_attention="{a}"')[1] for a in ("ring", "allgather"))
    said = "ring attention on flex at 1.29x" if flex else "ring attention at 8x the all-gather's time"
    assert said in ring_text and "ring attention" not in gather_text


@pytest.mark.parametrize("attention", ["allgather", "ring"])
def test_the_plan_simulates_flex_under_cp_flex(attention, monkeypatch):
    """With ``parallel.cp_flex`` on a GPU's profile the planner's fake-tensor step runs the cp attention
    on flex_attention (its operator through the allocation tracker): flex calls made, none without."""
    calls = []
    for name in ("attend", "attend_lse"):
        real = getattr(flexlib, name)
        monkeypatch.setattr(flexlib, name, lambda *a, real=real: calls.append(1) or real(*a))
    recipe = str(RECIPES / "llama_debug_cp.toml")
    argv = ["--hardware=h100_sxm", "--model.n_layers=2", f'--parallel.cp_attention="{attention}"', "--no-compare-cp"]
    for flex in (False, True):
        calls.clear()
        code, _, err, plan, _ = _plan_cli(recipe, *argv, f"--parallel.cp_flex={str(flex).lower()}")
        assert code == 0, err
        assert bool(calls) == flex, (flex, len(calls))


def test_the_start_line_says_what_cp_flex_does():
    """``parallel.cp_flex``: on CUDA the gather and the ring on flex, not Ulysses, and not where a rank's
    tokens are not whole tiles; on the CPU nothing (its kernels kept: the gather's flex has no CPU
    backward). A device object is all it reads: no GPU needed."""
    from meshpar.config.recipe import load
    from meshpar.distributed.mesh import resolve
    from meshpar.training.build import cp_flex_line

    def line(device: str, *argv: str) -> str:
        recipe = load(RECIPES / "llama_debug_cp.toml", ["--parallel.cp_flex=true", *argv])
        return cp_flex_line(recipe, resolve(recipe.parallel, 4), torch.device(device))

    assert "ring) on compiled flex_attention" in line("cuda", '--parallel.cp_attention="ring"')
    assert "allgather) on compiled flex_attention" in line("cuda")
    assert "Ulysses has no flex path" in line("cuda", '--parallel.cp_attention="ulysses"')
    assert "960 tokens per cp rank are not whole tiles of 128" in line("cuda", "--train.seq_len=1920")
    assert "is for CUDA: this cpu run keeps" in line("cpu")


def test_the_planner_runs_one_score_block_per_chunk_pair():
    """The planner's simulation takes each (query chunk, key chunk) pair's largest score block only
    (``Kernels(fake=True)``; a 131072-token plan would otherwise run ~10^5 fake matmuls per layer):
    the same pairs, the same largest block, so the same peak and hops."""
    ring = object.__new__(ringlib.Ring)
    ring.cp, ring.rank, ring.balanced, ring.kernels = 4, 1, True, Kernels()
    elements = 4 * 64 * 10  # blocks of 10 queries over a chunk of 64 keys
    every = {src: list(ring.pairs(src, 128, heads=4, elements=elements)) for src in range(4)}
    ring.kernels = Kernels(fake=True)
    for src, blocks in every.items():
        one = list(ring.pairs(src, 128, heads=4, elements=elements))
        assert len(blocks) > len(one) == {0: 2, 1: 3, 2: 2, 3: 2}[src]  # 2 full pairs per other rank; 3 its own

        def size(b):
            return (b[0].stop - b[0].start) * (b[1].stop - b[1].start)

        assert max(map(size, blocks)) == max(map(size, one))
