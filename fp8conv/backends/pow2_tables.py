"""Code tables for power-of-two requantization of e4m3 values (backends.pow2_codes): for each (input block,
exponent) pair, what quantize_pow2_rows (the definition) writes for each of the 128 magnitude codes, and
what the error report counts for it; and the report's sums from code counts.

Every value of an input block is x = float32(code) * s, s the block's scale. At exponent e it is written as
the definition writes it: y = x / 2^e (exact), clamped to +-448, one cast to e4m3. Its squared error
(value(q) - y)^2 x 4^e is exact in float64 (the difference is exact in float32, 4^e a power of two), as is
y^2 x 4^e = x^2: a chunk's report is then counts x those terms, summed in a fixed order: the same digits on
every machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .pow2 import E8M0_BIAS, FP8_MAX, ReportSums, powers_of_two
from .scratch import scratch

CODES = 256
MAGNITUDES = 128  # e4m3 codes without their sign bit: a table's second half is its first with the sign set
SIGN = 0x80
NAN_MAGNITUDE = 0x7F  # e4m3fn's NaN, either sign
E4M3_VALUES = torch.arange(MAGNITUDES, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
E4M3_BY_CODE = torch.arange(CODES, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
# a search decided from squared-error totals: two this far apart relatively are ordered the same by any float64
# summation of their exact terms (the definition's pairwise one errs by under 16 x 2^-53 of the total for 2^14
# terms, a sum of 128 counted terms by under 129 x 2^-53); nearer, the definition's own sums decide
DECISION_MARGIN = 2.0**-40
FLOAT64_BIAS = 1023
FLOAT64_EXPONENT_SHIFT = 52


def magnitude_values(grid: torch.Tensor) -> torch.Tensor:
    """[n_in, 128] float32: each input block's positive codes' values (grid: its scales), the definition's
    float32 products (a negative code's value is exactly the negation)."""
    return E4M3_VALUES[None, :] * grid.reshape(-1, 1).to(torch.float32)


def power_of_two_scales(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per input block (grid: its float32 scales, any shape): the exponent of its scale (int32), and whether
    the scale is a power of two E8M0 holds, so that its values keep their bytes at that exponent."""
    mantissa, exponent = torch.frexp(grid)
    e = exponent.to(torch.int32) - 1  # 0.5 x 2^E = 2^(E - 1)
    return e, (mantissa == 0.5) & (e >= -E8M0_BIAS) & (e <= E8M0_BIAS)


def four_to(e: torch.Tensor) -> torch.Tensor:
    """float64 4^e from its bits (e in [-127, 127]): exact on every machine, no pow."""
    return ((2 * e.to(torch.int64) + FLOAT64_BIAS) << FLOAT64_EXPONENT_SHIFT).view(torch.float64)


@dataclass(frozen=True)
class Tables:
    """P tables: codes [P * 256] uint8 (what each input code is written as); per magnitude code [P, 128] its
    squared error and its square as the definition's sums take them (float64, exact: the value's own units),
    whether it saturates and whether it flushes to zero."""

    codes: torch.Tensor
    err2: torch.Tensor
    norm2: torch.Tensor
    saturated: torch.Tensor
    flushed: torch.Tensor


def tables_at(x: torch.Tensor, e: torch.Tensor) -> Tables:
    """The tables of magnitude values x [P, 128] at exponents e [P] int32."""
    written = _written_at(x, e)
    norm2 = x.to(torch.float64).square_()  # y^2 x 4^e: both exact products of the same value
    norm2[:, NAN_MAGNITUDE] = 0.0
    if written.absent is not None:
        norm2.masked_fill_(written.absent, 0.0)
    codes = written.codes
    return Tables(
        codes=torch.cat((codes, codes | SIGN), dim=1).reshape(-1),
        err2=written.err2,
        norm2=norm2,
        saturated=written.magnitude > FP8_MAX,
        flushed=(codes == 0).logical_and_(x != 0),
    )


def squares_at(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """float64 [P, 128]: each magnitude value x [P, 128] written at exponent e [P], its squared error in the
    value's own units ((value(q) x 2^e - x)^2, exact): the leaves the definition's search sums."""
    return _written_at(x, e).err2


@dataclass(frozen=True)
class _Written:
    """Magnitude values at an exponent, as the definition writes them: their codes (uint8), squared errors
    (the value's units), |x / 2^e|, and the codes no block holds past float32 (None: none)."""

    codes: torch.Tensor
    err2: torch.Tensor
    magnitude: torch.Tensor
    absent: torch.Tensor | None


def _written_at(x: torch.Tensor, e: torch.Tensor) -> _Written:
    y = x * powers_of_two(-e)[:, None]  # as quantize_pow2_rows: x / 2^e, then the clamp and one cast
    codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    # each code's value looked up (torch's own cast, tabled: its cast back is scalar, ~5x slower)
    written = torch.index_select(E4M3_BY_CODE, 0, codes.view(-1).to(torch.int32)).view(codes.shape)
    scale2 = four_to(e)[:, None]  # back to the value's units: a power of two, exact
    err2 = written.sub_(y).to(torch.float64).square_().mul_(scale2)
    magnitude = y.abs_()
    # codes no block holds, counted 0 times, 0 here: NaN's, and any past float32
    err2[:, NAN_MAGNITUDE] = 0.0
    absent = None
    if not bool(magnitude[:, :NAN_MAGNITUDE].amax() < math.inf):
        absent = ~torch.isfinite(magnitude)
        err2.masked_fill_(absent, 0.0)
    return _Written(codes, err2, magnitude, absent)


def codes_of(blocks: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """uint8 [M, bn, bk]: blocks [gn, bn, gk, bk]'s codes at (g, c); a row's groups (bn = 1) are rows of bytes,
    gathered whole."""
    gn, bn, gk, bk = blocks.shape
    if bn == 1:
        return torch.index_select(blocks.view(gn * gk, bk), 0, g * gk + c).view(-1, 1, bk)
    return blocks.permute(0, 2, 1, 3)[g, c]


def codes_at(blocks: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """uint8 [M, bn, bk]: the codes of blocks [gn, bn, gk, bk] at flat indexes `at` (g x gk + c)."""
    gk = blocks.shape[2]
    if blocks.shape[1] == 1:
        return torch.index_select(blocks.view(-1, blocks.shape[3]), 0, at).unsqueeze(1)
    return codes_of(blocks, torch.div(at, gk, rounding_mode="floor"), at % gk)


def in_order_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """float64 sum over `dim`, one term after another in index order: a cumulative sum's last (its scan adds
    in order on every machine, where a reduction's vector lanes differ between AVX2 and AVX-512): one op
    where halving takes three a level, and these sums are a band's many small ones."""
    return values.cumsum(dim).select(dim, -1)


def table_sums(counts: torch.Tensor, tables: Tables, rows: torch.Tensor | slice) -> torch.Tensor:
    """float64 [R, 4]: per table (tables' rows, magnitude counts [R, 128]): squared error and squared values
    (count x term, summed over the codes in their order), saturated and flushed values (exact integers)."""
    n = scratch("pow2 table counts", tuple(counts.shape), torch.float64).copy_(counts)  # reused: no page faults
    terms = scratch("pow2 table terms", (2, *counts.shape), torch.float64)
    torch.mul(n, tables.err2[rows], out=terms[0])
    torch.mul(n, tables.norm2[rows], out=terms[1])
    sums = torch.zeros((counts.shape[0], 4), dtype=torch.float64)
    sums[:, :2] = in_order_sum(terms, 2).T
    for column, marked in ((2, tables.saturated[rows]), (3, tables.flushed[rows])):
        codes = torch.nonzero(marked.any(dim=0))[:, 0]  # a few: the largest codes saturate, the smallest flush
        if codes.numel():  # a masked sum over those codes (an int64 x bool product takes a slow path, ~7x)
            span = slice(int(codes[0]), int(codes[-1]) + 1)
            sums[:, column] = torch.where(marked[:, span], counts[:, span], 0).sum(dim=1)
    return sums


def slot_sums(
    sums: torch.Tensor, chunk_of: torch.Tensor, slots: torch.Tensor, chunks: int, width: int
) -> list[ReportSums]:
    """Each chunk's report from its tables' sums [R, 4] (table_sums), the table in row r at slot slots[r] of
    chunk chunk_of[r] (its key's place among the chunk's `width`; empty slots zero, which add exactly): summed
    over the slots in their order, all chunks at once."""
    dense = torch.zeros((chunks, width, 4), dtype=torch.float64)
    dense[chunk_of, slots] = sums
    err2, norm2 = in_order_sum(dense[:, :, :2], 1).T.tolist()
    saturated, flushed = dense[:, :, 2:].sum(dim=1).to(torch.int64).T.tolist()
    return list(zip(err2, norm2, saturated, flushed, strict=True))
