"""Run one planned job: read its inputs, compute its output tensors (weight first, then its scale)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..backends import Backend
from ..dtypes import torch_dtype
from ..plan import Action, Job
from .dequant import dequantize, scale_grid
from .pad import pad_to
from .quant import quantize, requantize

Reader = Callable[[str], torch.Tensor]


def run_job(job: Job, read: Reader, backend: Backend, fp8_max: float) -> list[torch.Tensor]:
    if job.action is Action.COPY:
        return [pad_to(read(job.source), job.spec.shape, parts=job.pad_parts)]
    if job.action is Action.DEQUANTIZE:
        assert job.fmt is not None and job.fmt.scale is not None
        out_dtype = torch_dtype(job.spec.dtype)
        return [dequantize(read(job.source), read(job.fmt.scale), job.fmt, out_dtype, backend)]
    if job.action is Action.KEEP_BLOCKS:
        assert job.fmt is not None and job.fmt.scale is not None
        weight = read(job.source)
        grid = scale_grid(read(job.fmt.scale), job.fmt, tuple(weight.shape))
        grid = grid.reshape(*weight.shape[:-2], *grid.shape[-2:])
        parts = job.pad_parts  # the plan keeps blocks of a fused [gate; up] only when each half is whole blocks
        return [
            pad_to(weight, job.outputs[0].shape, 0.0, parts),
            pad_to(grid.contiguous(), job.outputs[1].shape, 1.0, parts),
        ]
    # QUANTIZE: dequantize exactly as --to bf16 does, minus the rounding, then quantize afresh
    if job.fmt is not None:
        assert job.fmt.scale is not None
        weight = read(job.source)
        if tuple(weight.shape) == job.spec.shape:  # nothing to pad: dequantize and quantize in one go
            return list(requantize(weight, read(job.fmt.scale), job.fmt, job.out_block, fp8_max, backend))
        w32 = dequantize(weight, read(job.fmt.scale), job.fmt, torch.float32, backend)
    else:
        w32 = read(job.source).to(torch.float32)
    q, scale = quantize(pad_to(w32, job.spec.shape, parts=job.pad_parts), job.out_block, fp8_max, backend)
    return [q, scale]
