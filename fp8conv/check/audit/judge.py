"""One output tensor against the exact values it should hold, band by band, element by element.

Each element is exact, the nearest-even rounding of the exact value to the output's storage (a float
dtype, or e4m3 or INT8 at the element's stored scale), within one step of it (another rounding: toward
zero, stochastic), or wrong. FP8 outputs are judged at the scale they store: whatever scale another tool
chose, each value must be e4m3's rounding of the exact value at that scale (|q*s - w| <= 2^-4 |w| + s * 2^-9,
plus what a saturating tool clamped); INT8 ones the nearest integer step of their row's scale (within one
step: |q*s - w| < s, plus what was clamped at 127 steps). A tensor is judged by its worst element.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...backends.scratch import scratch
from ...dtypes import INT8_MAX
from .int8_rows import expected_codes
from .values import Band, Values

FP8_MAX = 448.0
MAX_SAMPLES = 16  # wrong elements kept with their bits (a flipped bit shows in them)
MAX_RANGES = 64  # wrong row ranges kept for the report

TruthReader = Callable[[int, int, int], torch.Tensor]  # (matrix, r0, r1) -> float32 [r1 - r0, K]

# significand bits and the smallest step of the float dtypes an output may store
_PRECISION = {torch.bfloat16: (8, -133), torch.float16: (11, -24), torch.float32: (24, -149)}
_BITS_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@dataclass
class WrongElement:
    index: tuple[int, ...]
    got: float
    expected: float
    got_bits: int | None
    expected_bits: int | None


@dataclass
class Judgement:
    elements: int = 0
    exact: int = 0
    nearest: int = 0  # the nearest-even rounding (exact ones included)
    within_step: int = 0  # within one step of the storage (the above included)
    nonfinite: int = 0  # NaN or Inf where the exact value is finite
    worst: WrongElement | None = None
    worst_error: float = -1.0
    error_sq: float = 0.0
    truth_sq: float = 0.0
    wrong_ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (matrix, first row, end row)
    wrong_rows: int = 0
    samples: list[WrongElement] = field(default_factory=list)
    wrong_columns: torch.Tensor | None = None  # bool [K]: a column wrong in any row

    @property
    def wrong(self) -> int:
        return self.elements - self.within_step

    @property
    def verdict(self) -> str:
        if self.wrong:
            return "wrong"
        if self.exact == self.elements:
            return "exact"
        return "rounded" if self.nearest == self.elements else "within-step"

    @property
    def relative_error(self) -> float:
        """||got - exact|| / ||exact|| over the tensor."""
        if self.truth_sq == 0:
            return 0.0 if self.error_sq == 0 else math.inf
        return math.sqrt(self.error_sq / self.truth_sq)

    def _add_ranges(self, m: int, r0: int, rows: torch.Tensor) -> None:
        self.wrong_rows += int(rows.numel())
        for r in rows.tolist():
            last = self.wrong_ranges[-1] if self.wrong_ranges else None
            if last is not None and last[0] == m and last[2] == r0 + r:
                self.wrong_ranges[-1] = (m, last[1], r0 + r + 1)
            elif len(self.wrong_ranges) < MAX_RANGES:
                self.wrong_ranges.append((m, r0 + r, r0 + r + 1))


def band_rows(values: Values, unit: int, band_elements: int) -> int:
    unit = max(unit, values.row_unit, 1)
    return max(unit, band_elements // max(values.cols, 1) // unit * unit)


def judge(truth: TruthReader, other: Values, band_elements: int, unit: int = 1) -> Judgement:
    """Every element of `other` against `truth`, in bands of whole row units."""
    j = Judgement()
    step = band_rows(other, unit, band_elements)
    for m in range(other.matrices):
        for r0 in range(0, other.rows, step):
            r1 = min(r0 + step, other.rows)
            compare_band(truth(m, r0, r1), other.read(m, r0, r1), other, j, (m, r0))
    return j


def expected_storage(t: torch.Tensor, got: Band, other: Values) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The nearest-even rounding of the exact values to the output's storage, and its bits."""
    dtype = other.float_dtype
    if dtype is not None:
        stored = t.to(dtype)
        return stored.to(torch.float32), stored.view(_BITS_VIEW[dtype])
    if got.scale is not None and other.int8:
        codes = expected_codes(t, got.scale)
        return codes.to(torch.float32) * got.scale, codes
    if got.scale is not None:
        s = got.scale
        # a zero scale makes 0/0 NaN here: such an element is judged exact or wrong, never nearest
        codes = (t / s).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return codes.to(torch.float32) * s, codes.view(torch.uint8)
    return t, None


def _expected_bits(t: torch.Tensor, got: Band, other: Values) -> torch.Tensor | None:
    """The bits the output should store (nearest-even rounding of the exact values), when its stored
    elements are at hand: a float dtype's, or e4m3 codes at the output's own scales."""
    if got.bits is None:
        return None
    dtype = other.float_dtype
    if dtype is not None:
        return scratch("audit expected", tuple(t.shape), dtype).copy_(t).view(_BITS_VIEW[dtype])
    if got.scale is not None and other.int8:
        return expected_codes(t, got.scale)
    if got.scale is not None:
        ratio = torch.div(t, got.scale, out=scratch("audit ratio", tuple(t.shape), torch.float32))
        codes = scratch("audit expected", tuple(t.shape), torch.float8_e4m3fn)
        return codes.copy_(ratio.clamp_(-FP8_MAX, FP8_MAX)).view(torch.uint8)
    return None


def _within_step(t: torch.Tensor, g: torch.Tensor, got: Band, other: Values) -> torch.Tensor:
    dtype = other.float_dtype
    if dtype is not None:
        bits, smallest = _PRECISION[dtype]
        _, exponent = torch.frexp(t)
        step = torch.ldexp(torch.ones_like(t), (exponent - bits).clamp_(min=smallest))
        return (g - t).abs() < step
    if got.scale is not None and other.int8:
        s = got.scale
        return (g - t).abs() < s + (t.abs() - INT8_MAX * s).clamp_(min=0)
    if got.scale is not None:
        s = got.scale
        bound = t.abs() * 2**-4 + s * 2**-9 + (t.abs() - FP8_MAX * s).clamp_(min=0)
        return (g - t).abs() <= bound
    return torch.zeros_like(t, dtype=torch.bool)


def compare_band(t: torch.Tensor, got: Band, other: Values, j: Judgement, at: tuple[int, int]) -> None:
    g = got.values
    if g.shape != t.shape:  # the caller checked the shapes; a reader giving another is a bug
        raise AssertionError(f"band of {other.name}: {tuple(g.shape)} against {tuple(t.shape)}")
    if not _all_nearest(t, got, other, j):
        _compare_each(t, got, other, j, at)


def _all_nearest(t: torch.Tensor, got: Band, other: Values, j: Judgement) -> bool:
    """The common case, counted in a few passes: every element is the nearest-even rounding of its exact
    value and everything is finite. False (nothing counted) sends the band to the element-wise judge."""
    g = got.values
    expected = _expected_bits(t, got, other)
    if expected is not None:  # the stored bits themselves: no decode of the expected storage
        assert got.bits is not None
        if not bool(torch.equal(expected, got.bits.view(expected.dtype))):  # (-0 for +0 too: judged each)
            return False
    elif not bool(torch.equal(g, expected_storage(t, got, other)[0])):  # NaN != NaN: judged each
        return False
    flat_g, flat_t = g.reshape(-1), t.reshape(-1)
    diff = torch.sub(flat_g, flat_t, out=scratch("audit diff", flat_t.shape, torch.float32))
    error_sq, truth_sq = float(torch.dot(diff, diff)), float(torch.dot(flat_t, flat_t))
    if not (math.isfinite(error_sq) and math.isfinite(truth_sq)):
        return False
    j.elements += t.numel()
    j.exact += int(torch.count_nonzero(torch.eq(flat_g, flat_t, out=scratch("audit same", flat_t.shape, torch.bool))))
    j.nearest += t.numel()
    j.within_step += t.numel()
    j.error_sq += error_sq
    j.truth_sq += truth_sq
    return True


def _compare_each(t: torch.Tensor, got: Band, other: Values, j: Judgement, at: tuple[int, int]) -> None:
    g = got.values
    both_nan = torch.isnan(g) & torch.isnan(t)
    exact = (g == t) | both_nan
    near, near_bits = expected_storage(t, got, other)
    nearest = exact | (g == near) | (torch.isnan(near) & torch.isnan(g))
    within = nearest | _within_step(t, g, got, other)
    j.elements += t.numel()
    j.exact += int(exact.sum())
    j.nearest += int(nearest.sum())
    j.within_step += int(within.sum())
    j.nonfinite += int((~torch.isfinite(g) & torch.isfinite(t)).sum())
    diff = torch.where(both_nan, 0.0, (g - t).to(torch.float64))
    j.error_sq += float(torch.nan_to_num(diff.square(), nan=math.inf).sum())
    j.truth_sq += float(torch.nan_to_num(t.to(torch.float64).square(), nan=0.0, posinf=0.0).sum())
    wrong = ~within
    if not bool(wrong.any()):
        return
    m, r0 = at
    j._add_ranges(m, r0, wrong.any(dim=1).nonzero().flatten())
    columns = wrong.any(dim=0)
    j.wrong_columns = columns if j.wrong_columns is None else j.wrong_columns | columns
    error = torch.where(wrong, torch.nan_to_num((g - t).abs(), nan=math.inf), -1.0)
    flat = int(error.argmax())
    if float(error.flatten()[flat]) > j.worst_error:
        j.worst_error = float(error.flatten()[flat])
        j.worst = _element(flat, t, g, got, near_bits, m, r0)
    for flat_index in wrong.flatten().nonzero().flatten()[: MAX_SAMPLES - len(j.samples)].tolist():
        j.samples.append(_element(flat_index, t, g, got, near_bits, m, r0))


def _element(flat: int, t, g, got: Band, near_bits, m: int, r0: int) -> WrongElement:
    k = t.shape[1]
    row, col = divmod(flat, k)
    got_bits = int(got.bits.reshape(-1)[flat].view(_int_view(got.bits)).item()) if got.bits is not None else None
    expected_bits = int(near_bits.reshape(-1)[flat].item()) if near_bits is not None else None
    return WrongElement((m, r0 + row, col), float(g[row, col]), float(t[row, col]), got_bits, expected_bits)


def _int_view(bits: torch.Tensor) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[bits.element_size()]
