"""Read an input's quantization config into one neutral description (QuantSettings), by the reader of its
dialect (fp8conv.model.dialects)."""

from __future__ import annotations

from typing import Any

from ..source.config import CONFIG_NAME, READ_FROM_KEY, find_quantization_config
from .dialects import KNOWN, reader_for
from .ignore_list import REGEX_PREFIX, IgnoreList
from .quant_settings import IGNORE_LIST_KEYS, QuantSettings, normalized_method

__all__ = ["QuantSettings", "module_matches", "normalized_method", "read_quant_settings"]


def read_quant_settings(config: dict[str, Any] | None) -> QuantSettings:
    qconfig, key = find_quantization_config(config)
    if qconfig is None:
        return QuantSettings(method=None, key=key)
    raw = qconfig.get("quant_method")
    method = normalized_method(raw)
    source_file = str(qconfig.get(READ_FROM_KEY, CONFIG_NAME))
    settings = QuantSettings(method=method, key=key, file=source_file)
    reader = reader_for(method)
    if reader is not None:
        reader(qconfig, config or {}, settings)
    elif method == "nvfp4":
        settings.refuse(
            f"quantization_config.quant_method {raw!r} names no NVFP4 checkpoint layout fp8conv knows",
            fix="fp8conv reads NVFP4 from compressed-tensors (nvfp4-pack-quantized) and ModelOpt "
            "(quant_method 'modelopt', quant_algo 'NVFP4') checkpoints",
        )
    else:
        settings.refuse(
            f"quantization_config.quant_method {raw!r} is not supported", fix=f"fp8conv reads quant_method {KNOWN}"
        )
    _refuse_unsafe_patterns(qconfig, settings)
    return settings


def _refuse_unsafe_patterns(qconfig: dict[str, Any], s: QuantSettings) -> None:
    """A `re:` entry that is no regex, or that could backtrack without bound, is refused by name, in one
    line, before anything is matched against it (ignore_list.unsafe_regex)."""
    for entry, reason in s.ignore_list().refused.items():
        sections = [qconfig] + [qconfig[k] for k in ("quantization",) if isinstance(qconfig.get(k), dict)]
        key = next(
            (k for sec in sections for k in IGNORE_LIST_KEYS if isinstance(sec.get(k), list) and entry in sec[k]),
            "ignore",
        )
        s.refuse(
            f"quantization_config.{key} entry {entry!r}: the regex after {REGEX_PREFIX!r} {reason}",
            fix="write the entry as plain module names, or as a regex without nested repeats or backreferences",
        )


def module_matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors / vLLM style: 're:<regex>', an exact module name, a parent module or a trailing
    name part; a pattern with shell wildcards (ModelOpt's exclude_modules, e.g. 'model.layers.*.mlp*') is
    matched as vLLM's ModelOpt reader matches it, fnmatch over the whole module name (or a parent module's).
    Compiles `patterns` on every call: matching many modules, use QuantSettings.lists_as_not_converted
    (ignore_list.IgnoreList), which compiles them once."""
    return IgnoreList(list(patterns)).matches(module)
