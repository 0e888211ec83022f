"""The fast CPU backend. Bit-identical to the reference, several times faster:

- float8_e4m3fn -> float32 without torch's scalar cast: the e4m3 byte, sign-extended to int16,
  shifted left 7 and with bit 14 cleared, is the float16 whose value is the e4m3 value / 256
  (subnormals included); float16 -> float32 is a vectorized cast, and the 256 is folded into the
  scale (x256 is exact, and (w/256) * (256*s) is the same real product, so the float32 rounding is
  the same). Scales of 2^120 or more (where x256 could overflow) go the reference way. The two NaN
  codes are found once per tensor with two max-reductions and patched only when present.
- Into bf16 or float16, blocks of 4096 values or more (DeepSeek's 128x128) are dequantized through
  a table instead: for each grid row, the 256 e4m3 values times each block's scale, computed as the reference computes
  them (torch's float8 -> float32, one float32 product, one cast to the output dtype). A chunk of
  rows is then one gather of those table entries (code + 256 x block column): the same bits as the
  reference by construction, NaN codes and huge scales included, at ~0.8 ns per value against ~1.1
  for the shift path on one core. Into float32 (and fused into channel FP8) the table measured no
  faster, so those keep the shift path.
- Work in row chunks that stay in cache, through scratch buffers reused across chunks and tensors:
  fresh allocations cost page faults, large temporaries cost memory bandwidth.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from .pow2 import Buffers
from .row_report import int8_row_sums_
from .scales import apply_global_scale, scale_to_float32
from .scratch import scratch
from .torch_device import TorchDeviceBackend, round_for_codes_

CHUNK_ELEMENTS = 1 << 20  # ~1M elements: measured best (per-call overhead vs cache) for dequant and requant
CLEAR_BIT_14 = -16385  # 0xBFFF as int16: the sign-extension copy of the sign bit lands on bit 14
E4M3_NAN_AS_F16 = 0x3F80  # |code| 0x7F after the shift: the e4m3 NaN
NAN_EXPONENT_BIT = 0x4000
SCALE_LIMIT = 2.0**120
TABLE_MIN_BLOCK = 4096  # values per block: below it, building a table per grid row costs more than it saves
GATHER_ELEMENTS = 1 << 17  # values per gather: measured best on DeepSeek widths (its indexes stay in cache)
INT8_PLANES = "int8 planes"  # an INT8 chunk's values and their rounding, side by side (row_report)
TABLES_KEPT = 8  # (scale byte, code byte) tables: 512 KiB each at most; NVFP4 tensors each have their own


def chunk_rows(n: int, k: int, bn: int) -> int:
    """Rows per chunk: whole blocks when a block is small, else a divisor of bn (so a chunk never
    straddles two grid rows and shares one row of scales)."""
    target = max(1, CHUNK_ELEMENTS // max(k, 1))
    if target >= bn:
        return (target // bn) * bn
    return next(d for d in range(min(target, bn), 0, -1) if bn % d == 0)


class CpuBackend(TorchDeviceBackend):
    def __init__(self) -> None:
        super().__init__("cpu", name="cpu")
        self._local = threading.local()  # scratch buffers per thread: bands may be computed side by side
        self._tables: dict[tuple[object, ...], torch.Tensor] = {}  # _scale_byte_table's, oldest first
        self._tables_lock = threading.Lock()
        # every e4m3 byte's float32 value by torch's own cast (the reference's), NaN codes included
        self._e4m3_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)

    @staticmethod
    def _row_scales(grid: torch.Tensor, r0: int, rows: int, bn: int) -> torch.Tensor:
        """[rows or 1, gk] scales for rows r0..r0+rows of one matrix."""
        if rows <= bn and r0 // bn == (r0 + rows - 1) // bn:
            return grid[r0 // bn][None]
        g0 = r0 // bn
        return grid[g0 : (r0 + rows + bn - 1) // bn].repeat_interleave(bn, dim=0)[r0 - g0 * bn :][:rows]

    def dequantize_blocks(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor
    ) -> None:
        scale = scale.to(torch.float32)
        if _use_tables(block) and out.element_size() == 2:  # float32 and channel: measured no faster
            for m in range(weight.shape[0]):
                self._table_dequantize(weight[m].view(torch.uint8), scale[m], block, 0, weight.shape[1], out[m])
            return
        if bool((scale.abs() >= SCALE_LIMIT).any()):  # x256 could overflow: not the same product any more
            super().dequantize_blocks(weight, scale, block, out)
            return
        direct = out.dtype == torch.float32 and out.is_contiguous()  # no extra copy pass
        k = weight.shape[2]

        def into(m: int, r0: int, rows: int) -> torch.Tensor:
            return out[m, r0 : r0 + rows] if direct else scratch("prod", rows * k, torch.float32).view(rows, k)

        for m, r0, prod in self._dequantized_chunks(weight, scale, block, into):
            if not direct:
                out[m, r0 : r0 + prod.shape[0]].copy_(prod)

    def _dequantized_chunks(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int],
        into: Callable[[int, int, int], torch.Tensor],
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Dequantize [M, N, K] a few rows at a time into into(m, r0, rows) ([rows, K] float32), and
        yield (m, r0, that chunk). Scales must be below SCALE_LIMIT."""
        bn, bk = block
        m_count, n, k = weight.shape
        step = chunk_rows(n, k, bn)
        scale256 = scale * 256.0
        codes = weight.view(torch.int8)
        has_nan = int(codes.max()) == 0x7F or int(codes.view(torch.uint8).max()) == 0xFF
        for m in range(m_count):
            for r0 in range(0, n, step):
                rows = min(step, n - r0)
                prod = into(m, r0, rows)
                self._dequantize_chunk(
                    codes[m, r0 : r0 + rows], self._row_scales(scale256[m], r0, rows, bn), bk, has_nan, prod
                )
                yield m, r0, prod

    def _table_dequantize(
        self, codes: torch.Tensor, grid: torch.Tensor, block: tuple[int, int], r0: int, rows: int, dst: torch.Tensor
    ) -> None:
        """dst[:rows] = rows r0.. of one [N, K] matrix of e4m3 codes (as uint8) dequantized with its float32
        scale grid [gn, gk]. A gather covers `span` rows: a piece of one grid row, or whole grid rows; its
        table holds 256 entries (dst's dtype, as int16) per block of those grid rows, and
        each code's index is code + 256 x its block's place in the table (grid row, then column)."""
        bn, bk = block
        n, k = codes.shape
        gk = grid.shape[1]
        span = gather_rows(k, bn)
        columns = self._column_offsets(k, bk, gk)
        table_rows, table = (-1, -1), torch.empty(0, dtype=torch.int16)  # grid rows [g0, g1) the table holds
        start = r0
        while start < r0 + rows:
            stop = min(start + span, r0 + rows, start + bn if span < bn else n)  # never across grid rows
            g0, g1 = start // bn, (stop + bn - 1) // bn
            if (g0, g1) != table_rows:
                # the reference's operations on the 256 codes: float8 -> float32, times the scale, one cast
                products = self._e4m3_values[None, None, :] * grid[g0:g1, :, None]
                table_rows, table = (g0, g1), products.to(dst.dtype).view(torch.int16).reshape(-1)
            index = scratch("index", (stop - start, k), torch.int32)
            index.copy_(codes[start:stop]).add_(columns)  # in place: a mixed-dtype add allocates
            for i in range(1, g1 - g0):  # a gather of whole grid rows starts on one (span >= bn)
                index[i * bn : (i + 1) * bn].add_(i * gk * 256)
            _gather_into(table, index.view(-1), dst[start - r0 : stop - r0])
            start = stop

    def _column_offsets(self, k: int, bk: int, gk: int) -> torch.Tensor:
        """[K] int32: 256 x the grid column of each weight column. Columns past the last whole block take
        the grid's last column, as the reference's remainder does."""
        key = (k, bk, gk)
        cache: dict[tuple[int, int, int], torch.Tensor] = self._local.__dict__.setdefault("columns", {})
        if key not in cache:
            column = torch.arange(k, dtype=torch.int32) // bk
            column[(k // bk) * bk :] = gk - 1
            cache[key] = column * 256
        return cache[key]

    def _dequantize_chunk(
        self, codes: torch.Tensor, scale256: torch.Tensor, bk: int, has_nan: bool, prod: torch.Tensor
    ) -> None:
        """prod[r, c] = float32(e4m3 codes[r, c]) * scale[r, c // bk] (scale256: [rows or 1, gk], x256)."""
        rows, k = codes.shape
        full_k, gk_full = (k // bk) * bk, k // bk
        bits = scratch("bits", rows * k, torch.int16).view(rows, k)
        bits.copy_(codes)  # sign-extending
        bits.bitwise_left_shift_(7).bitwise_and_(CLEAR_BIT_14)
        if has_nan:
            nan = bits.bitwise_and(0x7FFF) == E4M3_NAN_AS_F16
            torch.where(nan, bits.bitwise_or(NAN_EXPONENT_BIT), bits, out=bits)  # torch's NaN, sign kept
        prod.copy_(bits.view(torch.float16))
        if full_k:
            prod[:, :full_k].view(rows, gk_full, bk).mul_(scale256[:, :gk_full, None])
        if full_k < k:
            prod[:, full_k:].mul_(scale256[:, -1:])

    def requantize_blocks(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        in_block: tuple[int, int],
        out_block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        """Channel output fused chunk by chunk: dequantize a few rows into a cache-sized buffer, take
        their amax and divide them there. The float32 weight never goes to memory (a band-sized
        float32 copy, written and read back, ran at ~0.66 G elements/s; fused ~0.86)."""
        k = weight.shape[2]
        scale = scale.to(torch.float32)
        if out_block != (1, k) or bool((scale.abs() >= SCALE_LIMIT).any()):
            super().requantize_blocks(weight, scale, in_block, out_block, fp8_max, q_out, scale_out, row_sums)
            return

        def into(m: int, r0: int, rows: int) -> torch.Tensor:
            if row_sums is not None:  # the first of _write_codes' two planes: no copy there
                return scratch(INT8_PLANES, 2 * rows * k, torch.float32)[: rows * k].view(rows, k)
            return scratch("prod", rows * k, torch.float32).view(rows, k)

        for m, r0, prod in self._dequantized_chunks(weight, scale, in_block, into):
            rows = prod.shape[0]
            # as quantize_blocks below: max(amax, -amin), float32 division, clamp, one cast
            amax = torch.maximum(prod.amax(dim=1), prod.amin(dim=1).neg_())
            s = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
            torch.div(prod, s[:, None], out=prod).clamp_(-fp8_max, fp8_max)
            sums = None if row_sums is None else row_sums[m, r0 : r0 + rows]
            self._write_codes(prod, s, q_out[m, r0 : r0 + rows], sums)
            scale_out[m, r0 : r0 + rows, 0] = s

    def quantize_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        bn, bk = block
        m_count, n, k = weight.shape
        if k % bk or (n % bn and n > bn):  # partial blocks: the reference pads them, simply
            super().quantize_blocks(weight, block, fp8_max, q_out, scale_out, row_sums)
            return
        gk = k // bk
        step = max(bn, (max(1, CHUNK_ELEMENTS // max(k, 1)) // bn) * bn) if n >= bn else n
        for m in range(m_count):
            for r0 in range(0, n, step):
                rows = min(step, n - r0)
                g0, gn = r0 // bn, -(-rows // bn)
                bn_eff = bn if rows >= bn else rows
                w = weight[m, r0 : r0 + rows].view(gn, bn_eff, gk, bk)
                key, size = ("q32", rows * k) if row_sums is None else (INT8_PLANES, 2 * rows * k)
                tmp = scratch(key, size, torch.float32)[: rows * k].view(gn, bn_eff, gk, bk)
                # max(amax, -amin): two fast reductions, no abs pass; torch's abs-max reductions
                # (vector_norm inf, aminmax) are ~15x slower. NaN propagates as through abs.
                amax = torch.maximum(w.amax(dim=3).amax(dim=1), w.amin(dim=3).amin(dim=1).neg_())
                s = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
                torch.div(w, s[:, None, :, None], out=tmp).clamp_(-fp8_max, fp8_max)
                sums = None if row_sums is None else row_sums[m, r0 : r0 + rows]  # (channel: one row per block)
                self._write_codes(tmp.view(rows, k), s.view(-1), q_out[m, r0 : r0 + rows], sums)
                scale_out[m, g0 : g0 + gn] = s

    @staticmethod
    def _write_codes(y: torch.Tensor, scale: torch.Tensor, q_out: torch.Tensor, row_sums: torch.Tensor | None) -> None:
        """Scaled, clamped rows y [rows, K] (a scratch buffer, overwritten) into q_out's codes; with row_sums
        (INT8 rows, scale [rows]), their report's sums (row_report)."""
        if row_sums is None:
            q_out.copy_(round_for_codes_(y, q_out.dtype))
            return
        assert q_out.dtype == torch.int8 and y.shape[0] == scale.shape[0], "row sums are INT8 rows'"
        planes = scratch(INT8_PLANES, 2 * y.numel(), torch.float32).view(2, *y.shape)
        assert planes[0].data_ptr() == y.data_ptr(), "y is the first plane: the callers quantize into it"
        q_out.copy_(torch.round(planes[0], out=planes[1]))
        int8_row_sums_(planes, scale, row_sums)

    def _pow2_buffers(self) -> Buffers:
        return lambda key, shape, dtype: scratch(key, shape, dtype)

    @staticmethod
    def _decode_e4m3(q: torch.Tensor, out: torch.Tensor) -> None:
        """e4m3 codes into float32 `out` without torch's scalar cast (quantize_pow2_rows: its codes are
        clamped, never NaN): the sign-extended byte shifted into a float16 worth value / 256, times 256
        (exact), the bits torch's cast gives."""
        bits = scratch("pow2 bits", tuple(q.shape), torch.int16)
        bits.copy_(q.view(torch.int8))
        bits.bitwise_left_shift_(7).bitwise_and_(CLEAR_BIT_14)
        out.copy_(bits.view(torch.float16)).mul_(256.0)

    def decode_4bit(
        self,
        codes: torch.Tensor,
        values: torch.Tensor,
        scale: torch.Tensor,
        group: int,
        out: torch.Tensor,
        global_scale: torch.Tensor | None = None,
        divide_global: bool = False,
    ) -> None:
        """Table-driven. One-byte scales (E8M0 exponents, NVFP4's e4m3): a 65536-entry table indexed by
        (scale byte, code byte) holds both codes' values already scaled (and divided or multiplied by the
        global scale), each computed by the reference's float32 operations in its order and rounded once to
        out's dtype, so a chunk is an add (byte + 256 scale byte) and one gather. Other scales: a 256-entry
        table maps each byte to its two values at once (one int64 of two float32, or one int32 of two bf16),
        then one in-place multiply by the group scales; into bf16 directly when the scales are bf16 values:
        the products (at most 3 + 8 significant bits) are then exact in float32, and torch's bf16 multiply
        rounds that float32 product once, as the reference does."""
        if out.dtype not in (torch.float32, torch.bfloat16) or group % 2:
            super().decode_4bit(codes, values, scale, group, out, global_scale, divide_global)
            return
        if scale.dtype in (torch.uint8, torch.float8_e4m3fn):
            table = self._scale_byte_table(values, scale.dtype, out.dtype, global_scale, divide_global)
            self._decode_by_scale_byte(codes, table, scale.view(torch.uint8), group, out)
            return
        exact_in_out = out.dtype == torch.float32 or bool((scale.to(torch.bfloat16).to(torch.float32) == scale).all())
        if global_scale is not None or not exact_in_out:
            super().decode_4bit(codes, values, scale, group, out, global_scale, divide_global)
            return
        pairs = _byte_pair_table(values, out.dtype)
        scale = scale.to(out.dtype)
        for m, r0, rows, index in self._code_chunks(codes):
            dst = out[m, r0 : r0 + rows]
            _gather_into(pairs, index, dst)
            dst.view(rows, -1, group).mul_(scale[m, r0 : r0 + rows, :, None])

    def _code_chunks(self, codes: torch.Tensor) -> Iterator[tuple[int, int, int, torch.Tensor]]:
        """(m, r0, rows, index) for each cache-sized chunk of rows of codes [M, N, K/2]: the chunk's bytes
        as int32 gather indexes, in a buffer reused from chunk to chunk."""
        m_count, n, half = codes.shape
        step = max(1, CHUNK_ELEMENTS // max(2 * half, 1))
        for m in range(m_count):
            for r0 in range(0, n, step):
                rows = min(step, n - r0)
                index = scratch("codes", rows * half, torch.int32)
                index.copy_(codes[m, r0 : r0 + rows].reshape(-1))
                yield m, r0, rows, index

    def _scale_byte_table(
        self,
        values: torch.Tensor,
        scale_dtype: torch.dtype,
        out_dtype: torch.dtype,
        global_scale: torch.Tensor | None,
        divide_global: bool,
    ) -> torch.Tensor:
        """[256 * 256] entries of two out_dtype values: entry 256 s + b holds codes b & 15 and b >> 4 times
        the scale whose byte is s, as the reference computes them: float32 value * float32 scale (read by
        scale_to_float32, as the reference reads it), then / or * the float32 global scale, then one
        rounding. Kept for the last few (values, dtypes, global scale): an NVFP4 tensor has its own."""
        g = None if global_scale is None else global_scale.to(torch.float32).reshape(())
        g_key = None if g is None else (int(g.view(torch.int32)), divide_global)
        key = (tuple(values.tolist()), scale_dtype, out_dtype, g_key)
        table = self._tables.get(key)
        if table is not None:
            return table
        b = torch.arange(256)
        scales = scale_to_float32(b.to(torch.uint8).view(scale_dtype))
        pairs = torch.stack((values[b & 0xF], values[b >> 4]), dim=1).to(torch.float32)
        products = pairs[None] * scales[:, None, None]  # [scale byte, code byte, 2]: value * scale, as the reference
        apply_global_scale(products, g, divide_global)
        table = products.to(out_dtype).contiguous().view(torch.int64 if out_dtype == torch.float32 else torch.int32)
        table = table.reshape(-1)
        with self._tables_lock:  # band workers may build tables side by side
            if len(self._tables) >= TABLES_KEPT:
                del self._tables[next(iter(self._tables))]  # the oldest: dicts keep insertion order
            self._tables[key] = table
        return table

    def _decode_by_scale_byte(
        self, codes: torch.Tensor, table: torch.Tensor, scale_bytes: torch.Tensor, group: int, out: torch.Tensor
    ) -> None:
        """out = table[byte + 256 scale byte], each entry two values: one add and one gather per chunk."""
        for m, r0, rows, index in self._code_chunks(codes):
            shifted = scratch("scale bytes", scale_bytes[m, r0 : r0 + rows].numel(), torch.int32)
            shifted.copy_(scale_bytes[m, r0 : r0 + rows].reshape(-1)).bitwise_left_shift_(8)
            index.view(rows, -1, group // 2).add_(shifted.view(rows, -1, 1))
            _gather_into(table, index, out[m, r0 : r0 + rows])


def _use_tables(block: tuple[int, int]) -> bool:
    bn, bk = block
    return bn * bk >= TABLE_MIN_BLOCK


def gather_rows(k: int, bn: int) -> int:
    """Rows per table gather, ~GATHER_ELEMENTS values: whole grid rows when one is small, else a divisor
    of bn (so a gather stays within one grid row)."""
    if bn * k <= GATHER_ELEMENTS:
        return (GATHER_ELEMENTS // (bn * k)) * bn
    return next(d for d in range(min(bn, max(1, GATHER_ELEMENTS // k)), 0, -1) if bn % d == 0)


def _gather_into(table: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """dst = table[index], each table entry being two of dst's values: straight into dst when it is
    contiguous, through a temporary otherwise."""
    if dst.is_contiguous():
        torch.index_select(table, 0, index, out=dst.view(-1).view(table.dtype))
    else:
        dst.copy_(torch.index_select(table, 0, index).view(dst.dtype).view(dst.shape))


def _byte_pair_table(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[256] entries of two `dtype` values: byte b holds values[b & 15] first and values[b >> 4] second in
    memory, so a gathered row is the low code's value, then the high code's. The values (E2M1, INT4) are
    exact in bf16."""
    b = torch.arange(256)
    pairs = torch.stack((values[b & 0xF], values[b >> 4]), dim=1).to(dtype).contiguous()
    return pairs.view(torch.int64 if dtype == torch.float32 else torch.int32).reshape(256)
