"""The safetensors dtype names, their element sizes and torch dtypes.

Torch-free at import: planning and inspect use the names and sizes; torch_dtype() imports torch.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# safetensors name -> bytes per element. Sub-byte packed types are not listed: fp8conv refuses them.
ELEMENT_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
}


FP8_E4M3 = "F8_E4M3"
# The FP8 ranges a conversion quantizes to, written once: e4m3fn's 448 (also Gaudi3's), and Gaudi2's 240
# (e4m3fnuz-like; the compressed-tensors config then says so, or vllm-gaudi rescales a second time).
FP8_MAX_STANDARD = 448.0
FP8_MAX_GAUDI2 = 240.0
INT8_MAX = 127.0  # symmetric INT8 (--to int8): -127..127, as compressed-tensors and vLLM quantize
FLOAT_SCALE_DTYPES = frozenset({"F32", "BF16", "F16"})
# UE8M0 scales: float8_e8m0fnu, or uint8 exponents; both mean 2^(byte - 127)
UE8M0_SCALE_DTYPES = frozenset({"F8_E8M0", "U8"})
SCALE_DTYPES = FLOAT_SCALE_DTYPES | UE8M0_SCALE_DTYPES

# Target dtypes of a dequantizing conversion: CLI name -> (safetensors name, config name).
DEQUANT_TARGETS: dict[str, tuple[str, str]] = {
    "bfloat16": ("BF16", "bfloat16"),
    "float16": ("F16", "float16"),
    "float32": ("F32", "float32"),
}


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch  # here, not at the top: reading and planning never load torch

    return {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
        "F8_E8M0": torch.float8_e8m0fnu,
    }


def torch_dtype(name: str) -> torch.dtype:
    return _torch_dtypes()[name]
