"""Run one planned job: read its inputs, compute its output tensors (weight first, then its scale)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..backends import Backend
from ..backends.scales import scale_to_float32
from ..dtypes import torch_dtype
from ..model.classify import PACKED
from ..plan.conversion import Action, Job
from .chunks import in_chunks, plain_rows
from .dequant import dequantize, scale_grid, stored_scale
from .exact_pow2 import exact_pow2_applies, prefer_exact_pow2
from .int8_report import int8_tensor_error, row_sums_for
from .lora_merge import AdapterTensors, run_merged_job
from .pad import pad_to
from .pow2 import run_pow2_job
from .quant import quantize, requantize
from .unpack import block_exactness, dequantized_output, unpack_to_float32

if TYPE_CHECKING:
    from ..output.requant_report import TensorError

Reader = Callable[[str], torch.Tensor]


def run_job(
    job: Job,
    read: Reader,
    backend: Backend,
    fp8_max: float,
    exactness: list[int] | None = None,
    errors: dict[str, TensorError] | None = None,
    adapter: AdapterTensors | None = None,
) -> list[torch.Tensor]:
    """exactness: [exact, total] output blocks, added to for packed 4-bit weights quantized to FP8;
    errors: each requantization to power-of-two scales' or to INT8's report, by output weight name, and
    each merged weight's; adapter: --merge-lora's, for the jobs that merge it."""
    if job.merge is not None:
        assert adapter is not None, f"{job.source}: a merging job run without its adapter"
        tensors, error = run_merged_job(job, read, backend, fp8_max, adapter)
        if errors is not None:
            errors[job.spec.name] = error
        return tensors
    if job.action is Action.QUANTIZE_POW2:
        tensors, error = run_pow2_job(job, read, backend)
        if errors is not None:
            errors[job.spec.name] = error
        return tensors
    if job.action is Action.COPY:  # a weight kept as stored brings its scale (plan._stored_copies)
        return [pad_to(read(job.source), job.spec.shape, parts=job.pad_parts)] + [read(o.name) for o in job.outputs[1:]]
    if job.fmt is not None and job.fmt.kind in PACKED:
        if job.action is Action.DEQUANTIZE:
            return [dequantized_output(read, job.fmt, backend, torch_dtype(job.spec.dtype))]
        return _packed_to_fp8(job, read, backend, fp8_max, exactness, errors)
    if job.action is Action.DEQUANTIZE:
        assert job.fmt is not None and job.fmt.scale is not None
        out_dtype = torch_dtype(job.spec.dtype)
        out = dequantize(read(job.source), stored_scale(read, job.fmt), job.fmt, out_dtype, backend)
        return [plain_rows(out, job.fmt.chunked) if job.plain_rows and job.fmt.chunked else out]
    if job.action is Action.KEEP_BLOCKS:
        return _kept_blocks(job, read)
    # QUANTIZE: dequantize exactly as --to bf16 does, minus the rounding, then quantize afresh
    dtype = torch_dtype(job.spec.dtype)
    sums = row_sums_for(job.spec.shape, dtype)  # INT8's report
    if job.fmt is not None:
        assert job.fmt.scale is not None
        weight = read(job.source)
        exact_pow2 = exact_pow2_applies(job, read)
        if tuple(weight.shape) == job.spec.shape and job.out_chunks == 1 and not exact_pow2:  # in one go
            scale = stored_scale(read, job.fmt)
            tensors = list(requantize(weight, scale, job.fmt, job.out_block, fp8_max, backend, dtype, sums))
            _record_int8(job, sums, errors)
            return tensors
        w32 = dequantize(weight, stored_scale(read, job.fmt), job.fmt, torch.float32, backend)
    else:
        w32, exact_pow2 = read(job.source).to(torch.float32), False
    w32 = in_chunks(pad_to(w32, job.spec.shape, parts=job.pad_parts), job.out_chunks)
    q, scale = quantize(w32, job.out_block, fp8_max, backend, dtype, sums)
    _record_int8(job, sums, errors)
    if exact_pow2 and job.out_block is not None:  # power-of-two-scaled FP8 in another block geometry
        exact, total = prefer_exact_pow2(w32, q, scale, job.out_block, backend)
        if exactness is not None:
            exactness[0] += exact
            exactness[1] += total
    return [q.reshape(job.spec.shape), scale.reshape(job.outputs[1].shape)]


def _kept_blocks(job: Job, read: Reader) -> list[torch.Tensor]:
    """KEEP_BLOCKS: the weight's bytes, its scale grid widened to float32, both padded as planned."""
    assert job.fmt is not None and job.fmt.scale is not None
    weight = read(job.source)
    grid = kept_scale(read(job.fmt.scale), job, tuple(weight.shape), read)
    parts = job.pad_parts  # the plan keeps blocks of a fused [gate; up] only when each half is whole blocks
    return [pad_to(weight, job.outputs[0].shape, 0.0, parts), pad_to(grid, job.outputs[1].shape, 1.0, parts)]


def _record_int8(job: Job, row_sums: torch.Tensor | None, errors: dict[str, TensorError] | None) -> None:
    if row_sums is not None and errors is not None:
        errors[job.spec.name] = int8_tensor_error(row_sums, math.prod(job.spec.shape))


def _packed_to_fp8(
    job: Job,
    read: Reader,
    backend: Backend,
    fp8_max: float,
    exactness: list[int] | None,
    errors: dict[str, TensorError] | None,
) -> list[torch.Tensor]:
    """A packed 4-bit weight quantized to FP8 whole, its exact output blocks (rows) counted into exactness
    (or to INT8, its report into errors)."""
    assert job.fmt is not None
    w32 = unpack_to_float32(read, job.fmt, backend)
    dtype = torch_dtype(job.spec.dtype)
    sums = row_sums_for(job.spec.shape, dtype)
    q, scale = quantize(pad_to(w32, job.spec.shape), job.out_block, fp8_max, backend, dtype, sums)
    if sums is not None:  # exactness is an FP8 question (4-bit values on an e4m3 grid): the report says more
        _record_int8(job, sums, errors)
        return [q, scale]
    block = job.out_block or (1, job.spec.shape[-1])
    n, k = w32.shape[-2:]  # --pad-for-tp added zeros (exact) after the blocks that hold values
    grid = (-(-n // block[0]), -(-k // block[1]))
    if exact_pow2_applies(job, read):  # blocks a power of two holds exactly take it
        exact, total = prefer_exact_pow2(w32, q, scale, block, backend)
    else:
        exact, total = block_exactness(w32, q[..., :n, :k], scale[..., : grid[0], : grid[1]], block, backend)
    if exactness is not None:
        exactness[0] += exact
        exactness[1] += total
    return [q, scale]


def kept_scale(scale: torch.Tensor, job: Job, shape: tuple[int, ...], read: Reader | None = None) -> torch.Tensor:
    """A KEEP_BLOCKS job's output scale: the input's grid widened to float32; kept rows in chunks keep their
    per-chunk grid as it is stored."""
    assert job.fmt is not None
    if job.out_chunks > 1:
        return scale_to_float32(scale).reshape(job.outputs[1].shape).contiguous()
    stored = stored_scale(read, job.fmt) if read is not None else scale
    grid = scale_grid(stored, job.fmt, shape)
    return grid.reshape(*shape[:-2], *grid.shape[-2:]).contiguous()
