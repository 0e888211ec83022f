"""Packed 4-bit weights (MXFP4, NVFP4, INT4) -> their float32 values, on a backend.

Each value is code value * group scale (exact: E2M1 has 2 significant bits, INT4 at most 3, the
scales are powers of two, e4m3 or bf16), then for NVFP4 one float32 rounding by the global scale:
compressed-tensors divides by weight_global_scale, ModelOpt multiplies by weight_scale_2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch

from ..backends import Backend
from ..backends.scales import scale_to_float32
from ..backends.scratch import scratch
from ..model.classify import Kind, WeightFormat
from .exact_pow2 import exact_blocks, prefer_exact_pow2

# E2M1 code c: (-1)^(c >> 3) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]; INT4 (compressed-tensors): c - 8
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
INT4_VALUES = tuple(float(c - 8) for c in range(16))


def code_values(kind: Kind) -> torch.Tensor:
    return torch.tensor(INT4_VALUES if kind is Kind.INT4 else E2M1_VALUES, dtype=torch.float32)


def unpack_to_float32(
    read: Callable[[str], torch.Tensor], fmt: WeightFormat, backend: Backend, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight's float32 values rounded once to `dtype`, shaped fmt.shape ([..., N, K], before gpt-oss's
    transpose). Without a global scale the backend writes `dtype` directly; with one, float32 first."""
    assert fmt.shape is not None and fmt.scale is not None and fmt.group is not None
    shape = fmt.shape
    n, k = shape[-2], shape[-1]
    m = math.prod(shape[:-2])
    # int8 / uint8 / int32 containers: the bytes, viewed (little-endian: an int32's nibbles in order)
    codes = read(fmt.weight).contiguous().view(torch.uint8).reshape(m, n, k // 2)
    scale = _backend_scale(read(fmt.scale)).reshape(m, n, k // fmt.group)
    g = None if fmt.global_scale is None else read(fmt.global_scale).to(torch.float32).reshape(())
    out = torch.empty((m, n, k), dtype=dtype)
    if out.numel():
        backend.decode_4bit(codes, code_values(fmt.kind), scale, fmt.group, out, g, fmt.kind is Kind.NVFP4)
    return out.view(shape)


def _backend_scale(stored: torch.Tensor) -> torch.Tensor:
    """Scales as decode_4bit takes them: E8M0 as its bytes, viewed (never a numeric cast); e4m3 (NVFP4) as
    it is stored, one byte per scale (the CPU backend indexes its tables with it); others as float32."""
    if stored.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return stored.contiguous().view(torch.uint8)
    if stored.dtype == torch.float8_e4m3fn:
        return stored.contiguous()
    return scale_to_float32(stored)


def band_decoder(
    fmt: WeightFormat, stored_scale: torch.Tensor, global_scale: torch.Tensor | None, backend: Backend
) -> Callable[[torch.Tensor, int, torch.Tensor], None]:
    """For a 2-D packed weight written band by band: decode(codes, r0, out) writes rows r0.. of the
    weight (codes: those rows' bytes, [1, rows, K/2] uint8) into out ([1, rows, K], any float dtype),
    the bits unpack_to_float32 gives those rows."""
    assert fmt.shape is not None and fmt.group is not None and len(fmt.shape) == 2
    n, k = fmt.shape
    group, values = fmt.group, code_values(fmt.kind)
    scale = _backend_scale(stored_scale).reshape(n, k // group)
    g = None if global_scale is None else global_scale.to(torch.float32).reshape(())
    divide = fmt.kind is Kind.NVFP4

    def decode(codes: torch.Tensor, r0: int, out: torch.Tensor) -> None:
        rows = codes.shape[1]
        codes = codes.view(torch.uint8).view(1, rows, k // 2)
        backend.decode_4bit(codes, values, scale[r0 : r0 + rows][None], group, out, g, divide)

    return decode


def band_quantizer(
    fmt: WeightFormat,
    stored_scale: torch.Tensor,
    global_scale: torch.Tensor | None,
    backend: Backend,
    out_block: tuple[int, int],
    fp8_max: float,
    chunk_elements: int,
    exact_pow2: bool = False,
) -> Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[int, int]]:
    """For a 2-D packed weight quantized to FP8 band by band (bands of whole output blocks), decoded
    ~chunk_elements float32 values (whole output blocks) at a time (Tuning.packed_chunk_elements):
    quantize(codes, r0, q, scale, row_sums) writes those rows' FP8 values into q ([1, rows, K]) and their output
    blocks' scales into scale ([1, block rows, K blocks]), as quantize(unpack_to_float32(...)) does, and
    returns (exact, total) output blocks as block_exactness counts them (INT8: none counted; row_sums, its
    rows' report sums, filled in). The float32 values exist a
    few blocks at a time, never a band. exact_pow2: blocks a power of two holds exactly take it
    (exact_pow2.prefer_exact_pow2; a block target from power-of-two scales)."""
    assert fmt.shape is not None
    k = fmt.shape[1]
    decode = band_decoder(fmt, stored_scale, global_scale, backend)
    bn = out_block[0]
    step = max(bn, chunk_elements // max(k, 1) // bn * bn)

    def quantize(
        codes: torch.Tensor, r0: int, q: torch.Tensor, scale: torch.Tensor, row_sums: torch.Tensor | None
    ) -> tuple[int, int]:
        rows, exact, total = codes.shape[1], 0, 0
        for c0 in range(0, rows, step):
            c1 = min(rows, c0 + step)
            w32 = scratch("packed w32", (1, c1 - c0, k), torch.float32)
            decode(codes[:, c0:c1], r0 + c0, w32)
            q_part, s_part = q[:, c0:c1], scale[:, c0 // bn : -(-c1 // bn)]
            sums = None if row_sums is None else row_sums[:, c0:c1]
            backend.quantize_blocks(w32, out_block, fp8_max, q_part, s_part, sums)
            if q.dtype == torch.int8:  # exactness is an FP8 question (jobs._packed_to_fp8): the report says more
                continue
            if exact_pow2:  # blocks a power of two holds exactly take it (rewrite.exact_pow2)
                e, t = prefer_exact_pow2(w32, q_part, s_part, out_block, backend)
            else:
                back = scratch("packed back", tuple(w32.shape), torch.float32)
                e, t = block_exactness(w32, q_part, s_part, out_block, backend, back)
            exact, total = exact + e, total + t
        return exact, total

    return quantize


def dequantized_output(
    read: Callable[[str], torch.Tensor], fmt: WeightFormat, backend: Backend, dtype: torch.dtype
) -> torch.Tensor:
    """The weight as written by --to bf16 (or float16 / float32): one expert of a fused [E, N, K] tensor at
    a time, so only one expert is ever held twice; gpt-oss's experts transposed to [E, K, N] as
    transformers' GptOssExperts holds them."""
    assert fmt.shape is not None
    shape = fmt.shape
    if len(shape) == 2:
        return unpack_to_float32(read, fmt, backend, dtype)
    weight, scale = read(fmt.weight), read(fmt.scale)  # read once, sliced per expert below
    experts = weight.reshape(-1, *weight.shape[len(shape) - 2 :])
    scales = scale.reshape(-1, *scale.shape[len(shape) - 2 :])
    transpose = fmt.kind is Kind.MXFP4_GPT_OSS
    out = torch.empty((*shape[:-2], shape[-1], shape[-2]) if transpose else shape, dtype=dtype)
    flat = out.view(-1, *out.shape[-2:])
    one = replace(fmt, shape=shape[-2:])
    for e in range(experts.shape[0]):
        tensors = {fmt.weight: experts[e], fmt.scale: scales[e]}
        w = unpack_to_float32(lambda name, t=tensors: t[name] if name in t else read(name), one, backend, dtype)
        flat[e].copy_(w.T if transpose else w)
    return out


def block_exactness(
    w32: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    backend: Backend,
    back_buffer: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(exact, total) output blocks: a block is exact when float32(q) * scale gives back every value
    (exact_pow2.exact_blocks). back_buffer: float32 like w32, overwritten (else a fresh one)."""
    exact = exact_blocks(w32, q, scale, block, backend, back_buffer)
    return int(exact.sum()), exact.numel()
