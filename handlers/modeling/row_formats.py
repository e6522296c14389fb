"""Embedding rows in their served formats: float rows -> the bytes a table holds, and back.

Row-wise quantized dtypes (int8, int4, int2) keep per row an fp16 scale and an fp16 bias, then
the values packed 1, 2 or 4 to a byte (FBGEMM's fused row-wise format, as TorchRec quantizes a
trained table); fp16 and fp32 rows hold the values themselves. One row of dim ``d``:

    int8: 4 + d bytes    int4: 4 + d/2    int2: 4 + d/4    fp16: 2d    fp32: 4d

    packed = encode_rows(floats, "int4")        # float [n, d] -> uint8 [n, 4 + d/2]
    decode_rows(packed, "int4", d)              # -> the float rows the kernels look up
"""

from __future__ import annotations

import torch

from handlers.runtime import fbgemm_ops  # noqa: F401  the row-wise quantization operators

BITS = {"int8": 8, "int4": 4, "int2": 2}
SCALE_BIAS_BYTES = 4  # an fp16 scale, then an fp16 bias
FLOAT_TYPES = {"fp16": torch.float16, "fp32": torch.float32}


def encode_rows(floats: torch.Tensor, dtype: str) -> torch.Tensor:
    """Float rows [n, dim] -> uint8 [n, packed bytes]: scale and bias first for quantized dtypes."""
    floats = floats.detach().float().contiguous()
    if dtype in BITS:
        fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(floats, BITS[dtype])
        values, scale_bias = fused[:, :-SCALE_BIAS_BYTES], fused[:, -SCALE_BIAS_BYTES:]  # fused keeps them last
        return torch.cat([scale_bias, values], dim=1)
    return floats.to(FLOAT_TYPES[dtype]).view(torch.uint8)


def decode_rows(packed: torch.Tensor, dtype: str, dim: int) -> torch.Tensor:
    """uint8 [n, >= packed bytes] (a table's rows, alignment padding allowed) -> float [n, dim]."""
    if dtype in BITS:
        width = dim * BITS[dtype] // 8
        scale_bias = packed[:, :SCALE_BIAS_BYTES]
        values = packed[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + width]
        fused = torch.cat([values, scale_bias], dim=1).contiguous()
        return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, BITS[dtype])
    width = dim * FLOAT_TYPES[dtype].itemsize
    return packed[:, :width].contiguous().view(FLOAT_TYPES[dtype]).float()


def round_trip(floats: torch.Tensor, dtype: str) -> torch.Tensor:
    """The float rows a table of ``dtype`` serves for ``floats`` [n, dim]."""
    return decode_rows(encode_rows(floats, dtype), dtype, floats.shape[1])
