"""Power-of-two (UE8M0) block scales: the definition every backend runs (plain torch, any device).

A block's scale is 2^e, stored as the E8M0 byte e + 127. From float values (bf16 masters): e is the
smallest exponent with 448 * 2^e >= max(amax, 1e-4), the scale DeepGEMM's per_block_cast_to_fp8
(use_ue8m0=True) aims at, computed exactly from the bits (frexp) rather than through a rounded
log2(amax / 448), so no value saturates. From values that were FP8 already (a second rounding): that
exponent and the few below it are tried, and each block takes the one whose squared error against
the float32 values is least (saturation at 448 counted), ties going to the larger exponent. The
errors are summed in float64 from exact squares, in a fixed pairwise order: the choice never depends
on the device or its vector unit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# e4m3 codes -> float32 written into a given tensor laid out as the codes, bit for bit torch's cast (None:
# torch's cast itself)
Decode = Callable[[torch.Tensor, torch.Tensor], None] | None
# quantize_pow2_rows' temporaries: (key, shape, dtype) -> a tensor the caller may overwrite until it asks
# for the same key again
Buffers = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]

FP8_MAX = 448.0
HALF_FP8_MAX = 224.0  # an e4m3 value: the largest a block one exponent lower holds unclamped
AMAX_FLOOR = 1e-4  # DeepGEMM's: an all-zero block still gets a finite scale
E8M0_BIAS = 127
SEARCH_BELOW = 3  # exponents tried below the ceiling one when requantizing FP8 values
FLOAT32_BIAS = 127  # float32's exponent bias (the E8M0 byte uses the same)
FLOAT32_EXPONENT_SHIFT = 23


def ceil_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 e, smallest with 448 * 2^e >= max(amax, 1e-4). 448 = 0.875 * 2^9, so with amax = m * 2^E
    (m in [0.5, 1)) e is E - 9, plus one when m > 0.875: exact, no rounded division or logarithm."""
    mantissa, exponent = torch.frexp(torch.clamp(amax, min=AMAX_FLOOR))
    return exponent.to(torch.int32) - 9 + (mantissa > 0.875).to(torch.int32)


def powers_of_two(exponents: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from its bits (e in [-126, 127]: every exponent used here)."""
    return ((exponents.to(torch.int32) + FLOAT32_BIAS) << FLOAT32_EXPONENT_SHIFT).view(torch.float32)


def quantize_at(blocks: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """blocks [G, bn, gk, bk] float32 over scales 2^exponents [G, gk]: clamp(x / 2^e), one cast to e4m3."""
    scale = powers_of_two(exponents)[:, None, :, None]
    return (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def block_squared_errors(
    blocks: torch.Tensor, q: torch.Tensor, exponents: torch.Tensor, decode: Decode = None
) -> torch.Tensor:
    """[G, gk] float64: sum over each block of (q * 2^e - x)^2. The difference is exact in float32 (q * 2^e
    is x rounded to a coarser grid, or clamped, or zero) and its square exact in float64; the sum runs
    pairwise over the block's values in a fixed order of element-wise adds (block_sums). decode: e4m3 -> float32 into
    a given tensor, bit for bit torch's cast (the default)."""
    values = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    (decode or torch_decode)(q, values)
    diff = values.mul_(powers_of_two(exponents)[:, None, :, None]).sub_(blocks)
    squares = diff.to(torch.float64)
    squares.mul_(squares)
    return block_sums(squares)


def torch_decode(q: torch.Tensor, out: torch.Tensor) -> None:
    """e4m3 codes into float32 `out`: torch's own cast (the definition)."""
    out.copy_(q)


def pairwise_sum_(values: torch.Tensor, dim: int) -> torch.Tensor:
    """pairwise_sum's adds, in place (no temporary per halving): `values` is overwritten."""
    n = values.shape[dim]
    while n > 1:
        half = n // 2
        values.narrow(dim, 0, half).add_(values.narrow(dim, half, half))
        if n % 2:
            values.narrow(dim, 0, 1).add_(values.narrow(dim, n - 1, 1))
        n = half
    return values.narrow(dim, 0, 1).squeeze(dim)


def pairwise_sum(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` by halving: the same adds in the same order on every device."""
    while values.shape[dim] > 1:
        n = values.shape[dim]
        half = n // 2
        summed = values.narrow(dim, 0, half) + values.narrow(dim, half, half)
        if n % 2:
            summed.narrow(dim, 0, 1).add_(values.narrow(dim, n - 1, 1))
        values = summed
    return values.squeeze(dim)


def choose_exponents(blocks: torch.Tensor, amax: torch.Tensor, search: bool, decode: Decode = None) -> torch.Tensor:
    """int32 [G, gk]: the ceiling exponent, or (search) the one of it and SEARCH_BELOW below it whose block
    squared error is least (the first, i.e. the largest, on a tie): search_exponents over the blocks' values,
    on the blocks ceiling_wins cannot settle."""
    ceiling = ceil_exponents(amax)
    if not search:
        return ceiling

    def errors_at(g: torch.Tensor, gk: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
        subset = blocks.permute(0, 2, 1, 3)[g, gk].unsqueeze(2)  # [M, bn, 1, bk]: the open blocks alone
        return block_squared_errors(subset, quantize_at(subset, exponents), exponents, decode)

    open_blocks = ~ceiling_wins(amax, ceiling, blocks.shape[1] * blocks.shape[3])
    return search_exponents(amax, ceiling, open_blocks, errors_at)


# (block rows, block columns, exponents [M, 1]) of M blocks -> float64 [M, 1]: each block's squared error
# written at that exponent, summed as block_squared_errors sums it
ErrorsAt = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def search_exponents(
    amax: torch.Tensor, ceiling: torch.Tensor, open_blocks: torch.Tensor, errors_at: ErrorsAt
) -> torch.Tensor:
    """int32 [G, gk]: the ceiling exponents, except in open_blocks (those ceiling_wins cannot settle) the one of
    the ceiling and SEARCH_BELOW below it whose squared error (errors_at) is least, the first (the largest)
    on a tie. Over the ceiling and the one below it only where every open block's largest value is above 224
    x 2^e (any block not held up by AMAX_FLOOR): two or more below, that value alone clamps at 112 x 2^e or
    lower, an error over 112 x 2^e, more than every other value can gain (ceiling_wins). The same answer,
    without the trial quantizations that cannot win."""
    if not bool(open_blocks.any()):
        return ceiling
    g, gk = torch.nonzero(open_blocks, as_tuple=True)
    below = 1 if bool((amax[g, gk] > HALF_FP8_MAX * powers_of_two(ceiling[g, gk])).all()) else SEARCH_BELOW
    candidates = torch.stack([ceiling[g, gk][:, None] - i for i in range(below + 1)])  # [C, M, 1]
    errors = torch.stack([errors_at(g, gk, e) for e in candidates])
    best = torch.argmin(errors, dim=0)  # the first minimum: the largest exponent among equals
    chosen = ceiling.clone()
    chosen[g, gk] = torch.gather(candidates, 0, best[None])[0][:, 0]
    return chosen


def ceiling_wins(amax: torch.Tensor, ceiling: torch.Tensor, block_elements: int) -> torch.Tensor:
    """bool [G, gk]: blocks where no exponent below the ceiling e can have a smaller squared error, known
    from the block's largest value a alone. Scaled by 2^e (exact), every value is at most 448:
    - a value normal at both e and e' < e rounds to the same multiple of a power of two (e4m3's rounding
      is relative: a power-of-two scale moves no mantissa bit), so its error is the same;
    - a value above T = 448 x 2^e' clamps there at e', an error of |x| - T, while at e it is no further
      from its nearest e4m3 value than from T, which is one (224, 112, 56 x 2^e are e4m3 values): it only
      loses, and loses more the lower e' is; a lowers by at least (a - 224 x 2^e)^2 - err_e(a)^2 already at
      e - 1;
    - only values subnormal at e can gain, each at most its whole error there, under 2^-10 x 2^e.
    So e wins (ties go to it) where a' > 224 and (a' - 224)^2 - err(a')^2 >= block_elements x 2^-20, a' = a / 2^e
    and err(a') its e4m3 rounding error: exact float32 differences, squared exactly in float64, compared
    with a margin far above their rounding; and in an all-zero block (every error zero). a' is above 224
    unless AMAX_FLOOR set the ceiling: there nothing clamps one exponent lower, which may win. The search
    decides the rest (a' barely above 224: a few percent)."""
    scaled = amax / powers_of_two(ceiling)  # exact: a power of two
    rounded = scaled.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    lead = (scaled - HALF_FP8_MAX).to(torch.float64)
    err = (rounded - scaled).to(torch.float64)
    bound = block_elements * 2.0**-20
    wins = (lead > 0) & ((lead * lead - err * err) > bound + 2.0**-20 + bound * 2.0**-30)
    return wins | (amax == 0)


# One chunk of rows' error-report sums: squared error and squared values (float64 sums, each term in units
# of its block's scale, times 4^e), saturated values, values flushed to zero
ReportSums = tuple[float, float, int, int]


def quantize_pow2_rows(
    x: torch.Tensor, block: tuple[int, int], search: bool, q_out: torch.Tensor, decode: Decode, buffers: Buffers
) -> tuple[torch.Tensor, ReportSums]:
    """Rows x [r, K] float32 (whole block rows, or the matrix's last) quantized into q_out [r, K] e4m3 with
    power-of-two block scales (choose_exponents), and their report's sums, in one pass over the rows:
    (E8M0 bytes [ceil(r/bn), ceil(K/bk)] uint8, ReportSums). decode: e4m3 -> float32 into a given tensor,
    bit for bit torch's cast (a backend may do it faster); buffers: the temporaries (a backend may reuse
    them). x is not changed.

    Each block in units of its scale, y = x / 2^e (exact; at most 448 in magnitude at the ceiling, so no
    square overflows float32): per block, (value(q) - y)^2 and y^2 summed in float32 in a fixed pairwise
    order (block_sums; elementwise adds only: the same digits on every device and vector unit), then times
    4^e in float64 and summed pairwise over the rows' blocks (chunk_report). Saturated: |y| > 448, looked
    for (and clamped) only in blocks whose largest value is over 448 there (below their ceiling). Flushed:
    nonzero inputs less nonzero outputs."""
    r, k = x.shape
    bn, bk = block
    blocks = blocks_of(x, bn, bk)
    shape = tuple(blocks.shape)
    gr, gk = shape[0], shape[2]
    aligned = blocks.data_ptr() == x.data_ptr() and q_out.is_contiguous()
    q = q_out.view(shape) if aligned else buffers("pow2 q", shape, torch.float8_e4m3fn)
    # max(amax, -amin): two fast reductions, no abs pass (as CpuBackend.quantize_blocks); NaN propagates
    amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), blocks.amin(dim=3).amin(dim=1).neg_())
    exponents = choose_exponents(blocks, amax, search, decode)
    y = torch.mul(blocks, powers_of_two(-exponents)[:, None, :, None], out=buffers("pow2 y", shape, torch.float32))
    q.copy_(y)
    saturated = _clamp_saturated(y, q, amax, exponents)
    if not aligned:
        q_out.copy_(q.view(gr * bn, gk * bk)[:r, :k])
    return (exponents + E8M0_BIAS).to(torch.uint8), chunk_report(blocks, y, q, exponents, saturated, decode, buffers)


def chunk_report(
    x: torch.Tensor,
    y: torch.Tensor,
    q: torch.Tensor,
    exponents: torch.Tensor,
    saturated: int,
    decode: Decode,
    buffers: Buffers,
) -> ReportSums:
    """The report's sums of one chunk as written (quantize_pow2_rows' definition): x its values' blocks
    [gr, bn, gk, bk] (zero padding counts nothing), y = x / 2^e laid out as x (overwritten: its squares), q
    the written codes laid out as x, exponents [gr, gk], saturated as the caller counted it."""
    errors = buffers("pow2 errors", tuple(y.shape), torch.float32)  # value(q), then (value(q) - y)^2
    (decode or torch_decode)(q, errors)
    flushed = nonzero_values(x, buffers) - nonzero_values(errors, buffers)  # value(q) is +-0 where q's code is
    errors.sub_(y)
    squares = 4.0 ** exponents.to(torch.float64)
    err2 = block_sums(errors.mul_(errors)).to(torch.float64).mul_(squares)
    norm2 = block_sums(y.mul_(y)).to(torch.float64).mul_(squares)  # y is done with: its squares in place
    return (sum64(err2), sum64(norm2), saturated, flushed)


COUNT_PIECE = 1 << 24  # float32 sums of ones are exact below 2^24, whatever order the adds take


def nonzero_values(values: torch.Tensor, buffers: Buffers) -> int:
    """How many values are not +-0 (NaN counts): a float32 compare into ones and zeros and their sum, in pieces
    under 2^24, so exact on every device. torch.count_nonzero of float32 runs ~18x slower on the CPU (2.8 ns
    a value against 0.15), of the codes' magnitude bytes ~2x."""
    flat = values.reshape(-1)
    ones = buffers("pow2 nonzero", tuple(flat.shape), torch.float32)
    torch.ne(flat, 0, out=ones)
    return sum(int(ones[i : i + COUNT_PIECE].sum()) for i in range(0, flat.numel(), COUNT_PIECE))


def _blocks_over_range(amax: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(block rows, block columns) of the blocks whose largest value is over 448 in units of their scale
    (possible only below the ceiling; a few, if any), or None."""
    over = amax * powers_of_two(-exponents) > FP8_MAX
    return torch.nonzero(over, as_tuple=True) if bool(over.any()) else None


def _clamp_saturated(y: torch.Tensor, q: torch.Tensor, amax: torch.Tensor, exponents: torch.Tensor) -> int:
    """q [gr, bn, gk, bk] cast from y unclamped: the blocks over 448 cast again from y clamped to +-448.
    Returns how many values saturated."""
    over = _blocks_over_range(amax, exponents)
    if over is None:
        return 0
    blocks = y.permute(0, 2, 1, 3)[over]  # [M, bn, bk] copies: y itself stays unclamped for the report
    saturated = int(torch.count_nonzero(blocks.abs() > FP8_MAX))
    clamped = blocks.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    q.view(torch.uint8).permute(0, 2, 1, 3)[over] = clamped
    return saturated


def saturated_values(y: torch.Tensor, amax: torch.Tensor, exponents: torch.Tensor) -> int:
    """How many values of blocks y [gr, bn, gk, bk] (in units of their scales) are over 448."""
    over = _blocks_over_range(amax, exponents)
    return 0 if over is None else int(torch.count_nonzero(y.permute(0, 2, 1, 3)[over].abs() > FP8_MAX))


def fresh_buffers(device: torch.device | str) -> Buffers:
    """quantize_pow2_rows' temporaries, allocated anew each time on `device`."""
    return lambda key, shape, dtype: torch.empty(shape, dtype=dtype, device=device)


def sum64(values: torch.Tensor) -> float:
    """Every value, float64, pairwise in a fixed order."""
    return float(pairwise_sum(values.reshape(-1).to(torch.float64), 0)) if values.numel() else 0.0


def blocks_of(rows: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """[r, K] as [ceil(r/bn), bn, ceil(K/bk), bk]: a view, or zero-padded where r or K is not whole blocks
    (zeros add nothing to any sum or count)."""
    r, k = rows.shape
    gr, gk = -(-r // bn), -(-k // bk)
    if (r, k) != (gr * bn, gk * bk) or not rows.is_contiguous():
        padded = torch.zeros(gr * bn, gk * bk, dtype=rows.dtype, device=rows.device)
        padded[:r, :k] = rows
        rows = padded
    return rows.view(gr, bn, gk, bk)


def block_sums(values: torch.Tensor) -> torch.Tensor:
    """[gr, bn, gk, bk] -> [gr, gk]: each block's sum, pairwise over its rows (adds of whole rows of the
    chunk: fast), then its columns. `values` (a temporary) is overwritten."""
    return pairwise_sum(pairwise_sum_(values, 1), 2)
