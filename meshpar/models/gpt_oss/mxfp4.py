"""MXFP4, the format of gpt-oss's published expert weights, read back to floating point.

The published checkpoints (openai/gpt-oss-20b, -120b) store each expert projection as two tensors
(the OCP Microscaling Formats specification, v1.0):

    {name}_blocks  uint8 [E, R, G, 16]  32 FP4 (E2M1) values per block, two per byte: element 2i
                                        in the low nibble, 2i + 1 in the high one
    {name}_scales  uint8 [E, R, G]      each block's shared scale, E8M0: 2^(byte - 127); 255 is NaN

with R the projection's output rows (2F for gate_up_proj, D for down_proj) and G * 32 its input
width, blocks running along the input. ``dequantize_mxfp4`` returns transformers' (and meshpar's)
layout, [E, G * 32, R]: gate_up_proj[E, D, 2F], down_proj[E, F, D]. The attention, router,
embedding and output weights, and the experts' biases, are stored unquantized.

Every E2M1 value times a power of two within the scales' range is exact in bfloat16 and float32, so
the result is the quantized weights exactly (float16's narrower exponent range may flush or overflow).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # values per scale


def e2m1_values() -> Tensor:
    """The 16 FP4 E2M1 code points in code order, float32: sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent 0 is subnormal (0 or 0.5)."""
    codes = torch.arange(16)
    sign = 1 - 2 * (codes >> 3)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa))
    return (sign * magnitude).float()


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """``{name}_blocks`` uint8 [..., R, G, 16] and ``{name}_scales`` uint8 [..., R, G] -> [..., G * 32, R]
    in ``dtype`` (module docstring), one leading index (expert) at a time to bound the temporaries."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., R, G, {BLOCK // 2}] need scales [..., R, G]; got blocks "
                         f"{list(blocks.shape)} and scales {list(scales.shape)}")
    *lead, rows, groups, _ = blocks.shape
    values = e2m1_values().to(blocks.device)
    out = torch.empty(*lead, groups * BLOCK, rows, dtype=dtype, device=blocks.device)
    flat_out = out.view(-1, groups * BLOCK, rows)
    for i, (b, s) in enumerate(zip(blocks.reshape(-1, rows, groups, BLOCK // 2),
                                   scales.reshape(-1, rows, groups), strict=True)):
        codes = torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)  # [R, G, 32]: low nibble first
        exponent = s.to(torch.int32) - 127
        scale = torch.where(s == 255, torch.nan, torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent))
        w = values[codes.long()] * scale.unsqueeze(-1)  # [R, G, 32] float32, exact
        flat_out[i] = w.flatten(-2).t()  # [G * 32, R]
    return out
