"""config.json: read it (refusing anything that is not a JSON object) and rewrite it per target."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError

CONFIG_NAME = "config.json"
# Multimodal checkpoints (Kimi-VL, Qwen3-VL, ...) keep the language model's settings under text_config.
NESTED_CONFIG_KEYS = ("text_config",)


def load_config(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"is not valid JSON ({exc})", shard=path.name, fix="fix or re-download config.json"
        ) from exc
    if not isinstance(doc, dict):
        raise CheckpointError(
            f"holds a JSON {type(doc).__name__}, not an object",
            shard=path.name,
            fix="fix or re-download config.json",
        )
    return doc


def find_quantization_config(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str]:
    """The quantization_config and where it was found ('config.json' or 'config.json:text_config')."""
    if not config:
        return None, CONFIG_NAME
    if isinstance(config.get("quantization_config"), dict):
        return config["quantization_config"], CONFIG_NAME
    for key in NESTED_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and isinstance(nested.get("quantization_config"), dict):
            return nested["quantization_config"], f"{CONFIG_NAME}:{key}"
    return None, CONFIG_NAME


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


def dump_json(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
