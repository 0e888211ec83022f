"""Read an input's quantization_config (fp8 or compressed-tensors) into one neutral description."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .config import find_quantization_config
from .errors import CheckpointError

FLOAT_QUANTIZED_FORMATS = ("float-quantized", "naive-quantized")
# How configs spell the one FP8 type fp8conv reads: DeepSeek "e4m3", MiniMax-M2 torch's "float8_e4m3fn",
# safetensors' "F8_E4M3", Mistral's "fp8_e4m3". Compared lowercased.
E4M3_SPELLINGS = frozenset({"e4m3", "e4m3fn", "float8_e4m3fn", "float8_e4m3", "f8_e4m3", "fp8_e4m3", "fp8_e4m3fn"})
# Methods that are plain FP8 under another name: Meta's Llama-3.1 FP8 release (channel weight_scale [N, 1]).
FP8_ALIASES = ("fbgemm_fp8",)
# Packed 4-bit methods named in the refusal, so the user knows it is not an FP8 dialect fp8conv misses.
FOUR_BIT_METHODS = {"mxfp4": "MXFP4 (gpt-oss)", "nvfp4": "NVFP4", "modelopt_fp4": "NVFP4 (ModelOpt)"}


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
    if method == "fp8" or method in FP8_ALIASES:
        _read_fp8(qconfig, settings)
    elif method == "compressed-tensors":
        _read_compressed_tensors(qconfig, settings)
    elif isinstance(method, str) and method.lower() in FOUR_BIT_METHODS:
        settings.problems.append(
            CheckpointError(
                f"quantization_config.quant_method {method!r} is {FOUR_BIT_METHODS[method.lower()]} packed 4-bit "
                "weights, not FP8",
                shard=where,
                fix="fp8conv converts FP8 checkpoints only; packed 4-bit input is not supported",
            )
        )
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
    fmt_problem = _fmt_problem(q.get("fmt", "e4m3"))
    if fmt_problem:
        s.problems.append(
            CheckpointError(fmt_problem, shard=s.where, fix="fp8conv reads e4m3 (float8_e4m3fn) FP8 only")
        )
    # fbgemm_fp8 quantizes activations per token at run time (bounded by activation_scale_ub): dynamic
    s.activation_scheme = q.get("activation_scheme", "dynamic" if s.method in FP8_ALIASES else None)
    s.scale_fmt = q.get("scale_fmt")
    for key in ("modules_to_not_convert", "ignored_layers"):
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]


def _fmt_problem(fmt: Any) -> str | None:
    """None when `fmt` names e4m3fn; otherwise what it names instead (e5m2 and fnuz are other types)."""
    spelled = str(fmt).lower()
    if spelled in E4M3_SPELLINGS:
        return None
    if "e5m2" in spelled:
        return f"fmt {fmt!r} is e5m2 FP8, not e4m3"
    if "fnuz" in spelled:
        return f"fmt {fmt!r} is AMD's e4m3fnuz (exponent bias 8), not e4m3fn"
    return f"fmt {fmt!r} is not a known spelling of e4m3 FP8"


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
