"""Read an input's quantization_config (fp8 or compressed-tensors) into one neutral description."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .config import find_quantization_config
from .errors import CheckpointError

FLOAT_QUANTIZED_FORMATS = ("float-quantized", "naive-quantized")


@dataclass
class QuantSettings:
    method: str | None  # "fp8", "compressed-tensors" or None
    where: str  # "config.json" or "config.json:text_config"
    block: tuple[int, int] | None = None
    activation_scheme: str | None = None  # "dynamic" | "static"
    scale_fmt: str | None = None  # "ue8m0" when the config claims it
    not_converted: list[str] = field(default_factory=list)  # modules_to_not_convert / ignored_layers / ignore
    problems: list[CheckpointError] = field(default_factory=list)


def parse_block_size(value: Any, where: str) -> tuple[int, int]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise CheckpointError(
        f"weight_block_size {value!r} is not two positive integers",
        shard=where,
        fix="fix config.json or assert the block size with --block-size 128,128",
    )


def read_quant_settings(config: dict[str, Any] | None) -> QuantSettings:
    qconfig, where = find_quantization_config(config)
    if qconfig is None:
        return QuantSettings(method=None, where=where)
    method = qconfig.get("quant_method")
    settings = QuantSettings(method=str(method) if method is not None else None, where=where)
    if method == "fp8":
        _read_fp8(qconfig, settings)
    elif method == "compressed-tensors":
        _read_compressed_tensors(qconfig, settings)
    else:
        settings.problems.append(
            CheckpointError(
                f"quantization_config.quant_method {method!r} is not supported",
                shard=where,
                fix="fp8conv reads FP8 checkpoints: quant_method 'fp8' or compressed-tensors float-quantized",
            )
        )
    return settings


def _read_fp8(q: dict[str, Any], s: QuantSettings) -> None:
    if q.get("weight_block_size") is not None:
        try:
            s.block = parse_block_size(q["weight_block_size"], s.where)
        except CheckpointError as exc:
            s.problems.append(exc)
    if q.get("fmt", "e4m3") != "e4m3":
        s.problems.append(
            CheckpointError(f"fmt {q.get('fmt')!r} is not e4m3", shard=s.where, fix="fp8conv reads e4m3 FP8 only")
        )
    s.activation_scheme = q.get("activation_scheme")
    s.scale_fmt = q.get("scale_fmt")
    for key in ("modules_to_not_convert", "ignored_layers"):
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]


def _read_compressed_tensors(q: dict[str, Any], s: QuantSettings) -> None:
    top_format = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        s.problems.append(
            CheckpointError("compressed-tensors config has no config_groups", shard=s.where, fix="fix config.json")
        )
        return
    blocks = set()
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or top_format
        if not isinstance(weights, dict):
            continue
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or fmt not in FLOAT_QUANTIZED_FORMATS:
            s.problems.append(
                CheckpointError(
                    f"compressed-tensors group {gname!r} is {fmt} {weights.get('type')}"
                    f"{weights.get('num_bits')} weights, not FP8",
                    shard=s.where,
                    fix="fp8conv converts FP8 (float-quantized, 8-bit float) checkpoints only",
                )
            )
            continue
        if weights.get("strategy") == "block":
            try:
                blocks.add(parse_block_size(weights.get("block_structure"), s.where))
            except CheckpointError as exc:
                s.problems.append(exc)
        acts = group.get("input_activations")
        if isinstance(acts, dict):
            s.activation_scheme = "dynamic" if acts.get("dynamic") else "static"
    if len(blocks) > 1:
        s.problems.append(
            CheckpointError(
                f"config groups use different block structures {sorted(blocks)}",
                shard=s.where,
                fix="fp8conv needs one block size per checkpoint",
            )
        )
    elif blocks:
        s.block = blocks.pop()
    if isinstance(q.get("ignore"), list):
        s.not_converted += [str(m) for m in q["ignore"]]


def module_matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors / vLLM style: 're:<regex>', an exact module name, or a trailing name part."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
            return True
    return False
