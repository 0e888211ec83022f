"""Power-of-two requantization from e4m3 codes where input blocks hold many output blocks (MXFP8's 1x32 groups
inside DeepSeek's 128x128 block FP8; backends.pow2_codes): a group's exponent and table worked out per (input
block, largest code) pair and looked up per group, its codes counted as they are written."""

from __future__ import annotations

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
    chunk_sums,
    codes_of,
    magnitude_values,
    power_of_two_scales,
    table_sums,
    tables_at,
)
from .scratch import scratch

EXPONENT_SPAN = 32  # tables per input block at most: e4m3 spans 2^-9..448 (under 18 binades), search 3 below


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
        rows = (torch.arange(gn) * bn) // in_block[0]
        columns = (torch.arange(gk) * bk) // in_block[1]
        self.in_id = (rows[:, None] * grid.shape[1] + columns[None, :]).to(torch.int32)  # each block's input block
        grid = grid.reshape(-1).to(torch.float32)
        # the positive codes' values in each input block: the definition's float32 product
        self.values = magnitude_values(grid)
        self.top = _largest_magnitudes(blocks, report_rows).add_(self.in_id * MAGNITUDES)  # (input block, top)
        present = torch.bincount(self.top.view(-1), minlength=self.values.numel()).view(self.values.shape) > 0
        amax = self.values.abs()  # a block's largest value, by its largest code
        finite = bool((torch.isfinite(amax) | ~present).all())
        self.usable = finite and not bool(present[:, NAN_MAGNITUDE].any())
        if self.usable:
            self.usable = self._choose(amax, present, power_of_two_scales(grid.reshape(-1)))

    def _choose(self, amax: torch.Tensor, present: torch.Tensor, kept: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Per (input block, largest code): the exponent (the input's where its scale is a power of two, else
        the ceiling), whether the search may move it, its table; then per block, and the search."""
        gn, bn, gk, bk = self.blocks.shape
        kept_exponent, keeps = kept
        ceiling = ceil_exponents(amax)
        base = torch.where(keeps[:, None], kept_exponent[:, None], ceiling)
        open_tops = ~ceiling_wins(amax, ceiling, bn * bk) & ~keeps[:, None] & present
        lowest = torch.iinfo(torch.int32).min
        self.top_exponent = torch.where(present, base, lowest).amax(dim=1)  # each input block's largest exponent
        below = self.top_exponent[:, None] - base
        below[:, 0] = 0  # an all-zero block: every table writes its zeros as they are; its exponent is its own
        if int(torch.where(present, below, 0).max()) + SEARCH_BELOW >= EXPONENT_SPAN:
            return False  # not one e4m3 block's values: the definition decides
        in_blocks = torch.arange(amax.shape[0])[:, None]
        keys = in_blocks * EXPONENT_SPAN + below
        used = torch.zeros(amax.shape[0] * EXPONENT_SPAN, dtype=torch.bool)
        used[keys[present]] = True
        # the exponents the search may try: one lower where the largest value clamps there, else three
        clamps = amax > HALF_FP8_MAX * powers_of_two(ceiling)
        for i in range(1, SEARCH_BELOW + 1):
            used[keys[open_tops & (~clamps if i > 1 else True)] + i] = True
        self.table_at = (torch.cumsum(used, 0) - 1).to(torch.int32)  # dense (input block, exponent) key -> table
        self._build_tables(torch.nonzero(used)[:, 0])
        top = self.top.reshape(-1)

        def per_block(by_top: torch.Tensor) -> torch.Tensor:  # a lookup per block (int32 indexes: no copy)
            return torch.index_select(by_top.reshape(-1), 0, top).view(gn, gk)

        self.kept_all = bool(keeps.all())
        self.exponents = per_block((base + E8M0_BIAS).to(torch.uint8))
        self.table_of = per_block(self.table_at[keys])
        g, c = torch.nonzero(per_block(open_tops), as_tuple=True)
        if g.numel():
            moving = self._lowest_moving(open_tops & clamps, ceiling).view(-1)
            tops = self.top[g, c]
            rows = torch.nonzero(self._smallest_codes(g, c) < moving[tops])[:, 0]
            g, c, tops = g[rows], c[rows], tops[rows]
            self._search(g, c, amax.reshape(-1)[tops][:, None], ceiling.reshape(-1)[tops][:, None])
        return True

    def _lowest_moving(self, keys: torch.Tensor, ceiling: torch.Tensor) -> torch.Tensor:
        """int32 [n_in, 128]: per (input block, largest code) in keys (the open ones that clamp one exponent
        lower), 1 + the largest code at most that one whose squared error differs between the ceiling e and
        e - 1 (0: none does); elsewhere 128. A block holding no nonzero code below it errs the same at both:
        _search's gain 0, the ceiling settled (zero's error is zero at every exponent)."""
        moving = torch.full(keys.shape, MAGNITUDES, dtype=torch.int32)
        b, top = torch.nonzero(keys, as_tuple=True)
        if b.numel():
            e = ceiling[b, top]
            squares = self.tables.err2
            differs = squares[self._table(b, e)] != squares[self._table(b, e - 1)]
            codes = torch.arange(1, MAGNITUDES + 1, dtype=torch.int32)
            differs &= codes[None, :] <= (top[:, None] + 1)
            moving[b, top] = (differs * codes).amax(dim=1).to(torch.int32)
        return moving

    def _smallest_codes(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """int32 [M]: the smallest nonzero code magnitude of blocks (g, c) (NAN_MAGNITUDE where all are zero)."""
        codes = codes_of(self.blocks, g, c).flatten(1).to(torch.int32).bitwise_and_(NAN_MAGNITUDE)
        return codes.masked_fill_(codes == 0, NAN_MAGNITUDE).amin(dim=1)

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
        self.exponents[g[rows], c[rows]] = (e[rows] - 1 + E8M0_BIAS).to(torch.uint8)
        self.table_of[g[rows], c[rows]] = self._table(in_id[rows], e[rows] - 1)
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
        return each chunk's report sums."""
        gn, bn, gk, bk = self.blocks.shape
        step = max(1, self.report_rows // bn)
        chunk_counts, chunk_tables = [], []
        for g0 in range(0, gn, step):
            g1 = min(gn, g0 + step)
            tables = self.table_of[g0:g1]
            t0, t1 = int(tables.min()), int(tables.max()) + 1
            index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
            index.copy_(self.blocks[g0:g1])
            index.add_(((tables - t0) * CODES)[:, None, :, None])
            counts = torch.bincount(index.view(-1), minlength=(t1 - t0) * CODES).view(t1 - t0, 2, MAGNITUDES)
            table = self.tables.codes[t0 * CODES : t1 * CODES]
            torch.index_select(table, 0, index.view(-1), out=q_out[g0:g1].view(-1))
            counts = counts.sum(dim=1)
            used = torch.nonzero(counts.sum(dim=1) > 0)[:, 0]  # the chunk's own tables: its digits band-free
            chunk_counts.append(counts[used])
            chunk_tables.append(used + t0)
        sums = table_sums(torch.cat(chunk_counts), self.tables, torch.cat(chunk_tables)).split(
            [len(t) for t in chunk_tables]
        )
        return [chunk_sums(chunk) for chunk in sums]


def _largest_magnitudes(blocks: torch.Tensor, report_rows: int) -> torch.Tensor:
    """[gn, gk] int32: each block's largest code magnitude (its sign bit cleared), a chunk at a time: over a
    block's rows first where it has several (elementwise maxima of whole rows: fast in uint8), in int32
    within a row (a reduction over a few contiguous values runs ~8x faster in int32 than in uint8)."""
    gn, bn, gk, bk = blocks.shape
    step = max(1, report_rows // bn)
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
