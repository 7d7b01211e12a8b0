"""``meshpar plan`` with context parallelism: the 131072-token Llama recipes
dry-run at their world size and match their headers; a rank's
activations and compute fall as 1/cp; cp's K/V gathers are the arithmetic of
[Note: all-gather of K and V] at the link the mesh order gives them; the pipeline's
transfers carry T/(cp tp) tokens; the layout search tries cp for long sequences only."""

from __future__ import annotations

import math

import pytest

from meshpar.config import recipe as recipelib
from meshpar.distributed.mesh import Layout
from meshpar.parallel.context_parallel.apply import ATTENTIONS
from meshpar.planner.candidates import MIN_CP_TOKENS, candidates
from meshpar.planner.cost import _degree, _link
from tests.test_plan import RECIPES, _check_recipe, _run, planlib

CP_RECIPES = ("llama3_8b_128k", "llama3_70b_128k")
H100 = planlib.load_hardware("h100_sxm")[0]


@pytest.mark.slow  # a cluster recipe planned at its target size
@pytest.mark.parametrize("name", CP_RECIPES)
def test_cp_recipe_fits_at_its_world_size_and_its_header_is_the_plan(name):
    _check_recipe(name)  # how long: docs/performance.md#test-suite-and-set-up
    out = _run(str(RECIPES / f"{name}.toml"))[1]
    for category in ("parameters, sharded and gathered", "gradients", "activations", "temporaries", "AdamW state"):
        assert f"    {category}" in out  # the acceptance line: memory by category
    plan = _run(str(RECIPES / f"{name}.toml"))[3]
    assert plan.recipe.train.seq_len == 131072 <= plan.args.max_seq_len


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_cp_gathers_are_the_arithmetic_at_their_link():
    """Per block and microbatch, K and V ([mb, Hkv/tp, T/cp, Dh] bf16 each) gathered from cp - 1
    ranks three times: forward, the forward recomputed under selective checkpointing (it keeps
    matmul and attention outputs, not the gathered K and V) and backward's reduce-scatter of
    their gradients; on the critical path, across nodes when cp x tp exceeds a node."""
    for name in CP_RECIPES:
        plan = _run(str(RECIPES / f"{name}.toml"))[3]
        a, t, layout = plan.args, plan.recipe.train, plan.layout
        kv = 2 * t.micro_batch * a.n_kv_heads // layout.tp * t.seq_len // layout.cp * a.resolved_head_dim * 2
        expected = 3 * kv * (layout.cp - 1) * a.n_layers * plan.accum
        cp = next(c for c in plan.time.comm if c.dim == "cp")
        assert cp.bytes_per_step == pytest.approx(expected, rel=1e-9), name
        assert not cp.overlapped and cp.degree == layout.cp and cp.link == "inter-node"
        fsdp = next(c for c in plan.time.comm if c.dim == "dp_shard_cp")
        assert fsdp.overlapped and fsdp.degree == layout.dp_shard * layout.cp


def test_flattened_dims_take_their_parts_degrees_and_links():
    """[Note: flattened dims] in meshpar/planner/cost.py: ranks are row-major with cp just outside
    tp, so a cp group spans cp x tp consecutive ranks, and a flattened dim its outermost part's
    mesh dim and every dim inside it."""
    assert _link("cp", Layout(1, 1, 2, 2, 4), 8, H100)[0] == "intra-node"
    assert _link("cp", Layout(1, 1, 2, 4, 4), 8, H100)[0] == "inter-node"
    assert _link("dp_shard_cp", Layout(1, 1, 2, 4, 1), 8, H100)[0] == "intra-node"
    assert _link("dp_shard_cp", Layout(1, 1, 4, 4, 1), 8, H100)[0] == "inter-node"
    layout = Layout(1, 2, 8, 2, 2, ep=4)  # pp, dp_replicate, dp_shard, cp, tp
    degrees = {d: _degree(d, layout) for d in ("dp_replicate_cp", "dp_shard_cp_tp", "dp_shard_mod_ep_cp_tp", "ep")}
    assert degrees == {"dp_replicate_cp": 4, "dp_shard_cp_tp": 32, "dp_shard_mod_ep_cp_tp": 8, "ep": 4}
    assert _link("ep", layout, 16, H100)[0] == "intra-node"  # ep x cp x tp = 16 ranks
    assert _link("dp_shard_mod_ep_cp_tp", layout, 16, H100)[0] == "inter-node"  # dp_shard x cp x tp = 32


@pytest.mark.slow  # a cluster recipe planned at its target size
def test_activations_and_compute_per_rank_fall_as_one_over_cp():
    """Llama 3.1 8B at 131072 tokens, dp_shard 2 x cp (one microbatch): what a forward leaves alive
    and the compute time are 1/cp of cp 1's (the balanced split gives every rank T/cp tokens and
    1/cp of the causal attention); the gathered K and V are not kept under selective checkpointing."""
    act, compute = {}, {}
    for cp in (1, 2, 4, 8):
        recipe = recipelib.load(RECIPES / "llama3_8b.toml", ["--train.seq_len=131072", "--train.global_batch=2",
                                                              "--parallel.dp_shard=2", f"--parallel.cp={cp}"])
        plan = planlib.plan(recipe, 2 * cp, H100)
        act[cp], compute[cp] = plan.ranks[0].measured.activation_bytes, plan.time.compute_s
    assert act[1] > act[2] > act[4] > act[8]
    for cp in (2, 4, 8):
        assert act[cp] == pytest.approx(act[1] / cp, rel=0.01), (cp, act)
        assert compute[cp] == pytest.approx(compute[1] / cp, rel=1e-9)
    assert [round(act[cp] / 2**30) for cp in (1, 2, 4, 8)] == [469, 235, 117, 59]  # llama3_8b_128k's header


def test_pipeline_transfers_carry_a_cp_ranks_tokens():
    """pp 2 x cp 2 x tp 2: each microbatch a stage sends and receives fp32 [mb, T/(cp tp), D]."""
    code, _, err, plan, _ = _run(str(RECIPES / "llama_debug_cp.toml"), "--world", "16", "--hardware", "cpu",
                                 "--parallel.pp=2", "--parallel.tp=2")
    assert code == 0, err
    t, layout = plan.recipe.train, plan.layout
    hidden = t.micro_batch * t.seq_len // (layout.cp * layout.tp) * plan.args.dim * 4
    assert [r.p2p_bytes for r in plan.ranks] == [plan.accum * hidden] * 2
    pp = next(c for c in plan.time.comm if c.dim == "pp")
    assert pp.bytes_per_step >= plan.accum * hidden  # plus clipping's norm over the stages


def test_search_tries_cp_for_long_sequences_only():
    base = ["--model.size=8b", "--train.global_batch=8", '--parallel.param_dtype="bfloat16"']
    seen, attentions = set(), {}
    for c in candidates([*base, "--train.seq_len=131072"], 32, H100, 8, None):
        o = {k: v for k, v in (x.removeprefix("--").split("=", 1) for x in c.overrides)}
        tp, cp, pp = int(o["parallel.tp"]), int(o["parallel.cp"]), int(o["parallel.pp"])
        assert tp * cp * pp * int(o["parallel.dp_replicate"]) * int(o["parallel.dp_shard"]) == 32
        assert 131072 % (2 * cp * tp) == 0 and 131072 // cp >= MIN_CP_TOKENS and math.log2(cp).is_integer()
        seen.add(cp)
        attentions.setdefault((cp, tp), set()).add(o["parallel.cp_attention"].strip('"'))
    assert seen == {1, 2, 4, 8, 16}
    # each cp layout with each attention (cp x tp divides the 32 query heads in all of them, as Ulysses
    # needs); without cp one candidate, not three
    assert all(found == set(ATTENTIONS) if cp > 1 else found == {"allgather"} for (cp, _), found in attentions.items())
    assert {int(dict(x.split("=") for x in c.overrides)["--parallel.cp"])
            for c in candidates([*base, "--train.seq_len=8192"], 32, H100, 8, None)} == {1}


def test_search_leaves_out_ulysses_where_it_cannot_split_the_heads():
    """The debug Llama's 8 query heads: Ulysses at cp 4 x tp 4 (half a head a rank) is no candidate, the
    all-gather and the ring are; at cp 4 x tp 2 all three are."""
    found = {}
    for c in candidates(["--model.size=debug", "--train.global_batch=8", "--train.seq_len=131072"], 32, H100, 8, None):
        o = dict(x.removeprefix("--").split("=", 1) for x in c.overrides)
        found.setdefault((o["parallel.cp"], o["parallel.tp"]), set()).add(o["parallel.cp_attention"].strip('"'))
    assert found[("4", "4")] == {"allgather", "ring"} and found[("4", "2")] == set(ATTENTIONS)


@pytest.mark.slow  # four dry runs
def test_plan_counts_document_masks_once_without_cp_and_never_whole_with_it():
    """``model.attention = "document"`` is planned, not ignored. At cp 1 a forward leaves alive, more
    than causal attention (fp32, exactly): the [B, 1, T, T] mask, once for every layer; per layer,
    K and V repeated to the query heads for the masked kernel ([Note: masked grouped-query
    attention on CUDA]) in place of their grouped selves; and RoPE's cos, sin per row [B, 1, T,
    Dh/2] in place of views of the tables. Under cp 2 no rank holds a [T, T] mask ([Note: documents
    under context parallelism]): each chunk's is built inside its checkpointed attention, so a
    forward leaves less alive than causal cp's, whose fused attention keeps its output."""
    recipe = str(RECIPES / "llama_debug_cp.toml")
    argv = ["--train.seq_len=512", "--parallel.dp_shard=1", "--train.global_batch=4"]

    def planned(*extra):
        code, out, err, plan, _ = _run(recipe, *argv, *extra)
        assert code == 0, err
        return plan

    causal = planned("--parallel.cp=1", "--world=1")
    document = planned("--parallel.cp=1", "--world=1", '--model.attention="document"')
    a, t = causal.args, causal.recipe.train
    b, seq, dh = t.micro_batch, t.seq_len, a.dim // a.n_heads
    mask, rope = b * seq * seq * 4, 2 * b * seq * dh // 2 * 4
    repeated = a.n_layers * 2 * b * (a.n_heads - a.n_kv_heads) * seq * dh * 4
    alive = [p.ranks[0].measured.activation_bytes for p in (causal, document)]
    assert alive[1] - alive[0] == mask + repeated + rope
    causal_cp, document_cp = (planned("--parallel.cp=2", "--world=2", *extra).ranks[0].measured.activation_bytes
                              for extra in ([], ['--model.attention="document"']))
    assert document_cp < causal_cp
    # as meshpar train does, before any rank starts: later pipeline stages never see the token ids
    code, _, err, _, _ = _run(recipe, *argv, "--parallel.pp=2", "--parallel.cp=1", "--world=2",
                              '--model.attention="document"')
    assert code == 2 and "model.attention = 'document' with parallel.pp > 1" in err, err


@pytest.mark.parametrize("attention", ["allgather", "ring", "ulysses"])
def test_search_bound_is_above_the_planned_speed(attention):
    """The search prunes by ``upper_bound``, the tokens/s no dry run of a layout can exceed: so it must
    be at least what the plan gives, for each cp attention. The ring's hops are hidden behind its
    attention but each block's last ([Note: the ring's overlap]), so the bound must count only that hop
    of cp traffic: pricing all of it, as the gather's, puts the bound below the plan of the debug Llama
    at cp 2 on H100 links without checkpointing, the case below."""
    from meshpar.planner.candidates import upper_bound

    argv = ["--hardware=h100_sxm", f'--parallel.cp_attention="{attention}"', '--parallel.activation_checkpoint="none"',
            "--train.seq_len=2048"]
    code, _, err, plan, _ = _run(str(RECIPES / "llama_debug_cp.toml"), *argv)
    assert code == 0, err
    lay = plan.layout
    bound = upper_bound(plan.args, plan.recipe, lay.pp, lay.tp, lay.cp, lay.dp, plan.accum, plan.profile, 8, None)
    assert bound >= plan.time.tokens_per_s


def test_compare_cp_plans_each_attention():
    """``meshpar plan`` of a cp recipe (by default: ``--compare-cp``): the recipe planned with each cp
    attention, the recipe's own marked; on an H100 the ring is priced slower ([Note: the ring on a
    GPU]), Ulysses sends q and the output too. An attention the layout cannot take is named with the
    reason, and the plan still stands."""
    code, out, err, plan, _ = _run(str(RECIPES / "llama_debug_cp.toml"), "--world=4", compare_cp=True)
    assert code == 0, err
    assert plan.recipe.parallel.cp_attention == "allgather"
    rows = {line.split()[0].lstrip("*"): line for line in out.split("context-parallel attentions")[1].splitlines()[1:4]}
    assert set(rows) == {"allgather", "ring", "ulysses"} and rows["allgather"].lstrip().startswith("*")

    def figure(name: str, unit: str) -> float:
        return float(rows[name].split(unit)[0].split()[-1].replace(",", ""))

    assert figure("ring", " s |") > figure("allgather", " s |")
    assert figure("allgather", " GB per step") > 0 and figure("ulysses", " GB per step") > 0
    # the debug model's 8 query heads over tp 4 leave 2 a rank, which cp 4 cannot split for Ulysses
    code, out, err, _, _ = _run(str(RECIPES / "llama_debug_cp.toml"), "--world=16", "--parallel.tp=4",
                                "--parallel.cp=4", "--parallel.dp_shard=1", compare_cp=True)
    assert code == 0, err
    refused = next(line for line in out.splitlines() if line.lstrip().startswith("ulysses"))
    assert "not at this layout" in refused and "use cp in [2]" in refused, refused
