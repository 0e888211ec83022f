"""Row-band streaming of large 2-D FP8 and packed 4-bit weights: a band of rows is read, rewritten and
written while the next band is read and the previous ones are written (the scheduler runs the stages).
Memory per job is a few bands, not a tensor, and the band buffers are reused, so there are no page
faults for fresh allocations. Here, without torch (the plan uses it): the sizes and which jobs stream;
the arithmetic is rewrite/banded.py's."""

from __future__ import annotations

import math

from .formats import CONVERTIBLE, PACKED, Kind
from .plan import Action, Job
from .safetensors_file import TensorEntry

BAND_ELEMENTS = 1 << 22  # ~4M elements per band: 4 MB of FP8 in, 8 MB of bf16 out
OUT_SLOTS = 3  # bands that may wait for the writer
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


def band_elements_for(max_memory: int | None) -> int:
    """Elements per band under a memory cap (the default when there is none)."""
    if max_memory is None:
        return BAND_ELEMENTS
    return max(1, min(BAND_ELEMENTS, (max_memory - BASE_BYTES) // BYTES_PER_BAND_ELEMENT))


def whole_tensor_bytes(job: Job, entry: TensorEntry) -> int:
    """What rewriting a tensor whole holds at once: its input, its outputs and a float32 copy."""
    return entry.nbytes + job.nbytes + 4 * math.prod(job.spec.shape)


def streamable(job: Job, entry: TensorEntry, band_elements: int | None = None) -> bool:
    """A 2-D FP8 or packed 4-bit weight, rewritten without padding, over one band: band by band."""
    band_elements = BAND_ELEMENTS if band_elements is None else band_elements
    if job.fmt is not None and job.fmt.kind in PACKED:  # 2-D packed 4-bit weights
        return (
            job.action in (Action.DEQUANTIZE, Action.QUANTIZE)
            and job.fmt.kind is not Kind.MXFP4_GPT_OSS  # its experts are written transposed
            and len(entry.shape) == 2
            and job.spec.shape == job.fmt.shape
            and math.prod(job.spec.shape) > band_elements
        )
    return (
        job.action in (Action.DEQUANTIZE, Action.QUANTIZE)
        and job.fmt is not None
        and job.fmt.kind in CONVERTIBLE
        and len(entry.shape) == 2
        and job.spec.shape == entry.shape
        and entry.numel > band_elements
    )


def band_rows(job: Job, band_elements: int) -> int:
    """Rows per band: whole input blocks (and whole output blocks when quantizing), ~band_elements."""
    assert job.fmt is not None
    n, k = job.spec.shape  # the output's: a packed weight's input rows hold K/2 bytes
    out_rows_block = (job.out_block or (1, k))[0] if job.action is Action.QUANTIZE else 1
    unit = math.lcm(job.fmt.math_block((n, k))[0], out_rows_block)
    return max(unit, (band_elements // max(k, 1)) // unit * unit)
