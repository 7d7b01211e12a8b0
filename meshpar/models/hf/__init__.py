"""``model.family = "hf"``: any Hugging Face causal LM, built from its config by transformers.

    args = HFArgs.from_folder("path/to/folder")   # config.json (recipe overrides of n_layers, vocab_size)
    model = HFCausalLM(args)                       # on meta under meshpar's build, like every family

[Note: a transformers model as a meshpar family]
The model is transformers' own ``AutoModelForCausalLM.from_config``, run by its own forward, so
any architecture it ships trains (Gemma, Phi, Mistral, ...). ``HFCausalLM`` registers the causal
LM's children as its own under their names (``model``, ``lm_head``), so its state-dict names are
exactly the Hugging Face names: checkpoints and ``meshpar convert`` map them one to one. It keeps
the causal LM itself unregistered, to call its forward: every module it runs is one of ours, so
FSDP's hooks, checkpointing and compile (all applied in place: meshpar/parallel/wrap.py) act on
the modules transformers calls. The slots meshpar's parallelism uses: ``layers`` (the decoder
layers, found as the one ModuleList of ``num_hidden_layers`` modules), ``head`` and
``head_in_loss`` (the chunked loss, where logits are a plain ``lm_head(h)``). Document attention
(``document_eos``) hands transformers the boolean [B, 1, T, T] mask and per-document positions,
which its attention takes as they are (tests/test_hf_family.py: a packed row equals its documents).

[Note: initializing a transformers model]
After ``to_empty`` every value is garbage. Linear and embedding weights (the random ones) are
drawn by meshpar.models.init, layout-independent, with std ``initializer_range``, and marked
initialized; transformers' ``initialize_weights`` then sets everything else as the architecture
defines it (norms, biases, RoPE buffers): constants, the same on every rank. A model whose own
init draws other random parameters would draw them per rank; none of the tested ones does.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from meshpar.config.errors import RecipeError
from meshpar.models.attention import document_mask
from meshpar.models.init import canonical_name, draw_seed, normal_


def _transformers():
    try:
        import transformers
    except ImportError:
        raise RecipeError("model.family = 'hf' builds the model with transformers, which is not installed: pip "
                          "install 'meshpar[hf]'", "model.family") from None
    return transformers


@dataclass(frozen=True)
class HFArgs:
    """A Hugging Face architecture: its config.json (as text, with the recipe's overrides applied)
    and the figures meshpar's planner, logs and checks read."""

    config: str
    n_layers: int
    vocab_size: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    tie_embeddings: bool
    document_eos: int = -1

    @classmethod
    def from_config(cls, config: dict[str, Any], n_layers: int = 0, vocab_size: int = 0) -> HFArgs:
        config = dict(config)
        if n_layers:
            config["num_hidden_layers"] = n_layers
            if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Gemma 3, Qwen2, ...)
                config["layer_types"] = config["layer_types"][:n_layers]
        if vocab_size:
            config["vocab_size"] = vocab_size
        try:
            dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(json.dumps(config, sort_keys=True), int(config["num_hidden_layers"]), int(config["vocab_size"]),
                       dim, heads, int(config.get("num_key_value_heads") or heads),
                       int(config.get("head_dim") or dim // heads), int(config.get("max_position_embeddings") or 0),
                       bool(config.get("tie_word_embeddings", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise RecipeError(f"model.hf_path: config.json lacks what a decoder-only causal LM has ({e}); give the "
                              f"folder of a causal language model", "model.hf_path") from None

    @classmethod
    def from_folder(cls, folder: str, n_layers: int = 0, vocab_size: int = 0) -> HFArgs:
        path = Path(folder).expanduser() / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise RecipeError(f"model.hf_path = {folder!r}: cannot read {path} ({e}); give a Hugging Face model "
                              f"folder (config.json, and safetensors to start from its weights)",
                              "model.hf_path") from None
        return cls.from_config(config, n_layers, vocab_size)

    @property
    def hf_config(self) -> dict[str, Any]:
        return json.loads(self.config)

    @property
    def model_type(self) -> str:
        return str(self.hf_config.get("model_type", "?"))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim

    def matmul_params(self) -> int:
        """The weights of every linear layer (the output projection included, counted once when tied)."""
        return _matmul_params(self.config)

    def flops_per_token(self, seq_len: int) -> float:
        """6 per matmul weight plus attention's 12 * L * H * Dh * T, as meshpar's own families count."""
        return 6.0 * self.matmul_params() + 12.0 * self.n_layers * self.n_heads * self.head_dim * seq_len


@functools.cache
def _matmul_params(config: str) -> int:
    with torch.device("meta"):
        model = HFCausalLM(HFArgs.from_config(json.loads(config)))
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def build_config(args: HFArgs):
    """The transformers config object of ``args``, attention through PyTorch's SDPA."""
    transformers = _transformers()
    config = args.hf_config
    model_type = config.pop("model_type", None)
    if model_type is None:
        raise RecipeError("model.hf_path: config.json has no model_type; give a Hugging Face model folder",
                          "model.hf_path")
    try:
        built = transformers.AutoConfig.for_model(model_type, **config)
    except ValueError as e:
        raise RecipeError(f"model.hf_path: transformers {transformers.__version__} does not know model_type "
                          f"'{model_type}' ({e}); upgrade transformers", "model.hf_path") from None
    built._attn_implementation = "sdpa"
    return built


class HFCausalLM(nn.Module):
    """A transformers causal LM with meshpar's slots: [Note: a transformers model as a meshpar family].
    ``forward(tokens[B, T]) -> logits[B, T, V]`` (h[B, T, D] under ``head_in_loss`` with gradients)."""

    def __init__(self, args: HFArgs) -> None:
        super().__init__()
        transformers = _transformers()
        self.args = args
        config = build_config(args)
        try:
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.get_default_dtype())
        except ValueError as e:
            raise RecipeError(f"model.hf_path: model_type '{args.model_type}' has no causal language model in "
                              f"transformers ({e}); give the folder of a causal LM", "model.hf_path") from None
        own = [n for n, _ in [*hf.named_parameters(recurse=False), *hf.named_buffers(recurse=False)]]
        if own:
            raise RecipeError(f"model.family = 'hf': {type(hf).__name__} keeps tensors outside its modules ({own}), "
                              "which is not built", "model.family")
        for name, child in hf.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "_hf", hf)  # unregistered: its children are ours
        blocks = [(n, m) for n, m in hf.named_modules() if isinstance(m, nn.ModuleList) and len(m) == args.n_layers]
        if len(blocks) != 1:
            raise RecipeError(f"model.family = 'hf': {type(hf).__name__} has {len(blocks)} lists of "
                              f"num_hidden_layers = {args.n_layers} modules; its decoder layers cannot be told apart",
                              "model.family")
        self._blocks_path, blocks = blocks[0][0], [blocks[0][1]]
        self._keys = [str(i) for i in range(args.n_layers)]
        plain_head = not any(config.to_dict().get(k) for k in ("final_logit_softcapping", "logit_scale"))
        # modules already registered under their own names: set without registering them again
        object.__setattr__(self, "_blocks", blocks[0])
        object.__setattr__(self, "head", hf.get_output_embeddings() if plain_head else None)
        self.head_in_loss = False

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The decoder layers by index (the slot FSDP, checkpointing and compile take blocks from)."""
        return dict(zip(self._keys, self._blocks, strict=True))

    def copy_with_layers(self, keep: Sequence[int]) -> HFCausalLM:
        """A copy (of a model on meta) holding only the decoder layers ``keep``, under their indices:
        what the planner simulates of a large model ([Note: copying only a stage] in
        meshpar/parallel/pipeline/split.py). transformers runs the layers its list holds."""
        dropped = [b for i, b in enumerate(self._blocks) if i not in set(keep)]
        stage = copy.deepcopy(self, {id(b): None for b in dropped})
        parent, _, leaf = stage._blocks_path.rpartition(".")
        kept = nn.ModuleList([b for b in stage._blocks if b is not None])
        setattr(stage._hf.get_submodule(parent) if parent else stage._hf, leaf, kept)
        object.__setattr__(stage, "_blocks", kept)
        stage._keys = [str(i) for i in keep]
        config = stage._hf.config
        config.num_hidden_layers = len(kept)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = [config.layer_types[i] for i in keep]
        return stage

    @property
    def hf(self) -> nn.Module:
        """The transformers causal LM (sharing every module with this one)."""
        return self._hf

    def forward(self, tokens: Tensor) -> Tensor:
        extra = {}
        if self.args.document_eos >= 0:  # [Note: document-causal attention]: transformers takes the mask whole
            mask, positions = document_mask(tokens, self.args.document_eos)
            extra = {"attention_mask": mask, "position_ids": positions}
        if self.head_in_loss and torch.is_grad_enabled():  # the loss applies ``head`` chunk by chunk
            return self._hf.base_model(input_ids=tokens, use_cache=False, **extra).last_hidden_state
        return self._hf(input_ids=tokens, use_cache=False, **extra).logits

    @torch.no_grad()
    def init_weights(self) -> None:
        """[Note: initializing a transformers model]."""
        hf = self._hf
        hf.tie_weights()  # to_empty gave the tied output its own Parameter
        for t in [*hf.parameters(), *hf.buffers(), *hf.modules()]:
            t._is_hf_initialized = False
        std = hf.config.initializer_range if getattr(hf.config, "initializer_range", None) else 0.02
        seed = draw_seed()
        for name, module in self.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(module, (nn.Linear, nn.Embedding)) and not getattr(weight, "_is_hf_initialized", False):
                normal_(weight, std=std, key=canonical_name(f"{name}.weight"), seed=seed)
                weight._is_hf_initialized = True
        hf.initialize_weights()


def args_from_dict(d: dict[str, Any]) -> HFArgs:
    """HFArgs from ``dataclasses.asdict`` (a checkpoint's meshpar.json)."""
    return HFArgs(**{f.name: d[f.name] for f in dataclasses.fields(HFArgs) if f.name in d})
