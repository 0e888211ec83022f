"""compressed-tensors (`quant_method: "compressed-tensors"`): config_groups of FP8 (float-quantized,
naive-quantized), MXFP8 (mxfp8-quantized) and packed 4-bit weights (pack-quantized INT4,
nvfp4-pack-quantized, mxfp4-pack-quantized); `ignore`."""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError
from ..quant_settings import (
    FLOAT_QUANTIZED_FORMATS,
    MXFP4_GROUP,
    MXFP8_GROUP,
    NVFP4_GROUP,
    QuantSettings,
    parse_block_size,
)


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    top_format = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        s.refuse("compressed-tensors config has no config_groups", fix="fix config.json")
        return
    blocks = set()
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or top_format
        if not isinstance(weights, dict):
            continue
        packed = _packed_group(fmt, weights, gname, s)
        if packed is not None:
            s.packed[packed[0]] = packed[1]
            continue
        if fmt == "mxfp8-quantized":
            _mxfp8_group(weights, gname, s)
            continue
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or fmt not in FLOAT_QUANTIZED_FORMATS:
            s.refuse(
                f"compressed-tensors group {gname!r} is {fmt} {weights.get('type')}"
                f"{weights.get('num_bits')} weights, not FP8",
                fix="fp8conv converts FP8 (float-quantized, 8-bit float) checkpoints only",
            )
            continue
        if weights.get("strategy") == "block":
            try:
                blocks.add(parse_block_size(weights.get("block_structure"), s.key))
            except CheckpointError as exc:
                s.problems.append(exc)
        acts = group.get("input_activations")
        if isinstance(acts, dict):
            s.activation_scheme = "dynamic" if acts.get("dynamic") else "static"
    if len(blocks) > 1:
        s.refuse(
            f"config groups use different block structures {sorted(blocks)}",
            fix="fp8conv needs one block size per checkpoint",
        )
    elif blocks:
        s.block = blocks.pop()
    if isinstance(q.get("ignore"), list):
        s.not_converted += [str(m) for m in q["ignore"]]


def _mxfp8_group(w: dict[str, Any], gname: str, s: QuantSettings) -> None:
    """compressed-tensors mxfp8-quantized (MXFP8QuantizationCompressor): 8-bit float weights, strategy
    group, group_size 32, uint8 E8M0 weight_scale."""
    fp8_groups = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "group"
    if fp8_groups and w.get("group_size") == MXFP8_GROUP:
        s.mxfp8_group = MXFP8_GROUP
        s.activation_scheme = "dynamic"
        return
    s.refuse(
        f"compressed-tensors group {gname!r} is mxfp8-quantized {w.get('type')}{w.get('num_bits')} with "
        f"strategy {w.get('strategy')!r}, group_size {w.get('group_size')!r}",
        fix="fp8conv reads mxfp8-quantized as 8-bit float weights, strategy group, group_size 32",
    )


def _packed_group(fmt: Any, w: dict[str, Any], gname: str, s: QuantSettings) -> tuple[str, int] | None:
    """A compressed-tensors group of packed 4-bit weights: (format, group size), or None if not packed."""
    if fmt == "pack-quantized" and w.get("num_bits") == 4 and w.get("type") == "int":
        kind, ok = "int4-pack-quantized", w.get("strategy") == "group" and w.get("symmetric") is True
    elif fmt == "nvfp4-pack-quantized":
        kind = "nvfp4"
        ok = w.get("num_bits") == 4 and w.get("type") == "float" and w.get("strategy") == "tensor_group"
    elif fmt == "mxfp4-pack-quantized":  # compressed-tensors' MXFP4PackedCompressor: no global scale
        kind = "mxfp4-pack-quantized"
        ok = w.get("num_bits") == 4 and w.get("type") == "float" and w.get("strategy") == "group"
        ok = ok and w.get("symmetric", True) is True
    else:
        return None
    group = w.get("group_size")
    if not ok or not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 2:
        s.refuse(
            f"compressed-tensors group {gname!r} is {fmt} with strategy {w.get('strategy')!r}, "
            f"symmetric {w.get('symmetric')!r}, group_size {group!r}",
            fix="fp8conv reads symmetric group-wise INT4 and NVFP4 (tensor_group) packed weights only",
        )
        return None
    if kind == "nvfp4" and group != NVFP4_GROUP:
        s.refuse(f"NVFP4 group {gname!r} has group_size {group}, not 16", fix="fix config.json")
        return None
    if kind == "mxfp4-pack-quantized" and group != MXFP4_GROUP:
        s.refuse(f"MXFP4 group {gname!r} has group_size {group}, not 32", fix="fix config.json")
        return None
    if s.packed.get(kind, group) != group:
        s.refuse(
            f"config groups use different {kind} group sizes ({s.packed[kind]} and {group})",
            fix="fp8conv needs one group size per packed format",
        )
        return None
    return kind, group
