"""One reader per quantization dialect, each turning a config's quantization section into the neutral
QuantSettings (fp8conv.model.quant_settings) that the classifier, the plans and inspect read: a new dialect
is a new module here and one line in READERS. A reader is `read(qconfig, config, settings)`: it fills
`settings` and records what it refuses in `settings.problems`; it never reads a tensor (the classifier
confirms each against the tensors' dtypes and shapes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..quant_settings import FP8_ALIASES, QuantSettings
from . import compressed_tensors, deepseek_fp8, gpt_oss, modelopt, mxfp8_tag, quark

Reader = Callable[[dict[str, Any], dict[str, Any], QuantSettings], None]

# quant_method as vLLM compares it (quant_settings.normalized_method) -> its reader
READERS: dict[str, Reader] = {
    "fp8": deepseek_fp8.read,
    **{alias: deepseek_fp8.read for alias in FP8_ALIASES},
    "compressed-tensors": compressed_tensors.read,
    "mxfp4": gpt_oss.read,  # gpt-oss
    "mxfp8": mxfp8_tag.read,  # MiniMax-M3
    "modelopt": modelopt.read,
    "quark": quark.read,
}
KNOWN = "'fp8', 'compressed-tensors', 'mxfp4' (gpt-oss), 'mxfp8', 'modelopt' and 'quark'"


def reader_for(method: str | None) -> Reader | None:
    if method is None:
        return None
    if method.startswith("modelopt"):  # vLLM's test: modelopt, modelopt_fp4, modelopt_mixed ...
        return READERS["modelopt"]
    return READERS.get(method)
