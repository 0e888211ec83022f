"""`fp8conv verify SRC OTHER` for an output any tool made: every tensor of OTHER against fp8conv's exact
decode of SRC.

OTHER is read the way its own config and tensors say (fp8conv's readers of every dialect: bf16, channel,
block, ue8m0, MXFP8, compressed-tensors, ModelOpt), matched to SRC by name (names.py), and judged element
by element in row bands (judge.py); a wrong tensor gets the worst element, the tensor's relative error
and, where the pattern is a known one, its likely cause (causes.py). Nothing in SRC or OTHER is written.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...model.classify import Classification, classify
from ...model.weight_format import ChunkedRows
from ...records import collector_paused
from ...source.checkpoint import Checkpoint, open_checkpoint
from ..sampling import sampled
from .causes import likely_cause
from .int8_rows import classified_as_float, declares_int8_rows, int8_claim, with_int8_weights
from .judge import Judgement, TruthReader, judge
from .names import Match, match_names
from .structure import COMPANION_SUFFIXES, claimed_format, config_findings, left_behind, target_mismatches
from .values import Files, Values, logical_values

BAND_ELEMENTS = 1 << 22  # float32 elements per band and side: a few such tensors in memory at once


@dataclass
class TensorVerdict:
    name: str
    verdict: str  # exact, rounded, within-step, wrong, unreadable, shape
    stored: str
    made_from: str  # how it was matched: "same name", "renamed from X", "fused from 4 experts' ..."
    detail: str = ""
    cause: str | None = None
    judgement: Judgement | None = None

    @property
    def ok(self) -> bool:
        return self.verdict in ("exact", "rounded", "within-step")

    def line(self) -> str:
        cause = f"; likely cause: {self.cause}" if self.cause else ""
        return f"{self.verdict:<11} {self.name} ({self.stored}): {self.detail}{cause}"

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "verdict": self.verdict,
            "stored": self.stored,
            "made_from": self.made_from,
            "detail": self.detail,
            "cause": self.cause,
        }
        j = self.judgement
        if j is not None:
            doc |= {
                "elements": j.elements,
                "exact": j.exact,
                "nearest_even": j.nearest,
                "wrong": j.wrong,
                "relative_error": j.relative_error,
                "wrong_rows": [list(r) for r in j.wrong_ranges],
                "worst": None if j.worst is None else vars(j.worst) | {"index": list(j.worst.index)},
            }
        return doc


@dataclass
class AuditResult:
    ok: bool
    claimed: str
    tensors: list[TensorVerdict]
    missing: list[str]
    extra: list[str]
    findings: list[str]
    tensors_total: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.verdict] = counts.get(t.verdict, 0) + 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        counts = ", ".join(f"{n} {v}" for v, n in self.counts().items()) or "none"
        return (
            f"verify {verdict}: {len(self.tensors)} of {self.tensors_total} tensors judged ({counts}); "
            f"{len(self.missing)} missing, {len(self.extra)} extra, {len(self.findings)} other finding(s); "
            f"output read as {self.claimed}; {self.seconds:.1f} s"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "claimed": self.claimed,
            "counts": self.counts(),
            "tensors": [t.as_json() for t in self.tensors],
            "missing": self.missing,
            "extra": self.extra,
            "findings": self.findings,
            "notes": self.notes,
            "seconds": self.seconds,
        }


def _opened(
    source: str | os.PathLike[str], other: str | os.PathLike[str]
) -> tuple[Checkpoint, Checkpoint, Classification, Classification, bool]:
    """Both checkpoints and their classifications; and whether `other` is INT8 W8A8, whose int8 weights the
    audit reads itself (int8_rows.py: the classifier, for conversions, refuses them)."""
    with collector_paused():
        src, out = open_checkpoint(source), open_checkpoint(other)
        src_cls = classify(src.index, src.classification_config())
        out_config = out.classification_config()
        int8 = declares_int8_rows(out_config)
        out_cls = classify(out.index, classified_as_float(out_config) if int8 and out_config else out_config)
    return src, out, src_cls, out_cls, int8


def audit(
    source: str | os.PathLike[str],
    other: str | os.PathLike[str],
    *,
    to: str | None = None,
    sample: float = 1.0,
    band_elements: int = BAND_ELEMENTS,
    progress: Callable[[int, int], None] | None = None,
) -> AuditResult:
    """Judge every tensor of `other` (or a deterministic `sample` fraction of them, by name) against the
    exact values of `source`; structure and config are checked whole either way. progress(done, total):
    elements judged so far, after each tensor."""
    started = time.monotonic()
    src, out, src_cls, out_cls, int8 = _opened(source, other)
    problems = [p.one_line() for p in src_cls.problems]
    if problems:  # the source itself must be read for sure: the audit's truth is its exact decode
        raise_source_unreadable(problems)
    src_files, out_files = Files(src.index, "source"), Files(out.index, "other")
    try:
        truth = logical_values(src.index, src_cls, src_files)
        found = logical_values(out.index, out_cls, out_files)
        if int8:
            found = with_int8_weights(found, out.index, out_cls.weights, out_files)
        companions = left_behind(out.index, out_cls)
        for name in [n for n in found if n.endswith(COMPANION_SUFFIXES)]:
            del found[name]  # reported as left behind, never as an extra tensor
        matches, extra, missing = match_names(_shapes(truth), _shapes(found))
        missing, notes = _tied_head(missing, out)
        result = AuditResult(
            ok=False,
            claimed=int8_claim(found) if int8 else claimed_format(out.index, out_cls),
            tensors=[],
            missing=missing,
            extra=extra,
            findings=companions + config_findings(out.config, out.index, out_cls, quantized_elsewise=int8),
            tensors_total=len(found),
            notes=notes,
        )
        if to is not None:
            made_from_quantized = [found[m.other] for m in matches if any(truth[s].fmt is not None for s in m.sources)]
            result.findings += target_mismatches(to, made_from_quantized)
        judged = [m for m in matches if sampled(m.other, sample)]
        total, done = sum(math.prod(found[m.other].shape) for m in judged), 0
        for i, match in enumerate(judged):
            if i + 1 < len(judged):  # the next tensor's bytes come in while this one is judged
                _hint(judged[i + 1], truth, found, src_files, out_files)
            result.tensors.append(_judge_match(match, truth, found[match.other], src, src_files, band_elements))
            for values in (found[match.other], *(truth[s] for s in match.sources)):
                values.release()  # a tensor decoded whole is held while it is judged, not for the whole audit
            done += math.prod(found[match.other].shape)
            if progress is not None:
                progress(done, total)
    finally:
        src_files.close()
        out_files.close()
    result.ok = not (result.missing or result.extra or result.findings) and all(t.ok for t in result.tensors)
    result.seconds = time.monotonic() - started
    return result


def raise_source_unreadable(problems: list[str]) -> None:
    from ...errors import CheckpointError

    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise CheckpointError(f"the source cannot be decoded for sure: {problems[0]}{more}", fix="fix the source first")


def _hint(match: Match, truth: dict[str, Values], found: dict[str, Values], src: Files, out: Files) -> None:
    for name in found[match.other].stored_tensors:
        out.hint(name)
    for source in match.sources:
        for name in truth[source].stored_tensors:
            src.hint(name)


def _shapes(values: dict[str, Values]) -> dict[str, tuple[int, ...]]:
    return {n: v.shape for n, v in values.items()}


def _tied_head(missing: list[str], out: Checkpoint) -> tuple[list[str], list[str]]:
    """An output that ties lm_head to the embeddings (its config says so) need not hold lm_head."""
    config = out.config or {}
    tied = config.get("tie_word_embeddings") or (config.get("text_config") or {}).get("tie_word_embeddings")
    heads = [n for n in missing if n.endswith("lm_head.weight")]
    if not tied or not heads:
        return missing, []
    return [n for n in missing if n not in heads], [f"{', '.join(heads)}: not in the output, whose config ties it"]


def _judge_match(
    match: Match, truth: dict[str, Values], other: Values, src: Checkpoint, files: Files, band_elements: int
) -> TensorVerdict:
    made = match.how
    rows = [sum(s.rows[1] - s.rows[0] for s in matrix) for matrix in match.layout]
    cols = {truth[s.source].cols for matrix in match.layout for s in matrix}
    if len(match.layout) != other.matrices or any(r != other.rows for r in rows) or cols != {other.cols}:
        expected = (len(match.layout), rows[0] if rows else 0, next(iter(cols), 0))
        transposed = " (stored transposed?)" if (expected[2], expected[1]) == (other.rows, other.cols) else ""
        detail = f"shape {list(other.shape)}, but its source makes {list(_shape_of(match, truth))}{transposed}"
        return TensorVerdict(match.other, "shape", other.stored, made, detail)
    reader = _truth_reader(match, truth, files)
    chunked = _chunked_source(match, truth)
    if chunked is not None and other.float_dtype is not None:
        # a fused projection stored pre-sharded is read in the plain order once unquantized (as fp8conv
        # writes it: engines read float fused projections so); FP8 keeps the chunks, each on its grid
        reader = _in_plain_order(reader, chunked, other.rows)
        made += ", its rows in the plain order engines read unquantized"
    j = judge(reader, other, band_elements, _unit(match, truth))
    if other.unreadable:
        return TensorVerdict(match.other, "unreadable", other.stored, made, other.unreadable, None, j)
    verdict = TensorVerdict(match.other, j.verdict, other.stored, made, _detail(j, other), None, j)
    if j.verdict == "wrong":
        direct = match.direct
        source = truth[direct] if direct else None
        if source is not None:
            verdict.cause = likely_cause(source, src.index, files, other, j, band_elements, reader)
    return verdict


def _chunked_source(match: Match, truth: dict[str, Values]) -> ChunkedRows | None:
    direct = match.direct
    fmt = truth[direct].fmt if direct else None
    return fmt.chunked if fmt is not None else None


def _in_plain_order(reader: TruthReader, chunked: ChunkedRows, rows: int) -> TruthReader:
    order = torch.tensor(chunked.plain_order(), dtype=torch.long)

    def read(m: int, r0: int, r1: int) -> torch.Tensor:
        return reader(m, 0, rows).index_select(0, order[r0:r1])

    return read


def _shape_of(match: Match, truth: dict[str, Values]) -> tuple[int, ...]:
    first = match.layout[0][0] if match.layout and match.layout[0] else None
    rows = sum(s.rows[1] - s.rows[0] for s in match.layout[0]) if match.layout else 0
    cols = truth[first.source].cols if first else 0
    return (len(match.layout), rows, cols) if len(match.layout) > 1 else (rows, cols)


def _unit(match: Match, truth: dict[str, Values]) -> int:
    return max([1] + [truth[s.source].row_unit for matrix in match.layout for s in matrix])


def _truth_reader(match: Match, truth: dict[str, Values], files: Files) -> TruthReader:
    """The exact rows [r0, r1) of output matrix m, stacked from the source segments that make them (each
    copied out as read: the next read reuses the buffer)."""

    def read(m: int, r0: int, r1: int) -> torch.Tensor:
        stacked: torch.Tensor | None = None
        offset = 0
        for seg in match.layout[m]:
            a, b = seg.rows
            lo, hi = max(r0, offset), min(r1, offset + b - a)
            if lo < hi:
                values = truth[seg.source]
                part = values.values_of(seg.matrix, a + lo - offset, a + hi - offset)
                if lo == r0 and hi == r1:
                    return part  # one segment makes the whole band
                if stacked is None:
                    stacked = files.buffer("stacked", (r1 - r0, values.cols), torch.float32)
                stacked[lo - r0 : hi - r0].copy_(part)
            offset += b - a
        assert stacked is not None
        return stacked

    return read


def _detail(j: Judgement, other: Values) -> str:
    storage = str(other.float_dtype).removeprefix("torch.") if other.float_dtype else "e4m3 at its scales"
    if j.verdict == "exact":
        return f"all {j.elements} elements exact"
    if j.verdict == "rounded":
        return f"one nearest-even rounding to {storage} ({j.elements - j.exact} of {j.elements} rounded)"
    if j.verdict == "within-step":
        return (
            f"within one step of {storage}, but not nearest-even: {j.elements - j.nearest} of {j.elements} "
            "elements rounded another way (toward zero or stochastically)"
        )
    worst = j.worst
    where = f"rows {_ranges(j)}" if j.wrong_ranges else ""
    columns = j.wrong_columns
    if columns is not None and not bool(columns.all()):
        where += f"; columns {_column_ranges(columns)}"
    rel = abs(worst.got - worst.expected) / abs(worst.expected) if worst and worst.expected else float("inf")
    worst_text = (
        f"; worst {list(worst.index[1:]) if worst.index[0] == 0 else list(worst.index)}: {worst.got:.6g} for "
        f"{worst.expected:.6g} (relative error {rel:.3g})"
        if worst
        else ""
    )
    nonfinite = f"; {j.nonfinite} NaN/Inf" if j.nonfinite else ""
    return (
        f"{j.wrong} of {j.elements} elements wrong in {j.wrong_rows} row(s) ({where}){worst_text}{nonfinite}; "
        f"tensor relative error {j.relative_error:.3g}"
    )


def _ranges(j: Judgement) -> str:
    shown = [
        (f"matrix {m} " if m else "") + (f"{a}" if b - a == 1 else f"{a}-{b - 1}") for m, a, b in j.wrong_ranges[:8]
    ]
    return ", ".join(shown) + (" ..." if len(j.wrong_ranges) > 8 else "")


def _column_ranges(columns: torch.Tensor) -> str:
    wrong = columns.nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for c in wrong:
        if runs and runs[-1][1] + 1 == c:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:8]]
    return ", ".join(shown) + (" ..." if len(runs) > 8 else "")
