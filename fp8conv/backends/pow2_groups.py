"""Power-of-two requantization from e4m3 codes where input blocks hold many output blocks (MXFP8's 1x32 groups
inside DeepSeek's 128x128 block FP8; backends.pow2_codes): a group's exponent and table worked out per (input
block, largest code) pair and looked up per group, its codes counted as they are written."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import pow2_tables
from .pow2 import (
    E8M0_BIAS,
    HALF_FP8_MAX,
    SEARCH_BELOW,
    ReportSums,
    block_sums,
    ceil_exponents,
    ceiling_wins,
    powers_of_two,
    search_exponents,
)
from .pow2_tables import (
    CODES,
    MAGNITUDES,
    NAN_MAGNITUDE,
    codes_at,
    codes_of,
    magnitude_values,
    power_of_two_scales,
    slot_sums,
    table_sums,
    tables_at,
)
from .scratch import scratch

MAGNITUDE_VALUES = 2**20  # codes whose magnitudes are taken at once (4 MiB of int32: ~30% faster than 4x that)
SLICE_VALUES = 2**21  # codes indexed, counted and gathered at once (8 MiB of int32 index)
EXPONENT_SPAN = 32  # tables per input block at most: e4m3 spans 2^-9..448 (under 18 binades), search 3 below


class Keys:
    """The (input block, largest code) pairs of a band that occur (flat keys block x 128 + top code, in order)
    and what the choice needs of each: its largest value, its ceiling exponent, whether that value clamps one
    exponent lower, and (set by GroupTables._choose) whether the search may move it."""

    def __init__(self, key: torch.Tensor, amax: torch.Tensor) -> None:
        self.key, self.amax = key, amax
        self.block, self.top = key // MAGNITUDES, key % MAGNITUDES
        self.ceiling = ceil_exponents(amax)
        self.clamps = amax > HALF_FP8_MAX * powers_of_two(self.ceiling)
        self.open = torch.zeros(key.shape, dtype=torch.bool)

    def per_block(self, block_keys: torch.Tensor, size: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """A lookup of per-key values for every block (block_keys: each block's flat key, int32, of `size`)."""

        def lookup(values: torch.Tensor) -> torch.Tensor:
            dense = torch.zeros(size, dtype=values.dtype)
            dense[self.key] = values
            return torch.index_select(dense, 0, block_keys.view(-1)).view(block_keys.shape)

        return lookup

    def index_of(self, block_keys: torch.Tensor, size: int) -> torch.Tensor:
        """Each of these blocks' row among the keys (block_keys: their flat keys; `size`: all flat keys)."""
        rows = torch.zeros(size, dtype=torch.int32)
        rows[self.key] = torch.arange(self.key.numel(), dtype=torch.int32)
        return torch.index_select(rows, 0, block_keys)


class GroupTables:
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

    def _settle_open(self, opens: torch.Tensor, keys: Keys) -> None:
        """The open blocks (flat indexes) whose key (_key_rules) decides: e - 1 where the block holds a code
        whose term is positive (_search's gain beyond its margin), else the ceiling (no term nonzero: _search's
        zero gain); the rest go to _search."""
        k = keys.index_of(torch.index_select(self.top.view(-1), 0, opens), self.values.numel())
        row_of, positive = self._key_rules(keys)
        row = row_of[k]
        decided = torch.nonzero(row >= 0)[:, 0]
        codes = codes_at(self.blocks, opens[decided]).flatten(1).to(torch.int32).bitwise_and_(NAN_MAGNITUDE)
        codes.add_((row[decided] * MAGNITUDES)[:, None])
        gains = torch.index_select(positive.view(-1), 0, codes.view(-1)).view(codes.shape).any(dim=1)
        lowered = decided[gains]
        self._lower(opens[lowered], keys.ceiling[k[lowered]])
        rest = torch.nonzero(row < 0)[:, 0]
        if rest.numel():
            g, c = (
                torch.div(opens[rest], self.blocks.shape[2], rounding_mode="floor"),
                opens[rest] % self.blocks.shape[2],
            )
            self._search(g, c, keys.amax[k[rest]][:, None], keys.ceiling[k[rest]][:, None])

    def _key_rules(self, keys: Keys) -> tuple[torch.Tensor, torch.Tensor]:
        """Per open key that clamps one exponent lower, at its ceiling e, each code's term: its squared error at
        e less at e - 1 (codes above the largest: 0). Such a key decides where no term is negative and its
        least positive term is over 4 x DECISION_MARGIN x the largest squared error a block can have (any
        positive term then passes _search's test, with room for its float64 sums). Returns row_of, int32 per
        key: a deciding key's row of positive (else -1), and positive, bool [rows, 128]: which codes' terms are
        positive."""
        row_of = torch.full(keys.key.shape, -1, dtype=torch.int32)
        ruled = torch.nonzero(keys.open & keys.clamps)[:, 0]
        if not ruled.numel():
            return row_of, torch.zeros((0, MAGNITUDES), dtype=torch.bool)
        b, top, e = keys.block[ruled], keys.top[ruled], keys.ceiling[ruled]
        leaves = self.tables.err2[self._table(b, e)]
        terms = leaves - self.tables.err2[self._table(b, e - 1)]
        above = torch.arange(MAGNITUDES)[None, :] > top[:, None]
        terms.masked_fill_(above, 0.0)
        least_positive = torch.where(terms > 0, terms, math.inf).amin(dim=1)
        largest_error = self.blocks.shape[1] * self.blocks.shape[3] * leaves.masked_fill_(above, 0.0).amax(dim=1)
        decides = (terms >= 0).all(dim=1) & (least_positive > 4 * pow2_tables.DECISION_MARGIN * largest_error)
        row_of[ruled] = torch.where(decides, torch.arange(ruled.numel(), dtype=torch.int32), -1)
        return row_of, terms > 0

    def _lower(self, at: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Blocks `at` (flat indexes: ~3x faster than pairs) written one exponent below their ceilings [M]."""
        self.exponents.view(-1)[at] = (ceiling - 1 + E8M0_BIAS).to(torch.uint8)
        self.table_of.view(-1)[at] = self._table(self.in_id.view(-1)[at], ceiling - 1)

    def _search(self, g: torch.Tensor, c: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Blocks (g, c), with their largest values and ceiling exponents [M, 1]: search_exponents' answer; their
        exponents and tables set. Where the largest value clamps one exponent lower (over 224 x 2^e: every open
        block but those AMAX_FLOOR holds up), only the ceiling e and e - 1 can win (search_exponents); where no
        value errs more at e - 1 than at e (_gains; ceiling_wins leaves open only blocks whose largest value
        rounds down to 224 at e, its error there the same as clamped at e - 1), e - 1 wins if it gains beyond
        DECISION_MARGIN of the block's squared error, the ceiling if it gains nothing at all (equal leaves).
        The rest are searched on the tables' squares in the definition's pairwise order (_search_sums)."""
        in_id, e = self.in_id[g, c], ceiling[:, 0]
        error, gain, least = self._gains(g, c, in_id, e)
        clamps = amax[:, 0] > HALF_FP8_MAX * powers_of_two(e)
        lower = clamps & (least >= 0) & (gain > pow2_tables.DECISION_MARGIN * 2 * error)
        settled = lower | (clamps & (least >= 0) & (gain == 0))
        rows = torch.nonzero(lower)[:, 0]
        self._lower(g[rows] * self.blocks.shape[2] + c[rows], e[rows])
        for rest in (~settled & clamps, ~settled & ~clamps):  # apart: the first set tries one exponent lower only
            rows = torch.nonzero(rest)[:, 0]
            if rows.numel():
                self._search_sums(g[rows], c[rows], amax[rows], ceiling[rows])

    def _gains(
        self, g: torch.Tensor, c: torch.Tensor, in_id: torch.Tensor, e: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per block (g, c) at exponents e [M], float64 [M]: its squared error at e, the sum over its values of
        (squared error at e) - (squared error at e - 1), and the least such term (the terms: exact squares the
        definition sums)."""
        codes = codes_of(self.blocks, g, c).flatten(1).to(torch.int32).bitwise_and_(NAN_MAGNITUDE)
        squares = self.tables.err2.view(-1)
        table = self._table(in_id, e)
        at = codes.add_((table * MAGNITUDES)[:, None])
        below = at + ((self._table(in_id, e - 1) - table) * MAGNITUDES)[:, None]
        leaves = torch.index_select(squares, 0, at.view(-1)).view(codes.shape)
        terms = leaves - torch.index_select(squares, 0, below.view(-1)).view(codes.shape)
        return leaves.sum(dim=1), terms.sum(dim=1), terms.amin(dim=1)

    def _search_sums(self, g: torch.Tensor, c: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor) -> None:
        """search_exponents on blocks (g, c): each candidate's squared error from the tables' exact squares,
        summed as block_squared_errors sums them (the definition's own order)."""
        codes = codes_of(self.blocks, g, c).to(torch.int64).bitwise_and_(NAN_MAGNITUDE)
        in_id = self.in_id[g, c]
        squares = self.tables.err2.view(-1)

        def errors_at(rows: torch.Tensor, _: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
            tables = self._table(in_id[rows], exponents[:, 0]).to(torch.int64)
            return block_sums(squares[codes[rows] + (tables * MAGNITUDES)[:, None, None]].unsqueeze(2))

        every = torch.ones(amax.shape, dtype=torch.bool)
        chosen = search_exponents(amax, ceiling, every, errors_at)[:, 0]
        self.exponents[g, c] = (chosen + E8M0_BIAS).to(torch.uint8)
        self.table_of[g, c] = self._table(in_id, chosen)

    def _table(self, in_id: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        """The table of each (input block, exponent)."""
        return self.table_at[in_id * EXPONENT_SPAN + self.top_exponent[in_id] - exponents]

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
