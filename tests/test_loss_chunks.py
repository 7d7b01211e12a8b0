"""Chunked cross-entropy (``train.loss_chunks``, meshpar/training/loss.py): the same loss and gradients
as the whole-vocabulary loss, without the whole logits.

In one process, float64: each family's loss and every parameter's gradient with the head applied in
chunks (even, uneven, more chunks than tokens) equal the unchunked ones to TOL (tests/parity.py
[Note: parity in float64]; only the order of the sums differs). Under the other mesh dims the
chunked loss is a layout of the N-D parity runs against one unchunked process: tensor parallel's
loss parallel and pipeline's last stage (tests/test_train.py), context parallelism
(tests/test_context_parallel.py), mixture of experts with its auxiliary loss (tests/test_moe_compose.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshpar.config import recipe as recipelib
from meshpar.planner import cli as planlib
from meshpar.profiling.memory import AllocationTracker, Category
from meshpar.training.loss import AUTO_CHUNK_BYTES, TokenLoss, resolve_chunks
from tests.helpers import ROOT, build_model
from tests.parity import TOL, default_dtype, must_fail

VOCAB = 512


def _loss_and_grads(model: torch.nn.Module, loss: TokenLoss, tokens: torch.Tensor, targets: torch.Tensor):
    model.zero_grad(set_to_none=True)
    value = loss(model(tokens), targets)
    value.backward()
    return value.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(got, want) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    torch.testing.assert_close(loss, ref_loss, rtol=TOL, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=TOL, atol=TOL * g.abs().max().item(), msg=name)


@pytest.mark.parity
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3_moe"])  # gpt2: the head is the tied embedding
@default_dtype()
def test_chunked_loss_equals_the_whole_loss(family):
    model = build_model(family, vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, VOCAB, (2, 33), generator=gen) for _ in range(2))  # 66 tokens
    whole = _loss_and_grads(model, TokenLoss(), tokens, targets)
    model.head_in_loss = True
    assert model(tokens).shape == (2, 33, model.args.dim)  # the forward stops before the head
    for chunks in (2, 7, 66, 500):  # even, uneven (six of 10, one of 6), one token each, capped at 66
        _compare(_loss_and_grads(model, TokenLoss(model.head, chunks), tokens, targets), whole)


@default_dtype()
def test_the_comparison_catches_a_mean_of_chunk_means():
    """A planted bug: each chunk's mean, averaged over the 7 uneven chunks, weighs the last chunk's 6
    tokens like the others' 10; the parity comparison must see it."""
    model = build_model("llama", vocab_size=VOCAB)
    gen = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, VOCAB, (2, 33), generator=gen) for _ in range(2))
    whole = _loss_and_grads(model, TokenLoss(), tokens, targets)
    model.head_in_loss = True

    def mean_of_means(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        parts = zip(h.flatten(0, 1).split(10), t.flatten().split(10), strict=True)
        return torch.stack([F.cross_entropy(model.head(a), b) for a, b in parts]).mean()

    must_fail(lambda: _compare(_loss_and_grads(model, mean_of_means, tokens, targets), whole), "mean of chunk means")


def test_validation_takes_whole_logits():
    """Without autograd (validation, where FSDP has freed the root's parameters after the forward) the
    forward applies the head itself and the loss takes its logits."""
    model = build_model("llama", vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (2, 16))
    model.head_in_loss = True
    with torch.no_grad():
        logits = model(tokens)
        assert logits.shape == (2, 16, VOCAB)
        chunked = TokenLoss(model.head, 4)(logits, tokens)
    model.head_in_loss = False
    with torch.no_grad():
        assert torch.equal(chunked, TokenLoss()(model(tokens), tokens))


def test_resolve_chunks():
    assert resolve_chunks(1, 4096, 128256) == 1
    assert resolve_chunks(8, 4096, 128256) == 8
    assert resolve_chunks(8, 5, 128256) == 5  # never more chunks than tokens
    assert resolve_chunks(0, 8192, 128256) == 16  # 4 GiB of fp32 logits over 256 MiB chunks
    assert resolve_chunks(0, 8192, 128256 // 8) == 2  # vocabulary-sharded over tp 8
    assert resolve_chunks(0, 256, 2048) == 1
    assert AUTO_CHUNK_BYTES >= 8192 * 128256 * 4 / 16


def _peak_activations(chunks: int, vocab: int, tokens: int) -> tuple[int, torch.Tensor]:
    model = build_model("llama", vocab_size=vocab, n_layers=1)
    x = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
    model.head_in_loss = chunks > 1
    loss = TokenLoss(model.head if chunks > 1 else None, chunks)
    with AllocationTracker(model) as tracker:
        value = loss(model(x), x)
        value.backward()
    return tracker.peak()[Category.ACT] + tracker.peak()[Category.TEMP], value.detach()


def test_no_whole_logits_live_across_the_loss():
    """Whole, the loss holds at its peak the log-softmax it saved and the logits' gradient, at least
    2 x N x V x 4 bytes; in 8 chunks an eighth of that, plus up to two head-weight gradients (V x D x 4
    each: the chunks' gradients are summed into one). So the peak falls by at least the difference."""
    vocab, tokens, dim = 8192, 2048, 256
    whole, loss = _peak_activations(1, vocab, tokens)
    chunked, chunked_loss = _peak_activations(8, vocab, tokens)
    logits, head_grad = tokens * vocab * 4, vocab * dim * 4
    assert whole - chunked >= 2 * logits * 7 / 8 - 2 * head_grad, (whole, chunked, logits)
    # fp32, the same per-token losses summed in another order: each of the 2048 additions of positive terms
    # rounds by at most 2^-24 of the running sum, so the means differ by at most 2048 x 2^-24 relative
    torch.testing.assert_close(chunked_loss, loss, rtol=tokens * 2**-24, atol=0)


def test_the_planner_prices_the_chunked_loss():
    """`meshpar plan`'s simulated step holds one chunk's logits: the planned peak falls by about the
    logits' bytes (debug Llama, vocabulary 32768, 2048 tokens per microbatch on one rank)."""
    plans = {}
    for chunks in (1, 8):
        recipe = recipelib.load(ROOT / "recipes" / "llama_debug.toml",
                                ["--model.vocab_size=32768", "--train.seq_len=2048", "--train.micro_batch=1",
                                 "--train.global_batch=1", f"--train.loss_chunks={chunks}"])
        plans[chunks] = planlib.plan(recipe, 1, planlib.load_hardware("cpu")[0]).ranks[0].peak_bytes
    logits, head_grad = 2048 * 32768 * 4, 32768 * 256 * 4  # as test_no_whole_logits_live_across_the_loss
    assert plans[1] - plans[8] >= 2 * logits * 7 / 8 - 2 * head_grad, (plans, logits)
