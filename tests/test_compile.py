"""torch.compile per block (``parallel.compile``): inductor on this CPU gives the eager numbers.

Compiling replaces each block's ``forward`` on the instance, so parameter names do not change
and hooks on ``__call__`` (FSDP's) stay outside the compiled graph. One small model, one step:
compilation dominates the time (~10 s here). In float64, so inductor's fused kernels, which
add in other orders than eager's, agree to ~1e-15 and the tolerance is tests/parity.py's 1e-9.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from meshpar.activation_checkpoint import apply_activation_checkpointing
from meshpar.models.llama import Transformer
from meshpar.models.llama.args import ModelArgs
from meshpar.parallelize import apply_compile
from tests.parity import TOL, default_dtype

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128, max_seq_len=32)


@pytest.mark.parity
@default_dtype()
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
    assert abs(losses[0] - losses[1]) <= TOL * losses[0]
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert q.dtype == torch.float64, name
        torch.testing.assert_close(q.grad, p.grad, rtol=TOL, atol=TOL, msg=name)
