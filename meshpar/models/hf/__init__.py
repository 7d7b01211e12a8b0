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
``head_in_loss`` (the chunked loss, where logits are a plain ``lm_head(h)``), ``positions`` and
``inner_attention`` (context parallelism: [Note: routing a transformers model's attention] in
meshpar/models/hf/attention.py). Document attention (``document_eos``) hands transformers the
boolean [B, 1, T, T] mask and per-document positions, which its attention takes as they are
(tests/test_hf_family.py: a packed row equals its documents).

[Note: initializing a transformers model]
After ``to_empty`` every value is garbage. Linear and embedding weights (the random ones) are
drawn by meshpar.models.init, layout-independent, with std ``initializer_range``, and marked
initialized; transformers' ``initialize_weights`` then sets everything else as the architecture
defines it (norms, biases, RoPE buffers): constants, the same on every rank. Other random
parameters (DiffLlama's lambdas, XLNet's mask embedding) are drawn by transformers' own init, on a
sharded parameter by DTensor's random ops: not the values one rank would draw. A run that starts
from a folder's weights (``checkpoint.hf_weights``) loads them all, the same on every layout.

[Note: the attention a transformers model runs]
meshpar does not choose the attention kernel: transformers does, for the model class, as
``from_pretrained`` would (PyTorch's SDPA where the class declares it exact, its own eager
attention where the config needs what SDPA cannot express: soft-capped scores, sinks). The run's
start line names it (``HFCausalLM.attention``). Document attention's boolean mask goes to SDPA as
it is and to eager attention as the additive 0 / -inf mask that eager attention adds to its scores.
A mixture of experts runs transformers' default experts kernel (grouped_mm), except in float64, which
that kernel lacks: there the eager loop over experts, the same arithmetic per expert.

The pipeline stages' parts are in stages.py ([Note: a transformers model in pipeline stages]), the
chunked loss's check of the head in head.py ([Note: the head the chunked loss applies]), the routing
of attention to meshpar's slot in attention.py ([Note: routing a transformers model's attention]).
"""

from __future__ import annotations

import contextlib
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
from torch.distributed.tensor.experimental import implicit_replication

from meshpar.config.errors import RecipeError
from meshpar.models.attention import SequencePositions, document_mask
from meshpar.models.hf.attention import KEYWORD, Route, check_ran, refuse_failure, route_to
from meshpar.models.hf.head import head_alone
from meshpar.models.hf.stages import Boundary, StageLayers
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
    max_seq_len: int  # 0: the config states no limit (recurrent models)
    tie_embeddings: bool
    document_eos: int = -1

    @classmethod
    def from_config(cls, config: dict[str, Any], n_layers: int = 0, vocab_size: int = 0) -> HFArgs:
        config = dict(config)
        names = _config_class(config).attribute_map  # the type's own key for a common name (gpt2: n_layer)
        if n_layers:
            key = names.get("num_hidden_layers", "num_hidden_layers")
            before = config.get(key)
            config[key] = n_layers
            for k, v in config.items():  # per-layer lists (attention kinds, MLP kinds, limits): the first n_layers
                if isinstance(v, list) and (len(v) == before or k == "layer_types"):
                    config[k] = v[:n_layers]
        if vocab_size:
            config[names.get("vocab_size", "vocab_size")] = vocab_size
        built = build_config_from(config)
        try:
            dim, layers, vocab = (int(getattr(built, k)) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
        except (AttributeError, TypeError, ValueError) as e:
            raise RecipeError(f"model.hf_path: config.json lacks what a decoder-only causal LM has ({e}); give the "
                              f"folder of a causal language model", "model.hf_path") from None
        heads = int(_figure(built, "num_attention_heads") or 0)  # 0: no attention (Mamba, RWKV, xLSTM)
        kv_heads = int(_figure(built, "num_key_value_heads") or heads)
        head_dim = int(_figure(built, "head_dim") or (dim // heads if heads else 0))
        return cls(json.dumps(config, sort_keys=True), layers, vocab, dim, heads, kv_heads, head_dim,
                   int(_figure(built, "max_position_embeddings") or 0), bool(_figure(built, "tie_word_embeddings")))

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
def meta_model(config: str) -> HFCausalLM:
    """The model of ``HFArgs.config`` on the meta device, built once: what the planner's counts, the TP
    plan's module names and the converter's tied names read. Never modified."""
    with torch.device("meta"):
        return HFCausalLM(HFArgs.from_config(json.loads(config)))


@functools.cache
def _matmul_params(config: str) -> int:
    model = meta_model(config)
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            total += module.weight.numel()
    return total


def _figure(config: Any, name: str) -> Any:
    """A config's figure, or None where it has none or only per layer (Gemma 4's head_dim raises)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' per-layer attributes raise their own error
        return None


def _config_class(config: dict[str, Any]) -> type:
    """transformers' config class of a config.json's ``model_type``."""
    transformers = _transformers()
    model_type = config.get("model_type")
    if model_type is None:
        raise RecipeError("model.hf_path: config.json has no model_type; give a Hugging Face model folder",
                          "model.hf_path")
    try:
        return transformers.AutoConfig.for_model(model_type).__class__
    except ValueError as e:
        raise RecipeError(f"model.hf_path: transformers {transformers.__version__} does not know model_type "
                          f"'{model_type}' ({e}); upgrade transformers", "model.hf_path") from None


def _decode_floats(value: Any) -> Any:
    """config.json's non-JSON floats as transformers writes them: {"__float__": "Infinity"} -> inf."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in ("Infinity", "-Infinity", "NaN"):
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: _decode_floats(v) for k, v in value.items()}
    return [_decode_floats(v) for v in value] if isinstance(value, list) else value


def build_config_from(config: dict[str, Any]):
    """The transformers config object of a config.json dict, as ``from_pretrained`` reads it; attention
    by transformers' own choice for the class ([Note: the attention a transformers model runs])."""
    cls = _config_class(config)
    config = _decode_floats({k: v for k, v in config.items() if k != "model_type"})
    return cls(**config)


def build_config(args: HFArgs):
    """The transformers config object of ``args``."""
    return build_config_from(args.hf_config)


class HFCausalLM(nn.Module):
    """A transformers causal LM with meshpar's slots: [Note: a transformers model as a meshpar family].
    ``forward(tokens[B, T]) -> logits[B, T, V]`` (h[B, T, D] under ``head_in_loss`` with gradients)."""

    def __init__(self, args: HFArgs) -> None:
        super().__init__()
        transformers = _transformers()
        self.args = args
        config = build_config(args)
        dtype = torch.get_default_dtype()  # grouped_mm, transformers' experts kernel, has no float64
        kernels = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        try:
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, **kernels)
        except ValueError as e:
            raise RecipeError(f"model.hf_path: transformers {transformers.__version__} cannot build model_type "
                              f"'{args.model_type}' as a causal LM from this config.json ({e})",
                              "model.hf_path") from None
        if torch.empty(0).device.type == "meta":  # built on meta (meshpar's build): so is every parameter
            _parameters_to_meta(hf)
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
        # modules already registered under their own names: set without registering them again
        object.__setattr__(self, "_blocks", blocks[0])
        head = hf.get_output_embeddings()
        head_name = next((n for n, m in hf.named_children() if m is head), "")
        plain = head_name and hf.base_model is not hf and head_alone(type(hf), head_name)  # the loss runs the rest
        object.__setattr__(self, "head", head if plain else None)
        self.head_in_loss = False
        self.attention = hf.config._attn_implementation  # the attention kernel transformers chose
        # the slots context parallelism fills: where this forward's tokens sit, and one attention module for
        # every layer ([Note: routing a transformers model's attention] in meshpar/models/hf/attention.py)
        self.positions: SequencePositions = SequencePositions()
        self.inner_attention: nn.Module | None = None
        self._routed_ran = False  # a forward through the filled slot has run (its failures are no refusal)
        self.ends = (True, True)  # (holds the input embedding, holds the norm and head): a pipeline stage's part

    def attention_slots(self) -> list[tuple[nn.Module, bool]]:
        """The one module whose ``inner_attention`` slot serves every layer: this model."""
        return [(self, False)]

    def path_of(self, module: nn.Module | None) -> str:
        """The state-dict path of one of this model's modules ("" when it has none)."""
        return next((n for n, m in self.named_modules() if m is module), "") if module is not None else ""

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The decoder layers by index (the slot FSDP, checkpointing and compile take blocks from)."""
        return dict(zip(self._keys, self._blocks, strict=True))

    def copy_with_layers(self, keep: Sequence[int], first: bool = True, last: bool = True) -> HFCausalLM:
        """A copy (of a model on meta) holding only the decoder layers ``keep``, under their indices; the
        input embedding only if ``first``, the final norm and the head only if ``last``: a pipeline stage
        ([Note: a transformers model in pipeline stages]), or what the planner simulates of a large model
        ([Note: copying only a stage] in meshpar/parallel/pipeline/split.py)."""
        hf = self._hf
        dropped = [b for i, b in enumerate(self._blocks) if i not in set(keep)]
        if not first:
            dropped.append(hf.get_input_embeddings())
        if not last:
            dropped.append(hf.get_output_embeddings())
        stage = copy.deepcopy(self, {id(m): None for m in dropped})
        parent, _, leaf = stage._blocks_path.rpartition(".")
        kept = StageLayers({str(i): b for i, b in zip(range(len(stage._blocks)), stage._blocks, strict=True)
                             if b is not None})
        owner = stage._hf.get_submodule(parent) if parent else stage._hf
        setattr(owner, leaf, kept)
        object.__setattr__(stage, "_blocks", kept)
        stage._keys = [str(i) for i in keep]
        if not last:  # the base model's modules after its layers (the final norm) pass the hidden states on
            names = [n for n, _ in owner.named_children()]
            for name in names[names.index(leaf) + 1:]:
                if any(True for _ in getattr(owner, name).parameters()):
                    setattr(owner, name, nn.Identity())
        config = stage._hf.config
        config.num_hidden_layers = len(kept)
        for name, value in list(vars(config).items()):  # per-layer lists: the kept layers' entries
            if isinstance(value, list) and len(value) == len(self._blocks):
                setattr(config, name, [value[i] for i in keep])
        stage.ends = (first, last)
        if not (first and last):
            object.__setattr__(stage, "_boundary", Boundary(kept[0], kept[-1], self.args.dim))
        return stage

    @property
    def hf(self) -> nn.Module:
        """The transformers causal LM (sharing every module with this one)."""
        return self._hf

    def forward(self, x: Tensor) -> Tensor:
        """tokens[B, T] (the first stage) or h[B, T, D] (a later one) -> logits[B, T, V] (the last stage),
        else h[B, T, D]."""
        first, last = self.ends
        extra = self._inputs(x)
        with self._boundary.watch(x, self.args.model_type) if not (first and last) else contextlib.nullcontext():
            try:
                if last and not (self.head_in_loss and torch.is_grad_enabled()):
                    out = self._hf(use_cache=False, **extra).logits
                else:  # the last stage's under head_in_loss: the loss applies ``head`` chunk by chunk
                    out = self._hf.base_model(use_cache=False, **extra).last_hidden_state
            except Exception as e:
                if KEYWORD not in extra or self._routed_ran or isinstance(e, RecipeError):
                    raise
                raise refuse_failure(e, self.args.model_type) from e
            if not last:
                self._boundary.check_output(out, self.args.model_type)
        if KEYWORD in extra:
            check_ran(extra[KEYWORD], list(self._blocks), self.args.model_type)
            self._routed_ran = True
        return out

    def _inputs(self, x: Tensor) -> dict[str, Any]:
        """The keyword arguments of transformers' forward for ``x``: the tokens or hidden states, and the
        positions, mask and route that document attention and a filled attention slot need."""
        extra: dict[str, Any] = {"input_ids": x} if self.ends[0] else {"inputs_embeds": x}
        if self.inner_attention is not None:  # [Note: routing a transformers model's attention]
            route_to(self._hf)
            positions = self.positions.token_positions(x.shape[1], x.device)
            route = extra[KEYWORD] = Route(self.inner_attention, self.positions.whole_length(x.shape[1]))
            extra["position_ids"] = positions.expand(x.shape[0], -1)
            if self.args.document_eos >= 0:  # the slot takes the documents in the mask's place
                route.documents, extra["position_ids"] = self.positions.documents_of(x, self.args.document_eos)
        elif self.args.document_eos >= 0:  # [Note: document-causal attention]: transformers takes the mask whole
            mask, positions = document_mask(x, self.args.document_eos)
            if self.attention == "eager":  # eager attention adds its mask to the scores: 0 or -inf
                mask = torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, -torch.inf)
            extra.update(attention_mask=mask, position_ids=positions)
        return extra

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
        with implicit_replication():  # its constants (Mamba's A_log = log(1..N)) are whole tensors: copied to shards
            hf.initialize_weights()


def _parameters_to_meta(hf: nn.Module) -> None:
    """Parameters a model's code makes on the CPU whatever the default device (DiffLlama's
    ``torch.normal(..., size=...)``, XLNet's ``torch.FloatTensor(...)``), replaced by meta ones like the
    rest: their values are set after ``to_empty`` as every parameter's are ([Note: initializing a
    transformers model]), and FSDP takes a unit's parameters on one device."""
    for module in hf.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not p.is_meta:
                setattr(module, name, nn.Parameter(p.to("meta"), requires_grad=p.requires_grad))


def args_from_dict(d: dict[str, Any]) -> HFArgs:
    """HFArgs from ``dataclasses.asdict`` (a checkpoint's meshpar.json)."""
    return HFArgs(**{f.name: d[f.name] for f in dataclasses.fields(HFArgs) if f.name in d})
