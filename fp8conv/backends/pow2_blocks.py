"""Power-of-two requantization from e4m3 codes where each input block is one output block (ue8m0 from
DeepSeek's 128x128 block FP8; backends.pow2_codes): each block's codes counted first, then every choice
made from its counts."""

from __future__ import annotations

import torch

from . import pow2_tables
from .pow2 import (
    E8M0_BIAS,
    HALF_FP8_MAX,
    SEARCH_BELOW,
    ReportSums,
    ceil_exponents,
    ceiling_wins,
    choose_exponents,
    powers_of_two,
)
from .pow2_tables import (
    CODES,
    MAGNITUDES,
    NAN_MAGNITUDE,
    SIGN,
    codes_of,
    magnitude_values,
    power_of_two_scales,
    slot_sums,
    squares_at,
    table_sums,
    tables_at,
)
from .scratch import scratch


class BlockTables:
    """Output blocks that are the input's blocks (ue8m0 from 128x128 block FP8): each block's codes counted
    first, one bincount a chunk of report rows; its largest value, exponent (_search) and report all from
    its counts; then one gather a chunk through its block's table."""

    def __init__(self, blocks: torch.Tensor, grid: torch.Tensor, report_rows: int) -> None:
        gn, bn, gk, bk = blocks.shape
        self.blocks, self.step = blocks, max(1, report_rows // bn)
        columns = torch.arange(self.step)[:, None] * gk + torch.arange(gk)[None, :]  # a chunk's blocks, in order
        self.offsets = (columns * CODES).to(torch.int32)[:, None, :, None]
        counts = self._counts()
        present = counts > 0
        x = magnitude_values(grid)
        top = (present * torch.arange(MAGNITUDES)).amax(dim=1)
        amax = x.gather(1, top[:, None])[:, 0].abs()  # each block's largest value: its largest code's
        self.usable = not bool(present[:, NAN_MAGNITUDE].any()) and bool(torch.isfinite(amax).all())
        if not self.usable:
            return
        kept, keeps = power_of_two_scales(grid.reshape(-1))
        ceiling = ceil_exponents(amax)
        exponents = torch.where(keeps, kept, ceiling)
        rows = torch.nonzero(~ceiling_wins(amax, ceiling, bn * bk) & ~keeps)[:, 0]
        if rows.numel():
            exponents[rows] = self._search(rows, counts[rows], x[rows], amax[rows], ceiling[rows])
        self.tables = tables_at(x, exponents)
        self.exponents = (exponents + E8M0_BIAS).to(torch.uint8).view(gn, gk)
        self.kept_all = bool(keeps.all())
        sums, per_chunk = table_sums(counts, self.tables, slice(None)), self.step * gk
        chunks = -(-gn // self.step)
        slots = torch.arange(gn * gk)
        self.parts = slot_sums(sums, slots // per_chunk, slots % per_chunk, chunks, per_chunk)

    def _index(self, g0: int, g1: int) -> torch.Tensor:
        """Block rows g0..g1's codes as indexes into their blocks' tables (code + 256 x the block's place)."""
        _, bn, gk, bk = self.blocks.shape
        index = scratch("pow2 codes index", (g1 - g0, bn, gk, bk), torch.int32)
        return index.copy_(self.blocks[g0:g1]).add_(self.offsets[: g1 - g0])

    def _counts(self) -> torch.Tensor:
        """[blocks, 128] int64: how many of each block's values have each magnitude code."""
        gn, gk = self.blocks.shape[0], self.blocks.shape[2]
        counts = torch.empty((gn * gk, 2, MAGNITUDES), dtype=torch.int64)
        for g0 in range(0, gn, self.step):
            g1 = min(gn, g0 + self.step)
            index = self._index(g0, g1).view(-1)
            counts[g0 * gk : g1 * gk] = torch.bincount(index, minlength=(g1 - g0) * gk * CODES).view(-1, 2, MAGNITUDES)
        return counts.sum(dim=1)

    def _search(
        self, rows: torch.Tensor, counts: torch.Tensor, x: torch.Tensor, amax: torch.Tensor, ceiling: torch.Tensor
    ) -> torch.Tensor:
        """int32 [M]: search_exponents' answer for blocks `rows`, from their counts [M, 128]: each candidate's
        total squared error is counts x the exact squares the definition sums. A candidate none of whose
        present codes errs less than the best so far cannot beat it (every leaf of the definition's sums is
        as large or larger, and ties stay); one DECISION_MARGIN under it beats it, one over it does not; the
        rest (none on bench/synth.py's input) are searched by the definition on their values."""
        below = 1 if bool((amax > HALF_FP8_MAX * powers_of_two(ceiling)).all()) else SEARCH_BELOW
        n, present = counts.to(torch.float64), counts > 0
        # every candidate's squares at once (one table build, not one per exponent): [below + 1, M, 128]
        tried = (ceiling[None, :] - torch.arange(below + 1, dtype=torch.int32)[:, None]).reshape(-1)
        candidates = squares_at(x.repeat(below + 1, 1), tried).view(below + 1, *x.shape)
        best, best_squares = ceiling.clone(), candidates[0]
        best_error = (n * best_squares).sum(dim=1)
        unsure = torch.zeros(rows.shape, dtype=torch.bool)
        for i in range(1, below + 1):
            squares = candidates[i]
            error = (n * squares).sum(dim=1)
            may_win = (present & (squares < best_squares)).any(dim=1)
            margin = pow2_tables.DECISION_MARGIN * (error + best_error)
            wins = may_win & (error < best_error - margin)
            unsure |= may_win & ~wins & (error <= best_error + margin)
            best = torch.where(wins, ceiling - i, best)
            best_squares = torch.where(wins[:, None], squares, best_squares)
            best_error = torch.where(wins, error, best_error)
        if bool(unsure.any()):
            best[unsure] = self._search_values(rows[unsure], x[unsure], amax[unsure])
        return best

    def _search_values(self, rows: torch.Tensor, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """int32 [M]: choose_exponents (the definition) on blocks `rows`' values, decoded from their codes."""
        gk = self.blocks.shape[2]
        codes = codes_of(self.blocks, rows // gk, rows % gk).to(torch.int64)  # [M, bn, bk]
        magnitudes = x.gather(1, (codes & NAN_MAGNITUDE).flatten(1)).view(codes.shape)
        values = torch.where(codes >= SIGN, -magnitudes, magnitudes)
        return choose_exponents(values.unsqueeze(2), amax[:, None], True)[:, 0]

    def apply(self, q_out: torch.Tensor) -> list[ReportSums]:
        """Write the output codes into q_out (uint8 laid out as the blocks); the report's sums per chunk."""
        gn, gk = self.blocks.shape[0], self.blocks.shape[2]
        for g0 in range(0, gn, self.step):
            g1 = min(gn, g0 + self.step)
            table = self.tables.codes[g0 * gk * CODES : g1 * gk * CODES]
            torch.index_select(table, 0, self._index(g0, g1).view(-1), out=q_out[g0:g1].view(-1))
        return self.parts
