"""Context parallelism: every sequence split over the ``cp`` ranks, attention exact over all of it.

    idx = sequence_indices(seq_len=8192, cp=4, rank=1, balanced=True)   # this rank's token indices
    tokens_local = tokens[:, idx]                                          # [B, T/cp]
    apply_context_parallel(model, cp_mesh)                                 # before FSDP, on meta
    apply_context_parallel(model, cp_mesh, attention="ring")               # or K/V around a ring

Each cp rank holds ``T / cp`` tokens of every sequence of its data-parallel batch and runs the
whole model on them: the embeddings, norms, projections and feed-forwards need nothing from the
other ranks; attention does, since a query attends to every earlier key of the sequence. Two
seams of the model are replaced on the instance (the model files hold no parallel code):
``rope_tables`` returns cos, sin at the global positions of the rank's tokens, and every
``Attention.attend`` gathers K and V of the whole sequence over cp and masks by global position,
or, with ``attention="ring"`` (``parallel.cp_attention``), passes each rank's K/V chunk around the
cp ranks and merges partial results (meshpar/parallel/context_parallel/ring.py, [Note: ring attention]).

[Note: balanced sequence split]
Causal attention costs query t work proportional to t, so cutting the sequence into cp contiguous
slices gives the last rank about 2cp - 1 times the first's attention work, and every rank waits
for it. Cut into 2cp chunks instead, rank r holds chunks r and 2cp - 1 - r (one from the front,
its mirror from the back, torchtitan's and Megatron's "load-balanced" split): every rank then has
the same number of (query, key) pairs to within one chunk's diagonal. The split is pure
scheduling: positions follow the global index and the mask compares global positions, so the
losses and gradients equal the contiguous split's and one process's (tests/test_context_parallel.py).

[Note: all-gather of K and V]
Attention over cp gathers K and V (after RoPE) from every cp rank, in rank order, and runs one
attention of the local queries over all T keys with the mask ``key position <= query position``;
backward reduce-scatters their gradients (``_GatherSequence``). With grouped-query attention K
and V are small: per layer and microbatch a rank receives 2 x B x Hkv x T x Dh x (cp - 1) / cp
elements, Llama 3 70B (Hkv 8 of 64 heads) 1/8 of what gathering the queries would cost. The
alternative, K/V passed around a ring with an online-softmax merge of partial results
(``attention="ring"``: meshpar/parallel/context_parallel/ring.py, [Note: ring attention]), moves the same bytes in
forward (cp - 1 hops of T/cp) and twice as many in backward (K/V again, plus their gradients back
to their owners); what it buys is memory (two chunks of K/V at a time instead of all T) and
overlap of each hop with a chunk's attention. Both are built, and the gather is the default:
- at the sizes this is for, with the planner's H100 links (450 GB/s in a node, 50 GB/s across),
  the gather is under 1% of a block's compute inside a node and 3-8% across nodes (Llama 3 8B and
  70B at T = 131072); the ring hides all but one hop per block of it ([Note: the ring's overlap]
  in meshpar/planner/cost.py), so the planner prices the ring 2.7% (8B) and 6% (70B) faster across
  nodes when nothing of the attention is kept either way, but 23% and 15% slower with the selective
  checkpointing their recipes use, which keeps the gather's fused attention output and recomputes
  the ring's attention forward;
- but the ring's attention is explicit matmuls per chunk pair, where the gather calls one fused
  kernel per query chunk: on the CPU (tests/benchmarks/bench_cp.py, debug Llama, T 2048-8192, cp 2
  and 4) the ring's step with the balanced split took 0.99-1.20x the gather's, slower at 5 of 6, and on
  a GPU the flash kernel's advantage is expected to exceed the few percent the ring hides. Its
  peak activation per rank is at most the gather's (0.94x at cp 4: no gathered K/V, no masks),
  which is what to choose it for: a sequence whose gathered K/V does not fit, or multi-head
  attention without GQA (K/V as large as the queries) across slow links.

[Note: attention per query chunk]
The gathered K and V are put back in sequence order, and each chunk of local queries attends to
the keys up to its own chunk's end, the last ``n`` of them causally: one attention call per chunk
with ``causal_lower_right(n, keys)`` (the causal mask aligned to the bottom right, which the fused
GPU kernels apply without building it). No [T/cp, T] mask exists, and the keys after a chunk
(half of all pairs) are never computed: rank r's two chunks of c = T/2cp queries see (r + 1) c and
(2cp - r) c keys, 2cp + 1 chunks of keys in all on every rank.

[Note: the causal mask off the fused kernels]
On CUDA the flash kernel applies the bottom-right causal mask without building it. Elsewhere (the
CPU kernels, and CUDA kernels that cannot take it) PyTorch builds each chunk's [n, keys] mask and
keeps it as a float tensor for backward: T^2 / cp memory per layer, which at cp 4 and T = 8192
made a rank's activations 0.433 of one process's instead of 0.276 (tests/benchmarks/bench_cp.py).
Off CUDA each chunk's attention is therefore checkpointed: the mask lives only during its call,
and backward recomputes that one attention. Exact (the same kernels, the same order), at the cost
of one more attention forward per chunk in backward on CPU.

[Note: compiling a block under cp]
``parallel.compile`` compiles each block's forward (meshpar/parallel/parallelize.py ``apply_compile``). Its
cp attention is wrapped in ``torch.compiler.disable``: collectives, an autograd Function and a
checkpoint per chunk that dynamo would trace into and break at anyway (at comm's timing calls: 11
graphs for the debug Llama's 2 blocks); disabled, each block is two graphs, up to the attention and
after it, around one eager call. A checkpointed block cannot be split so: torch's checkpoint traces
its region whole or not at all, and a break inside ran every such block uncompiled (0 graphs). There
``apply_compile`` compiles the block's norms and feed-forward, and the checkpoint runs them (and
recomputes them) as compiled functions. tests/test_compile.py checks both against eager.

[Note: documents under context parallelism]
Document-causal attention ([Note: document-causal attention] in meshpar/models/attention.py) needs
each token's document, a prefix count of EOS tokens over the whole sequence, which a rank's slice
does not show, and its [B, 1, T, T] mask, which at T = 131072 would be 32 GiB per sequence in bf16.
So ``Transformer.document_tables`` is replaced too: each forward all-gathers the token ids over cp
(B x T int64, 1 MiB per sequence at 131072: one collective per forward, not per layer), derives
doc[B, T] and the positions of the whole sequence (``document_ids``), and returns doc in the mask's
place with RoPE at this rank's tokens' positions in their documents. Attention builds its masks
from doc, never [T, T]: the gather path per query chunk, ``causal & doc[q] == doc[k]`` as
[B, 1, n, keys] bools inside that chunk's checkpointed attention on every device (the fused
kernels cannot take a document mask unbuilt, and a kept mask would be T^2 / cp per layer), the
ring per score block next to its diagonal mask ([Note: ring attention]; a block of queries may
meet a key chunk with none of its document, whose rows merge nothing). The numbers are one
process's (tests/test_context_parallel.py, tests/test_ring_attention.py). The cost is that of the
dense kernels: every (query, key) pair causality allows is computed, the other documents' masked,
where FlexAttention's block mask would skip them (not built).

Limits: the gathered K/V are materialized per layer (70B at T = 131072 holds 2 x 8 x 131072 x 128
bf16 = 0.5 GiB per layer during its attention, and twice that while reordered; the ring holds two
chunks of T/cp); under torch.compile attention stays eager ([Note: compiling a block under cp]);
GPT-2 (learned positions) has no context parallelism.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from meshpar.distributed import comm
from meshpar.models.attention import document_ids, masked_attention
from meshpar.parallel.context_parallel.ring import ring_attention

ATTENTIONS = ("allgather", "ring")  # parallel.cp_attention: [Note: all-gather of K and V], [Note: ring attention]


def sequence_indices(seq_len: int, cp: int, rank: int, *, balanced: bool = True) -> Tensor:
    """The global indices (int64, increasing) of the ``seq_len / cp`` tokens cp rank ``rank`` holds:
    chunks ``rank`` and ``2cp - 1 - rank`` of ``2cp`` ([Note: balanced sequence split]), or the
    ``rank``-th of ``cp`` contiguous slices (``balanced=False``)."""
    if balanced:
        if seq_len % (2 * cp):
            raise ValueError(f"a sequence of {seq_len} tokens does not cut into 2 x cp = {2 * cp} equal chunks")
        c = seq_len // (2 * cp)
        return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])
    if seq_len % cp:
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into cp = {cp} equal slices")
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


def shard_sequence(x: Tensor, mesh: DeviceMesh, *, balanced: bool = True) -> Tensor:
    """``x[B, T, ...]``'s tokens held by this cp rank: ``x[:, sequence_indices(T, ...)]``."""
    idx = sequence_indices(x.shape[1], mesh.size(), mesh.get_local_rank(), balanced=balanced)
    return x[:, idx.to(x.device)]


class _Layout:
    """Where a forward's tokens sit: this rank's global positions, the order that puts every rank's
    gathered chunks back in sequence order, and the local query chunks with how many keys each sees."""

    def __init__(self, mesh: DeviceMesh, balanced: bool) -> None:
        self.mesh, self.balanced = mesh, balanced

    def positions(self, local_len: int) -> Tensor:
        cp = self.mesh.size()
        return sequence_indices(local_len * cp, cp, self.mesh.get_local_rank(), balanced=self.balanced)

    def every_rank(self, local_len: int) -> Tensor:
        """[cp, T/cp]: row r the global positions of the tokens cp rank r holds."""
        cp = self.mesh.size()
        return torch.stack([sequence_indices(local_len * cp, cp, r, balanced=self.balanced) for r in range(cp)])

    def query_chunks(self, local_len: int) -> list[tuple[int, int, int]]:
        """(first local query, queries, keys it may see: the sequence up to its chunk's end) per
        chunk this rank holds: [Note: attention per query chunk]."""
        cp, rank = self.mesh.size(), self.mesh.get_local_rank()
        if not self.balanced:
            return [(0, local_len, (rank + 1) * local_len)]
        c = local_len // 2
        return [(0, c, (rank + 1) * c), (c, c, (2 * cp - rank) * c)]


def _in_sequence_order(x: Tensor, cp: int, balanced: bool) -> Tensor:
    """Gathered chunks, in rank order along dim 2, in sequence order: with the balanced split rank r
    sent chunks (r, 2cp - 1 - r), so the front halves in rank order are chunks 0 .. cp - 1 and the
    back halves in reverse rank order chunks cp .. 2cp - 1."""
    if not balanced:
        return x
    b, h, total, d = x.shape
    halves = x.view(b, h, cp, 2, total // (2 * cp), d)
    return torch.cat([halves[:, :, :, 0], halves[:, :, :, 1].flip(2)], dim=2).view(b, h, total, d)


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, *, balanced: bool = True,
                           attention: str = "allgather") -> None:
    """Make ``model`` (a Llama-family transformer or stage, on meta or with values) run on this cp
    rank's slice of each sequence: RoPE at global positions, attention over ``mesh`` (1-D, ``cp``)
    with K and V gathered (``attention="allgather"``) or passed around a ring (``"ring"``,
    meshpar/parallel/context_parallel/ring.py), document-causal when the model's ``document_eos`` is set
    ([Note: documents under context parallelism]). The inputs must be sliced alike
    (``shard_sequence``)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"cp attention {attention!r} is none of {ATTENTIONS} (parallel.cp_attention)")
    layout = _Layout(mesh, balanced)
    model.rope_tables = functools.partial(_rope_tables, model, layout)
    model.document_tables = functools.partial(_document_tables, model, layout)
    attend = _attend if attention == "allgather" else _attend_ring
    for block in model.layers.values():
        # [Note: compiling a block under cp]: torch.compile runs this eagerly, between two graphs
        block.attention.attend = torch.compiler.disable(functools.partial(attend, layout))


def attends_over_cp(block: nn.Module) -> bool:
    """Whether ``block``'s attention was given a cp attention by ``apply_context_parallel``."""
    return "attend" in vars(block.attention)


def _rope_tables(model: nn.Module, layout: _Layout, seq_len: int) -> tuple[Tensor, Tensor]:
    idx = layout.positions(seq_len).to(model.rope_cos.device)
    return model.rope_cos[idx], model.rope_sin[idx]


def _document_tables(model: nn.Module, layout: _Layout, tokens: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """[Note: documents under context parallelism]: the whole sequence's documents doc[B, T] (what
    cp attention takes in the mask's place) and RoPE's cos, sin[B, 1, T/cp, Dh/2] at the positions
    of this rank's tokens in their documents; ``dtype`` (the mask's) is not needed."""
    doc, positions = document_ids(_whole_sequence(layout, tokens), model.args.document_eos)
    positions = positions[:, layout.positions(tokens.shape[1]).to(tokens.device)]  # [B, T/cp]
    return doc, model.rope_cos[positions].unsqueeze(1), model.rope_sin[positions].unsqueeze(1)


def _whole_sequence(layout: _Layout, tokens: Tensor) -> Tensor:
    """Every cp rank's token ids [B, T/cp], gathered, in sequence order: [B, T]."""
    cp, local_len = layout.mesh.size(), tokens.shape[1]
    tokens = tokens.contiguous()
    gathered = tokens.new_empty((cp, *tokens.shape))  # [cp, B, T/cp]
    comm.all_gather(gathered.view(-1), tokens.view(-1), layout.mesh.get_group(), dim="cp").wait()
    # the global position of each gathered token, in rank order; its inverse puts them in sequence order
    held = layout.every_rank(local_len).flatten()
    return gathered.movedim(0, 1).flatten(1)[:, held.argsort().to(tokens.device)]


def _documents(mask: Tensor | None) -> Tensor | None:
    """The doc[B, T] ids that ``_document_tables`` passed in the mask's place, or None (causal)."""
    if mask is not None and (mask.is_floating_point() or mask.dim() != 2):
        raise ValueError(f"context parallel attention takes None (causal) or the documents doc[B, T] of "
                         f"Transformer.document_tables, not a mask of shape {tuple(mask.shape)} and dtype "
                         f"{mask.dtype}: was the model's document_tables replaced by apply_context_parallel?")
    return mask


def _attend(layout: _Layout, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """[Note: all-gather of K and V]: q[B, H, T/cp, Dh] over k, v gathered to [B, Hkv, T, Dh];
    ``mask`` None (causal) or the documents doc[B, T] ([Note: documents under context parallelism])."""
    doc = _documents(mask)
    cp, group = layout.mesh.size(), layout.mesh.get_group()
    k = _in_sequence_order(_GatherSequence.apply(k, group), cp, layout.balanced)
    v = _in_sequence_order(_GatherSequence.apply(v, group), cp, layout.balanced)
    # [Note: the causal mask off the fused kernels]: recomputed in backward rather than kept; a
    # document mask is built and recomputed on every device
    plain = _fused(q) and doc is None
    run = _chunk_attention if plain else functools.partial(checkpoint, _chunk_attention, use_reentrant=False)
    positions = layout.positions(q.shape[2]).to(q.device)
    out = []
    for first, n, keys in layout.query_chunks(q.shape[2]):
        docs = () if doc is None else (doc[:, positions[first:first + n]], doc[:, :keys])
        out.append(run(q[:, :, first:first + n], k[:, :, :keys], v[:, :, :keys], *docs))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def _attend_ring(layout: _Layout, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """[Note: ring attention]: q[B, H, T/cp, Dh] over every rank's k, v[B, Hkv, T/cp, Dh] in turn."""
    doc = _documents(mask)
    if doc is not None:  # each rank's tokens' documents, [B, cp, T/cp]
        doc = doc[:, layout.every_rank(q.shape[2]).to(doc.device)]
    return ring_attention(q, k, v, layout.mesh, balanced=layout.balanced, documents=doc)


def _fused(q: Tensor) -> bool:
    """Whether the attention kernels apply ``causal_lower_right`` without building it (CUDA's flash).
    The planner, simulating a GPU step on CPU fake tensors, replaces it with True."""
    return q.device.type == "cuda"


def _chunk_attention(q: Tensor, k: Tensor, v: Tensor, q_doc: Tensor | None = None,
                     k_doc: Tensor | None = None) -> Tensor:
    """q[B, H, n, Dh] over the keys k, v[B, Hkv, keys, Dh] up to its chunk's end, causal at the bottom
    right: torch's ``causal_lower_right`` on CUDA (the flash kernel applies it unbuilt); elsewhere
    the same mask built here as bools, since torch would build it anyway, and a tensor subclass
    cannot be made under a dispatch mode (selective checkpointing, fake tensors, the allocation
    tracker). With documents (q_doc[B, n], k_doc[B, keys]) a query also sees only its own
    document's keys: the mask [B, 1, n, keys], built here."""
    n, keys = q.shape[2], k.shape[2]
    if _fused(q) and q_doc is None:
        mask = causal_lower_right(n, keys)
    else:
        mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(diagonal=keys - n)
        if q_doc is not None:  # [Note: masked grouped-query attention on CUDA]
            mask = mask & (q_doc.unsqueeze(2) == k_doc.unsqueeze(1)).unsqueeze(1)  # [B, 1, n, keys]
            return masked_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class _GatherSequence(torch.autograd.Function):
    """x[B, H, t, Dh] on each of n ranks -> [B, H, n * t, Dh] in rank order; backward sums the
    gradient of every rank's copy and hands each rank its own slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        n = torch.distributed.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((n, *x.shape))
        comm.all_gather(out.view(-1), x.view(-1), group, dim="cp").wait()
        return out.movedim(0, 2).flatten(2, 3)  # [n, B, H, t, Dh] -> [B, H, n * t, Dh]

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        n = torch.distributed.get_world_size(group)
        b, h, total, d = grad.shape
        rows = grad.view(b, h, n, total // n, d).movedim(2, 0).reshape(n, -1)  # [n, B * H * t * Dh]
        buffer = comm.ReduceScatterInput(rows.shape[1], group, dtype=grad.dtype, device=grad.device)
        buffer.copy_rows(0, rows)
        comm.reduce_scatter_rows(buffer, group, dim="cp").wait()
        return buffer.output.view(b, h, total // n, d), None
