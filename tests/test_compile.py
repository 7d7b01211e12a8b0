"""torch.compile per block (``parallel.compile``): inductor on this CPU gives the eager numbers.

Compiling wraps each block's ``forward`` in place (meshpar/parallel/wrap.py), so parameter names
do not change and hooks on ``__call__`` (FSDP's) stay outside the compiled graph. One small model, one step:
compilation dominates the time.

In float32, the dtype compile serves, not float64: inductor's float64 CPU code does not
compile under ATEN_CPU_CAPABILITY=default (``at::vec`` undeclared) and gives NaN under avx2
(PyTorch 2.13), and .ci/run reruns this test on both paths. The tolerance is derived: one
forward and backward, no optimizer step (so nothing divides by a gradient's own size), and
inductor's fused kernels add each reduction (norms, softmax, matmuls over K <= 128) in
another order than eager's, which bounds the difference by ~K * 2^-24 = 8e-6 relative per
sum: 1e-5 on the loss, rtol 1e-4 (plus atol 1e-6 for gradients near zero) on the gradients.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from meshpar.models.llama import Transformer
from meshpar.models.llama.args import ModelArgs
from meshpar.models.moe.family import MOE
from meshpar.parallel.activation_checkpoint import apply_activation_checkpointing
from meshpar.parallel.parallelize import apply_compile
from tests.helpers import build_model

pytestmark = pytest.mark.slow  # inductor builds C++ kernels: seconds a test, out of the inner loop

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=32)


@pytest.mark.parity
def test_compiled_blocks_match_eager_with_checkpointing():
    torch.manual_seed(0)
    eager = Transformer(ARGS)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(compiled, "selective")
    apply_compile(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0]  # see the module docstring
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_blocks_compile_without_a_graph_break(mode):
    """The checkpoint wrapper's own bookkeeping ([Note: a recompute's side outputs]) stays out of the
    compiled graph: a counter mutated inside torch.utils.checkpoint is a side effect dynamo refuses,
    and a graph break there left every block uncompiled. fullgraph=True turns a break into an error."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    apply_activation_checkpointing(model, mode)
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, fullgraph=True)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_compiled_moe_blocks_in_fp32_match_eager(family):
    """torch 2.13's grouped_mm runs on CPU in fp32 eagerly, but its meta function, which dynamo traces
    with, takes bf16 only: compiled fp32 experts take the loop (meshpar/models/moe/grouped.py), where
    they failed to compile. DeepSeek-V3: one dense block, then one of shared and routed experts under
    group-limited sigmoid routing, with MLA (YaRN RoPE, values padded to the keys' width). gpt-oss: a
    sliding and a full layer of sink attention (window 8 < 16 tokens), biased clamped experts. Tolerance
    as the dense test's (see the module docstring): K <= 256 here, 1.5e-5 relative per sum."""
    overrides = {"qwen3_moe": {"mlp_only_layers": ()}, "deepseek_v3": {"first_k_dense": 1}}.get(family, {})
    eager = build_model(family, n_layers=2, max_seq_len=32, **overrides)
    args = eager.args
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5 * losses[0]
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_compiled_float8_blocks_match_eager_float8(mode):
    """``model.float8`` under ``parallel.compile``: torchao's emulated float8 casts and matmuls trace into
    each block's graph with no break, and give eager float8's gradients. Bound as the dense test's
    (rtol 1e-4, here on the gradients as one vector); a compiled value that lands on the other side of
    a float8 rounding boundary would move its element by one float8 step, which this bound also allows
    only for a few elements. float8 itself moves the gradients by over 1e-2 (asserted below), so a
    compiled graph that dropped the casts fails."""
    from torch._dynamo.utils import counters

    from meshpar.parallel import float8 as float8lib

    tokens = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))

    def gradients(float8: bool, compiled: bool) -> torch.Tensor:
        torch.manual_seed(0)
        model = Transformer(ARGS)
        model.init_weights()
        if float8:
            float8lib.apply_float8(model, mode, emulate=True, fsdp_all_gather=False)
        if compiled:
            apply_compile(model)
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    counters.clear()
    compiled = gradients(True, True)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    eager, unconverted = gradients(True, False), gradients(False, False)
    assert (compiled - eager).norm() <= 1e-4 * eager.norm(), ((compiled - eager).norm() / eager.norm()).item()
    assert (unconverted - eager).norm() > 1e-2 * eager.norm(), "float8 changed nothing: the comparison cannot fail"


def test_checkpointed_moe_blocks_stay_eager_and_let_go_of_their_recompute():
    """A checkpointed MoE block sets aux_loss inside checkpoint: dynamo refuses the side effect, so
    compiled it graph-broke and ran eagerly past the wrapper that drops its recompute's aux_loss
    ([Note: a recompute's side outputs]); apply_compile leaves such blocks eager, dense ones compiled."""
    from meshpar.parallel.activation_checkpoint import sets_side_outputs_under_checkpoint

    model = build_model("qwen3_moe", n_layers=3, mlp_only_layers=(1,), max_seq_len=32)
    args = model.args
    apply_activation_checkpointing(model, "full", forget=MOE.forget, leaving=[i for i, _ in MOE.sparse_layers(model)])
    assert [sets_side_outputs_under_checkpoint(b) for b in model.layers.values()] == [True, False, True]
    before = [b.forward for b in model.layers.values()]
    apply_compile(model)
    assert [b.forward is f for b, f in zip(model.layers.values(), before, strict=True)] == [True, False, True]
    held = []
    model.tok_embeddings.weight.register_hook(lambda g: held.extend(m.aux_loss is not None for m in model.moe_layers()))
    tokens = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    (F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss).backward()
    assert held == [False, False]


def _compiled_under_cp(checkpointing: str) -> dict:
    """On a cp rank of 2 (gloo, fp32): the model's local logits and gradients compiled against eager,
    and what dynamo made of it ([Note: compiling a block under cp])."""
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from meshpar.parallel.context_parallel.apply import apply_context_parallel
    from meshpar.parallel.context_parallel.layout import shard_sequence

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    eager = build_model("llama", n_layers=2, vocab_size=64, max_seq_len=32)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    compiled = copy.deepcopy(eager)
    for model in (eager, compiled):
        apply_context_parallel(model, mesh)
        apply_activation_checkpointing(model, checkpointing)
    apply_compile(compiled, cp=True)
    counters.clear()
    out = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        loss = F.cross_entropy(model(shard_sequence(tokens[:, :-1], mesh)).flatten(0, 1),
                               shard_sequence(tokens[:, 1:], mesh).flatten())
        loss.backward()
        out[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
    out["graphs"] = counters["stats"]["unique_graphs"]
    out["breaks"] = sum(counters["graph_break"].values())
    return out


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_compiled_blocks_under_cp_match_eager(checkpointing):
    """cp 2 (all-gather) with parallel.compile: without checkpointing each block compiles to two
    graphs around its eager attention (the one break: the disabled attention); checkpointed, its
    norms and feed-forward compile (one graph for both RMSNorms, one for the feed-forward, every
    block sharing them) and nothing breaks. Both equal eager within the module docstring's bounds."""
    from tests.distributed import run_distributed

    for r in run_distributed(_compiled_under_cp, 2, checkpointing, timeout=240):
        (want, grads), (got, compiled) = r["eager"], r["compiled"]
        assert abs(got - want) <= 1e-5 * want
        for name, g in grads.items():
            torch.testing.assert_close(compiled[name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert (r["graphs"], r["breaks"]) == ((4, 2) if checkpointing == "none" else (2, 0)), r
