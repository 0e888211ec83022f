"""What engines read in the layouts they treat specially, checked on an output from its own config.json and
tensors, the way the engines' loaders read them, independently of the plan that wrote the output: verify's
other checks compare the output with that plan, so a plan that chose a layout an engine reads differently
would pass them.

- MiMo-V2.5 fused qkv_proj (config `attention_projection_layout: "fused_qkv"`), as vLLM's
  `_shard_fp8_qkv_proj` (after vllm#57508) and sglang's `_resolve_deferred_qkv_scale_inv` read it: a
  block-FP8 qkv_proj is config num_key_value_heads chunks, each decoded on its own ceil(rows / bn) scale
  rows, and must give the input's values in the input's stored order; a float one is read as plain
  [Q; K; V] (vLLM QKVParallelLinear): chunk c holds the layer's heads / ckpt_tp query heads and
  max(1, kv / ckpt_tp) key and value heads; sliding-window layers (hybrid_layer_pattern 1) and MTP
  layers take the swa_ geometry.
- Inkling's fused experts (`w13_weight`, gate and up rows interleaved): no engine reads them as block FP8
  (vllm#48876: every block would hold gate and up rows).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch

from ..backends.scales import scale_to_float32

FP8_MAX = 448.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.qkv_proj\.weight$")
Truth = Callable[[str], torch.Tensor | None]  # an output tensor's name -> the input's exact decode (stored order)
Read = Callable[[str], torch.Tensor]


def engine_layout_problems(
    config: dict[str, Any] | None, tensors: dict[str, tuple[str, tuple[int, ...]]], read: Read, truth: Truth
) -> list[str]:
    """`tensors`: every output tensor's (dtype, shape); `read` an output tensor; `truth` the input's decode."""
    if not isinstance(config, dict):
        return []
    problems: list[str] = []
    mimo = _mimo_section(config)
    if mimo is not None:
        for name, (dtype, shape) in tensors.items():
            if name.endswith(".self_attn.qkv_proj.weight"):
                problems += _mimo_qkv(mimo, config, name, dtype, shape, tensors, read, truth)
    if _is_inkling(config):
        problems += [
            f"{name}: Inkling's fused experts interleave gate and up rows, so every block holds both; no engine "
            "reads them as block FP8 (vllm#48876)"
            for name, (dtype, _) in tensors.items()
            if dtype == "F8_E4M3" and re.search(r"w13_weight$", name) and name + "_scale_inv" in tensors
        ]
    return problems


def _sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in (config.get("text_config"), config) if isinstance(s, dict)]


def _mimo_section(config: dict[str, Any]) -> dict[str, Any] | None:
    for section in _sections(config):
        if str(section.get("model_type", "")).startswith("mimo_v2") and (
            section.get("attention_projection_layout") == "fused_qkv"
        ):
            return section
    return None


def _is_inkling(config: dict[str, Any]) -> bool:
    return any(str(s.get("model_type", "")).startswith("inkling") for s in _sections(config))


def _mimo_parts(section: dict[str, Any], name: str) -> tuple[int, tuple[int, int, int]] | None:
    """(ckpt_tp, the q, k and v rows of one chunk) of the layer `name` is in, or None if the config lacks them."""
    m = _LAYER.search(name)
    pattern = section.get("hybrid_layer_pattern")
    swa = ".mtp." in f".{name}" or (
        m is not None and isinstance(pattern, list) and int(m.group(1)) < len(pattern) and pattern[int(m.group(1))] == 1
    )
    p = "swa_" if swa else ""
    heads = section.get(p + "num_attention_heads")
    kv = section.get(p + "num_key_value_heads")
    head_dim = section.get(p + "head_dim")
    v_head_dim = section.get(p + "v_head_dim", head_dim)
    tp = section.get("num_key_value_heads")
    values = (heads, kv, head_dim, v_head_dim, tp)
    if not all(isinstance(v, int) and v > 0 for v in values) or heads % tp:
        return None
    per_chunk = max(1, kv // tp)
    return tp, (heads // tp * head_dim, per_chunk * head_dim, per_chunk * v_head_dim)


def _mimo_qkv(
    section: dict[str, Any],
    config: dict[str, Any],
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    read: Read,
    truth: Truth,
) -> list[str]:
    layout = _mimo_parts(section, name)
    if layout is None:
        return [f"{name}: config.json has no head geometry the engines could chunk a fused qkv_proj by"]
    tp, parts = layout
    rows = sum(parts)
    if len(shape) != 2 or shape[0] != tp * rows:
        return [f"{name}: {shape[0]} rows, but the engines read {tp} chunks of {rows} ({parts} of q, k, v)"]
    want = truth(name)
    if dtype == "F8_E4M3":
        scale_name = name + "_scale_inv"
        if scale_name not in tensors:
            return [f"{name}: block FP8 without {scale_name}, which the engines read it with"]
        bn, bk = _block(config)
        per_chunk = math.ceil(rows / bn)
        scale_shape = tensors[scale_name][1]
        if scale_shape != (tp * per_chunk, math.ceil(shape[1] / bk)):
            return [
                f"{scale_name}: {list(scale_shape)}, but the engines read {tp} chunks of {per_chunk} scale rows "
                f"(each {rows}-row chunk on its own {bn}x{bk} grid): [{tp * per_chunk}, {math.ceil(shape[1] / bk)}]"
            ]
        if want is None:
            return []
        q, s = read(name).to(torch.float32), scale_to_float32(read(scale_name))
        full = torch.cat(
            [
                s[c * per_chunk : (c + 1) * per_chunk]
                .repeat_interleave(bn, 0)[:rows]
                .repeat_interleave(bk, 1)[:, : shape[1]]
                for c in range(tp)
            ]
        )
        got = q * full
        excess = (want.abs() - FP8_MAX * full).clamp(min=0)
        if not bool(((got - want).abs() <= want.abs() * 2**-4 + full * 2**-9 + excess).all()):
            return [f"{name}: read chunk by chunk as the engines read it, its values are not the input's"]
        return []
    if want is None:
        return []
    order = [c * rows + sum(parts[:p]) + r for p in range(3) for c in range(tp) for r in range(parts[p])]
    expected = want[torch.tensor(order, dtype=torch.long)]
    got = read(name)
    if got.dtype.is_floating_point and not torch.equal(got, expected.to(got.dtype)):
        return [f"{name}: engines read a float qkv_proj as plain [Q; K; V]; its rows are not the input's in that order"]
    return []


def _block(config: dict[str, Any]) -> tuple[int, int]:
    for section in _sections(config):
        quant = section.get("quantization_config")
        if isinstance(quant, dict) and isinstance(quant.get("weight_block_size"), list):
            bn, bk = quant["weight_block_size"]
            return int(bn), int(bk)
    return (128, 128)
