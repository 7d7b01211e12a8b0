"""Context parallelism (meshpar/parallel/context_parallel/apply.py) against one process.

A debug Llama (GQA: 8 query heads, 4 kv heads) runs a batch of sequences whole in one process and
split over cp 2 and cp 4 ranks, each rank holding its tokens of every sequence ([Note: balanced
sequence split]) and gathering K and V over cp ([Note: all-gather of K and V]). In float64 the
logits of each rank's tokens equal the whole run's at those positions, and the gradients (each
rank's loss is the mean over its tokens; averaged over cp ranks, as FSDP over dp_shard x cp does)
equal the whole run's, to TOL; the contiguous split gives the same numbers (the balancing is only
scheduling), and it is what differs in attention work per rank.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from meshpar.data.prepared import builtin_text
from meshpar.distributed import comm_record
from meshpar.models.attention import Kernels
from meshpar.parallel.activation_checkpoint import apply_activation_checkpointing
from meshpar.parallel.context_parallel import flex as flexlib
from meshpar.parallel.context_parallel import layout as layoutlib
from meshpar.parallel.context_parallel.apply import ATTENTIONS, apply_context_parallel
from meshpar.parallel.context_parallel.layout import sequence_indices, shard_sequence
from meshpar.parallel.context_parallel.ulysses import check_heads, kv_repeats
from meshpar.train import train
from meshpar.training.preflight import preflight
from tests.distributed import CaseSet, run_distributed
from tests.helpers import build_model, load_recipe, merged_state, train_losses, train_on_rank
from tests.parity import TOL, default_dtype, in_float64, must_fail
from tests.test_document_attention import EOS, packed_documents

B, T = 2, 32


def _setup(tmp):
    torch.set_default_dtype(torch.float64)
    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))


def _case_parity(mesh) -> dict:
    ref, tokens, logits = reference_model()
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for balanced in (True, False):
        local, grads, calls = run_cp(ref, inputs, targets, mesh, balanced)
        idx = sequence_indices(T, mesh.size(), mesh.get_local_rank(), balanced=balanced)
        diff = {"logits": (local - logits[:, idx]).abs().max().item()}
        for (name, grad), q in zip(grads.items(), ref.parameters(), strict=True):
            diff[name] = ((grad - q.grad).abs().max() / q.grad.abs().max()).item()
        out[balanced] = {"diff": diff, "calls": calls}
    return out


def reference_model(seed: int = 0, documents: bool = False, n_kv_heads: int = 4, seq_len: int = T):
    """The debug Llama (2 blocks, vocabulary 64), a batch [B, seq_len + 1] of tokens, and its logits after
    one process's forward and backward (its parameters hold their gradients). With ``documents``
    the tokens are packed documents (DOCUMENTS) and the model's attention is document-causal."""
    ref = build_model("llama", "debug", n_layers=2, vocab_size=64, max_seq_len=seq_len,
                      document_eos=EOS if documents else -1, n_kv_heads=n_kv_heads)
    if documents:
        tokens, _ = packed_documents(64, DOCUMENTS, seed=seed)
    else:
        tokens = torch.randint(0, 64, (B, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    logits = ref(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return ref, tokens, logits


def run_cp(ref, inputs, targets, mesh, balanced: bool, attention: str = "allgather", flex: bool = False,
           checkpoint: str = "none"):
    """A copy of ``ref`` over cp on this rank's tokens (its attention on flex_attention with ``flex``, its
    blocks under ``checkpoint``'s activation checkpointing): its logits, every parameter's gradient
    averaged over the cp ranks (as FSDP over dp_shard x cp does), the collectives it issued."""
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    apply_context_parallel(model, mesh, balanced=balanced, attention=attention, flex=flex)
    apply_activation_checkpointing(model, checkpoint)
    with comm_record.count() as counted:
        local = model(shard_sequence(inputs, mesh, balanced=balanced))
        F.cross_entropy(local.flatten(0, 1), shard_sequence(targets, mesh, balanced=balanced).flatten()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad.clone()
        dist.all_reduce(grads[name])
        grads[name] /= mesh.size()
    return local.detach(), grads, dict(counted.calls)


# Packed documents ending with EOS (tests/test_document_attention.py): row 0's boundaries fall inside
# chunks; row 1's first document ends at token 8, so the next starts on a chunk boundary (chunks of 8
# at cp 2, 4 at cp 4, balanced), and its last one runs through every later chunk.
DOCUMENTS = ((5, 9, 19), (8, 3, 22))


def _case_documents(mesh) -> dict:
    """[Note: documents under context parallelism]: each attention and split against one process's
    document-causal model, and the same cp run with the documents dropped (plain causal)."""
    ref, tokens, logits = reference_model(documents=True)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    causal = copy.deepcopy(ref)
    causal.args = dataclasses.replace(causal.args, document_eos=-1)
    out = {}
    for attention in ATTENTIONS:
        for balanced in (True, False):
            idx = sequence_indices(T, mesh.size(), mesh.get_local_rank(), balanced=balanced)
            local, grads, calls = run_cp(ref, inputs, targets, mesh, balanced, attention)
            diff = {"logits": (local - logits[:, idx]).abs().max().item()}
            diff.update({name: ((grads[name] - q.grad).abs().max() / q.grad.abs().max()).item()
                         for name, q in ref.named_parameters()})
            undocumented = run_cp(causal, inputs, targets, mesh, balanced, attention)[0]
            out[attention, balanced] = {"diff": diff, "calls": calls,
                                        "causal": (undocumented - logits[:, idx]).abs().max().item()}
    return out


def _case_ulysses(mesh) -> dict:
    """Ulysses (meshpar/parallel/context_parallel/ulysses.py) against one process, balanced and
    contiguous, with 4, 2 and 1 kv heads (at cp 4 the last two repeat kv heads: [Note: Ulysses with
    grouped-query attention]); then with the balanced split's reorder left out (a planted bug)."""
    out = {}
    for kv in (4, 2, 1):
        ref, tokens, logits = reference_model(n_kv_heads=kv)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        for balanced in (True, False):
            local, grads, calls = run_cp(ref, inputs, targets, mesh, balanced, "ulysses")
            idx = sequence_indices(T, mesh.size(), mesh.get_local_rank(), balanced=balanced)
            diff = {"logits": (local - logits[:, idx]).abs().max().item()}
            diff.update({name: ((grads[name] - q.grad).abs().max() / q.grad.abs().max()).item()
                         for name, q in ref.named_parameters()})
            out[kv, balanced] = {"diff": diff, "calls": calls}
    ref, tokens, logits = reference_model()
    order, layoutlib._sequence_order = layoutlib._sequence_order, lambda held: torch.arange(len(held))
    try:
        local = run_cp(ref, tokens[:, :-1], tokens[:, 1:], mesh, True, "ulysses")[0]
    finally:
        layoutlib._sequence_order = order
    out["unordered"] = (local - logits[:, sequence_indices(T, mesh.size(), mesh.get_local_rank())]).abs().max().item()
    return out


def _case_flex(mesh) -> dict:
    """[Note: cp attention on flex_attention]: the cp model with the all-gather's attention on flex,
    forward only (flex has no CPU backward), causal and by document, at the shortest sequence that
    gives each rank whole tiles: every rank's logits against one process's; and whether the flex
    path ran (its block mask kept on the layout)."""
    t = flexlib.BLOCK * 2 * mesh.size()
    out = {}
    for documents in (False, True):
        ref = build_model("llama", "debug", n_layers=2, vocab_size=64, max_seq_len=t,
                          document_eos=EOS if documents else -1)
        tokens = torch.randint(0, 64, (B, t), generator=torch.Generator().manual_seed(1))  # EOS about 1 in 64
        model = copy.deepcopy(ref)
        apply_context_parallel(model, mesh)
        for block in model.layers.values():
            block.attention.inner_attention.kernels = Kernels(flex=True)
        with torch.no_grad():
            whole, local = ref(tokens), model(shard_sequence(tokens, mesh))
        idx = sequence_indices(t, mesh.size(), mesh.get_local_rank())
        layout = model.layers["0"].attention.inner_attention.layout
        ran = any(key[0] == "flex" for key in (layout._doc_masks if documents else layout._built))
        out[documents] = {"diff": ((local - whole[:, idx]).abs().max() / whole.abs().max()).item(), "flex": ran}
    return out


JOBS = CaseSet({"parity": (_case_parity, (2, 4)), "documents": (_case_documents, (2, 4)),
                "ulysses": (_case_ulysses, (2, 4)), "flex": (_case_flex, (2, 4))}, setup=_setup, timeout=240)


def test_sequence_indices_balance_the_causal_work():
    """Balanced: every rank's (query, key) pairs within one chunk's diagonal of the others'; the
    contiguous split gives the last rank about 2cp - 1 times the first's."""
    def pairs(idx):  # causal keys per query, summed
        return int((idx + 1).sum())

    for cp in (2, 4, 8):
        bal = [pairs(sequence_indices(1024, cp, r)) for r in range(cp)]
        con = [pairs(sequence_indices(1024, cp, r, balanced=False)) for r in range(cp)]
        assert max(bal) - min(bal) <= (1024 // (2 * cp)) ** 2, bal
        assert con[-1] / con[0] > 2 * cp - 2, con
        assert sorted(torch.cat([sequence_indices(1024, cp, r) for r in range(cp)]).tolist()) == list(range(1024))


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process(world):
    r = JOBS.check("parity", world)[0]
    for balanced in (True, False):
        diff = r[balanced]["diff"]
        worst = max(diff.values())
        assert worst <= TOL, (balanced, {k: v for k, v in diff.items() if v > TOL})
        # per layer, forward: K and V gathered; backward: their gradients reduce-scattered
        assert r[balanced]["calls"] == {("all_gather", "cp"): 2 * 2, ("reduce_scatter", "cp"): 2 * 2}


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_document_attention_under_cp_matches_one_process(world):
    """Packed documents at cp 2 and 4, with the all-gather and the ring, balanced and contiguous:
    every rank's logits and every parameter's gradient equal one process's document-causal model
    to TOL; the same cp run with plain causal attention does not (tokens would see earlier
    documents). Per layer the collectives of causal cp, and one gather of the token ids per
    forward (the whole sequence's documents)."""
    for rank, r in enumerate(JOBS.check("documents", world)):
        for (attention, balanced), case in r.items():
            worst = max(case["diff"].values())
            assert worst <= TOL, (attention, balanced, rank, {k: v for k, v in case["diff"].items() if v > TOL})
            must_fail(lambda case=case: _close([case["causal"]], [0.0], "causal"), "documents dropped under cp")
            layers, hops = 2, world - 1
            want = {"allgather": {("all_gather", "cp"): 1 + 2 * layers, ("reduce_scatter", "cp"): 2 * layers},
                    "ring": {("all_gather", "cp"): 1, ("send_recv", "cp"): 3 * layers * hops},
                    # q, k, v and the output each way, forward and backward
                    "ulysses": {("all_gather", "cp"): 1, ("all_to_all", "cp"): 8 * layers}}[attention]
            assert case["calls"] == want, (attention, case["calls"])


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_one_process(world):
    """Every rank's logits and every parameter's gradient equal one process's to TOL, for every kv
    head count and both splits; per layer four all-to-alls forward and four backward, nothing else;
    without the reorder of the balanced split's chunks the logits are wrong."""
    for rank, r in enumerate(JOBS.check("ulysses", world)):
        for (kv, balanced), case in ((k, c) for k, c in r.items() if k != "unordered"):
            worst = max(case["diff"].values())
            assert worst <= TOL, (kv, balanced, rank, {k: v for k, v in case["diff"].items() if v > TOL})
            assert case["calls"] == {("all_to_all", "cp"): 8 * 2}, case["calls"]
        must_fail(lambda r=r: _close([r["unordered"]], [0.0], "unordered"), "chunks left in rank order")


@pytest.mark.parity
@pytest.mark.parametrize("world", [2, 4])
def test_gather_on_flex_matches_one_process_forward(world):
    """The all-gather's attention on flex_attention in the cp model (Kernels(flex=True)): every
    rank's logits equal one process's to TOL, causal and by document; its backward needs CUDA
    (tests/test_cuda.py)."""
    for rank, r in enumerate(JOBS.check("flex", world)):
        for documents, case in r.items():
            assert case["flex"] and case["diff"] <= TOL, (rank, documents, case)


def test_ulysses_kv_repeats_and_head_checks():
    assert [kv_repeats(8, kv, 4) for kv in (8, 4, 2, 1)] == [1, 1, 2, 4]
    assert kv_repeats(32, 8, 16) == 2  # Llama 3 70B's heads over cp 16: each kv head twice
    assert check_heads(32, 8, 4, 8) is None
    assert "use cp in [2]" in check_heads(8, 4, 4, 4)


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) and got, (what, got, want)
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= TOL * abs(w), (what, got, want)


def _train_matches(recipe, world: int, reference) -> None:
    """``recipe`` trained on ``world`` ranks in float64 against the one-rank ``reference``: losses,
    gradient norms, validation losses and every parameter to TOL."""
    results = run_distributed(in_float64, world, train_on_rank, recipe, timeout=300, init_process_group=False)
    records = results[0][0]
    _close(train_losses(records), train_losses(reference.records), "loss")
    for key in ("grad_norm", "val_loss"):
        _close([r[key] for r in records if key in r], [r[key] for r in reference.records if key in r], key)
    state = merged_state(results)
    assert state.keys() == reference.state_dict.keys()
    for name, want in reference.state_dict.items():
        assert want.dtype == torch.float64, name
        torch.testing.assert_close(state[name], want, rtol=TOL, atol=TOL, msg=name)


LAYOUTS = {  # name: (overrides of recipes/llama_debug_cp.toml, world size)
    "cp2-dp_shard2": ([], 4),  # the recipe: FSDP over dp_shard x cp
    "cp2": (["--parallel.dp_shard=1"], 2),  # no FSDP: gradients averaged over cp as over replicas
    # cp outside tp; the loss in 3 chunks of each rank's 128 tokens, vocabulary-sharded (meshpar/training/loss.py)
    "cp2-tp2-chunked-loss": (["--parallel.dp_shard=1", "--parallel.tp=2", "--train.loss_chunks=3"], 4),
    "pp2-cp2": (["--parallel.dp_shard=1", "--parallel.pp=2"], 4),
    "replicate2-cp2": (["--parallel.dp_shard=1", "--parallel.dp_replicate=2"], 4),
    # 3D, with the ring: its K/V chunks are a tp rank's heads, passed over that rank's cp group, per stage
    "pp2-cp2-tp2-ring": (["--parallel.dp_shard=1", "--parallel.pp=2", "--parallel.tp=2",
                          '--parallel.cp_attention="ring"'], 8),
    # each chunk's attention is itself checkpointed on CPU: [Note: the causal mask off the fused kernels]
    "cp2-dp_shard2-selective-ac-chunked-loss": (['--parallel.activation_checkpoint="selective"',
                                                 "--train.loss_chunks=3"], 4),
    # K/V passed around the ring instead of gathered ([Note: ring attention], tests/test_ring_attention.py),
    # under selective checkpointing, which recomputes the ring's forward whole (its hops included)
    "cp2-dp_shard2-ring-selective-ac": (['--parallel.cp_attention="ring"',
                                         '--parallel.activation_checkpoint="selective"'], 4),
    # the heads split over cp for attention (meshpar/parallel/context_parallel/ulysses.py), each tp rank's 4
    "cp2-tp2-ulysses": (["--parallel.dp_shard=1", "--parallel.tp=2", '--parallel.cp_attention="ulysses"'], 4),
    "pp2-cp2-ulysses-full-ac": (["--parallel.dp_shard=1", "--parallel.pp=2", '--parallel.cp_attention="ulysses"',
                                 '--parallel.activation_checkpoint="full"'], 4),
}
RESUMED = {"cp2-dp_shard2"}  # its step-1 checkpoint also resumes on one rank and on cp 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with default_dtype():
        return train(load_recipe("llama_debug_cp.toml", tmp_path_factory.mktemp("ref"), *STEPS,
                                 "--parallel.dp_shard=1", "--parallel.cp=1"), return_state=True)


# two steps: the second runs on the first update and its own update is checked in every parameter
STEPS = ["--train.steps=2", "--train.seq_len=256", "--train.eval_every=2", "--data.val_fraction=0.1"]


# the parity reruns on other kernel paths (.ci/run) take the recipe's own layout and the ring only: the
# same float64 arithmetic as the others, and each rerun of all of them would add minutes
PARITY_LAYOUTS = {"cp2-dp_shard2", "cp2-dp_shard2-ring-selective-ac"}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.parity) if name in PARITY_LAYOUTS else name
                                    for name in LAYOUTS])
def test_meshpar_train_with_cp_matches_one_rank(layout, reference, tmp_path, data_cache):
    """recipes/llama_debug_cp.toml through meshpar train in each layout against the same recipe on
    one rank, float64, 2 steps at 256 tokens: losses, validation loss, gradient norms and every
    parameter to TOL. The recipe's own layout's step-1 checkpoint then resumes on one rank and on
    cp 4, each giving the straight run's step-2 loss (a skipped or repeated sample would not)."""
    overrides, world = LAYOUTS[layout]
    resume = layout in RESUMED
    recipe = load_recipe("llama_debug_cp.toml", tmp_path / "run", *STEPS, *overrides,
                         *(["--checkpoint.every=1"] if resume else []))
    _train_matches(recipe, world, reference)
    if resume:  # cp changes no parameter placement but the FSDP mesh; the data position is global
        saved = f"--checkpoint.load_from={tmp_path / 'run' / 'checkpoints' / 'step_1'}"
        with default_dtype():
            one = train(load_recipe("llama_debug_cp.toml", tmp_path / "one", *STEPS, saved, "--parallel.dp_shard=1",
                                    "--parallel.cp=1"))
        _close(train_losses(one.records), train_losses(reference.records)[1:], "resumed on one rank")
        cp4 = load_recipe("llama_debug_cp.toml", tmp_path / "cp4", *STEPS, saved, "--parallel.dp_shard=1",
                          "--parallel.cp=4")
        records = run_distributed(in_float64, 4, train_on_rank, cp4, timeout=300, init_process_group=False)[0][0]
        _close(train_losses(records), train_losses(reference.records)[1:], "resumed on cp 4")


# --- document-causal attention through meshpar train --------------------------------------------

DOC_LAYOUTS = {  # name: (overrides of recipes/llama_debug_cp.toml, world size)
    "cp2-dp_shard2": ([], 4),
    "cp2-tp2-ring": (["--parallel.dp_shard=1", "--parallel.tp=2", '--parallel.cp_attention="ring"'], 4),
    "cp2-dp_shard2-ulysses": (['--parallel.cp_attention="ulysses"'], 4),
}


@pytest.fixture(scope="module")
def paragraphs(tmp_path_factory, data_cache) -> list[str]:
    """The built-in text cut into its paragraphs (~70 tokens each with BPE 512), one document each,
    as a .jsonl corpus: every 256-token sequence packs several, and a document ends with EOS."""
    path = tmp_path_factory.mktemp("documents") / "paragraphs.jsonl"
    with path.open("w") as f:
        for text in builtin_text().split("\n\n"):
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
    return [f"--data.path={path}", '--data.tokenizer="bpe"', "--data.vocab_size=512", "--model.vocab_size=512",
            '--model.attention="document"']


@pytest.fixture(scope="module")
def documents_reference(tmp_path_factory, paragraphs):
    recipe = load_recipe("llama_debug_cp.toml", tmp_path_factory.mktemp("doc-ref"), *STEPS, *paragraphs,
                         "--parallel.dp_shard=1", "--parallel.cp=1")
    eos = preflight(recipe, 1).corpus.eos_id
    with default_dtype():
        done = train(recipe, return_state=True)
    return done, eos


@pytest.mark.parametrize("layout", list(DOC_LAYOUTS))
def test_meshpar_train_with_documents_under_cp_matches_one_rank(layout, documents_reference, paragraphs, tmp_path):
    """``model.attention = "document"`` with cp 2 (the gather inside FSDP; the ring under tp 2) on a
    corpus of short documents against the same recipe on one rank, float64, 2 steps at 256 tokens:
    losses, gradient norms, validation loss and every parameter to TOL."""
    reference, eos = documents_reference
    assert eos is not None
    overrides, world = DOC_LAYOUTS[layout]
    recipe = load_recipe("llama_debug_cp.toml", tmp_path / "run", *STEPS, *paragraphs, *overrides)
    _train_matches(recipe, world, reference)
