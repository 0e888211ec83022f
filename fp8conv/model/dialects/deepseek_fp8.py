"""The DeepSeek / transformers `quant_method: "fp8"` dialect (and Meta's `fbgemm_fp8`): one block size for the
checkpoint (weight_block_size), modules_to_not_convert / ignored_layers, DeepSeek-V4's expert_dtype and
the MXFP4 experts some releases declare inside it (store_dtype, routed_experts_quant_method)."""

from __future__ import annotations

from typing import Any

from ...errors import CheckpointError
from ..quant_settings import FP8_ALIASES, MXFP4_GROUP, QuantSettings, fmt_problem, parse_block_size


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    _read_fp8(q, s)
    _read_expert_dtype(config, q, s)


def _read_fp8(q: dict[str, Any], s: QuantSettings) -> None:
    if q.get("weight_block_size") is not None:
        try:
            s.block = parse_block_size(q["weight_block_size"], s.key)
        except CheckpointError as exc:
            s.problems.append(exc)
    problem = fmt_problem(q.get("fmt", "e4m3"))
    if problem:
        s.refuse(problem, fix="fp8conv reads e4m3 (float8_e4m3fn) FP8 only")
    # fbgemm_fp8 quantizes activations per token at run time (bounded by activation_scale_ub): dynamic
    s.activation_scheme = q.get("activation_scheme", "dynamic" if s.method in FP8_ALIASES else None)
    s.scale_fmt = q.get("scale_fmt")
    for key in ("modules_to_not_convert", "ignored_layers"):
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]
    _read_mxfp4_store_dtype(q, s)


def _read_mxfp4_store_dtype(q: dict[str, Any], s: QuantSettings) -> None:
    """MXFP4 routed experts inside an fp8 config: MiMo-V2.5-Pro-FP4 `store_dtype: mxfp4`, Ling
    `routed_experts_quant_method: mxfp4` (vLLM's Fp8Config.store_dtype, which loads those experts with its
    MXFP4 MoE method: uint8 [N, K/2] codes, uint8 E8M0 scales [N, K/32], named weight_scale or, Ling,
    weight_scale_inv). The packed tensors are then read as MXFP4, never as FP8."""
    declared = {k: q[k] for k in ("store_dtype", "routed_experts_quant_method") if q.get(k) is not None}
    if not declared:
        return
    kinds = {str(v).lower() for v in declared.values()}
    if kinds != {"mxfp4"}:
        s.refuse(
            f"quantization_config declares {declared}; fp8conv reads MXFP4 routed experts only",
            fix="fp8conv reads store_dtype / routed_experts_quant_method 'mxfp4' inside an fp8 config",
        )
        return
    group = q.get("routed_experts_group_size", q.get("mxfp4_block_size", MXFP4_GROUP))
    if group != MXFP4_GROUP:
        s.refuse(f"MXFP4 experts in groups of {group!r}, not 32", fix="MXFP4 has one E8M0 scale per 32 values")
        return
    s.packed["mxfp4"] = MXFP4_GROUP


def _read_expert_dtype(config: dict[str, Any], q: dict[str, Any], s: QuantSettings) -> None:
    """DeepSeek-V4: expert_dtype at the top level (V4) or, reportedly, inside quantization_config."""
    sections = [q, config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    value = next((sec["expert_dtype"] for sec in sections if sec.get("expert_dtype") is not None), None)
    if value is None:
        return
    s.expert_dtype = str(value)
    if value == "fp4":
        s.packed["mxfp4"] = MXFP4_GROUP
    elif value != "fp8":
        s.refuse(
            f"expert_dtype {value!r} is neither 'fp4' nor 'fp8'",
            fix="fp8conv reads DeepSeek-V4 experts in MXFP4 (fp4) or block FP8 (fp8)",
        )
