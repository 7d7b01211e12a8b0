"""Float8 training through torchao: the recipe's ``model.float8`` applied to a stage built on meta.

    skipped = apply_float8(stage, "tensorwise", emulate=False, fsdp_all_gather=True)
    ... after each optimizer step: precompute_scales(stage)

The transformer's ``nn.Linear`` layers become torchao's ``Float8Linear`` (matmuls in float8 with
dynamic scales: ``tensorwise`` one scale per tensor, ``rowwise`` one per row, ``rowwise_with_gw_hp``
rowwise with the weight gradient in high precision), except the output projection (the logits,
which float8 costs accuracy on, as torchtitan leaves it) and any layer whose dims are not multiples
of 16 (float8 matmuls need them). With tensorwise scaling under FSDP the weights are all-gathered in
float8 (torchao's weight subclass defines the all-gather extension: meshpar/fsdp/extensions.py), and
``precompute_scales`` computes every weight's scale in one pass after the optimizer step, as
torchao recommends, instead of an all-reduce per weight per all-gather. ``emulate`` runs the float8
casts and matmuls in high precision where no float8 kernel exists (a CPU): the same numbers, the
speed of neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from meshpar.distributed._torch import TorchDispatchMode, c10d_functional_ops

MODES = ("none", "tensorwise", "rowwise", "rowwise_with_gw_hp")
SKIPPED_NAMES = ("output",)  # the output projection (Llama, Qwen); GPT-2 ties it to the embedding


def _config(mode: str, emulate: bool, fsdp_all_gather: bool):
    from torchao.float8 import Float8LinearConfig

    if mode == "tensorwise":
        return Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=fsdp_all_gather)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(mode), emulate=emulate)


def shards_over_ranks(layout) -> bool:
    """Whether FSDP gathers parameters from several ranks (``Mesh.fsdp``: dp_shard x cp)."""
    return layout.dp_shard * layout.cp > 1


def float8_all_gather(mode: str, layout) -> bool:
    """Whether FSDP all-gathers the weights in float8 (tensorwise only; rowwise gathers in the
    parameter dtype, as torchao does)."""
    return mode == "tensorwise" and shards_over_ranks(layout)


def apply_float8(model: nn.Module, mode: str, *, emulate: bool, fsdp_all_gather: bool) -> list[str]:
    """Convert ``model``'s eligible linear layers in place; returns the names of those left out."""
    from torchao.float8 import convert_to_float8_training

    skipped: list[str] = []

    def eligible(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # the filter is asked of every module; only linears are converted
        if name.split(".")[-1] in SKIPPED_NAMES or module.in_features % 16 or module.out_features % 16:
            skipped.append(name)
            return False
        return True

    convert_to_float8_training(model, config=_config(mode, emulate, fsdp_all_gather), module_filter_fn=eligible)
    return skipped


# [Note: float8 TP styles and biases]
# torchao's float8 styles cast the output gradient to float8 outside the layer (in the style's output
# hook), so a bias added inside the layer gets the sum of float8-rounded gradients, not of the
# high-precision ones a converted layer without tp computes: tp would change the training. Layers
# with a bias (GPT-2, Qwen2's q/k/v) keep PyTorch's styles; their matmuls still run in float8.
def float8_tp_style(module: nn.Module, style: ParallelStyle) -> ParallelStyle:
    """The tensor-parallel style for ``module`` under tensorwise float8 (a plan's ``Restyle``,
    meshpar/parallel/tensor_parallel/plan.py): torchao's float8 counterparts of PyTorch's column-wise and
    row-wise styles on converted linears, and of a sub-layer's input gather where every linear it holds
    is converted (the input is cast once, then all-gathered in float8 and shared by its projections).
    Any other entry (meshpar's own styles, unconverted layers such as the output, linears with a bias)
    keeps its style: the layer still computes in float8, its tp collectives move the high-precision
    tensors."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def converted(m: nn.Module) -> bool:  # [Note: float8 TP styles and biases]
        return isinstance(m, Float8Linear) and m.bias is None

    if converted(module) and type(style) in (ColwiseParallel, RowwiseParallel):
        float8_style = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
        return float8_style(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                            use_local_output=style.use_local_output)
    linears = [m for m in module.children() if isinstance(m, nn.Linear)]
    if type(style) is PrepareModuleInput and linears and all(converted(m) for m in linears):
        return PrepareFloat8ModuleInput(input_layouts=style.input_layouts,
                                        desired_input_layouts=style.desired_input_layouts,
                                        use_local_output=style.use_local_output)
    return style


# [Note: float8 all-gathers over gloo]
# torchao's float8 TP styles cast a sub-layer's input (and in backward the output gradient) to a
# DTensor of Float8TrainingTensor before redistributing it, so tensor parallelism all-gathers the
# float8 data (a functional ``all_gather_into_tensor`` on the subclass's float8 tensor). gloo has no
# float8 type ("Invalid scalar type"). An all-gather only copies, so the same bytes gathered as
# ``uint8`` and viewed back are exactly the float8 gather: ``Float8Bytes`` is a dispatch mode,
# entered around forward and backward only where the tp group runs on gloo (a CPU run), that does
# this for float8 all-gathers and passes every other op through. NCCL gathers float8 itself.
class Float8Bytes(TorchDispatchMode):
    """Float8 all-gathers as bytes, for backends without float8 types ([Note: float8 all-gathers over gloo])."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers = 0  # float8 all-gathers it moved as bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _ALL_GATHERS:
            return func(*args, **kwargs)
        from torchao.float8.float8_training_tensor import Float8TrainingTensor

        t = args[0]
        if isinstance(t, Float8TrainingTensor):  # rebuilt around the gathered data, as torchao's own op does
            self.gathers += 1
            data = _gathered_bytes(func, t._data, args[1:], kwargs)
            return Float8TrainingTensor(data, t._scale, t._orig_dtype, t._linear_mm_config, t._gemm_input_role)
        if t.dtype in _FLOAT8:
            self.gathers += 1
            return _gathered_bytes(func, t, args[1:], kwargs)
        return func(*args, **kwargs)


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_ALL_GATHERS = (c10d_functional_ops().all_gather_into_tensor.default,)


def _gathered_bytes(all_gather, data: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
    """``data`` (float8) all-gathered as uint8 and waited for: the functional op's result, viewed back."""
    out = all_gather(data.contiguous().view(torch.uint8), *args, **kwargs)
    return c10d_functional_ops().wait_tensor.default(out).view(data.dtype)


def around_step(mode: str, tp_mesh) -> contextlib.AbstractContextManager:
    """What forward and backward run under for ``mode`` on a ``tp_mesh`` (None without tp): ``Float8Bytes``
    where tensorwise float8 all-gathers over gloo, else nothing."""
    if mode == "tensorwise" and tp_mesh is not None and dist.get_backend(tp_mesh.get_group()) == "gloo":
        return Float8Bytes()
    return contextlib.nullcontext()


def precompute_scales(model: nn.Module) -> None:
    """Every float8-gathered weight's scale for the next all-gathers, in one pass (tensorwise). Run it
    before the first step too: without a precomputed scale torchao's all-gather computes the amax over
    the FSDP mesh only, so under tensor parallelism each tp rank would scale its shard by its own amax
    for that one step (and a resumed run would not repeat the uninterrupted one)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear import Float8Linear

    # torchao's pass stacks the weights' amaxes, which needs one mesh; a mixture-of-experts layer under tp
    # shards its dense linears (DeepSeek's shared experts) over dp_shard x tp flattened, the blocks' over
    # (dp_shard, tp): one pass per mesh. Each weight's scale is its own amax's either way.
    by_mesh: dict[Any, list[nn.Module]] = {}
    for m in model.modules():
        if isinstance(m, Float8Linear) and isinstance(m.weight, DTensor):
            by_mesh.setdefault(m.weight.device_mesh, []).append(m)
    for modules in by_mesh.values():
        precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(modules))
