"""The error report of a requantization to power-of-two scales or to INT8 rows: per tensor, how far the written
values are from the input's own (float32, dequantized) values, and how many saturated or flushed to zero (INT8
rows: not counted, see backends.row_report).

Torch-free (the CLI prints it); fp8conv.rewrite.pow2 and rewrite.int8_report measure it, with float64 sums in a
fixed order: the same digits on every host, thread count and split of the run into parts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TensorError:
    """relative_frobenius: ||written - input|| / ||input|| (0 for an all-zero input); elements: counted."""

    relative_frobenius: float
    saturated: int  # |x| above 448 x its block's scale: clamped to +-448
    flushed: int | None  # x nonzero, written as zero (below e4m3's smallest step); None: not counted (INT8)
    elements: int
    exact: bool = False  # the input's bytes and exponents kept as they are
    # --merge-lora, a merged weight (relative_frobenius then measures the output against the merged float32
    # weight): ||delta|| / ||input||, and the share of the delta the written values kept, <out - input, delta>
    # / ||delta||^2 (1: all of it; near 0: rounded away). None: not merged
    delta_relative: float | None = None
    survived: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _MERGE_FIELDS:  # records of runs without a merge stay as they were
            if d[key] is None:
                d.pop(key)
        return d


_MERGE_FIELDS = ("delta_relative", "survived")
_FIELDS = {f.name for f in fields(TensorError)}


def exact(elements: int) -> TensorError:
    return TensorError(0.0, 0, 0, elements, exact=True)


def summary(errors: dict[str, TensorError]) -> dict[str, Any]:
    """The run's aggregate: the worst tensor, the element-weighted mean, and the counts. Summed in name
    order: the same digits whatever order the jobs finished in, or however parts split the run."""
    if not errors:
        return {}
    ordered = [errors[name] for name in sorted(errors)]
    worst = max(sorted(errors), key=lambda name: errors[name].relative_frobenius)
    elements = sum(e.elements for e in ordered)
    return {
        "tensors": len(errors),
        "exact": sum(e.exact for e in ordered),
        "worst_tensor": worst,
        "worst_relative_frobenius": errors[worst].relative_frobenius,
        "mean_relative_frobenius": sum(e.relative_frobenius * e.elements for e in ordered) / max(elements, 1),
        "saturated": sum(e.saturated for e in ordered),
        "flushed": None if any(e.flushed is None for e in ordered) else sum(e.flushed or 0 for e in ordered),
        **_merge_summary(errors),
    }


ROUNDED_AWAY = 0.5  # --merge-lora: a merged weight whose output kept less of its delta is named in a warning


def _merge_summary(errors: dict[str, TensorError]) -> dict[str, Any]:
    """--merge-lora's part of the summary: how many weights took a delta, the share of it the outputs kept
    (element-weighted), and the weights where the rounding took most of it away."""
    merged = {name: errors[name] for name in sorted(errors) if errors[name].survived is not None}
    if not merged:
        return {}
    elements = sum(e.elements for e in merged.values())
    return {
        "merged": len(merged),
        "mean_survived": sum((e.survived or 0.0) * e.elements for e in merged.values()) / max(elements, 1),
        "rounded_away": [n for n, e in merged.items() if (e.survived or 0.0) < ROUNDED_AWAY],
    }


def merge_line(record: dict[str, Any] | None) -> str | None:
    """--merge-lora's line after the run, or None without a merge."""
    if not record or "merged" not in record["summary"]:
        return None
    s = record["summary"]
    merged = [t for t in record["tensors"].values() if t.get("survived") is not None]
    worst = max((t["relative_frobenius"] for t in merged), default=0.0)
    return (
        f"merged a LoRA adapter into {s['merged']} weight(s): the outputs keep {s['mean_survived']:.1%} of its delta "
        f"(element-weighted); against the merged float32 weights the written ones are at most {worst:.3%} off"
    )


def merge_warning(record: dict[str, Any] | None, named: int = 3) -> str | None:
    """The warning for merged weights whose fine-tune the output's rounding mostly took away, or None."""
    if not record or not record["summary"].get("rounded_away"):
        return None
    away, tensors = record["summary"]["rounded_away"], record["tensors"]
    listed = ", ".join(f"{n} ({tensors[n]['survived']:.0%} kept)" for n in away[:named])
    more = f" and {len(away) - named} more" if len(away) > named else ""
    return (
        f"the merged LoRA delta is mostly rounded away in {len(away)} weight(s): {listed}{more}; the delta is "
        "smaller than the output's rounding step there (a bf16 output keeps more of it)"
    )


def requant_record(errors: dict[str, TensorError]) -> dict[str, Any] | None:
    """The manifest's and --json's record: the summary and every tensor's report, by name."""
    if not errors:
        return None
    return {"summary": summary(errors), "tensors": {name: errors[name].to_dict() for name in sorted(errors)}}


def errors_of_record(record: object) -> dict[str, TensorError] | None:
    """requant_record's record read back (a part's, for finalize to merge): every tensor's report, or
    None when the record is not one (finalize refuses it: anyone who can write OUT can write a record)."""
    tensors = record.get("tensors") if isinstance(record, dict) else None
    if not isinstance(tensors, dict) or not tensors:
        return None
    out = {}
    for name, doc in tensors.items():
        if not isinstance(doc, dict) or not _FIELDS - set(_MERGE_FIELDS) <= set(doc) <= _FIELDS:
            return None
        saturated, flushed, elements = (doc[key] for key in ("saturated", "flushed", "elements"))
        rel = doc["relative_frobenius"]
        counts_ok = _is_count(saturated) and _is_count(elements) and (flushed is None or _is_count(flushed))
        if not counts_ok or not isinstance(doc["exact"], bool):
            return None
        if type(rel) not in (int, float) or not math.isfinite(rel) or rel < 0:
            return None
        merged = [doc.get(key) for key in _MERGE_FIELDS]
        if not all(m is None or (type(m) in (int, float) and math.isfinite(m)) for m in merged):
            return None
        out[name] = TensorError(float(rel), saturated, flushed, elements, doc["exact"], *merged)
    return out


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


COARSEST_NAMED = 3  # --to int8: the tensors with the largest relative error, named on the summary line


def summary_line(record: dict[str, Any] | None, target: str = "block") -> str | None:
    """The terminal's one line for requant_record's record."""
    if not record:
        return None
    s = record["summary"]
    if s.get("merged") == s["tensors"]:  # every reported weight merged: merge_line says it
        return None
    if target == "int8":  # a row's step is its largest value / 127: rows with outliers are the coarse ones
        tensors = record["tensors"]
        coarsest = sorted(tensors, key=lambda n: (-tensors[n]["relative_frobenius"], n))[:COARSEST_NAMED]
        named = ", ".join(f"{n} {tensors[n]['relative_frobenius']:.3%}" for n in coarsest)
        return (
            f"quantized {s['tensors']} tensor(s) to INT8 rows (amax / 127 per row): relative error mean "
            f"{s['mean_relative_frobenius']:.3%}; coarsest (outlier rows): {named}"
        )
    return (
        f"requantized {s['tensors']} tensor(s) to power-of-two scales ({s['exact']} exact, bytes kept): relative "
        f"error mean {s['mean_relative_frobenius']:.3%}, worst {s['worst_relative_frobenius']:.3%} "
        f"({s['worst_tensor']}); {s['saturated']} saturated, {s['flushed']} flushed to zero"
    )
