"""Activation checkpointing: the same gradients as no checkpointing, and exactly the expected recompute.

Backward's matrix multiplies are counted with a dispatch mode. Without checkpointing each
linear layer costs two in backward (grad input, grad weight). ``full`` recomputes a block's
forward in backward: 6 more per checkpointed Llama block (wq, wk, wv, wo, w1, w3; recomputation
stops early once every tensor backward needs exists, and nothing saves w2's output);
``selective`` keeps matmul outputs, so backward runs no extra matmul but does recompute the
elementwise work (SiLU).
"""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from meshpar.models.llama import LLAMA_SIZES, Transformer
from meshpar.models.moe.family import MOE
from meshpar.parallel.activation_checkpoint import apply_activation_checkpointing, not_kept
from meshpar.profiling.memory import AllocationTracker, Category
from tests.helpers import build_model

ARGS = LLAMA_SIZES["debug"].__class__(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128,
                                      max_seq_len=32)
RECOMPUTED_MATMULS_PER_BLOCK = 6


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model(mode: str, every: int = 1) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    return apply_activation_checkpointing(model, mode, every)


def _backward_ops(model: Transformer) -> tuple[Counter, dict[str, torch.Tensor]]:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    with _OpCounter() as counter:
        loss.backward()
    return counter.ops, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode, every, recomputed_blocks", [("full", 1, 4), ("full", 2, 2), ("full", 3, 2),
                                                            ("selective", 1, 0)])
@pytest.mark.parity
def test_gradients_equal_and_recompute_counted(mode, every, recomputed_blocks):
    base_ops, base_grads = _backward_ops(_model("none"))
    ops, grads = _backward_ops(_model(mode, every))
    assert grads.keys() == base_grads.keys()
    for name, g in grads.items():  # recomputation repeats the same ops on the same inputs: exact
        torch.testing.assert_close(g, base_grads[name], rtol=0, atol=0, msg=name)
    matmuls = ops["mm"] + ops["addmm"] + ops["bmm"]
    base_matmuls = base_ops["mm"] + base_ops["addmm"] + base_ops["bmm"]
    assert matmuls - base_matmuls == RECOMPUTED_MATMULS_PER_BLOCK * recomputed_blocks
    # one SiLU per block; its recompute happens in backward for every checkpointed block
    checkpointed = len(range(0, ARGS.n_layers, every))
    assert ops["silu"] - base_ops["silu"] == checkpointed


def test_names_unchanged_and_eval_unaffected():
    model = _model("full")
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _model("none").named_parameters()]
    with torch.no_grad():
        x = torch.zeros(1, 4, dtype=torch.long)
        torch.testing.assert_close(model(x), _model("none")(x), rtol=0, atol=0)


def test_bad_mode():
    with pytest.raises(ValueError, match="choose one of none, full, selective"):
        apply_activation_checkpointing(_model("none"), "some")


# --- a recompute's side outputs ([Note: a recompute's side outputs]) -----------------------------

def _moe_model(mode: str):
    model = build_model("qwen3_moe", n_layers=4, mlp_only_layers=(), max_seq_len=256)
    sparse = [i for i, _ in MOE.sparse_layers(model)]
    return apply_activation_checkpointing(model, mode, forget=MOE.forget, leaving=sparse)


def _moe_backward(model) -> tuple[dict[str, torch.Tensor], list, int]:
    """Gradients, whether each sparse layer held an ``aux_loss`` when backward reached the embedding
    (the last gradient of the step), and the peak activation bytes of forward + backward."""
    tokens = torch.randint(0, model.args.vocab_size, (2, 257), generator=torch.Generator().manual_seed(1))
    held = []
    model.tok_embeddings.weight.register_hook(
        lambda g: held.extend(moe.aux_loss is not None for moe in model.moe_layers()))
    with AllocationTracker(model) as tracker:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
        del logits
        loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, held, tracker.peak()[Category.ACT]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_recompute_leaves_no_aux_loss_holding_its_activations(mode):
    base_grads, base_held, base_act = _moe_backward(_moe_model("none"))
    grads, held, act = _moe_backward(_moe_model(mode))
    for name, g in grads.items():  # the router's gradient includes the forward's aux_loss, not the recompute's
        torch.testing.assert_close(g, base_grads[name], rtol=0, atol=0, msg=name)
    # Without checkpointing nothing recomputes, and the forward's aux_loss is still on each layer.
    assert base_held == [True] * 4
    # Each layer's recompute set aux_loss again; held until the step's end, it kept that layer's
    # recomputed input and router probabilities alive through the rest of backward.
    assert held == [False] * 4
    # The bound sits between the two cases it separates (this model, 2 x 256 tokens): with the
    # recompute's aux_loss let go, peak activations are about 0.14 of no checkpointing's; held to
    # the step's end, about 0.52.
    assert act < 0.3 * base_act, (act, base_act)


class _MatmulInAFunction(torch.autograd.Function):
    """x @ w computed in an autograd Function's forward under ``not_kept``, as the ring on flex
    computes its steps (meshpar/parallel/context_parallel/ring_flex.py)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with not_kept():
            return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


class _FunctionBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w, self.v = (torch.nn.Parameter(torch.randn(8, 8, generator=g)) for _ in range(2))

    def forward(self, x):
        return torch.relu(_MatmulInAFunction.apply(x, self.w)) @ self.v


class _FunctionModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": _FunctionBlock()})

    def forward(self, x):
        return self.layers["0"](x)


def test_selective_recomputes_what_runs_under_not_kept():
    """[Note: what selective checkpointing recomputes anyway]: a matmul of the block is kept, one run
    under ``not_kept`` (in an autograd Function, as a ring's steps) is recomputed: selective
    recomputation adds exactly that one matmul to backward; the gradients are unchanged."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    runs = {}
    for mode in ("none", "selective"):
        model = apply_activation_checkpointing(_FunctionModel(), mode)
        loss = model(x.clone().requires_grad_()).square().sum()
        with _OpCounter() as counter:
            loss.backward()
        runs[mode] = (counter.ops["mm"], [p.grad for p in model.parameters()])
    assert runs["selective"][0] - runs["none"][0] == 1
    for got, want in zip(runs["selective"][1], runs["none"][1], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
