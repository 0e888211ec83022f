"""Row-band streaming of large 2-D FP8 and packed 4-bit weights: a band of rows is read, rewritten and
written while the next band is read and the previous ones are written (the scheduler runs the stages).
Memory per job is a few bands, not a tensor, and the band buffers are reused, so there are no page
faults for fresh allocations. Here, without torch (the plan uses it): the sizes, which jobs stream and
each band's place in the input and the output; the arithmetic is rewrite/banded.py's (rewrite/experts.py's
for gpt-oss's fused experts, whose bands are rows of the transposed output [E, K, N])."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..dtypes import ELEMENT_BYTES
from ..model.classify import CONVERTIBLE, PACKED, Kind
from ..options import DEFAULT_TUNING, Tuning
from ..storage.safetensors_file import TensorEntry
from ..storage.shard_reader import read_capacity
from ..storage.writer import COPY_CHUNK_BYTES
from .conversion import Action, Job, RunJob, Strategy

# a converted weight's band is Tuning.convert_band_elements (verify reads its own, Tuning.verify_band_elements)
OUT_SLOTS = 3  # bands that may wait for the writer
# the E8M0 targets' error report sums rows in chunks of this many (whole blocks of both: 128-row blocks, 1x32
# groups); their bands are whole chunks, so the report's digits do not depend on the band size
REPORT_ROWS = 128
READ_AHEAD = 3  # band reads in flight ahead of the arithmetic, across tensors
BAND_WORKERS = 2  # bands computed at once, one torch thread each (a pool the pipeline sizes to the cores)
IN_SLOTS = READ_AHEAD + BAND_WORKERS  # input bands held: those read ahead and those being computed
# Bytes held per band element at once: IN_SLOTS input bands (1 B) and OUT_SLOTS output bands (up to
# 4 B); the float32 work happens in the backend's cache-sized chunks, counted in BASE_BYTES.
BYTES_PER_BAND_ELEMENT = IN_SLOTS * 1 + OUT_SLOTS * 4
# What a run holds besides the bands: Python, torch, the backend's cache-sized scratch (measured:
# VmHWM 255 MB converting a checkpoint too small to stream; ~290 MB with the default bands).
BASE_BYTES = 256 * 2**20
MIN_BAND_BYTES = 16 * 2**20
# Under --max-memory the write side holds less, the same bytes out: the shard writer keeps CAPPED_SEGMENTS
# segments (the default 8 filled 24 MiB more than the cap allowed: measured, 0.5 GiB DeepSeek-shaped to bf16
# under 272 MiB, VmHWM 295 MiB with 8, 274 with 2), and file-to-file copies go a segment at a time
CAPPED_SEGMENTS = 2


@dataclass(frozen=True)
class WriteLimits:
    """What the write thread may hold: segments (of segment_bytes) per shard writer, and the copy
    buffer's chunk."""

    segments: int
    copy_bytes: int
    segment_bytes: int

    @property
    def nbytes(self) -> int:
        """At most: the copy buffer, the segments of the shard being written and one more (the next
        shard's header while the last one commits, or a segment read back to be hashed)."""
        return read_capacity(self.copy_bytes) + (self.segments + 1) * self.segment_bytes


def write_limits(max_memory: int | None, tuning: Tuning = DEFAULT_TUNING) -> WriteLimits:
    """The write side's limits: the fast defaults, or under a memory cap the small ones it counts."""
    if max_memory is None:
        return WriteLimits(tuning.max_segments, COPY_CHUNK_BYTES, tuning.segment_bytes)
    return _capped_writes(tuning)


def _capped_writes(tuning: Tuning) -> WriteLimits:
    """Under any memory cap: CAPPED_SEGMENTS segments, and copies a segment at a time."""
    return WriteLimits(CAPPED_SEGMENTS, tuning.segment_bytes, tuning.segment_bytes)


def fixed_bytes(max_memory: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """What a run under `max_memory` holds besides its bands and the tensors it rewrites whole."""
    return BASE_BYTES + write_limits(max_memory, tuning).nbytes


def lowest_max_memory(tuning: Tuning = DEFAULT_TUNING) -> int:
    """The lowest --max-memory a run accepts: what it holds besides bands, and the smallest bands."""
    return BASE_BYTES + _capped_writes(tuning).nbytes + MIN_BAND_BYTES


def band_elements_for(max_memory: int | None, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Elements per band under a memory cap (the tuning's when there is none)."""
    most = tuning.convert_band_elements
    if max_memory is None:
        return most
    return max(1, min(most, (max_memory - fixed_bytes(max_memory, tuning)) // BYTES_PER_BAND_ELEMENT))


def whole_tensor_bytes(job: Job, entry: TensorEntry) -> int:
    """What rewriting a tensor whole holds at once: its input, its outputs and a float32 copy."""
    return entry.nbytes + job.nbytes + 4 * math.prod(job.spec.shape)


def held_bytes(job: RunJob, entry: TensorEntry) -> tuple[str, int] | None:
    """What a job holds at once that the band size does not bound, and why: a WHOLE job's tensors, or
    the bands of gpt-oss's experts (each read is a whole expert); None for the rest (copied file to file,
    or streamed in bands)."""
    if job.strategy is Strategy.WHOLE:
        return "is rewritten whole", whole_tensor_bytes(job, entry)
    if job.strategy is Strategy.BANDED and expert_banded(job):
        return "streams in reads of whole gpt-oss experts", expert_band_bytes(job, job.band_rows)
    return None


def streamable(job: Job, entry: TensorEntry, band_elements: int) -> bool:
    """A 2-D FP8 or packed 4-bit weight, rewritten without padding, or gpt-oss's fused [E, N, K/32, 16]
    experts dequantized, over one band: band by band."""
    if job.out_chunks > 1 or job.plain_rows:  # rows in chunks (a fused projection, a few MB): whole
        return False
    if expert_banded(job):
        return len(entry.shape) == 4 and math.prod(job.spec.shape) > band_elements
    if job.fmt is not None and job.fmt.kind in PACKED:  # 2-D packed 4-bit weights
        return (
            job.action in (Action.DEQUANTIZE, Action.QUANTIZE, Action.QUANTIZE_POW2)
            and job.fmt.kind is not Kind.MXFP4_GPT_OSS  # FP8 targets are refused by the plan
            and len(entry.shape) == 2
            and job.spec.shape == job.fmt.shape
            and math.prod(job.spec.shape) > band_elements
        )
    return (
        job.action in (Action.DEQUANTIZE, Action.QUANTIZE, Action.QUANTIZE_POW2)
        and job.fmt is not None
        and job.fmt.kind in CONVERTIBLE
        and len(entry.shape) == 2
        and job.spec.shape == entry.shape
        and entry.numel > band_elements
    )


def band_rows(job: Job, band_elements: int) -> int:
    """Rows per band: whole input blocks (and whole output blocks when quantizing), ~band_elements.
    gpt-oss's experts: rows of the output [E, K, N] seen as [E * K, N] (expert_band_rows)."""
    assert job.fmt is not None
    if expert_banded(job):
        return expert_band_rows(job, band_elements)
    n, k = job.spec.shape  # the output's: a packed weight's input rows hold K/2 bytes
    out_rows_block = (job.out_block or (1, k))[0] if job.action is not Action.DEQUANTIZE else 1
    # E8M0 targets: bands of whole error-report chunks too, so the report is the same for any band size
    report_rows = REPORT_ROWS if job.action is Action.QUANTIZE_POW2 else 1
    unit = math.lcm(job.fmt.math_block((n, k))[0], out_rows_block, report_rows)
    return max(unit, (band_elements // max(k, 1)) // unit * unit)


def expert_banded(job: Job) -> bool:
    """gpt-oss's fused MXFP4 experts dequantized: streamed by rows of their transposed output."""
    return job.fmt is not None and job.fmt.kind is Kind.MXFP4_GPT_OSS and job.action is Action.DEQUANTIZE


@dataclass(frozen=True)
class BandRead:
    """The bytes one read of a streamed job takes: a range of its weight's data and, for gpt-oss's
    experts, the same experts' range of their scales (read with them, not whole: the scales of one
    gpt-oss-120b tensor are 66 MB)."""

    offset: int  # from the tensor's first byte
    nbytes: int
    scale_offset: int = 0
    scale_nbytes: int = 0


@dataclass(frozen=True)
class Band:
    """Rows [r0, r0 + rows) of the output seen as rows of its last dimension (one output range)."""

    r0: int
    rows: int
    read: BandRead | None  # None: computed from the previous band's read (another part of one expert)


def bands(job: RunJob, entry: TensorEntry) -> list[Band]:
    """Every band of a BANDED job, in order, with the input read each one starts."""
    if expert_banded(job):
        return _expert_bands(job, entry)
    n, step = job.spec.shape[0], job.band_rows
    row_bytes = entry.nbytes // entry.shape[0]  # K for FP8, K/2 for packed 4-bit
    return [
        Band(r0, min(step, n - r0), BandRead(r0 * row_bytes, min(step, n - r0) * row_bytes)) for r0 in range(0, n, step)
    ]


def _expert_bands(job: RunJob, entry: TensorEntry) -> list[Band]:
    """Whole experts per band, or, when one expert is over the band budget, slices of its output rows
    (k) that all decode from one read of the expert (output rows are input columns: a slice of them is
    spread over all of the expert's bytes)."""
    assert job.fmt is not None and job.fmt.group is not None
    experts, k, n = job.spec.shape
    in_bytes, scale_bytes = entry.nbytes // experts, n * k // job.fmt.group  # E8M0: a byte per group
    if job.band_rows >= k:
        per = job.band_rows // k
        return [
            Band(e * k, m * k, BandRead(e * in_bytes, m * in_bytes, e * scale_bytes, m * scale_bytes))
            for e in range(0, experts, per)
            for m in [min(per, experts - e)]
        ]
    out = []
    for e in range(experts):
        read = BandRead(e * in_bytes, in_bytes, e * scale_bytes, scale_bytes)
        out += [Band(e * k + k0, min(job.band_rows, k - k0), None if k0 else read) for k0 in range(0, k, job.band_rows)]
    return out


def band_buffer_bytes(job: RunJob, entry: TensorEntry) -> tuple[int, int, int]:
    """The buffers a BANDED job's bands take at most, by kind: an input read (with a gpt-oss expert's
    scales), an output band, and a band worker's decoded expert before its transpose (gpt-oss only)."""
    size = ELEMENT_BYTES[job.spec.dtype]
    if expert_banded(job):
        _, k, n = job.spec.shape
        rows = job.band_rows
        return -(-rows // k) * expert_input_bytes(job), rows * n * size, min(rows, k) * n * size
    n, k = job.spec.shape
    rows = min(job.band_rows, n)  # at least one block of rows: over band_elements when rows are long
    return rows * (entry.nbytes // entry.shape[0]), rows * k * size, 0


def bands_held(banded: list[tuple[RunJob, TensorEntry]]) -> int:
    """What the band buffers hold over a run of these BANDED jobs: the scheduler reuses IN_SLOTS input
    and OUT_SLOTS output buffers (and a decoded expert per band worker) from job to job, each kept at
    the largest size a job asked of it (measured: gpt-oss experts of two shapes under 320M, VmHWM 338 MiB
    when each job's bands alone were counted)."""
    if not banded:
        return 0
    sizes = [band_buffer_bytes(job, entry) for job, entry in banded]
    return (
        IN_SLOTS * max(s[0] for s in sizes)
        + OUT_SLOTS * max(s[1] for s in sizes)
        + BAND_WORKERS * max(s[2] for s in sizes)
    )


def expert_band_bytes(job: Job, rows: int) -> int:
    """What a gpt-oss expert job holds at once in bands of `rows` output rows: IN_SLOTS reads of whole
    experts with their scales, OUT_SLOTS output bands, and per band worker one expert's (or slice's)
    decoded values before their transpose."""
    _, k, n = job.spec.shape
    size = ELEMENT_BYTES[job.spec.dtype]
    return (
        IN_SLOTS * -(-rows // k) * expert_input_bytes(job) + (OUT_SLOTS * rows + BAND_WORKERS * min(rows, k)) * n * size
    )


def expert_band_rows(job: Job, band_elements: int) -> int:
    """As many whole experts per band as the band budget (band_elements at BYTES_PER_BAND_ELEMENT) holds,
    else the most output rows of one expert, in whole MXFP4 groups, that it holds: at least one group
    (--max-memory refuses a job whose bands that does not fit)."""
    assert job.fmt is not None and job.fmt.group is not None
    experts, k, n = job.spec.shape
    budget, group = band_elements * BYTES_PER_BAND_ELEMENT, job.fmt.group
    one = expert_band_bytes(job, k)
    if one <= budget:
        return min(experts, 1 + (budget - one) // (expert_band_bytes(job, 2 * k) - one)) * k
    per_row = (OUT_SLOTS + BAND_WORKERS) * n * ELEMENT_BYTES[job.spec.dtype]
    rows = (budget - IN_SLOTS * expert_input_bytes(job)) // per_row // group * group
    return min(k, max(group, rows))


def expert_input_bytes(job: Job) -> int:
    """One gpt-oss expert's blocks and E8M0 scales (a byte per group)."""
    assert job.fmt is not None and job.fmt.group is not None
    _, k, n = job.spec.shape
    return n * k // 2 + n * k // job.fmt.group
