"""Power-of-two requantization from e4m3 codes where input blocks hold many output blocks (MXFP8's 1x32 groups
inside DeepSeek's 128x128 block FP8; backends.pow2_codes): a group's exponent and table worked out per (input
block, largest code) pair and looked up per group, its codes counted as they are written."""

from __future__ import annotations

import math

import torch

from .pow2 import (
    E8M0_BIAS,
    SEARCH_BELOW,
    ReportSums,
    ceiling_wins,
)
from .pow2_group_search import EXPONENT_SPAN, Keys, OpenGroups
from .pow2_tables import (
    CODES,
    MAGNITUDES,
    NAN_MAGNITUDE,
    magnitude_values,
    power_of_two_scales,
    slot_sums,
    table_sums,
    tables_at,
)
from .scratch import scratch

MAGNITUDE_VALUES = 2**20  # codes whose magnitudes are taken at once (4 MiB of int32: ~30% faster than 4x that)
SLICE_VALUES = 2**21  # codes indexed, counted and gathered at once (8 MiB of int32 index)


class GroupTables(OpenGroups):
    """One band's output exponents and tables: built from the band's codes and input scales, then applied
    chunk by chunk (apply). usable False: the definition must decide (NaN codes, non-finite values, values
    from outside one e4m3 block's range).

    A block's exponent, unless searched, depends on its input block and its largest magnitude code alone, as
    do its table: both are worked out once per (input block, largest code) that occurs, then looked up per
    block (a band of MXFP8 groups has one block per 32 values: per-block arithmetic would cost more than
    the tables)."""

    def __init__(self, blocks: torch.Tensor, grid: torch.Tensor, in_block: tuple[int, int], report_rows: int) -> None:
        """blocks: the band's codes as uint8 [gn, bn, gk, bk] (blocks_of: zero-padded to whole output blocks);
        grid: [gn_in, gk_in] float32 scales of the input blocks from the band's first row."""
        gn, bn, gk, bk = blocks.shape
        self.blocks, self.report_rows = blocks, report_rows
        self.in_rows, self.gk_in = in_block[0], grid.shape[1]
        rows = (torch.arange(gn) * bn) // in_block[0]
        columns = (torch.arange(gk) * bk) // in_block[1]
        self.in_id = (rows[:, None] * grid.shape[1] + columns[None, :]).to(torch.int32)  # each block's input block
        grid = grid.reshape(-1).to(torch.float32)
        # the positive codes' values in each input block: the definition's float32 product
        self.values = magnitude_values(grid)
        self.top = _largest_magnitudes(blocks).add_(self.in_id * MAGNITUDES)  # (input block, top)
        # the (input block, largest code) pairs that occur, in order: the rest of the choice is per pair
        key = torch.nonzero(torch.bincount(self.top.view(-1), minlength=self.values.numel()))[:, 0]
        amax = torch.index_select(self.values.view(-1), 0, key).abs_()  # a block's largest value, by its top code
        finite = bool(torch.isfinite(amax).all())
        self.usable = finite and not bool((key % MAGNITUDES == NAN_MAGNITUDE).any())
        if self.usable:
            self.usable = self._choose(Keys(key, amax), power_of_two_scales(grid))

    def _choose(self, keys: Keys, kept: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Per (input block, largest code) that occurs: the exponent (the input's where its scale is a power of
        two, else the ceiling), whether the search may move it, its table; then per block, and the search."""
        bn, bk = self.blocks.shape[1], self.blocks.shape[3]
        kept_exponent, keeps = kept
        b, top, ceiling = keys.block, keys.top, keys.ceiling
        keep = keeps[b]
        base = torch.where(keep, kept_exponent[b], ceiling)
        keys.open = ~ceiling_wins(keys.amax, ceiling, bn * bk) & ~keep
        lowest = torch.iinfo(torch.int32).min
        self.top_exponent = torch.full((keeps.numel(),), lowest, dtype=torch.int32).scatter_reduce_(0, b, base, "amax")
        # an all-zero block: every table writes its zeros as they are (its exponent stays its own)
        below = (self.top_exponent[b] - base).masked_fill_(top == 0, 0)
        if int(below.max()) + SEARCH_BELOW >= EXPONENT_SPAN:
            return False  # not one e4m3 block's values: the definition decides
        tables = b * EXPONENT_SPAN + below
        used = torch.zeros(keeps.numel() * EXPONENT_SPAN, dtype=torch.bool)
        used[tables] = True
        # the exponents the search may try: one lower where the largest value clamps there, else three
        for i in range(1, SEARCH_BELOW + 1):
            used[tables[keys.open & (~keys.clamps if i > 1 else True)] + i] = True
        before = torch.cumsum(used, 0).to(torch.int32)
        self.table_at = before - 1  # dense (input block, exponent) key -> table
        self.tables_before = torch.cat((torch.zeros(1, dtype=torch.int32), before))  # tables under each key
        self.table_keys = torch.nonzero(used)[:, 0]
        self._build_tables(self.table_keys)
        self.kept_all = bool(keeps.all())
        per_block = keys.per_block(self.top, self.values.numel())
        self.exponents = per_block((base + E8M0_BIAS).to(torch.uint8))
        self.table_of = per_block(self.table_at[tables])
        opens = torch.nonzero(per_block(keys.open).view(-1))[:, 0]
        if opens.numel():
            self._settle_open(opens, keys)
        return True

    def _build_tables(self, keys: torch.Tensor) -> None:
        """Each (input block, exponent) key's table (pow2_tables.tables_at)."""
        blocks_in = keys // EXPONENT_SPAN
        self.tables = tables_at(self.values[blocks_in], self.top_exponent[blocks_in] - keys % EXPONENT_SPAN)

    def apply(self, q_out: torch.Tensor) -> list[ReportSums]:
        """Write the output codes of every chunk of report rows into q_out (uint8 laid out as the blocks) and
        return each chunk's report sums. A chunk's tables are those of the input blocks it touches: a run of
        table numbers (keys in order), counted together."""
        gn, bn, gk, bk = self.blocks.shape
        step = max(1, self.report_rows // bn)
        spans = self._chunk_spans(step)
        offsets = self.table_of * CODES
        counts = []
        for g0, g1, t0, t1 in _slices(spans, step, gn, bn * gk * bk):
            index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
            index.copy_(self.blocks[g0:g1])
            index.add_((offsets[g0:g1] - t0 * CODES)[:, None, :, None])
            chunk = torch.bincount(index.view(-1), minlength=(t1 - t0) * CODES)
            torch.index_select(self.tables.codes[t0 * CODES : t1 * CODES], 0, index.view(-1), out=q_out[g0:g1].view(-1))
            counts.append(chunk.view(t1 - t0, 2, MAGNITUDES).sum(dim=1))
        tables = torch.cat([torch.arange(t0, t1) for _, t0, t1 in spans])
        chunk_of = torch.repeat_interleave(torch.arange(len(spans)), torch.tensor([t1 - t0 for _, t0, t1 in spans]))
        slots = self.table_keys[tables] - torch.tensor([k0 for k0, _, _ in spans])[chunk_of]
        # chunks of whole input-block rows count each table once, in order: its rows as they are
        every_once = tables.numel() == self.table_keys.numel()
        sums = table_sums(torch.cat(counts), self.tables, slice(None) if every_once else tables)
        return slot_sums(sums, chunk_of, slots, len(spans), self._chunk_slots())

    def _chunk_spans(self, step: int) -> list[tuple[int, int, int]]:
        """Per chunk of `step` block rows: its first key and its run of tables [t0, t1) (the keys of the input
        blocks its rows touch)."""
        gn, bn = self.blocks.shape[:2]
        starts = torch.arange(0, gn, step)
        first = (starts * bn) // self.in_rows
        last = -(-(torch.clamp(starts + step, max=gn) * bn) // self.in_rows)
        keys_per_row = self.gk_in * EXPONENT_SPAN
        k0, k1 = first * keys_per_row, last * keys_per_row
        return list(zip(k0.tolist(), self.tables_before[k0].tolist(), self.tables_before[k1].tolist(), strict=True))

    def _chunk_slots(self) -> int:
        """A chunk's report slots: the keys of as many input-block rows as any chunk of report rows can touch
        (its rows start at multiples of report_rows from the matrix's first row: from the shapes alone, so a
        chunk's sums are the same whatever band holds it)."""
        rows, in_rows = self.report_rows, self.in_rows
        most_rows = -(-(in_rows - math.gcd(rows, in_rows) + rows) // in_rows)
        return most_rows * self.gk_in * EXPONENT_SPAN


def _slices(spans: list[tuple[int, int, int]], step: int, gn: int, row_values: int) -> list[tuple[int, int, int, int]]:
    """Runs of whole chunks (block rows [g0, g1), tables [t0, t1)) counted and gathered at once, SLICE_VALUES
    at most: chunks whose tables no other chunk shares (whole input-block rows) are counted together, their
    counts still each chunk's own (a few ops per run, not per chunk: MoE experts have many short chunks)."""
    runs: list[tuple[int, int, int, int]] = []
    for i, (_, t0, t1) in enumerate(spans):
        g0, g1 = i * step, min(gn, (i + 1) * step)
        if runs and runs[-1][3] == t0 and (g1 - runs[-1][0]) * row_values <= SLICE_VALUES:
            runs[-1] = (runs[-1][0], g1, runs[-1][2], t1)
        else:
            runs.append((g0, g1, t0, t1))
    return runs


def _largest_magnitudes(blocks: torch.Tensor) -> torch.Tensor:
    """[gn, gk] int32: each block's largest code magnitude (its sign bit cleared), MAGNITUDE_VALUES values at a
    time: over a block's rows first where it has several (elementwise maxima of whole rows: fast in uint8), in
    int32 within a row (a reduction over a few contiguous values runs ~8x faster in int32 than in uint8)."""
    gn, bn, gk, bk = blocks.shape
    step = max(1, MAGNITUDE_VALUES // (bn * gk * bk))
    top = torch.empty((gn, gk), dtype=torch.int32)
    for g0 in range(0, gn, step):
        g1 = min(gn, g0 + step)
        if bn == 1:
            magnitudes = scratch("pow2 codes magnitudes", (g1 - g0, gk, bk), torch.int32)
            magnitudes.copy_(blocks[g0:g1, 0]).bitwise_and_(NAN_MAGNITUDE)
            top[g0:g1] = magnitudes.amax(dim=2)
        else:
            codes = scratch("pow2 codes magnitudes", (g1 - g0, bn, gk, bk), torch.uint8)
            torch.bitwise_and(blocks[g0:g1], NAN_MAGNITUDE, out=codes)
            top[g0:g1] = codes.amax(dim=1).amax(dim=2)
    return top
