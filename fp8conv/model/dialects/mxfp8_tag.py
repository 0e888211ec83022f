"""MiniMax-style `quant_method: "mxfp8"` with ignored_layers (vLLM reads it as ModelOpt MXFP8): e4m3 weights,
one UE8M0 scale per 1x32 group along K."""

from __future__ import annotations

from typing import Any

from ..quant_settings import MXFP8_GROUP, QuantSettings
from . import modelopt


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    """MiniMax-M3 style `quant_method: mxfp8` + `ignored_layers`: vLLM loads it as ModelOpt MXFP8
    (ModelOptMxFp8Config.from_config); a ModelOpt-shaped section inside is read as ModelOpt."""
    if isinstance(q.get("quantization"), dict) or q.get("quant_algo"):
        modelopt.read(q, config, s)
        return
    s.mxfp8_group = MXFP8_GROUP
    s.activation_scheme = "dynamic"  # MXFP8 activations are quantized at run time
    if q.get("weight_block_size") not in (None, [1, MXFP8_GROUP]):
        s.refuse(
            f"quant_method 'mxfp8' with weight_block_size {q['weight_block_size']!r}",
            fix=f"MXFP8 has one E8M0 scale per 1x{MXFP8_GROUP} group: weight_block_size [1, 32] or none",
        )
    for key in ("ignored_layers", "modules_to_not_convert"):  # MiniMax; transformers-style saves
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]
