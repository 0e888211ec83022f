"""Fused gate/up parameters stored with gate and up rows interleaved ([g0, u0, g1, u1, ...]) rather than
in halves ([gate; up]): Inkling (model_type inkling_mm_model / inkling_text; config
`inference_moe_w13_interleaved`, default true). Confirmed in the loaders: vLLM InklingMoE.load_expert_weight
copies `slab[0::2]` to the gate half and `slab[1::2]` to the up half, weight and channel scale alike; its dense
MLP keeps the order with an interleaved SwiGLU; sglang `deinterleave_gate_up`; transformers' conversion
mapping de-interleaves `w13_weight` into `gate_up_proj` (Interleave) and re-interleaves it on save.

What that means for a converter: a row's own scale (channel FP8: `[E, 2I, 1]`, the RedHatAI release's
own format) or a float row follows its row wherever a loader moves it, so bf16 and channel outputs keep
the interleaved order under the release's names. A 128-row block holds 64 gate and 64 up rows whose
de-interleaved halves no single block scale describes, and no engine reads block-FP8 Inkling
(vllm#48876: "intentionally out of scope"): block targets are refused by name. MXFP8 (per-row groups) is
refused too: no engine is known to read Inkling in it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..errors import CheckpointError

INTERLEAVED_TYPES = ("inkling",)  # model_type prefixes: inkling_mm_model, inkling_text
# the interleaved [gate; up] parameters: routed experts, shared experts, the dense layers' MLP
INTERLEAVED = re.compile(r"(?:^|\.)(?:experts\.w13_weight|shared_experts\.shared_w13_weight|mlp\.w13_dn\.weight)$")
# the 3-D fused expert parameters vLLM reads as compressed-tensors channel FP8 with `<param>_scale` [E, out, 1]
CHANNEL_FUSED = re.compile(r"(?:^|\.)(?:experts\.w(?:13|2)_weight|shared_experts\.shared_w(?:13|2)_weight)$")


def interleaved_family(config: dict[str, Any] | None) -> bool:
    """The config is of a family whose fused gate/up rows are interleaved."""
    if not isinstance(config, dict):
        return False
    for section in (config.get("text_config"), config):
        if isinstance(section, dict) and str(section.get("model_type", "")).startswith(INTERLEAVED_TYPES):
            return section.get("inference_moe_w13_interleaved", True) is not False
    return False


def reads_fused_channel(config: dict[str, Any] | None, name: str) -> bool:
    """A 3-D fused expert parameter the family's engine loads as channel FP8 (vLLM InklingMoE)."""
    return interleaved_family(config) and CHANNEL_FUSED.search(name) is not None


def interleaved_problems(
    config: dict[str, Any] | None, names: Iterable[tuple[str, str]], target: str
) -> list[CheckpointError]:
    """`names`: (tensor, shard) of every tensor a run would write as FP8 in blocks or MXFP8 groups."""
    if not interleaved_family(config):
        return []
    return [
        CheckpointError(
            f"holds gate and up rows interleaved ([g0, u0, g1, u1, ...]), so every row block mixes both; no engine "
            f"reads Inkling as --to {target} (vLLM de-interleaves rows and their channel scales only; vllm#48876)",
            tensor=name,
            shard=shard,
            fix="convert with --to channel (the release's own format) or --to bf16",
        )
        for name, shard in names
        if INTERLEAVED.search(name)
    ]
