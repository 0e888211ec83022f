"""The choice of exponents for MXFP8 groups from e4m3 codes (backends.pow2_groups) per (input block, largest
code) pair that occurs (Keys), and the groups `ceiling_wins` leaves open: most decided by their key's rule
from the codes they hold, the rest searched on the tables' exact squares as the definition sums them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import pow2_tables
from .pow2 import (
    E8M0_BIAS,
    HALF_FP8_MAX,
    block_sums,
    ceil_exponents,
    powers_of_two,
    search_exponents,
)
from .pow2_tables import MAGNITUDES, NAN_MAGNITUDE, Tables, codes_at, codes_of

WITHIN_MARGIN, DECIDES = 1, 2  # kinds of code in an open key: a positive term, one far beyond the margin
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


@dataclass(frozen=True)
class KeyRules:
    """_key_rules' answer: row_of, int32 per key: the row of a key with no negative term (else -1); per row
    and code, kinds (uint8: DECIDES, WITHIN_MARGIN, or 0: no gain), leaves and terms (float64)."""

    row_of: torch.Tensor
    kinds: torch.Tensor
    leaves: torch.Tensor
    terms: torch.Tensor


class OpenGroups:
    """GroupTables' search: what it reads of the plan (set by GroupTables) and how it settles open groups."""

    blocks: torch.Tensor  # the band's codes, uint8 [gn, bn, gk, bk]
    top: torch.Tensor  # each group's flat key, int32 [gn, gk]
    values: torch.Tensor  # each input block's magnitude values, float32 [n_in, 128]
    in_id: torch.Tensor  # each group's input block, int32 [gn, gk]
    top_exponent: torch.Tensor  # each input block's largest exponent, int32 [n_in]
    table_at: torch.Tensor  # dense (input block, exponent) key -> table, int32
    tables: Tables
    exponents: torch.Tensor  # each group's E8M0 byte, uint8 [gn, gk]
    table_of: torch.Tensor  # each group's table, int32 [gn, gk]

    def _settle_open(self, opens: torch.Tensor, keys: Keys) -> None:
        """The open blocks (flat indexes) whose key has no negative term (_key_rules), as _search would settle
        them: e - 1 where the block holds a code whose term is beyond the margin's reach, the ceiling where it
        holds none whose term is positive (zero gain), else by the block's gain and error (its codes' terms
        and leaves, summed), the definition's sums (_search_sums) where those are within the margin; the rest
        (keys with a negative term) go to _search."""
        k = keys.index_of(torch.index_select(self.top.view(-1), 0, opens), self.values.numel())
        rules = self._key_rules(keys)
        row = rules.row_of[k]
        ruled = torch.nonzero(row >= 0)[:, 0]
        codes = codes_at(self.blocks, opens[ruled]).flatten(1).to(torch.int32).bitwise_and_(NAN_MAGNITUDE)
        codes.add_((row[ruled] * MAGNITUDES)[:, None])
        kind = torch.index_select(rules.kinds.view(-1), 0, codes.view(-1)).view(codes.shape).amax(dim=1)
        lowered, near = ruled[kind == DECIDES], ruled[:0]
        within = torch.nonzero(kind == WITHIN_MARGIN)[:, 0]
        if within.numel():
            at = codes[within].view(-1)
            error = torch.index_select(rules.leaves.view(-1), 0, at).view(-1, codes.shape[1]).sum(dim=1)
            gain = torch.index_select(rules.terms.view(-1), 0, at).view(-1, codes.shape[1]).sum(dim=1)
            wins = gain > pow2_tables.DECISION_MARGIN * 2 * error
            lowered, near = torch.cat((lowered, ruled[within[wins]])), ruled[within[~wins]]
        self._lower(opens[lowered], keys.ceiling[k[lowered]])
        for rest, search in ((near, self._search_sums), (torch.nonzero(row < 0)[:, 0], self._search)):
            if rest.numel():
                g = torch.div(opens[rest], self.blocks.shape[2], rounding_mode="floor")
                search(
                    g, opens[rest] % self.blocks.shape[2], keys.amax[k[rest]][:, None], keys.ceiling[k[rest]][:, None]
                )

    def _key_rules(self, keys: Keys) -> KeyRules:
        """Per open key that clamps one exponent lower, at its ceiling e, each code's leaf (squared error at e)
        and term (that less its squared error at e - 1; codes above the largest: 0). Where no term is
        negative, a block's gain is at least its largest term: one over 4 x DECISION_MARGIN x the largest
        squared error a block can have decides (it passes _search's test, with room for its float64 sums)."""
        row_of = torch.full(keys.key.shape, -1, dtype=torch.int32)
        ruled = torch.nonzero(keys.open & keys.clamps)[:, 0]
        b, top, e = keys.block[ruled], keys.top[ruled], keys.ceiling[ruled]
        leaves = self.tables.err2[self._table(b, e)]
        terms = leaves - self.tables.err2[self._table(b, e - 1)]
        above = torch.arange(MAGNITUDES)[None, :] > top[:, None]
        terms.masked_fill_(above, 0.0)
        leaves.masked_fill_(above, 0.0)
        largest_error = self.blocks.shape[1] * self.blocks.shape[3] * leaves.amax(dim=1)
        decisive = terms > (4 * pow2_tables.DECISION_MARGIN * largest_error)[:, None]
        kinds = (terms > 0).to(torch.uint8).add_(decisive)  # WITHIN_MARGIN, or DECIDES where decisive
        row_of[ruled] = torch.where((terms >= 0).all(dim=1), torch.arange(ruled.numel(), dtype=torch.int32), -1)
        return KeyRules(row_of, kinds, leaves, terms)

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
