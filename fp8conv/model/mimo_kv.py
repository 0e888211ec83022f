"""MiMo-V2-Flash / V2.5 attention scales made in another unit than the weight's rows (model_type
mimo_v2_flash, mimo_v2). Read from config.json's head geometry and k_proj's (or qkv_proj's) grid,
never from the grid looking valid: v_proj's grid has a plausible row count either way.

- Per-head fused K/V (sglang-jax `WeightLoader.dequant_fused_kv`): each KV head's K rows (head_dim)
  and V rows (v_head_dim) were quantized as one unit of ceil((head_dim + v_head_dim) / bn) row blocks;
  k_proj keeps the first ceil(head_dim / bn) of each head's scale rows, v_proj the rest. A block that
  straddles K and V (192 + 128 rows: K rows 128..191 and V rows 0..63) has its scale in k_proj.
  Detected when k_proj has kv * ceil(head_dim / bn) scale rows and that differs from ceil(kv * head_dim / bn).
- Fused qkv_proj pre-split per KV head (vLLM `mimo_v2._shard_fp8_qkv_proj`): num_key_value_heads groups
  [Q_g | K_g | V_g], each quantized alone ("per-group padded": kv * ceil(rows_per_group / bn) scale
  rows), or the whole tensor on one grid ("globally packed", a plain block grid, left as it is).

A layer is sliding-window when hybrid_layer_pattern[L] == 1: swa_num_attention_heads,
swa_num_key_value_heads, swa_head_dim, swa_v_head_dim (vLLM MiMoV2FlashDecoderLayer); else the plain keys.
A transformers-5 config says it with layer_types, and its SWA layers have twice num_key_value_heads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CheckpointError
from ..source.index import CheckpointIndex
from .weight_format import Kind, RowScales, WeightFormat

MIMO_MODEL_TYPES = frozenset({"mimo_v2_flash", "mimo_v2"})
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.$")


@dataclass(frozen=True)
class Heads:
    heads: int
    kv: int
    head_dim: int
    v_head_dim: int

    @property
    def group_rows(self) -> int:  # one KV head's [Q | K | V] rows in a fused qkv_proj
        return (self.heads // self.kv) * self.head_dim + self.head_dim + self.v_head_dim


def mimo_text_config(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The section holding MiMo's attention geometry, when the model is MiMo-V2."""
    if not isinstance(config, dict):
        return None
    for section in (config.get("text_config"), config):
        if isinstance(section, dict) and section.get("model_type") in MIMO_MODEL_TYPES:
            return section
    return None


def _geometry(section: dict[str, Any], swa: bool) -> Heads | None:
    p = "swa_" if swa and "swa_num_key_value_heads" in section else ""

    def key(name: str) -> Any:  # a swa_ key the config leaves out is the layer's plain one
        return section.get(p + name, section.get(name))

    heads, kv, hd = key("num_attention_heads"), key("num_key_value_heads"), key("head_dim")
    vhd = key("v_head_dim") or hd
    if swa and not p and isinstance(kv, int):  # transformers' MiMoV2FlashAttention: SWA layers have 2x KV heads
        kv *= 2
    if not all(isinstance(x, int) and x > 0 for x in (heads, kv, hd, vhd)) or heads % kv:
        return None
    return Heads(heads, kv, hd, vhd)


def _candidates(section: dict[str, Any], prefix: str) -> list[Heads]:
    """The layer's geometry from hybrid_layer_pattern; both kinds where the layer is not in it (MTP)."""
    pattern = section.get("hybrid_layer_pattern")
    if not isinstance(pattern, list) and isinstance(section.get("layer_types"), list):  # a transformers-5 save
        pattern = [int(t == "sliding_attention") for t in section["layer_types"]]
    m = _LAYER.search(prefix)
    if m and not prefix.startswith(("mtp.", "model.mtp.")) and isinstance(pattern, list):
        layer = int(m.group(1))
        if layer < len(pattern):
            g = _geometry(section, pattern[layer] == 1)
            return [g] if g else []
    return [g for g in (_geometry(section, False), _geometry(section, True)) if g]


def mimo_row_scales(
    index: CheckpointIndex,
    config: dict[str, Any] | None,
    weights: dict[str, WeightFormat],
    block: tuple[int, int] | None,
) -> dict[str, WeightFormat]:
    """The weights whose scales are in another unit, re-read as they were made; the rest untouched.
    `block`: the confirmed block size (config.json or --block-size); nothing is re-read without one."""
    section = mimo_text_config(config)
    if section is None or block is None:
        return weights
    out = dict(weights)
    for name, fmt in weights.items():
        if name.endswith(".self_attn.k_proj.weight"):
            prefix = name[: -len("k_proj.weight")]
            out.update(_fused_kv(index, weights, prefix, _candidates(section, prefix), block))
        elif name.endswith(".self_attn.qkv_proj.weight") and fmt.kind is Kind.UNVERIFIED:
            # a plain grid ("globally packed") is already read right by the classifier
            prefix = name[: -len("qkv_proj.weight")]
            out.update(_fused_qkv(index, fmt, _candidates(section, prefix), block))
    return out


def _gridded(fmt: WeightFormat | None) -> bool:
    """Block FP8, or refused only because its grid disagrees with the block size."""
    return fmt is not None and fmt.scale is not None and fmt.kind in (Kind.BLOCK, Kind.UNVERIFIED)


def _fused_kv(
    index: CheckpointIndex,
    weights: dict[str, WeightFormat],
    prefix: str,
    candidates: list[Heads],
    block: tuple[int, int],
) -> dict[str, WeightFormat]:
    kf, vf = weights.get(prefix + "k_proj.weight"), weights.get(prefix + "v_proj.weight")
    if kf is None or vf is None or not (_gridded(kf) and _gridded(vf)):
        return {}
    assert kf.scale is not None and vf.scale is not None
    k_w, k_s = index.entry(kf.weight).shape, index.entry(kf.scale).shape
    v_w, v_s = index.entry(vf.weight).shape, index.entry(vf.scale).shape
    bn, bk = block
    grid_k = math.ceil(k_w[-1] / bk)
    for g in candidates:
        kb = math.ceil(g.head_dim / bn)
        vb = math.ceil((g.head_dim + g.v_head_dim) / bn) - kb
        shapes_fit = k_w == (g.kv * g.head_dim, k_w[-1]) and v_w == (g.kv * g.v_head_dim, k_w[-1])
        if not shapes_fit or g.kv * kb == math.ceil(g.kv * g.head_dim / bn):
            continue  # another geometry, or one where the per-head and the uniform grids are the same
        if k_s != (g.kv * kb, grid_k) or v_s != (g.kv * vb, grid_k):
            continue
        rows = math.gcd(g.head_dim, g.v_head_dim, bn)
        layout = f"K and V quantized together per KV head ({g.kv} heads of {g.head_dim}+{g.v_head_dim} rows)"
        k_index = tuple(_k_row(i * rows, g, kb, bn) for i in range(k_w[0] // rows))
        v_index = tuple(_v_row(i * rows, g, kb, vb, bn, v_s[0]) for i in range(v_w[0] // rows))
        return {
            kf.weight: _row_scaled(kf, block, RowScales(rows, k_index, layout)),
            vf.weight: _row_scaled(vf, block, RowScales(rows, v_index, layout, peer=kf.scale)),
        }
    return {}


def _k_row(row: int, g: Heads, kb: int, bn: int) -> int:
    """k_proj row -> its scale row: its head's unit block (always one of K's kb blocks)."""
    head, local = divmod(row, g.head_dim)
    return head * kb + local // bn


def _v_row(row: int, g: Heads, kb: int, vb: int, bn: int, own_rows: int) -> int:
    """v_proj row -> its row in [v_proj's scale; k_proj's scale]: V sits after K in its head's unit; a
    block that starts in K (it straddles both) has its scale in k_proj's."""
    head, local = divmod(row, g.v_head_dim)
    unit_block = (g.head_dim + local) // bn
    if unit_block < kb:
        return own_rows + head * kb + unit_block
    return head * vb + unit_block - kb


def _fused_qkv(
    index: CheckpointIndex, fmt: WeightFormat, candidates: list[Heads], block: tuple[int, int]
) -> dict[str, WeightFormat]:
    if not _gridded(fmt):
        return {}
    assert fmt.scale is not None
    w, s = index.entry(fmt.weight).shape, index.entry(fmt.scale).shape
    bn, bk = block
    for g in candidates:
        r = g.group_rows
        per_group = math.ceil(r / bn)
        if w != (g.kv * r, w[-1]) or s != (g.kv * per_group, math.ceil(w[-1] / bk)):
            continue
        rows = math.gcd(r, bn)
        index_rows = tuple((i * rows) // r * per_group + (i * rows) % r // bn for i in range(w[0] // rows))
        layout = f"qkv_proj quantized per KV head ({g.kv} groups of {r} rows)"
        return {fmt.weight: _row_scaled(fmt, block, RowScales(rows, index_rows, layout))}
    return {}


def _row_scaled(fmt: WeightFormat, block: tuple[int, int], rows: RowScales) -> WeightFormat:
    return replace(fmt, kind=Kind.BLOCK, block=block, row_scales=rows, reason=None, fix=None)


def fused_qkv_problems(
    index: CheckpointIndex, config: dict[str, Any] | None, weights: dict[str, WeightFormat], to: str
) -> list[CheckpointError]:
    """MiMo-V2.5's fused qkv_proj, [Q_g | K_g | V_g] per KV head: vLLM de-interleaves it only when it is
    block FP8 (_try_load_fp8_qkv_proj); no loader is known to read it dequantized or as channel FP8."""
    if to == "block" or mimo_text_config(config) is None:
        return []
    return [
        CheckpointError(
            f"is MiMo's fused qkv_proj, stored per KV head ([Q | K | V] per group); vLLM reads that order only "
            f"as block FP8, and no engine is known to load it as --to {to}",
            tensor=name,
            shard=index.shard_of(name).name,
            fix="convert with --to block (vLLM's MiMo loader reads the result)",
        )
        for name, fmt in weights.items()
        if name.endswith(".self_attn.qkv_proj.weight") and fmt.kind is Kind.BLOCK
    ]
