"""The error report of a requantization to power-of-two scales: per tensor, how far the written values
are from the input's own (float32, dequantized) values, and how many saturated or flushed to zero.

Torch-free (the CLI prints it); fp8conv.rewrite.pow2 measures it: a report, not output bytes, so its
float64 sums run in torch's order (the last digits may differ by vector unit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class TensorError:
    """relative_frobenius: ||written - input|| / ||input|| (0 for an all-zero input); elements: counted."""

    relative_frobenius: float
    saturated: int  # |x| above 448 x its block's scale: clamped to +-448
    flushed: int  # x nonzero, written as zero (below e4m3's smallest step at its block's scale)
    elements: int
    exact: bool = False  # the input's bytes and exponents kept as they are

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exact(elements: int) -> TensorError:
    return TensorError(0.0, 0, 0, elements, exact=True)


def summary(errors: dict[str, TensorError]) -> dict[str, Any]:
    """The run's aggregate: the worst tensor, the element-weighted mean, and the counts."""
    if not errors:
        return {}
    worst = max(errors, key=lambda name: errors[name].relative_frobenius)
    elements = sum(e.elements for e in errors.values())
    return {
        "tensors": len(errors),
        "exact": sum(e.exact for e in errors.values()),
        "worst_tensor": worst,
        "worst_relative_frobenius": errors[worst].relative_frobenius,
        "mean_relative_frobenius": sum(e.relative_frobenius * e.elements for e in errors.values()) / max(elements, 1),
        "saturated": sum(e.saturated for e in errors.values()),
        "flushed": sum(e.flushed for e in errors.values()),
    }


def requant_record(errors: dict[str, TensorError]) -> dict[str, Any] | None:
    """The manifest's and --json's record: the summary and every tensor's report, by name."""
    if not errors:
        return None
    return {"summary": summary(errors), "tensors": {name: errors[name].to_dict() for name in sorted(errors)}}


def summary_line(record: dict[str, Any] | None) -> str | None:
    """The terminal's one line for requant_record's record."""
    if not record:
        return None
    s = record["summary"]
    return (
        f"requantized {s['tensors']} tensor(s) to power-of-two scales ({s['exact']} exact, bytes kept): relative "
        f"error mean {s['mean_relative_frobenius']:.3%}, worst {s['worst_relative_frobenius']:.3%} "
        f"({s['worst_tensor']}); {s['saturated']} saturated, {s['flushed']} flushed to zero"
    )
