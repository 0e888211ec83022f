"""Why a tensor is wrong, when the pattern is one the public bug reports keep showing.

Each hypothesis is a way of misreading the source (its scale dropped, inverted, read in another block
size, UE8M0 exponents read as integers): the source is decoded that way and the output judged against it.
A hypothesis is named only when every element of the output then passes, so a cause is never a guess.
Rows in another order are found by the rows themselves; a flipped bit by the stored bits.
"""

from __future__ import annotations

import math

import torch

from ...backends.scales import scale_to_float32
from ...model.classify import Kind
from ...source.index import CheckpointIndex
from .judge import Judgement, TruthReader, judge
from .values import Files, Values, plain_values, scaled_fp8_values

MAX_PERMUTED_ROWS = 1 << 20  # rows fingerprinted to find a permutation


def likely_cause(
    source: Values,
    index: CheckpointIndex,
    files: Files,
    other: Values,
    judgement: Judgement,
    band_elements: int,
    truth: TruthReader,
) -> str | None:
    flipped = _flipped_bits(judgement)
    if flipped:
        return flipped
    for cause, misread in _misreadings(source, index, files):
        if judge(misread.values_of, other, band_elements, misread.row_unit).verdict != "wrong":
            return cause
    return _permuted_rows(truth, other, judgement, band_elements)


def _misreadings(source: Values, index: CheckpointIndex, files: Files) -> list[tuple[str, Values]]:
    fmt = source.fmt
    if fmt is None or not source.fp8 or fmt.scale is None:
        return []
    entry, scale_entry = index.entry(fmt.weight), index.entry(fmt.scale)
    found = [
        (
            "the scale was not applied: the values are the FP8 codes themselves (off by 1/scale)",
            plain_values(fmt.weight, entry, files),
        ),
        (
            "the scale was applied inverted: codes divided by weight_scale_inv instead of multiplied",
            scaled_fp8_values(fmt, entry, index, files, decode_scale=lambda s: 1 / scale_to_float32(s)),
        ),
    ]
    if scale_entry.dtype in ("U8", "F8_E8M0"):
        found.append(
            (
                "E8M0 scales read as integers (the byte b used as the scale instead of 2^(b-127))",
                scaled_fp8_values(fmt, entry, index, files, decode_scale=_integer_exponents),
            )
        )
    if fmt.kind is Kind.BLOCK and fmt.block:
        n, k = entry.shape[-2], entry.shape[-1]
        bn, bk = fmt.block
        gn, gk = math.ceil(n / bn), math.ceil(k / bk)
        for guess in {(n // gn, k // gk), (math.ceil(n / gn), math.ceil(k / gk))}:
            if guess != (bn, bk) and min(guess) > 0:
                found.append(
                    (
                        f"block size {guess} inferred from the scale grid ({gn} x {gk}) instead of the "
                        f"checkpoint's {(bn, bk)}",
                        scaled_fp8_values(fmt, entry, index, files, block=guess),
                    )
                )
    return found


def _integer_exponents(stored: torch.Tensor) -> torch.Tensor:
    return stored.view(torch.uint8).to(torch.float32)


def _flipped_bits(j: Judgement) -> str | None:
    """A few wrong elements, each one bit away from the right storage: a corrupted byte, not arithmetic."""
    if not j.samples or j.wrong > len(j.samples):
        return None
    bits = []
    for e in j.samples:
        if e.got_bits is None or e.expected_bits is None:
            return None
        diff = (e.got_bits ^ e.expected_bits) & 0xFFFFFFFF
        if diff == 0 or diff & (diff - 1):
            return None
        bits.append(f"{list(e.index[1:]) if e.index[0] == 0 else list(e.index)} bit {diff.bit_length() - 1}")
    return f"{len(bits)} element(s) one bit away from the right value (a flipped bit): " + ", ".join(bits)


def _permuted_rows(truth: TruthReader, other: Values, j: Judgement, band_elements: int) -> str | None:
    """Each wrong row equal to another row of the exact values (rounded as the output stores them)."""
    dtype = other.float_dtype
    if dtype is None or other.rows * other.matrices > MAX_PERMUTED_ROWS or not j.wrong_rows:
        return None
    wanted: dict[tuple[float, float], list[tuple[int, int]]] = {}
    got_prints: dict[tuple[int, int], tuple[float, float]] = {}
    wrong = {(m, r) for m, a, b in j.wrong_ranges for r in range(a, b)}
    if len(wrong) != j.wrong_rows:  # more ranges than kept: the mapping could not be shown whole
        return None
    step = max(1, band_elements // max(other.cols, 1))
    for m in range(other.matrices):
        for r0 in range(0, other.rows, step):
            r1 = min(r0 + step, other.rows)
            expected = truth(m, r0, r1).to(dtype).to(torch.float64)
            got = other.read(m, r0, r1).values.to(torch.float64)
            for r, p in enumerate(_fingerprints(expected)):
                wanted.setdefault(p, []).append((m, r0 + r))
            for r, p in enumerate(_fingerprints(got)):
                if (m, r0 + r) in wrong:
                    got_prints[(m, r0 + r)] = p
    moves = []
    for row, p in sorted(got_prints.items()):
        places = [w for w in wanted.get(p, []) if w != row]
        if not places:
            return None
        moves.append((row, places[0]))
    return "rows in another order: " + _describe_moves(moves)


def _fingerprints(rows: torch.Tensor) -> list[tuple[float, float]]:
    weights = torch.arange(1, rows.shape[1] + 1, dtype=torch.float64)
    return list(zip(rows.sum(dim=1).tolist(), (rows * weights).sum(dim=1).tolist(), strict=True))


def _describe_moves(moves: list[tuple[tuple[int, int], tuple[int, int]]]) -> str:
    """Runs of consecutive rows moved together: 'rows 0-95 hold rows 96-191 of the input'."""
    runs: list[list[int]] = []  # [matrix, first, last, source first]
    for (m, r), (sm, sr) in moves:
        last = runs[-1] if runs else None
        if last and last[0] == m == sm and last[2] + 1 == r and last[3] + (r - last[1]) == sr:
            last[2] = r
        else:
            runs.append([m, r, r, sr])
    shown = [
        (f"matrix {m} " if m else "")
        + (f"row {a}" if a == b else f"rows {a}-{b}")
        + f" hold input row{'s' if a != b else ''} "
        + (f"{s}" if a == b else f"{s}-{s + b - a}")
        for m, a, b, s in runs[:6]
    ]
    more = f" (and {len(runs) - 6} more runs)" if len(runs) > 6 else ""
    return "; ".join(shown) + more
