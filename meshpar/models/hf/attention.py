"""A transformers model's attention through meshpar's attention slot (``HFCausalLM.inner_attention``).

    model.inner_attention = ContextParallelAttention(layout)   # apply_context_parallel fills it
    logits = model(tokens)                                     # every layer's attention runs it

[Note: routing a transformers model's attention]
transformers calls each layer's attention through its ``AttentionInterface``: the function registered
under the config's ``_attn_implementation`` gets the module, q[B, H, t, Dh], k, v[B, Hkv, t, Dh], the
mask, ``scaling`` and ``dropout``, and every keyword argument the model's forward was given. meshpar
registers one function, ``ROUTED``, stateless; a model whose ``inner_attention`` slot is filled
switches its config to it and passes, as one such keyword, a ``Route`` holding the slot's module (and
the documents, under document attention). The function hands q, k, v to that module, which attends as
meshpar's own families do (context parallelism's gather, ring or Ulysses), and records which
attention modules ran. Positions are the model's own code's, computed from the ``position_ids`` the
forward passes: the global positions of the rank's tokens (``positions.token_positions``).

That equals the model's own attention only where the model asks for plain causal softmax attention
with a scale: no mask of its own (ALiBi, padding), no sliding window shorter than the sequence, no
soft-capping, sinks or dropout, and no other keyword the function does not know. Each is refused at
the call that carries it, by name. And only where attention is the layers' one exchange between
tokens: after a forward, every decoder layer must have run the function (a recurrent layer, a
convolution or a layer with its own attention code does not), and a layer holding a convolution is
refused before launch (``check``), since a Mamba mixer beside attention in one layer would pass the
count. A model whose first routed forward fails (DeepSeek-V3.2's indexer reads the mask transformers
would have built) is refused with its error. The refusals come at the first forward, before any
update, as RecipeErrors naming ``parallel.cp``.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from meshpar.config.errors import RecipeError

ROUTED = "meshpar"  # the name the function is registered under in transformers' AttentionInterface
KEYWORD = "meshpar_attention"  # the keyword the forward passes the Route as
# keywords transformers passes every attention that do not change what it computes
PASSED = frozenset({KEYWORD, "position_ids", "cache_position", "output_attentions", "use_cache",
                    "past_key_values", "position_embeddings", "layer_idx", "return_dict"})
# keywords that ask for more than causal softmax attention: the name -> what it is
NOT = "which meshpar's attention slot does not compute"
REFUSED = {"sliding_window": "sliding-window attention", "softcap": "soft-capped attention scores",
           "s_aux": "attention sinks", "sinks": "attention sinks", "head_mask": "a mask over heads"}


class Route:
    """One forward's way to meshpar's attention slot: the slot's module, the length of the whole sequence
    (every rank's tokens), the documents doc[B, T] the slot takes in the mask's place (None: causal), and
    the ids of the attention modules that ran."""

    def __init__(self, attention: nn.Module, seq_len: int, documents: Tensor | None = None) -> None:
        self.attention, self.seq_len, self.documents = attention, seq_len, documents
        self.ran: set[int] = set()


def routed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention-function signature -> (out[B, t, H, Dv], no weights): [Note: routing a
    transformers model's attention]."""
    route = kwargs.get(KEYWORD)
    what = type(module).__name__
    if not isinstance(route, Route):
        _refuse(f"{what} does not pass the model's forward arguments on to its attention, so they cannot route it")
    if attention_mask is not None:
        _refuse(f"{what} passes an attention mask of its own (a positional bias, or a mask over tokens), {NOT}")
    if dropout:
        _refuse(f"{what} applies dropout {dropout} to its attention weights, {NOT}")
    if not getattr(module, "is_causal", True):
        _refuse(f"{what} attends both ways (is_causal = False), {NOT}")
    for name, value_ in kwargs.items():
        if name == "sliding_window" and isinstance(value_, int) and value_ >= route.seq_len:
            continue  # a window as long as the sequence: every earlier token, plain causal attention
        if name not in PASSED and value_ is not None and value_ is not False:
            _refuse(f"{what} asks for {REFUSED.get(name, f'an attention argument meshpar does not know ({name})')}, "
                    f"{NOT}")
    route.ran.add(id(module))
    if scaling is not None and scaling != query.shape[-1] ** -0.5:  # the slot's softmax scales by 1/sqrt(Dh)
        query = query * (scaling * math.sqrt(query.shape[-1]))
    out = route.attention(query, key, value, route.documents)  # [B, H, t, Dv]
    return out.transpose(1, 2).contiguous(), None


def _refuse(why: str) -> None:
    raise RecipeError(f"parallel.cp: {why} ([Note: routing a transformers model's attention] in "
                      "meshpar/models/hf/attention.py); set parallel.cp = 1", "parallel.cp")


def route_to(hf: nn.Module) -> None:
    """Switch the transformers model ``hf``'s attention to ``ROUTED`` (registered first, once)."""
    import transformers

    transformers.AttentionInterface.register(ROUTED, routed_attention)  # a dict update: once or again alike
    if hf.config._attn_implementation != ROUTED:
        hf.set_attn_implementation(ROUTED)
    if hf.config._attn_implementation != ROUTED:
        _refuse(f"{type(hf).__name__} does not call its attention through transformers' AttentionInterface, so "
                "meshpar's attention slot cannot take its place")


def check_ran(route: Route, layers: list[nn.Module], model_type: str) -> None:
    """After a forward: every decoder layer ran its attention through the route."""
    for i, layer in enumerate(layers):
        if not any(id(m) in route.ran for m in layer.modules()):
            _refuse(f"{model_type}'s decoder layer {i}, a {type(layer).__name__}, mixes its tokens without "
                    "transformers' attention interface (a recurrent or convolutional layer, or attention code of "
                    "its own), so it would see only this rank's part of the sequence")


def check(model: nn.Module, model_type: str) -> None:
    """Before launch, on the model on meta: no decoder layer holds a convolution over the sequence."""
    for i, layer in enumerate(model.layers.values()):
        convs = [n for n, m in layer.named_modules() if isinstance(m, (nn.Conv1d, nn.Conv2d))]
        if convs:
            _refuse(f"{model_type}'s decoder layer {i} holds a convolution over the sequence ({convs[0]}: a "
                    "recurrent or convolutional token mixer), which would see only this rank's part of it")


def refuse_failure(e: Exception, model_type: str) -> RecipeError:
    """The refusal of a model whose first routed forward failed (not by a refusal of its own)."""
    return RecipeError(f"parallel.cp: {model_type} fails with meshpar's attention in place of its own "
                       f"({type(e).__name__}: {e}): its attention does more than call transformers' attention "
                       "interface ([Note: routing a transformers model's attention] in "
                       "meshpar/models/hf/attention.py); set parallel.cp = 1", "parallel.cp")
