"""gpt-oss (`quant_method: "mxfp4"`): MXFP4 experts as *_blocks / *_scales; modules_to_not_convert stay bf16."""

from __future__ import annotations

from typing import Any

from ..quant_settings import MXFP4_GROUP, QuantSettings


def read(q: dict[str, Any], config: dict[str, Any], s: QuantSettings) -> None:
    """gpt-oss: MXFP4 experts as *_blocks / *_scales; modules_to_not_convert stay bf16."""
    s.packed["mxfp4-gpt-oss"] = MXFP4_GROUP
    if isinstance(q.get("modules_to_not_convert"), list):
        s.not_converted += [str(m) for m in q["modules_to_not_convert"]]
