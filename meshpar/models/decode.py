"""Generation in one process with a KV cache: what ``meshpar generate`` and ``train.sample_every``
run (the command line is meshpar/inference/generate.py).

[Note: a KV cache through the model's slots]
The model files hold no inference code. Generation fills the two slots training's parallelism uses
(meshpar/models/attention.py): the model's ``positions`` gives RoPE at the positions after the
tokens already cached, and every block's ``attention.inner_attention`` writes this forward's keys
and values into the cache and attends over everything cached: the last ``n`` of ``keys`` queries
see the keys up to themselves (the bottom-right causal mask; none for one new token). The prompt is
one forward (prefill), each new token one more; ``KVCache.advance`` moves the offset after a
forward, so every layer of one forward writes at the same place. A forward computes what the
whole-sequence forward computes for the same rows, in another summation order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshpar.models.attention import InnerAttention, SequencePositions


class KVCache:
    """Keys and values of every layer for one sequence, [1, Hkv, capacity, Dh] each, filled up to ``length``."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.length = capacity, 0
        self.layers: list[tuple[Tensor, Tensor] | None] = []

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this forward's k, v[B, Hkv, n, Dh] of ``layer`` at the offset; every cached key and value."""
        while len(self.layers) <= layer:
            self.layers.append(None)
        if self.layers[layer] is None:
            shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
            self.layers[layer] = (k.new_empty(shape), v.new_empty(shape))
        ks, vs = self.layers[layer]
        end = self.length + k.shape[2]
        ks[:, :, self.length:end], vs[:, :, self.length:end] = k, v
        return ks[:, :, :end], vs[:, :, :end]

    def advance(self, n: int) -> None:
        self.length += n


class CachedPositions(SequencePositions):
    """The ``positions`` slot while generating: a forward's tokens follow the cached ones."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def rope(self, cos_table: Tensor, sin_table: Tensor, seq_len: int) -> tuple[Tensor, Tensor]:
        start = self.cache.length
        return cos_table[start:start + seq_len], sin_table[start:start + seq_len]

    def documents(self, cos_table: Tensor, sin_table: Tensor, tokens: Tensor, eos: int,
                  dtype: torch.dtype) -> tuple[None, Tensor, Tensor]:
        """A model trained with document-causal attention generates one document: plain causal."""
        cos, sin = self.rope(cos_table, sin_table, tokens.shape[1])
        return None, cos, sin


class CachedAttention(InnerAttention):
    """An ``inner_attention`` slot while generating: [Note: a KV cache through the model's slots]."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        super().__init__()
        self.cache, self.layer = cache, layer

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        k, v = self.cache.write(self.layer, k, v)
        n, keys = q.shape[2], k.shape[2]
        allowed = None if n == 1 else torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)


@contextlib.contextmanager
def cached(model: nn.Module, capacity: int) -> Iterator[KVCache]:
    """``use_cache`` for the ``with`` block, the model's own slots and mode put back after it."""
    slots = model.positions, [block.attention.inner_attention for block in model.layers.values()]
    training = model.training
    try:
        yield use_cache(model, capacity)
    finally:
        model.positions = slots[0]
        for block, attention in zip(model.layers.values(), slots[1], strict=True):
            block.attention.inner_attention = attention
        model.train(training)


def use_cache(model: nn.Module, capacity: int) -> KVCache:
    """Fill ``model``'s slots with a fresh cache of ``capacity`` tokens (a Llama-family or MoE model)."""
    if not hasattr(model, "positions") or not all(hasattr(b, "attention") for b in model.layers.values()):
        raise ValueError(f"{type(model).__name__} has no positions and attention slots: generation is built for the "
                         "RoPE families (llama, qwen2, qwen3, qwen3_moe, mixtral), not for GPT-2's learned positions")
    if capacity > model.args.max_seq_len:
        raise ValueError(f"{capacity} tokens exceed the model's max_seq_len {model.args.max_seq_len}: shorten the "
                         "prompt or --max-new-tokens")
    cache = KVCache(capacity)
    model.positions = CachedPositions(cache)
    for i, block in enumerate(model.layers.values()):
        block.attention.inner_attention = CachedAttention(cache, i)
    return cache


def next_token(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Greedy (``temperature`` 0), or a draw at ``temperature`` from the smallest set of tokens whose
    probabilities reach ``top_p`` (nucleus sampling)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p  # the token that crosses top_p stays
    sorted_probs = sorted_probs * keep
    pick = torch.multinomial(sorted_probs.cpu() / sorted_probs.sum().cpu(), 1, generator=generator)
    return int(order[pick.to(order.device)])


def prompt_ids(tokenizer, text: str) -> list[int]:
    """``text``'s token ids as a model sees a document's start: the tokenizer's BOS first, if it has one."""
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_id", None)
    return ids if bos is None else [bos, *ids]


@torch.no_grad()
def generate(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, stop: int | None = None) -> list[int]:
    """The tokens ``model`` continues ``prompt`` with: at most ``max_new_tokens``, ending early after
    ``stop`` (an end-of-text id), with a KV cache in the model's slots for the call (``cached``).
    Under FSDP every rank calls it alike (each forward gathers the parameters)."""
    if not prompt:
        raise ValueError("an empty prompt: give at least one token")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature {temperature} must be >= 0 and top_p {top_p} in (0, 1]")
    device = _device(model)
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    tokens, out = torch.tensor([list(prompt)], device=device), []
    with cached(model, len(prompt) + max_new_tokens) as cache:
        model.eval()
        for _ in range(max_new_tokens):
            logits = model(tokens)[0, -1]
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # a DTensor
            cache.advance(tokens.shape[1])
            token = next_token(logits, temperature, top_p, generator)
            out.append(token)
            if token == stop:
                break
            tokens = torch.tensor([[token]], device=device)
    return out


def _device(model: nn.Module) -> torch.device:
    """Where the model computes (a sharded parameter's local tensor's device)."""
    p = next(model.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device
