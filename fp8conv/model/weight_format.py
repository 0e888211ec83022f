"""What one weight's format is (a Kind) and the companions that travel with it (a WeightFormat).

Below the classifiers (formats.py, packed_formats.py), which both build these values.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    BLOCK = "block-fp8"
    PER_TENSOR = "per-tensor-fp8"
    CHANNEL = "channel-fp8"
    UNQUANTIZED = "unquantized"
    UNVERIFIED = "unverified"
    UNSUPPORTED = "unsupported"
    MXFP8 = "mxfp8"  # e4m3 weights with a UE8M0 (uint8 / e8m0) scale per 1x32 group along K: [..., N, K/32]
    # packed 4-bit weights (see packed_formats.py): two codes per byte, the low nibble first
    MXFP4 = "mxfp4"  # DeepSeek-V4 routed experts: int8 [N, K/2] + e8m0 `.scale` [N, K/32]
    MXFP4_GPT_OSS = "mxfp4-gpt-oss"  # gpt-oss: uint8 *_blocks [E, N, K/32, 16] + *_scales [E, N, K/32]
    NVFP4 = "nvfp4"  # compressed-tensors nvfp4-pack-quantized: e4m3 scale per 16, / global scale
    NVFP4_MODELOPT = "nvfp4-modelopt"  # ModelOpt NVFP4: e4m3 scale per 16, * weight_scale_2
    INT4 = "int4-pack-quantized"  # compressed-tensors pack-quantized: 8 codes per int32, q = nibble - 8
    MXFP4_CT = "mxfp4-pack-quantized"  # compressed-tensors: uint8 weight_packed [N, K/2] + E8M0 weight_scale

    def __str__(self) -> str:
        return self.value


CONVERTIBLE = frozenset({Kind.BLOCK, Kind.PER_TENSOR, Kind.CHANNEL, Kind.MXFP8})
PACKED = frozenset({Kind.MXFP4, Kind.MXFP4_GPT_OSS, Kind.NVFP4, Kind.NVFP4_MODELOPT, Kind.INT4, Kind.MXFP4_CT})


@dataclass(frozen=True)
class RowScales:
    """Block FP8 whose scale rows follow another unit than ceil(N / bn) (fp8conv.model.mimo_kv): each `rows`-row
    group of the weight takes row `index[i]` of its scales, stacked [own scale; peer's scale]."""

    rows: int
    index: tuple[int, ...]
    layout: str  # what the unit is, for messages and inspect
    peer: str | None = None  # a second scale tensor some rows take (MiMo's v_proj: k_proj's)


@dataclass(frozen=True)
class ChunkedRows:
    """A fused projection stored pre-sharded (fp8conv.model.mimo_kv: MiMo-V2.5's qkv_proj): `chunks` equal
    row chunks, each holding its own share of every part in order ([q_c; k_c; v_c]) and, when quantized,
    its own block grid. The plain layout engines read unquantized is each part's rows of every chunk in
    turn ([q_0; q_1; ...; k_0; ...; v_0; ...])."""

    chunks: int
    parts: tuple[tuple[str, int], ...]  # (part, rows in one chunk), in the chunk's order
    layout: str  # for messages and inspect

    @property
    def chunk_rows(self) -> int:
        return sum(rows for _, rows in self.parts)

    def plain_order(self) -> list[int]:
        """For each row of the plain layout, the stored row it comes from."""
        order: list[int] = []
        start = 0
        for _, rows in self.parts:
            for c in range(self.chunks):
                first = c * self.chunk_rows + start
                order.extend(range(first, first + rows))
            start += rows
        return order


@dataclass(frozen=True)
class WeightFormat:
    """One quantized weight and the companions that travel with it."""

    weight: str
    kind: Kind
    scale: str | None = None
    companions: tuple[str, ...] = ()  # activation scales etc., consumed with the weight
    block: tuple[int, int] | None = None  # the confirmed block size, for block-fp8
    reason: str | None = None  # why unverified / unsupported
    fix: str | None = None
    # packed 4-bit kinds only
    group: int | None = None  # elements per scale along K
    global_scale: str | None = None  # NVFP4: weight_global_scale (divides) or weight_scale_2 (multiplies)
    shape_tensor: str | None = None  # compressed-tensors INT4: weight_shape, checked before the run
    shape: tuple[int, ...] | None = None  # the unpacked [..., N, K]
    out_name: str | None = None  # the output weight's name (X.weight_packed -> X.weight, X_blocks -> X)
    row_scales: RowScales | None = None  # block FP8 with scale rows in another unit than ceil(N / bn)
    chunked: ChunkedRows | None = None  # rows stored pre-sharded in chunks, each with its own grid

    def math_block(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The block that makes every convertible kind one computation: channel and tensor are (1, K)."""
        k = shape[-1]
        if self.row_scales is not None and self.block:
            return (self.row_scales.rows, self.block[1])
        # MXFP8: (1, 32); per-tensor with a block: one scale per gate/up half
        if self.kind in (Kind.BLOCK, Kind.MXFP8, Kind.PER_TENSOR) and self.block:
            return self.block
        if self.kind in PACKED and self.group:
            return (1, self.group)
        # channel and per-tensor: one scale per row (per-tensor scales are broadcast to every row)
        return (1, max(k, 1))

    @property
    def consumed(self) -> tuple[str, ...]:
        found = (self.scale, *self.companions) if self.scale else self.companions
        if self.global_scale is None and self.shape_tensor is None and self.row_scales is None:
            return found  # 100k FP8 weights: no generator to build for the three absent
        peer = self.row_scales.peer if self.row_scales else None
        return found + tuple(n for n in (self.global_scale, self.shape_tensor, peer) if n)
