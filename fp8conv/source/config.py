"""config.json: read it (refusing anything that is not a JSON object) and rewrite it per target."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
# Mistral releases ship params.json (vLLM --config-format mistral) beside config.json.
MISTRAL_PARAMS_NAME = "params.json"
# Multimodal checkpoints (Kimi-VL, Qwen3-VL, ...) keep the language model's settings under text_config.
NESTED_CONFIG_KEYS = ("text_config",)
# ModelOpt (before 0.31) writes its quantization here instead of config.json; vLLM, SGLang and TensorRT-LLM
# read it when config.json has no quantization_config. Never copied to an output (see source.py).
MODELOPT_CONFIG_NAME = "hf_quant_config.json"
# Marks a quantization_config read from MODELOPT_CONFIG_NAME, so messages name that file; never written
# (every output config drops or replaces the input's quantization_config).
READ_FROM_KEY = "_fp8conv_read_from"


def load_config(path: Path) -> dict[str, Any]:
    """config.json (or params.json): a JSON object, or one refusal naming the file; opened with no link
    followed out of its checkpoint folder, size-capped and depth-guarded (index.read_input_json)."""
    from .index import read_input_json  # index.py reads shards, which config readers do not need

    return read_input_json(path, fix=f"fix or re-download {path.name}")


def present(path: Path) -> bool:
    """There is an entry by this name (a dangling link, a FIFO too: opening it then says why it cannot
    be read, rather than the file being taken as absent)."""
    return os.path.lexists(path)


def find_quantization_config(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """The quantization_config and the config.json section holding it (None: the top level; 'text_config')."""
    if not config:
        return None, None
    if isinstance(config.get("quantization_config"), dict):
        return config["quantization_config"], None
    for key in NESTED_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and isinstance(nested.get("quantization_config"), dict):
            return nested["quantization_config"], key
    return None, None


def with_modelopt_config(config: dict[str, Any] | None, root: Path) -> dict[str, Any] | None:
    """config.json as vLLM reads it: without a quantization_config of its own, hf_quant_config.json's
    ({"producer": ..., "quantization": {"quant_algo": ...}}) becomes it, as quant_method modelopt."""
    path = root / MODELOPT_CONFIG_NAME
    if config is None or find_quantization_config(config)[0] is not None or not present(path):
        return config
    sidecar = load_config(path)
    return config | {"quantization_config": {"quant_method": "modelopt", **sidecar, READ_FROM_KEY: path.name}}


def rewrite_for_dequantized(config: dict[str, Any], dtype_name: str) -> dict[str, Any]:
    """Drop every quantization_config and name the new dtype, at the top level and in nested configs."""
    out = copy.deepcopy(config)
    for section in [out, *(out[k] for k in NESTED_CONFIG_KEYS if isinstance(out.get(k), dict))]:
        section.pop("quantization_config", None)
        has_any = "torch_dtype" in section or "dtype" in section
        # transformers 5 writes `dtype`, older configs `torch_dtype`: update what is there.
        for key in ("torch_dtype", "dtype"):
            if key in section:
                section[key] = dtype_name
        if section is out and not has_any:
            section["torch_dtype"] = dtype_name
    return out


def _without_quantization(config: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(config)
    out.pop("quantization_config", None)
    for key in NESTED_CONFIG_KEYS:
        if isinstance(out.get(key), dict):
            out[key].pop("quantization_config", None)
    return out


def rewrite_for_channel(config: dict[str, Any], ignore: list[str], fp8_dtype_flavor: str | None) -> dict[str, Any]:
    """compressed-tensors FP8_DYNAMIC: channel-wise FP8 weights, dynamic per-token FP8 activations."""
    out = _without_quantization(config)
    quant = _compressed_tensors_fp8({"strategy": "channel"}, {"strategy": "token"}, {}, ignore)
    if fp8_dtype_flavor:
        # vllm-gaudi reads this and does not rescale 240-range weights a second time on Gaudi2
        quant["fp8_dtype_flavor"] = fp8_dtype_flavor
    out["quantization_config"] = quant
    return out


def rewrite_for_int8(config: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors W8A8 (its preset): symmetric INT8 weights with one float32 scale per output row,
    dynamic per-token INT8 activations, format int-quantized; what vLLM's CompressedTensorsW8A8Int8 (Linear)
    and CompressedTensorsW8A8Int8MoEMethod read."""
    out = _without_quantization(config)
    int8 = {"num_bits": 8, "type": "int"}
    out["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "symmetric": True, "dynamic": True},
                "output_activations": None,
                "format": "int-quantized",
            }
        },
        "ignore": ignore,
    }
    return out


def compressed_tensors_block(block: tuple[int, int], ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors FP8_BLOCK (llm-compressor's preset): block FP8 weights with `weight_scale`
    grids, dynamic per-group activations; what a Mistral-native params.json can say for block FP8."""
    weights, activations = {"strategy": "block"}, {"strategy": "group", "group_size": block[1]}
    return _compressed_tensors_fp8(weights, activations, {"block_structure": list(block)}, ignore)


def _compressed_tensors_fp8(
    weights: dict[str, Any], activations: dict[str, Any], weights_after: dict[str, Any], ignore: list[str]
) -> dict[str, Any]:
    """One compressed-tensors float-quantized group of FP8 Linears; the keys in llm-compressor's order
    (strategy fields before symmetric/dynamic, `weights_after` last)."""
    fp8 = {"num_bits": 8, "type": "float"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**fp8, **weights, "symmetric": True, "dynamic": False, **weights_after},
                "input_activations": {**fp8, **activations, "symmetric": True, "dynamic": True},
            }
        },
        "ignore": ignore,
    }


def rewrite_for_block(config: dict[str, Any], block: tuple[int, int], not_converted: list[str]) -> dict[str, Any]:
    """Block FP8 as DeepSeek ships it, with an explicit block size and the unquantized modules listed."""
    out = _without_quantization(config)
    quant: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",  # block-wise FP8 in vLLM / SGLang supports dynamic activations only
        "weight_block_size": list(block),
    }
    if not_converted:
        quant["modules_to_not_convert"] = not_converted  # transformers
        quant["ignored_layers"] = not_converted  # vLLM
    out["quantization_config"] = quant
    return out


def rewrite_for_mxfp8(config: dict[str, Any], not_converted: list[str], spelling: str) -> dict[str, Any]:
    """MXFP8 (e4m3 weights, a uint8 E8M0 `weight_scale` per 1x32 group, the same tensors either way) as
    config.json spells it: compressed-tensors' mxfp8-quantized (its MXFP8 preset, what vLLM's
    CompressedTensorsW8A8Mxfp8 reads: group strategy, group_size 32, symmetric, scale_dtype uint8, dynamic
    MXFP8 activations; transformers loads it through compressed-tensors), or ModelOpt's (vLLM's
    ModelOptMxFp8Config: quant_method modelopt, quant_algo MXFP8, the unquantized modules under `ignore`)."""
    out = _without_quantization(config)
    if spelling == "modelopt":
        out["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MXFP8", "ignore": not_converted}
        return out
    mx = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group"}
    group = {
        "targets": ["Linear"],
        "weights": mx | {"dynamic": False, "scale_dtype": "torch.uint8"},
        "input_activations": mx | {"dynamic": True, "scale_dtype": "torch.uint8"},
        "output_activations": None,
        "format": "mxfp8-quantized",
    }
    out["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": not_converted,
    }
    return out


def rewrite_mistral_params(
    params: dict[str, Any], output_config: dict[str, Any] | None, to: str
) -> dict[str, Any] | None:
    """params.json's `quantization` entry, rewritten like config.json's quantization_config; None when
    params.json cannot describe the output. vLLM's Mistral reader accepts `qformat_weight: fp8_e4m3`
    (per-tensor) or a compressed-tensors entry, which it passes through; it has no spelling for
    DeepSeek-style block FP8 (`weight_scale_inv` grids)."""
    out = copy.deepcopy(params)
    out.pop("quantization", None)
    if to == "bf16":
        return out
    if to == "channel" and output_config is not None and isinstance(output_config.get("quantization_config"), dict):
        out["quantization"] = copy.deepcopy(output_config["quantization_config"])
        return out
    return None


def dump_json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
