"""NVIDIA ModelOpt (`quant_method: "modelopt"`, config.json or hf_quant_config.json): NVFP4, FP8 per tensor
and per channel, MXFP8, and MIXED_PRECISION of those, per layer."""

from __future__ import annotations

from typing import Any

from ..quant_settings import (
    MODELOPT_FP8_ALGOS,
    MODELOPT_MIXED_ALGO,
    MODELOPT_MXFP8_ALGO,
    MODELOPT_NVFP4_ALGOS,
    MXFP8_GROUP,
    NVFP4_GROUP,
    QuantSettings,
)


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    """ModelOpt, in either form vLLM reads: hf_quant_config.json's {"quantization": {quant_algo, group_size,
    exclude_modules}} (also found nested in config.json), or config.json's flat {quant_algo, group_size,
    ignore}. quant_algo is compared upper-cased; W4A16_NVFP4 has NVFP4's weights (bf16 activations);
    FP8 is per-tensor, FP8_PER_CHANNEL_PER_TOKEN channel; MIXED_PRECISION names an algo per layer."""
    nested = q.get("quantization")
    section = nested if isinstance(nested, dict) else q
    raw, group = section.get("quant_algo"), section.get("group_size")
    if str(raw).upper() == MODELOPT_MIXED_ALGO:
        _read_modelopt_mixed(section, s)
    elif not _modelopt_algo(raw, group, s, where="quant_algo"):
        return
    for key in ("exclude_modules", "ignore"):
        if isinstance(section.get(key), list):
            s.not_converted += [str(m) for m in section[key]]


def _modelopt_algo(raw: Any, group: Any, s: QuantSettings, where: str) -> bool:
    """Record what one ModelOpt algo (compared upper-cased) declares; False (and a refusal) for one fp8conv
    does not read."""
    algo = str(raw).upper()
    if algo in MODELOPT_NVFP4_ALGOS and group in (None, NVFP4_GROUP):
        s.packed["nvfp4-modelopt"] = NVFP4_GROUP
    elif algo in MODELOPT_FP8_ALGOS:
        s.activation_scheme = "static" if algo == "FP8" else "dynamic"  # FP8 ships a static input_scale
    elif algo == MODELOPT_MXFP8_ALGO:
        s.mxfp8_group = MXFP8_GROUP
        s.activation_scheme = s.activation_scheme or "dynamic"
    else:
        s.refuse(
            f"ModelOpt {where} {raw!r} with group_size {group!r} is not supported",
            fix=f"fp8conv reads ModelOpt {', '.join(MODELOPT_FP8_ALGOS + MODELOPT_NVFP4_ALGOS)} (group_size 16), "
            f"{MODELOPT_MXFP8_ALGO} and {MODELOPT_MIXED_ALGO} of those",
        )
        return False
    return True


def _read_modelopt_mixed(section: dict[str, Any], s: QuantSettings) -> None:
    """MIXED_PRECISION: `quantized_layers` maps each module to its own {quant_algo, group_size} (vLLM's
    ModelOptMixedPrecisionConfig); each algo is declared as if it were the checkpoint's only one, and the
    tensors of each layer then say which it is (dtypes and companions, as for any checkpoint)."""
    layers = section.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        s.refuse(
            "ModelOpt quant_algo MIXED_PRECISION has no quantized_layers mapping",
            fix="fix the quantization config: MIXED_PRECISION lists each quantized module's quant_algo",
        )
        return
    algos: dict[str, tuple[str, Any, Any]] = {}
    for module, info in layers.items():
        entry = info if isinstance(info, dict) else {}
        raw = entry.get("quant_algo")
        algos.setdefault(str(raw).upper(), (module, raw, entry.get("group_size")))
    for module, raw, group in algos.values():
        _modelopt_algo(raw, group, s, where=f"quantized_layers[{module!r}].quant_algo")
    if "FP8" in algos:
        s.activation_scheme = "static"
