"""MXFP8 inputs: an e4m3 weight with one UE8M0 exponent per 1x32 group along K.

MiniMax-M3 (`quant_method: mxfp8`, scale `weight_scale_inv`), ModelOpt `quant_algo: MXFP8` and
compressed-tensors `mxfp8-quantized` (scale `weight_scale`) store the same bytes: weight [..., N, K]
float8_e4m3fn, scale [..., N, K/32] uint8 (or float8_e8m0fnu), w = float32(q) * 2^(e - 127). That is
block FP8 with a (1, 32) block and UE8M0 scales, so it dequantizes through the block path; here it is
only recognised, and its grid checked exactly (K a whole number of groups, no partial group).
"""

from __future__ import annotations

from ..dtypes import UE8M0_SCALE_DTYPES
from ..storage.safetensors_file import TensorEntry
from .weight_format import Kind, WeightFormat


def classify_mxfp8(
    w: TensorEntry, s: TensorEntry, group: int, companions: tuple[str, ...], where: str
) -> WeightFormat | None:
    """The WeightFormat of an e4m3 weight `w` with scale `s` when `where` declares MXFP8 in groups of
    `group`: MXFP8, or refused by name; None when the scale is not UE8M0 (a float-scaled FP8 layer of a
    mixed checkpoint, classified as usual)."""
    if s.dtype not in UE8M0_SCALE_DTYPES or len(w.shape) < 2:
        return None

    def refuse(reason: str, fix: str) -> WeightFormat:
        return WeightFormat(w.name, Kind.UNSUPPORTED, s.name, companions, reason=reason, fix=fix)

    k = w.shape[-1]
    if k % group:
        return refuse(
            f"is MXFP8 ({where}) but K = {k} is not a multiple of the group size {group}",
            "MXFP8 needs whole 1x32 groups along K (vLLM refuses this shape too)",
        )
    expected = (*w.shape[:-1], k // group)
    if s.shape != expected:
        return refuse(
            f"MXFP8 scale {s.name} has shape {list(s.shape)} but {list(w.shape)} in 1x{group} groups "
            f"needs {list(expected)}",
            "the checkpoint is damaged or in a layout fp8conv does not know",
        )
    return WeightFormat(w.name, Kind.MXFP8, s.name, companions, block=(1, group))
