"""INT8 W8A8 outputs (compressed-tensors int-quantized: what `--to int8` and llm-compressor's W8A8 write),
read by the audit only: fp8conv converts FP8, so its classifier refuses int8 weights; an audit of an INT8
output reads each as q * scale in float32, the way vLLM's CompressedTensorsW8A8Int8 does, and judges it
against INT8's own rounding at the scale it stores.

Read for sure only when config.json declares it and the tensors agree: every config group symmetric 8-bit
int weights, per channel or per tensor; each such weight int8 with a float scale of one value per row (or
one for the tensor), and no zero point (asymmetric INT8 stays unreadable).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ...dtypes import FLOAT_SCALE_DTYPES, INT8_MAX, torch_dtype
from ...model.classify import Kind, WeightFormat
from ...source.index import CheckpointIndex
from ...storage.safetensors_file import TensorEntry
from .values import Band, Files, Values

STORED = "int8 rows"  # Values.stored of an INT8 weight


def declares_int8_rows(config: dict[str, Any] | None) -> bool:
    """config.json's quantization_config is compressed-tensors with symmetric 8-bit int weights per channel
    or per tensor in every group (int-quantized)."""
    quant = (config or {}).get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "compressed-tensors":
        return False
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False
    for group in groups.values():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or quant.get("format")
        if not isinstance(weights, dict) or fmt != "int-quantized":
            return False
        if (weights.get("type"), weights.get("num_bits"), weights.get("symmetric")) != ("int", 8, True):
            return False
        if weights.get("strategy") not in ("channel", "tensor"):
            return False
    return True


def classified_as_float(config: dict[str, Any]) -> dict[str, Any]:
    """The config the INT8 output's tensors are classified by: without its quantization_config, which the
    classifier refuses (it converts FP8); the int8 weights are then read here, the rest as plain tensors."""
    out = copy.deepcopy(config)
    out.pop("quantization_config", None)
    return out


def with_int8_weights(
    found: dict[str, Values], index: CheckpointIndex, weights: dict[str, WeightFormat], files: Files
) -> dict[str, Values]:
    """`found` (logical_values of the output) with each int8 weight read as INT8 rows, not unreadable."""
    for fmt in weights.values():
        values = int8_weight_values(fmt, index, files)
        if values is not None:
            found[values.name] = values
    return found


def int8_claim(found: dict[str, Values]) -> str:
    """What an output declaring INT8 is, by its tensors: INT8 rows, or none (float weights under the claim)."""
    return "int8" if any(v.int8 for v in found.values()) else "int8 declared, no int8 weight"


def int8_weight_values(fmt: WeightFormat, index: CheckpointIndex, files: Files) -> Values | None:
    """An int8 weight [..., N, K] with a float scale of N values (or one), as q * scale in float32; None when
    the tensors are not that layout (a zero point, another scale shape): then it stays unreadable."""
    entry = index.entry(fmt.weight)
    if fmt.kind is not Kind.UNSUPPORTED or entry.dtype != "I8" or len(entry.shape) != 2 or fmt.scale is None:
        return None
    base = fmt.weight.removesuffix(".weight")
    if base + ".weight_zero_point" in index.locations:
        return None
    scale_entry = index.entry(fmt.scale)
    if scale_entry.dtype not in FLOAT_SCALE_DTYPES or scale_entry.numel not in (1, entry.shape[0]):
        return None
    return _int8_values(fmt, entry, scale_entry, files)


def _int8_values(fmt: WeightFormat, entry: TensorEntry, scale_entry: TensorEntry, files: Files) -> Values:
    n, k = entry.shape
    assert fmt.scale is not None
    scales: list[torch.Tensor] = []

    def row_scales(r0: int, r1: int) -> torch.Tensor:
        if not scales:  # N values at most: read once
            stored = files.whole(fmt.scale).to(torch.float32).reshape(-1)
            scales.append(stored.expand(n) if stored.numel() == 1 else stored)
        return scales[0][r0:r1, None]

    def read(m: int, r0: int, r1: int) -> Band:
        rows = r1 - r0
        codes = files.rows(fmt.weight, r0, rows, k, slot="codes")
        s = row_scales(r0, r1)
        values = torch.mul(codes, s, out=files.buffer("values", (rows, k), torch.float32))  # one float32 product
        return Band(values, codes, lambda: s.expand(rows, k))

    scale_dtype = str(torch_dtype(scale_entry.dtype)).removeprefix("torch.")
    return Values(fmt.weight, (n, k), f"{STORED}, {scale_dtype} scales", 1, read, True, fmt=fmt, int8=True)


def expected_codes(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """INT8's rounding of exact values t at the stored scales: the nearest integer, ties to even, clamped."""
    return torch.round(t / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
