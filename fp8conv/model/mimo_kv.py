"""MiMo-V2-Flash / V2.5 attention scales made in another unit than the weight's rows (model_type
mimo_v2_flash, mimo_v2). Read from config.json's head geometry and k_proj's (or qkv_proj's) grid,
never from the grid looking valid: v_proj's grid has a plausible row count either way.

- Per-head fused K/V (sglang-jax `WeightLoader.dequant_fused_kv`): each KV head's K rows (head_dim)
  and V rows (v_head_dim) were quantized as one unit of ceil((head_dim + v_head_dim) / bn) row blocks;
  k_proj keeps the first ceil(head_dim / bn) of each head's scale rows, v_proj the rest. A block that
  straddles K and V (192 + 128 rows: K rows 128..191 and V rows 0..63) has its scale in k_proj.
  Detected when k_proj has kv * ceil(head_dim / bn) scale rows and that differs from ceil(kv * head_dim / bn).
- Fused qkv_proj stored pre-sharded (config `attention_projection_layout: "fused_qkv"`; vLLM
  `mimo_v2._shard_fp8_qkv_proj` after vllm#57508, sglang `get_mimo_v2_fused_qkv_expected_tp_size` and
  `_get_ckpt_qkv_shard_sizes`): ckpt_tp = config num_key_value_heads chunks in every layer, global,
  sliding-window and MTP alike, chunk c holding [Q_c; K_c; V_c]: the layer's nh / ckpt_tp query heads and
  max(1, nkv / ckpt_tp) key and value heads from c on. Each chunk is quantized alone: ckpt_tp *
  ceil(chunk_rows / bn) scale rows, which is the plain ceil(N / bn) only where a chunk is whole blocks
  (V2.6: global chunks of 3392 rows, 108 scale rows for 106 row blocks; sliding-window 3712, 116 either
  way). The engines undo the chunks only in their block-FP8 path: a float qkv_proj is read as plain
  [Q; K; V] by vLLM (QKVParallelLinear), so --to bf16 writes that order, and any FP8 qkv_proj is taken
  into the block path (`_try_load_fp8_qkv_proj`), so --to channel / mxfp8 are refused.

A layer is sliding-window when hybrid_layer_pattern[L] == 1: swa_num_attention_heads,
swa_num_key_value_heads, swa_head_dim, swa_v_head_dim (vLLM MiMoV2FlashDecoderLayer); else the plain keys.
MTP layers have the sliding-window geometry (vLLM MiMoV2MTPLayer, sglang MiMoV2MTPLayer). A
transformers-5 config says it with layer_types, and its SWA layers have twice num_key_value_heads.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CheckpointError
from ..source.index import CheckpointIndex
from .weight_format import ChunkedRows, Kind, RowScales, WeightFormat

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


def _candidates(section: dict[str, Any], prefix: str, fused: bool = False) -> list[Heads]:
    """The layer's geometry from hybrid_layer_pattern; both kinds where the layer is not in it (MTP),
    but for the fused qkv_proj, whose loaders give MTP layers the sliding-window one."""
    pattern = section.get("hybrid_layer_pattern")
    if not isinstance(pattern, list) and isinstance(section.get("layer_types"), list):  # a transformers-5 save
        pattern = [int(t == "sliding_attention") for t in section["layer_types"]]
    m = _LAYER.search(prefix)
    if prefix.startswith(("mtp.", "model.mtp.")) and fused:  # MTP layers are sliding-window ones
        return [g for g in (_geometry(section, True),) if g]
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
    """The weights whose scales are in another unit, or whose rows are stored in chunks, re-read as they
    were made; the rest untouched. `block`: the confirmed block size (config.json or --block-size);
    nothing is re-read without one."""
    section = mimo_text_config(config)
    if section is None or block is None:
        return weights
    out = dict(weights)
    chunks = fused_qkv_chunks(section)
    for name, fmt in weights.items():
        if name.endswith(".self_attn.k_proj.weight"):
            prefix = name[: -len("k_proj.weight")]
            out.update(_fused_kv(index, weights, prefix, _candidates(section, prefix), block))
        elif name.endswith(".self_attn.qkv_proj.weight") and chunks is not None:
            prefix = name[: -len("qkv_proj.weight")]
            out.update(_fused_qkv(index, fmt, _candidates(section, prefix, fused=True), chunks, block))
    return out


def fused_qkv_chunks(section: dict[str, Any]) -> int | None:
    """The chunks a fused qkv_proj is stored in: config num_key_value_heads when the config says
    `attention_projection_layout: "fused_qkv"` (sglang get_mimo_v2_fused_qkv_expected_tp_size), else None."""
    if section.get("attention_projection_layout") != "fused_qkv":
        return None
    kv = section.get("num_key_value_heads")
    return kv if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 else None


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
    index: CheckpointIndex, fmt: WeightFormat, candidates: list[Heads], chunks: int, block: tuple[int, int]
) -> dict[str, WeightFormat]:
    """qkv_proj stored in `chunks` chunks of [Q_c; K_c; V_c]: its chunk layout, and, where the chunks are
    not whole row blocks, its per-chunk scale rows (a plain grid, "globally packed", is read as it is)."""
    if not _gridded(fmt):
        return {}
    assert fmt.scale is not None
    w, s = index.entry(fmt.weight).shape, index.entry(fmt.scale).shape
    bn, bk = block
    for g in candidates:
        if g.heads % chunks:
            continue
        kv = max(1, g.kv // chunks)
        parts = (("q", g.heads // chunks * g.head_dim), ("k", kv * g.head_dim), ("v", kv * g.v_head_dim))
        r = sum(rows for _, rows in parts)
        if w != (chunks * r, w[-1]):
            continue
        layout = ChunkedRows(chunks, parts, f"qkv_proj stored in {chunks} chunks of [Q; K; V] ({r} rows each)")
        per_chunk, cols = chunks * math.ceil(r / bn), math.ceil(w[-1] / bk)
        if s == (per_chunk, cols) and r % bn:
            rows = math.gcd(r, bn)
            index_rows = tuple(
                (i * rows) // r * (per_chunk // chunks) + (i * rows) % r // bn for i in range(w[0] // rows)
            )
            return {
                fmt.weight: replace(_row_scaled(fmt, block, RowScales(rows, index_rows, layout.layout)), chunked=layout)
            }
        if s == (math.ceil(w[0] / bn), cols) and fmt.kind is Kind.BLOCK:
            return {fmt.weight: replace(fmt, chunked=layout)}
    return {}


def _row_scaled(fmt: WeightFormat, block: tuple[int, int], rows: RowScales) -> WeightFormat:
    return replace(fmt, kind=Kind.BLOCK, block=block, row_scales=rows, reason=None, fix=None)


def fused_qkv_problems(
    index: CheckpointIndex, config: dict[str, Any] | None, weights: dict[str, WeightFormat], to: str
) -> list[CheckpointError]:
    """A fused qkv_proj stored in chunks as FP8 other than blocks: vLLM's MiMo loader takes every FP8
    qkv_proj into its block path (_try_load_fp8_qkv_proj waits for a weight_scale_inv), and sglang's reads
    chunks only with block scales: no engine is known to load it as channel FP8 or MXFP8."""
    if to not in ("channel", "mxfp8", "int8"):
        return []
    return [
        CheckpointError(
            f"is MiMo's fused qkv_proj, stored in {fmt.chunked.chunks} chunks of [Q; K; V]; vLLM's MiMo loader "
            f"reads an FP8 qkv_proj only as block FP8 (_try_load_fp8_qkv_proj), and no engine is known to load "
            f"it as --to {to}",
            tensor=name,
            shard=index.shard_of(name).name,
            fix="convert with --to block (chunks and their scale grids kept) or --to bf16 (plain [Q; K; V])",
        )
        for name, fmt in weights.items()
        if fmt.chunked is not None
    ]
