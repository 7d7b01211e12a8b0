"""Document-causal attention (``document_eos`` in a family's args) against each document run alone.

Documents of different lengths, each ending with EOS, are packed into sequences; a model built
with ``document_eos = EOS`` must give, at every document's positions, the logits of the same
model (``document_eos = -1``) run on that document alone, and the gradients of the sum of the
per-document losses. With plain causal attention on the packed sequence they must not match
(``must_fail``). Then Llama and GPT-2 (each TP plan table) under tensor parallelism (sequence
parallel) and under FSDP on 2 ranks, against the single-process model with ``document_eos`` set:
the loss, every gathered gradient, and every parameter after one AdamW step.

Everything runs in float64 with tests/parity.py's ``TOL`` (1e-9, its [Note: parity in
float64]): a document alone and the same document inside a packed sequence add the same
numbers in other orders (attention over T keys, masked ones adding exp(-inf) = 0), which
moves a float64 result by ~1e-15; a token that sees another document moves its logits by ~1.
The models are the debug sizes cut to 2 layers; one spawned job of 2 ranks runs every
distributed case. torch.compile with the mask is not run here (compiling costs tens of seconds on
two shared cores); tests/test_compile.py covers the compiled block, whose mask is one more input.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from meshpar.models.attention import document_mask
from meshpar.models.gpt2.parallelize import gpt2_tp_plan
from meshpar.models.llama.parallelize import llama_tp_plan
from meshpar.parallel.activation_checkpoint import apply_activation_checkpointing
from meshpar.parallel.tensor_parallel.plan import apply_tp, loss_parallel_context, reduce_partial_grads
from tests.distributed import CaseSet
from tests.helpers import FAMILIES
from tests.parity import TOL, default_dtype, must_fail

EOS = 0  # documents draw their other tokens from 1 .. V-1
LENGTHS = ((5, 9, 19), (13, 3, 17))  # two rows of 33 tokens: inputs [:, :-1], targets [:, 1:]
MODELS = ("llama", "qwen3", "gpt2")  # qwen3: per-head q/k norms before RoPE
PARALLEL = {"llama": llama_tp_plan, "gpt2": gpt2_tp_plan}  # on 2 ranks: each TP plan table (Qwen3 shares Llama's)


def _build(family: str, eos: int = EOS, device: str | None = None) -> nn.Module:
    """``family``'s debug size with 2 layers; every build has the same weights (seed 0, and
    meshpar.models.init makes values independent of ``document_eos`` and of the device)."""
    cls, sizes = FAMILIES[family]
    with torch.device(device or "cpu"):
        model = cls(dataclasses.replace(sizes["debug"], n_layers=2, document_eos=eos))
    if device is None:
        torch.manual_seed(0)
        model.init_weights()
    return model


def packed_documents(vocab_size: int, lengths=LENGTHS, seed: int = 1) -> tuple[Tensor, list[list[tuple[int, int]]]]:
    """tokens[B, T] of random documents, each ending with EOS, and each row's (start, end) spans."""
    g = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for row in lengths:
        docs = [torch.randint(1, vocab_size, (n,), generator=g) for n in row]
        for doc in docs:
            doc[-1] = EOS
        rows.append(torch.cat(docs))
        ends = torch.tensor(row).cumsum(0).tolist()
        spans.append(list(zip([0, *ends[:-1]], ends, strict=True)))
    return torch.stack(rows), spans


def _documents(tokens: Tensor, spans) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document of inputs tokens[B, T] (the last one of a row may be cut)."""
    t = tokens.shape[1]
    docs = [(b, s, min(e, t)) for b, row in enumerate(spans) for s, e in row if s < t]
    assert len(docs) == sum(map(len, spans)), docs  # no vacuous comparison
    return docs


def _assert_per_document(packed: Tensor, alone: nn.Module, tokens: Tensor, spans) -> None:
    for b, s, e in _documents(tokens, spans):
        gap = (packed[b, s:e] - alone(tokens[b:b + 1, s:e])[0]).abs().max().item()
        assert gap <= TOL, (b, s, e, gap)


@pytest.mark.parity
@pytest.mark.parametrize("family", MODELS)
@default_dtype()
def test_packed_documents_match_each_document_alone(family):
    model, alone = _build(family), _build(family, eos=-1)
    tokens, spans = packed_documents(model.args.vocab_size)
    with torch.no_grad():
        _assert_per_document(model(tokens), alone, tokens, spans)
        # plain causal attention on the packed sequence: later documents see earlier ones
        must_fail(lambda: _assert_per_document(alone(tokens), alone, tokens, spans), "attention across documents")


@pytest.mark.parity
@pytest.mark.parametrize("family", MODELS)
@default_dtype()
def test_without_eos_outputs_are_plain_causal(family):
    """No EOS in the sequence: one document, today's outputs. Not bit-identical (SDPA with a mask
    takes another kernel path than ``is_causal``), so to the float64 TOL."""
    model, plain = _build(family), _build(family, eos=-1)
    tokens = torch.randint(1, model.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        gap = (model(tokens) - plain(tokens)).abs().max().item()
    assert gap <= TOL


@pytest.mark.parity
@pytest.mark.parametrize("family", MODELS)
@default_dtype()
def test_packed_gradients_match_sum_of_documents(family):
    """Summed cross-entropy over the packed batch (random targets, the same at each position in
    both runs) against the sum over documents run alone: every parameter's gradient, relative to
    its scale. Checkpointing the packed model's blocks (selective) changes nothing."""
    model, alone = _build(family), _build(family, eos=-1)
    apply_activation_checkpointing(model, "selective")
    tokens, spans = packed_documents(model.args.vocab_size)
    targets = torch.randint(0, model.args.vocab_size, tokens.shape, generator=torch.Generator().manual_seed(3))
    loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), reduction="sum")
    loss.backward()
    ref = sum(F.cross_entropy(alone(tokens[b:b + 1, s:e])[0], targets[b, s:e], reduction="sum")
              for b, s, e in _documents(tokens, spans))
    ref.backward()
    assert abs(loss.item() - ref.item()) <= TOL * abs(ref.item())
    grads = {n: p.grad for n, p in alone.named_parameters()}
    assert grads and grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        err = (p.grad - grads[name]).abs().max().item() / grads[name].abs().max().item()
        assert err <= TOL, (name, err)


def test_document_mask_and_positions():
    tokens = torch.tensor([[5, 0, 6, 7, 0, 8], [0, 1, 2, 3, 4, 0]])  # EOS = 0 ends its document
    mask, positions = document_mask(tokens, EOS)
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    doc = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    expected = (doc[:, :, None] == doc[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    assert torch.equal(mask[:, 0], expected)
    bias, _ = document_mask(tokens, EOS, dtype=torch.float64)
    assert torch.equal(bias, torch.zeros_like(bias).masked_fill(~mask, float("-inf")))


@default_dtype()
def test_mask_is_built_once_and_shared_by_every_layer():
    """[Note: document-causal attention]: a bool mask would be converted, and saved for
    backward, by every attention call; the model's additive mask is one tensor for all layers."""
    model = _build("llama")
    tokens, _ = packed_documents(model.args.vocab_size)
    shape = (tokens.shape[0], 1, tokens.shape[1], tokens.shape[1])
    saved = []

    def pack(t: Tensor) -> Tensor:
        if t.shape == shape:
            saved.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    assert len(saved) >= model.args.n_layers and len(set(saved)) == 1, saved


@pytest.mark.parametrize("family", ("llama", "gpt2"))
def test_later_pipeline_stages_refuse_document_attention(family):
    model = _build(family, device="meta")
    setattr(model, "tok_embeddings" if family == "llama" else "wte", None)
    with pytest.raises(ValueError, match="document_eos = 0: this pipeline stage receives hidden states.*pp = 1"):
        model(torch.empty(1, 4, model.args.dim, device="meta"))


# --- on 2 ranks: tensor parallel and FSDP against one process ---------------------------------

def _full(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _step(model: nn.Module, tokens: Tensor, loss_parallel: bool) -> float:
    """Next-token cross-entropy (mean), backward, and one AdamW step after the caller's checks."""
    with loss_parallel_context(loss_parallel):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return (loss.to_local() if isinstance(loss, DTensor) else loss).item()


def _compare(model: nn.Module, ref: nn.Module, loss: float, ref_loss: float) -> dict:
    """Loss, gathered gradients (relative to their scale) and parameters after one AdamW step."""
    grads = {n: (_full(p.grad) - ref.get_parameter(n).grad).abs().max().item()
             / ref.get_parameter(n).grad.abs().max().item() for n, p in model.named_parameters()}
    for m in (model, ref):
        torch.optim.AdamW(m.parameters(), lr=1e-3).step()
    params = {n: (_full(p.detach()) - ref.get_parameter(n)).abs().max().item() for n, p in model.named_parameters()}
    return {"loss": (loss, ref_loss), "grads": grads, "params": params}


def _case_tp(meshes: dict) -> dict:
    """tp = 2, sequence parallel, logits vocab-sharded (loss parallel); the batch on both ranks."""
    out = {}
    for family, plan in PARALLEL.items():
        ref, model = _build(family), _build(family, device="meta")
        apply_tp(model, meshes["tp"], plan(loss_parallel=True))
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        tokens, _ = packed_documents(ref.args.vocab_size)
        loss = _step(model, tokens, loss_parallel=True)
        reduce_partial_grads(model)  # pure TP: replicated parameters' gradients are partial sums
        out[family] = _compare(model, ref, loss, _step(ref, tokens, loss_parallel=False))
    return out


def _case_fsdp(meshes: dict) -> dict:
    """dp_shard = 2: fully_shard per block, then the root; each rank trains on its own packed row."""
    from meshpar.fsdp import fully_shard

    out, rank = {}, meshes["dp_shard"].get_local_rank()
    for family in PARALLEL:
        ref, model = _build(family), _build(family, device="meta")
        for block in model.layers.values():
            fully_shard(block, mesh=meshes["dp_shard"])
        fully_shard(model, mesh=meshes["dp_shard"])
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        model.init_weights()
        tokens, _ = packed_documents(ref.args.vocab_size)
        loss = torch.tensor(_step(model, tokens[rank:rank + 1], loss_parallel=False))
        dist.all_reduce(loss)  # rows of equal length: the mean of the ranks' means is the batch mean
        out[family] = _compare(model, ref, loss.item() / 2, _step(ref, tokens, loss_parallel=False))
    return out


def _setup(tmp: Path) -> dict:
    torch.set_default_dtype(torch.float64)  # see the module docstring
    return {dim: init_device_mesh("cpu", (2,), mesh_dim_names=(dim,)) for dim in ("tp", "dp_shard")}


JOBS = CaseSet({"tp": (_case_tp, 2), "fsdp": (_case_fsdp, 2)}, setup=_setup, timeout=180)


@pytest.mark.parity
@pytest.mark.parametrize("case", JOBS.names(world=2))
def test_document_attention_parallel_matches_one_process(case):
    results = JOBS.check(case, 2)[0]
    assert set(results) == set(PARALLEL)
    for family, r in results.items():
        loss, ref_loss = r["loss"]
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), (family, loss, ref_loss)
        assert r["grads"] and r["params"], family
        worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, (family, "gradient", worst)
        worst = max(r["params"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, (family, "parameter", worst)
