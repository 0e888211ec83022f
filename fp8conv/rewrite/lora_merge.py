"""--merge-lora's arithmetic: a targeted weight's float32 values (decoded exactly, as --to bf16 does before
its rounding), plus its LoRA delta, then the job's one rounding to its output; and the report of how much of
the delta the written values kept.

The delta, (B @ A) x scaling, is one rounding to float32 of float64 arithmetic in a fixed order: the rank's
outer products B[:, i] A[i, :] (exact in float64: products of float32 values) summed for i = 0 .. r-1, times
the scaling. No matmul: its reduction order depends on the BLAS and the vector unit, and the merged bytes
must be the same on every device and host. The merged weight is input + delta, one float32 add.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from dataclasses import replace

import torch

from ..backends import Backend
from ..backends.pow2 import E8M0_BIAS, pairwise_sum_, powers_of_two, sum64
from ..dtypes import torch_dtype
from ..output.requant_report import TensorError
from ..plan.conversion import Action, Job
from ..source.lora_adapter import ADAPTER_WEIGHTS, LoraAdapter, LoraTerm
from ..storage.safetensors_file import read_tensor
from .dequant import dequantize, stored_scale
from .pad import pad_to
from .pow2 import quantize_pow2_reported, stored_exponents
from .quant import quantize

Reader = Callable[[str], torch.Tensor]
DELTA_ROWS = 64  # rows of the delta summed at once: float64 [64, K] stays in cache over the rank's updates


class AdapterTensors:
    """The adapter's tensors, read on demand with pread (any thread), and its terms."""

    def __init__(self, adapter: LoraAdapter) -> None:
        self.adapter = adapter
        self._fd: int | None = None
        self._lock = threading.Lock()

    def read(self, name: str) -> torch.Tensor:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.adapter.weights, os.O_RDONLY | os.O_CLOEXEC)
        return read_tensor(self._fd, self.adapter.entries[name], ADAPTER_WEIGHTS)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def lora_delta(term: LoraTerm, tensors: AdapterTensors) -> torch.Tensor:
    """(B @ A) x scaling as float32 [N, K] (an embedding's transposed, [V, D]; a fused experts parameter's
    [E, N, K], or one expert's rows), by the module's definition."""
    a, b = tensors.read(term.a).to(torch.float64), tensors.read(term.b).to(torch.float64)
    if term.embedding:
        return _low_rank(a.t(), b.t(), term.rank, term.scaling)
    if not term.experts:
        return _low_rank(b, a, term.rank, term.scaling)
    a3, b3 = a.reshape(term.experts, term.rank, -1), b.reshape(b.shape[0], term.rank, term.experts)
    if term.rows is not None:
        b3 = b3[term.rows[0] : term.rows[1]]
    if term.expert is not None:
        return _low_rank(b3[:, :, term.expert], a3[term.expert], term.rank, term.scaling)
    return torch.stack([_low_rank(b3[:, :, e], a3[e], term.rank, term.scaling) for e in range(term.experts)])


def _low_rank(left: torch.Tensor, right: torch.Tensor, rank: int, scaling: float) -> torch.Tensor:
    """float32 of (sum over i < rank of left[:, i] right[i, :]) x scaling, float64 in that order."""
    n, k = left.shape[0], right.shape[1]
    out = torch.empty(n, k, dtype=torch.float32)
    acc = torch.empty(min(DELTA_ROWS, max(n, 1)), k, dtype=torch.float64)
    term_rows = torch.empty_like(acc)
    for r0 in range(0, n, DELTA_ROWS):
        rows = min(DELTA_ROWS, n - r0)
        total, one = acc[:rows], term_rows[:rows]
        torch.mul(left[r0 : r0 + rows, 0:1], right[0:1], out=total)
        for i in range(1, rank):
            total.add_(torch.mul(left[r0 : r0 + rows, i : i + 1], right[i : i + 1], out=one))
        out[r0 : r0 + rows] = total.mul_(scaling)  # one rounding to float32
    return out


def run_merged_job(
    job: Job, read: Reader, backend: Backend, fp8_max: float, tensors: AdapterTensors
) -> tuple[list[torch.Tensor], TensorError]:
    """The job's output tensors from its weight with the adapter's change, and the merge's report. Memory:
    the input's and the merged weight's float32 values (8 bytes a value) and the outputs; the report's
    float64 work a few rows at a time."""
    assert job.merge is not None
    base = _input_values(job, read, backend)
    merged = _merged_values(job.merge, base, tensors)
    outputs, grid, counts = _outputs(job, merged, backend, fp8_max)
    report = merge_report(base, merged, outputs[0], grid, _written_block(job), job)
    return outputs, replace(report, saturated=counts[0], flushed=counts[1])


def _input_values(job: Job, read: Reader, backend: Backend) -> torch.Tensor:
    """The base weight's float32 values [N, K]: a float tensor widened, FP8 dequantized exactly."""
    if job.fmt is None:
        return read(job.source).to(torch.float32)
    return dequantize(read(job.source), stored_scale(read, job.fmt), job.fmt, torch.float32, backend)


def _merged_values(target: str, base: torch.Tensor, tensors: AdapterTensors) -> torch.Tensor:
    """The weight a merge makes: the adapter's whole tensor if it saves one, plus the delta if it has one."""
    adapter = tensors.adapter
    replacement = adapter.replacements.get(target)
    values = base if replacement is None else tensors.read(replacement).to(torch.float32)
    term = adapter.terms.get(target)
    return values if term is None else lora_delta(term, tensors).add_(values)  # delta + input: no third copy


def _outputs(
    job: Job, merged: torch.Tensor, backend: Backend, fp8_max: float
) -> tuple[list[torch.Tensor], torch.Tensor | None, tuple[int, int | None]]:
    """The job's outputs from the merged float32 weight (one rounding each); the float32 scale grid the
    written codes are read with (None: a float output); and (saturated, flushed) as the target's own report
    counts them (power-of-two scales count both; none saturates elsewhere, and only they count the flushed)."""
    spec = job.spec
    if job.action in (Action.DEQUANTIZE, Action.COPY):
        return [pad_to(merged.to(torch_dtype(spec.dtype)), spec.shape, parts=job.pad_parts)], None, (0, None)
    padded = pad_to(merged, spec.shape, parts=job.pad_parts)
    if job.action is Action.QUANTIZE_POW2:  # a float weight now: the ceiling exponent, as from bf16
        assert job.out_block is not None
        q, exponents, parts = quantize_pow2_reported(padded, job.out_block, False, backend)
        grid = powers_of_two(exponents.to(torch.int32) - E8M0_BIAS)
        counts = (sum(p.saturated for p in parts), sum(p.flushed for p in parts))
        return [q, stored_exponents(exponents.reshape(job.outputs[1].shape), job)], grid, counts
    dtype = torch_dtype(spec.dtype)
    q, scale = quantize(padded, job.out_block, fp8_max, backend, dtype)  # (INT8: this module's report)
    return [q.reshape(spec.shape), scale.reshape(job.outputs[1].shape)], scale, (0, None)


def _written_block(job: Job) -> tuple[int, int]:
    """The block each written scale covers: the job's, one per row for row scales."""
    return job.out_block or (1, job.spec.shape[-1])


REPORT_ROWS = 128  # rows of the report's float64 work at once (times the output block's rows)
SUMS = 5  # per row: squared error, merged^2, delta^2, input^2, <written - input, delta>
SUM_ROWS = 16  # rows whose five float64 planes are summed at once: a few MiB, in cache


def merge_report(
    base: torch.Tensor,
    merged: torch.Tensor,
    written: torch.Tensor,
    grid: torch.Tensor | None,
    block: tuple[int, int],
    job: Job,
) -> TensorError:
    """relative_frobenius: ||written - merged|| / ||merged||; delta_relative: ||merged - base|| / ||base||;
    survived: <written - base, merged - base> / ||merged - base||^2. `written`: the output weight as planned
    (padded: the input and merged weights are padded alike, their zeros adding nothing), read with `grid`
    (None: a float output). float64, each row summed pairwise over its values, the rows then pairwise in
    row order: the same digits on every host, whatever the chunk of rows."""
    elements = merged.numel()
    shape = tuple(written.shape)
    base, merged = (pad_to(t, shape, parts=job.pad_parts) for t in (base, merged))
    n, k = shape[-2:]
    matrices = elements and base.numel() // (n * k)
    step = math.lcm(REPORT_ROWS, block[0])
    sums = torch.empty(matrices * n, SUMS, dtype=torch.float64)
    for m in range(matrices):
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            values = _decoded_rows(written, grid, block, m, r0, r1)
            rows = [t.reshape(-1, n, k)[m, r0:r1] for t in (base, merged)]
            _row_sums(*rows, values, sums[m * n + r0 : m * n + r1])
    err2, merged2, delta2, base2, moved = (sum64(sums[:, i]) for i in range(SUMS))
    return TensorError(
        relative_frobenius=math.sqrt(err2 / merged2) if merged2 > 0 else 0.0,
        saturated=0,
        flushed=None,
        elements=elements,
        delta_relative=math.sqrt(delta2 / base2) if base2 > 0 else float(delta2 > 0),  # a zero base: 1 if any
        survived=moved / delta2 if delta2 > 0 else 1.0,
    )


def _row_sums(base: torch.Tensor, merged: torch.Tensor, written: torch.Tensor, out: torch.Tensor) -> None:
    """Rows [r, K] float32: their SUMS, each row pairwise over its values in float64, into out [r, SUMS];
    SUM_ROWS rows at a time, the five terms as planes of one buffer summed together (in place)."""
    buffer = torch.empty(SUMS, min(SUM_ROWS, base.shape[0]), base.shape[1], dtype=torch.float64)
    for r0 in range(0, base.shape[0], SUM_ROWS):
        r1 = min(base.shape[0], r0 + SUM_ROWS)
        planes = buffer[:, : r1 - r0]
        w, m, d, b, moved = planes
        w.copy_(written[r0:r1])
        m.copy_(merged[r0:r1])
        b.copy_(base[r0:r1])
        torch.sub(m, b, out=d)  # the delta
        torch.sub(w, b, out=moved).mul_(d)
        w.sub_(m)  # the error
        torch.mul(planes[:4], planes[:4], out=planes[:4])  # error^2, merged^2, delta^2, input^2
        out[r0:r1] = pairwise_sum_(planes, 2).t()


def _decoded_rows(
    written: torch.Tensor, grid: torch.Tensor | None, block: tuple[int, int], m: int, r0: int, r1: int
) -> torch.Tensor:
    """Rows [r0, r1) of matrix m of the written weight as float32 values: a float output as it is; codes
    times their scales (the grid's rows of those rows: r0 is a multiple of the block's rows)."""
    n, k = written.shape[-2:]
    rows = written.reshape(-1, n, k)[m, r0:r1]
    if grid is None:
        return rows.to(torch.float32)
    bn, bk = block
    g = grid.reshape(-1, *grid.shape[-2:])[m, r0 // bn : -(-r1 // bn)].to(torch.float32)
    return rows.to(torch.float32) * g.repeat_interleave(bn, dim=0)[: r1 - r0].repeat_interleave(bk, dim=1)[:, :k]
