"""A model family seen by the converter: meshpar's names and shapes, the Hugging Face names and
transposes (from ``meshpar/models/<family>/convert.py``), the experts stacked from one Hugging Face
tensor each ([Note: stacked experts]), the parameters a folder may hold quantised
([Note: quantised tensors on import]), the tensor-parallel placement of every parameter, and the
check that a checkpoint's tensors fit the model its meshpar.json describes."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from meshpar.models import FAMILIES, get_family
from meshpar.parallel.tensor_parallel.styles import VocabParallelEmbedding

# [Note: stacked experts]
# meshpar keeps a sparse layer's experts as one tensor per projection, layers.{i}.moe.experts.w1
# [E, F, D]; Hugging Face keeps one tensor per expert, ...experts.{j}.gate_proj.weight [F, D]
# (an adapter's EXPERT_KEYS: stacked meshpar name -> per-expert name, {j} the expert). The
# converter still moves one meshpar tensor at a time ([Note: streaming conversion]), so the
# unit is one layer's one projection: HFSource.read allocates the stacked tensor and reads each
# expert's bytes straight into its slice t[j] (contiguous in [E, F, D]); HFSink writes the E
# per-expert entries next to each other in one shard, in expert order, so the stacked tensor's
# bytes are theirs as they stand; load_hf_weights reads only the experts (and rows) of a rank's
# shard. Peak memory is the largest tensor's as before, a stacked one counting as one tensor.
# A stacked tensor is never transposed. Family hf's fused experts (transformers' gate_up_proj
# [E, 2F, D], expert j's gate rows then its up rows) are written the same way: the adapter's
# hf_layout lists their Hugging Face names in the order of their bytes ([Note: transformers'
# conversion run lazily], meshpar/models/hf/experts.py).

# [Note: quantised tensors on import]
# A folder may store a parameter quantised, as several tensors of other names and dtypes (gpt-oss's
# experts: MXFP4 ``..._blocks`` and ``..._scales``, uint8). An adapter's optional ``QUANTIZED``,
# {meshpar name ({i} a block): (source Hugging Face names ({i} likewise), decode)}, says so;
# ``decode(*sources, dtype=...)`` returns the parameter in meshpar's layout (nothing transposed) and
# in ``dtype``. A folder holding the parameter's own name (``KEYS``) is read as it stands; one holding
# any of its sources instead is decoded, and every source must be there. Invariant the readers rely
# on: dim 0 of every source and of the result is one index (an expert), so decoding sources[a:b]
# gives result[a:b]: HFSource.read decodes one dim-0 row at a time into the result (the peak stays
# one meshpar tensor, [Note: streaming conversion]), and load_hf_weights reads and decodes only the
# rows of a rank's shard. A parameter is either quantised or stacked per expert, not both. Export
# (``--to hf``) writes the plain tensor under its own name, in the dtype it has: quantising is the
# publisher's choice, and decoding back what was written gives the same values.


# (*sources, dtype=) -> the parameter: an adapter's QUANTIZED decoder ([Note: quantised tensors on import])
Decode = Callable[..., torch.Tensor]


class ConvertError(Exception):
    """A checkpoint problem; the message names the folder, file or tensor, and the fix."""


def _pattern(name: str) -> re.Pattern:
    """A name with {i} (a block index) as a pattern whose group ``i`` is the index."""
    return re.compile("^" + re.escape(name).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


def _compile(patterns: Mapping[str, str] | frozenset[str]) -> list[tuple[re.Pattern, str]]:
    items = patterns.items() if isinstance(patterns, Mapping) else ((p, p) for p in patterns)
    return [(_pattern(src), dst) for src, dst in items]


def _match(table: list[tuple[re.Pattern, str]], name: str) -> str | None:
    for pattern, template in table:
        m = pattern.match(name)
        if m:
            return template.replace("{i}", m.group("i")) if "i" in pattern.groupindex else template
    return None


@dataclass(frozen=True)
class ModelSpec:
    """A model family and its args: meshpar's names and shapes, the Hugging Face names, the plan."""

    family: str
    args: Any

    @property
    def adapter(self) -> Any:
        """The family's conversion adapter (``Family.adapter``): a module with ``KEYS`` (meshpar name ->
        Hugging Face name, {i} a block), ``TRANSPOSED``, ``IGNORED_HF``, ``tied(args)``, ``config.json``
        both ways (``hf_config``, ``args_from_hf_config``, ``args_from_dict``) and, optionally,
        ``EXPERT_KEYS`` with ``EXPERTS_KEY`` ([Note: stacked experts]), ``QUANTIZED``
        ([Note: quantised tensors on import]), ``HF_PREFIX``, ``skipped_hf(config)``,
        ``hf_export_error(args)``, ``TRAINING_ONLY``, ``ZERO_INIT``, ``IDENTITY`` and ``hf_layout(args)``
        (family hf)."""
        return get_family(self.family).adapter

    @functools.cached_property
    def _meta(self) -> tuple[dict[str, torch.Size], list[str]]:
        """(state-dict shapes, tied names included; the children before ``layers``) of the model on meta."""
        with torch.device("meta"):
            model = get_family(self.family).model_cls(self.args)
        children = [name for name, _ in model.named_children()]
        ends = children[:children.index("layers")] if "layers" in children else children
        return {k: v.shape for k, v in model.state_dict().items()}, ends

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Every state-dict tensor (tied names included) -> shape."""
        return self._meta[0]

    @functools.cached_property
    def _to_hf(self) -> list[tuple[re.Pattern, str]]:
        return _compile(self.adapter.KEYS)

    @functools.cached_property
    def _transposed(self) -> list[tuple[re.Pattern, str]]:
        return _compile(self.adapter.TRANSPOSED)

    @functools.cached_property
    def _experts(self) -> list[tuple[re.Pattern, str]]:
        return _compile(getattr(self.adapter, "EXPERT_KEYS", {}))

    @functools.cached_property
    def _expert_names(self) -> list[re.Pattern]:
        """Per-expert Hugging Face names as patterns whose group ``j`` is the expert."""
        return [re.compile("^" + re.escape(hf).replace(r"\{i\}", r"\d+").replace(r"\{j\}", r"(?P<j>\d+)") + "$")
                for hf in getattr(self.adapter, "EXPERT_KEYS", {}).values()]

    @functools.cached_property
    def tied(self) -> dict[str, str]:
        return self.adapter.tied(self.args)

    @property
    def size_name(self) -> str:
        return next((n for n, a in get_family(self.family).sizes.items() if a == self.args), "custom")

    def hf_name(self, fqn: str) -> str:
        if getattr(self.adapter, "IDENTITY", False):  # family "hf": the names are transformers' own
            return fqn
        name = _match(self._to_hf, fqn)
        if name is None:
            where = getattr(self.adapter, "__name__", None) or type(self.adapter).__module__
            raise ConvertError(f"tensor '{fqn}' has no Hugging Face name in {where}.KEYS; add it there")
        return name

    @functools.cached_property
    def _quantized(self) -> list[tuple[re.Pattern, tuple[Sequence[str], Decode]]]:
        return [(_pattern(fqn), entry) for fqn, entry in getattr(self.adapter, "QUANTIZED", {}).items()]

    def quantized(self, fqn: str) -> tuple[list[str], Decode] | None:
        """(the Hugging Face tensors a folder may store ``fqn`` as, decode), where the adapter's ``QUANTIZED``
        names it, else None: [Note: quantised tensors on import]."""
        for pattern, (sources, decode) in self._quantized:
            m = pattern.match(fqn)
            if m:
                i = m.group("i") if "i" in pattern.groupindex else ""
                return [source.replace("{i}", i) for source in sources], decode
        return None

    def stacked(self, fqn: str) -> bool:
        """Whether ``fqn`` stacks one Hugging Face tensor per expert along dim 0: [Note: stacked experts]."""
        return _match(self._experts, fqn) is not None

    @functools.cached_property
    def _layout(self) -> dict[str, Any]:
        """Family hf: {fqn: experts.Saved} where transformers saves a tensor under other names or transposed."""
        return self.adapter.hf_layout(self.args) if hasattr(self.adapter, "hf_layout") else {}

    def hf_names(self, fqn: str, experts: int | None = None) -> list[str]:
        """The Hugging Face tensors ``fqn`` is stored as: its one name, or one per expert in dim-0 order
        (``experts`` of them; default: as many as the model has), or family hf's pieces in byte order."""
        if fqn in self._layout:
            return list(self._layout[fqn].names)
        template = _match(self._experts, fqn)
        if template is None:
            return [self.hf_name(fqn)]
        return [template.replace("{j}", str(j)) for j in range(experts or self.shapes[fqn][0])]

    def expert_of(self, hf_name: str) -> int | None:
        """The expert ``j`` of a per-expert Hugging Face name; None for any other name."""
        m = next((m for p in self._expert_names if (m := p.match(hf_name))), None)
        return int(m.group("j")) if m else None

    def transposed(self, fqn: str) -> bool:
        if fqn in self._layout:
            return self._layout[fqn].transposed
        return _match(self._transposed, fqn) is not None

    def hf_shape(self, fqn: str, shape: Sequence[int]) -> list[int]:
        """The shape of each Hugging Face tensor of ``fqn`` (of one expert's, where stacked)."""
        if fqn in self._layout:
            return list(self._layout[fqn].shape)
        if self.stacked(fqn):
            return list(shape[1:])
        return list(reversed(shape)) if self.transposed(fqn) else list(shape)

    def stage(self, fqn: str, pp: int) -> int:
        """The pipeline stage holding ``fqn`` under an even split, one stage per pp rank."""
        if pp == 1:
            return 0
        from meshpar.parallel.pipeline.split import stage_layers

        m = re.match(r"layers\.(\d+)\.", fqn)
        if m:
            layer = int(m.group(1))
            return next(s for s, r in enumerate(stage_layers(self.args.n_layers, pp)) if layer in r)
        return 0 if fqn.split(".")[0] in self._meta[1] else pp - 1  # [Note: where the ends of a model are]

    @functools.cached_property
    def plan(self) -> Any:
        """The family's tensor-parallel plan table with vocab-sharded logits: where it places each parameter."""
        return get_family(self.family).tp_plan.with_loss_parallel(True)

    def tp_placement(self, fqn: str) -> Placement:
        """How the family's tensor-parallel plan table places parameter ``fqn`` on the tp mesh: as its
        module's style declares, where the style places every parameter of its module one way and says
        so in ``placement`` (FusedColwiseParallel's StridedShard(0, 3), [Note: fused projections];
        gpt-oss's ShardedByHead), else as torch's column- and row-wise styles place a Linear's."""
        module, _, param = fqn.rpartition(".")
        m = re.match(r"layers\.\d+\.(.+)", module)
        style = self.plan.block.get(m.group(1)) if m else self.plan.root.get(module)
        declared = getattr(style, "placement", None)
        if isinstance(declared, Placement):
            return declared
        if isinstance(style, (ColwiseParallel, VocabParallelEmbedding)):
            return Shard(0)  # Linear weight [out/tp, in] and bias [out/tp]; embedding rows [V/tp, D]
        if isinstance(style, RowwiseParallel):
            return Shard(1) if param == "weight" else Replicate()
        return Replicate()


def spec_from_info(info: Mapping[str, Any], where: Path) -> ModelSpec:
    family = info.get("family")
    if family not in FAMILIES:
        raise ConvertError(f"{where}: unknown model family '{family}'; meshpar converts {', '.join(FAMILIES)}")
    return ModelSpec(family, FAMILIES[family].adapter.args_from_dict(info["model_args"]))


def check_model_tensors(spec: ModelSpec, found: Mapping[str, Sequence[int]], where: str) -> None:
    """ConvertError naming the first tensor missing, unexpected or of the wrong shape for ``spec``."""
    for fqn, shape in spec.shapes.items():
        if fqn not in found:
            raise ConvertError(f"{where}: tensor 'model.{fqn}' is missing; a {spec.family} model with these "
                               f"model_args has it (shape {list(shape)}). The checkpoint is incomplete or was saved "
                               f"from another model: check meshpar.json's family and model_args")
        if list(found[fqn]) != list(shape):
            raise ConvertError(f"{where}: tensor 'model.{fqn}' has shape {list(found[fqn])}, but the {spec.family} "
                               f"model in meshpar.json's model_args needs {list(shape)}: the checkpoint was saved "
                               f"from another model shape; fix model_args or convert the matching checkpoint")
    extra = sorted(set(found) - set(spec.shapes))
    if extra:
        raise ConvertError(f"{where}: tensors {', '.join('model.' + e for e in extra[:5])} are not parameters of "
                           f"the {spec.family} model in meshpar.json; check its family and model_args")
