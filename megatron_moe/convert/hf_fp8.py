"""Fine-grained FP8 checkpoints, as DeepSeek-V3 / R1 are published: config.json's
`quantization_config` = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...};
each quantized linear weight W `[out, in]` is stored as float8_e4m3fn `<name>` beside a float32
`<name>_scale_inv` `[ceil(out / 128), ceil(in / 128)]`, one scale per 128 x 128 block:

    W[i, j] = w[i, j] * scale_inv[i // 128, j // 128]

computed in fp32 and rounded to bf16, as DeepSeek-V3's `inference/fp8_cast_bf16.py` (`weight_dequant`)
writes its bf16 checkpoint. `HFReader.get` dequantizes every FP8 tensor it reads this way (and
marks its scale used), so the import holds those bf16 values; it says so once on stderr.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Tuple

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_block_size(config: dict) -> Optional[Tuple[int, int]]:
    """The (rows, columns) of one scale's block when config.json declares fine-grained FP8, else None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size") or (128, 128)
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size={block} is not a [rows, columns] block")
    return int(block[0]), int(block[1])


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int],
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 `weight [out, in]` x its per-block `scale_inv [ceil(out / rows), ceil(in / cols)]`, in fp32,
    then `dtype` (module docstring)."""
    rows, cols = weight.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"an FP8 weight {tuple(weight.shape)} in {block[0]} x {block[1]} blocks needs a scale_inv "
                         f"of shape {expected}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_read(reader, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (read as `name` by `reader`, an HFReader) dequantized when it is FP8 (module docstring)."""
    if tensor.dtype not in FP8_DTYPES:
        return tensor
    block = fp8_block_size(reader.config)
    if block is None or tensor.dim() != 2:
        raise ValueError(f"{reader.path}: {name} is {tensor.dtype} but config.json declares no fine-grained FP8 "
                         "quantization_config (quant_method fp8 with weight_block_size) for a 2-D weight")
    weight = dequantize_fp8(tensor, reader.get(name + "_scale_inv"), block)
    if not getattr(reader, "fp8_said", False):
        print(f"{reader.path}: FP8 weights ({tensor.dtype}, {block[0]} x {block[1]} block scales) dequantized to bf16 "
              "as DeepSeek-V3's fp8_cast_bf16.py does", file=sys.stderr)
        reader.fp8_said = True
    return weight
