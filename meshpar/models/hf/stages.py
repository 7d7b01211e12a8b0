"""Pipeline stages of a transformers model: the layers a stage keeps, and the check of its boundaries.

[Note: a transformers model in pipeline stages]
A stage (``copy_with_layers(keep, first, last)``) is the causal LM with only its decoder layers in
the list transformers loops over; the first stage keeps the input embedding, the last the final
norm and head, and a stage without them has the embedding dropped and the modules after the layers
(the final norm) made identities. A later stage runs transformers' own base model forward on
``inputs_embeds`` = the previous stage's hidden states, so masks, RoPE and positions are computed by
the model's own code on every stage. That equals the whole model only where the base model passes
the embeddings to its first layer unchanged and returns its last layer's output unchanged but for
the norm; many do not (Gemma scales its embeddings, GPT-2 adds position embeddings, Gemma 3n adds
per-layer inputs from the token ids). So every stage's forward checks both boundaries by identity,
with hooks on its first and last layer (``Boundary``): the first layer's input must be the very
tensor the stage received, and the stage's output the very tensor its last layer returned. A model
that fails either is refused at its first forward, before any update, naming ``parallel.pp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from meshpar.config.errors import RecipeError


def same(a: Any, b: Tensor) -> bool:
    """``a`` is ``b`` or a view of the same elements (same memory, shape and strides: ``h.view(shape)``)."""
    return a is b or (isinstance(a, Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


class StageLayers(nn.ModuleList):
    """A stage's decoder layers, registered under their indices in the whole model (so state-dict names
    do not depend on the split), in order; slicing keeps the indices (transformers loops over
    ``layers[:num_hidden_layers]``)."""

    def __init__(self, layers: dict[str, nn.Module] | None = None) -> None:
        nn.Module.__init__(self)
        for key, layer in (layers or {}).items():
            self.add_module(key, layer)

    def __getitem__(self, idx: int | slice) -> Any:
        items = list(self._modules.items())
        return StageLayers(dict(items[idx])) if isinstance(idx, slice) else items[idx][1]


class Boundary:
    """A pipeline stage's check that transformers' base model hands its hidden states to the stage's
    first decoder layer and from its last one unchanged ([Note: a transformers model in pipeline stages])."""

    def __init__(self, first: nn.Module, last: nn.Module, width: int) -> None:
        self.seen: dict[str, Any] = {}
        self.ran, self.width = False, width  # a forward has run; the hidden size D
        first.register_forward_pre_hook(self._into_first, with_kwargs=True)
        last.register_forward_hook(self._out_of_last)

    def _into_first(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.seen.setdefault("in", args[0] if args else kwargs.get("hidden_states"))

    def _out_of_last(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.seen["out"] = out[0] if isinstance(out, (tuple, list)) else out

    @contextlib.contextmanager
    def watch(self, x: Tensor, model_type: str) -> Iterator[None]:
        """Around the base model's forward; a stage that takes hidden states (``x`` a float tensor) must
        see its first layer take ``x`` itself. An error of the stage's first forward is refused by name:
        the model's own code could not run on a stage's part of it."""
        self.seen.clear()
        try:
            try:
                yield
            except Exception as e:
                if self.ran or isinstance(e, RecipeError):  # a refusal of the model's own (routed attention)
                    raise
                raise RecipeError(f"parallel.pp: {model_type}'s base model does not run as a pipeline stage "
                                  f"({type(e).__name__}: {e}): what passes between its layers is more than the "
                                  "hidden states; set parallel.pp = 1", "parallel.pp") from e
            self.ran = True
            if x.is_floating_point() and not same(self.seen.get("in"), x):
                raise RecipeError("parallel.pp: this transformers model changes its embeddings before its first "
                                  "decoder layer (a scale, added positions or per-layer inputs), so a later pipeline "
                                  "stage cannot take the previous stage's hidden states in their place; set "
                                  "parallel.pp = 1", "parallel.pp")
        finally:
            self.seen.clear()

    def check_output(self, h: Tensor, model_type: str) -> None:
        if not same(self.seen.get("out"), h) or h.dim() != 3 or h.shape[-1] != self.width:
            raise RecipeError(f"parallel.pp: {model_type}'s base model changes the hidden states after its last "
                              "decoder layer other than by its final norm, or its layers pass more than hidden "
                              "states [B, T, D], so a stage's output is not the next stage's input; set "
                              "parallel.pp = 1", "parallel.pp")
