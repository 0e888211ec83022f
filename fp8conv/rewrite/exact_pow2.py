"""Block FP8 from values a power of two can hold exactly (MXFP4 experts, E8M0- or power-of-two-scaled FP8 in
another block geometry): an output block takes the power-of-two scale at its ceiling exponent wherever
that scale gives back every value, and keeps the amax / 448 scale elsewhere.

The ceiling exponent e (the least with 448 x 2^e >= amax) is the one to try: no value clamps there, and a
value that is normal at e is exact at every exponent that does not clamp it (e4m3's rounding is relative),
while a lower exponent clamps the largest value and a higher one coarsens the subnormal step. So if any
power of two reproduces a block, the ceiling's does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..backends import Backend
from ..backends.pow2 import blocks_of, ceil_exponents, powers_of_two
from ..plan.conversion import Action, Job
from .dequant import unit_scale_decoder

CHUNK_ELEMENTS = 1 << 20  # values checked at once: a few MiB of float32 temporaries


def exact_pow2_applies(job: Job, read: Callable[[str], torch.Tensor]) -> bool:
    """exact_pow2_for, with the job's stored scales read by name."""
    fmt = job.fmt
    if fmt is None or fmt.scale is None:
        return False
    return exact_pow2_for(job, read(fmt.scale), read(fmt.global_scale) if fmt.global_scale else None)


def exact_pow2_for(job: Job, scale: torch.Tensor, global_scale: torch.Tensor | None) -> bool:
    """A requantization to FP8 blocks (not rows: --to channel keeps amax / 448) from an FP8 or packed weight
    whose stored scales (`scale`, and `global_scale` if any) are all powers of two."""
    return (
        job.action is Action.QUANTIZE
        and job.out_block is not None
        and job.fmt is not None
        and scales_are_powers_of_two(scale, global_scale)
    )


def scales_are_powers_of_two(scale: torch.Tensor, global_scale: torch.Tensor | None = None) -> bool:
    """Whether stored scales (and a global scale, if any) are all powers of two: E8M0 bytes by dtype, float
    scales by their bits. Only then can a block hold its values exactly under a power of two."""
    for s in (scale, global_scale):
        if s is None:
            continue
        if s.dtype in (torch.uint8, torch.float8_e8m0fnu):
            continue
        mantissa, _ = torch.frexp(s.to(torch.float32).abs())
        if not bool((mantissa == 0.5).all()):
            return False
    return True


def prefer_exact_pow2(
    w32: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], backend: Backend
) -> tuple[int, int]:
    """w32 [..., n, K] float32; q [..., >= n, >= K] e4m3 and scale [..., >= gn, >= gk] float32 its amax / 448
    blocks (padding past n, K untouched). In place, each block that the amax / 448 scale does not give back
    exactly with a power of two, but the ceiling power of two does, takes that scale and its codes.
    Returns (exact, total) blocks as written."""
    n, k = w32.shape[-2], w32.shape[-1]
    if w32.numel() == 0:  # no rows or columns: no blocks
        return 0, 0
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    x3 = w32.reshape(-1, n, k)
    q3 = q.reshape(-1, *q.shape[-2:])
    s3 = scale.reshape(-1, *scale.shape[-2:])
    step = max(1, CHUNK_ELEMENTS // max(bn * k, 1)) * bn  # whole block rows
    exact = 0
    for m in range(x3.shape[0]):
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            exact += _exact_chunk(x3[m, r0:r1], q3[m, r0:r1, :k], s3[m, r0 // bn : -(-r1 // bn), :gk], block, backend)
    return exact, x3.shape[0] * gn * gk


def _exact_chunk(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], backend: Backend
) -> int:
    """One chunk of whole block rows: x [r, K], q [r, K], scale [gr, gk] (views written in place)."""
    r, k = x.shape
    bn, bk = block
    blocks = blocks_of(x, bn, bk)
    gr, gk = blocks.shape[0], blocks.shape[2]
    amax = torch.maximum(blocks.amax(dim=3).amax(dim=1), blocks.amin(dim=3).amin(dim=1).neg_())
    exponents = ceil_exponents(amax)
    y = blocks * powers_of_two(-exponents)[:, None, :, None]  # exact, at most 448: no clamp
    codes = y.to(torch.float8_e4m3fn)
    decoded = torch.empty(y.shape, dtype=torch.float32)
    unit_scale_decoder(backend)(codes, decoded)
    pow2_exact = ~(decoded != y).any(dim=3).any(dim=1)
    amax_exact = exact_blocks(x, q, scale, block, backend)[0]
    mantissa, _ = torch.frexp(scale)
    kept = amax_exact & (mantissa.abs() == 0.5)  # already exact under a power of two (an all-zero block's 1.0)
    take = pow2_exact & ~kept
    if bool(take.any()):
        scale[take] = powers_of_two(exponents)[take]
        elements = take[:, None, :, None].expand(gr, bn, gk, bk).reshape(gr * bn, gk * bk)[:r, :k]
        new = codes.view(gr * bn, gk * bk)[:r, :k].view(torch.uint8)
        q.view(torch.uint8).copy_(torch.where(elements, new, q.view(torch.uint8)))
    return int((pow2_exact | amax_exact).sum())


def exact_blocks(
    w32: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    backend: Backend,
    back_buffer: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [M, gn, gk]: the output blocks in which float32(q) * scale gives back every value of w32
    [..., n, K] (q likewise, scale [..., gn, gk]). back_buffer: float32 like w32, overwritten (else a fresh
    one)."""
    n, k = w32.shape[-2], w32.shape[-1]
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    shape = (math.prod(w32.shape[:-2]), n, k)
    back = torch.empty(shape, dtype=torch.float32) if back_buffer is None else back_buffer.view(shape)
    backend.dequantize_blocks(q.reshape(back.shape), scale.reshape(-1, gn, gk).to(torch.float32), block, back)
    differs = back.ne_(w32.reshape(back.shape))  # in place: 1.0 where a value did not come back
    if n % bn or k % bk:  # zero-pad to whole blocks: padding never differs
        differs = torch.nn.functional.pad(differs, (0, gk * bk - k, 0, gn * bn - n))
    return differs.view(-1, gn, bn, gk, bk).amax(dim=(2, 4)) == 0
