"""Zero-padding along the MLP width for --pad-for-tp: the padded model computes the same function."""

from __future__ import annotations

import torch


def pad_to(t: torch.Tensor, shape: tuple[int, ...], fill: float = 0.0, parts: int = 1) -> torch.Tensor:
    """`t` in the leading corner of a `shape` tensor filled with `fill` (0 for weights, 1 for new scales).
    parts > 1: the one padded axis holds `parts` equal pieces (a fused [gate; up]), each padded at its end."""
    if tuple(t.shape) == shape:
        return t
    if t.dtype == torch.float8_e4m3fn:  # fill via the bytes: 0x00 is +0.0
        if fill != 0:
            return _bad(fill)
        return pad_to(t.view(torch.uint8), shape, fill, parts).view(torch.float8_e4m3fn)
    if parts > 1:
        (axis,) = (i for i in range(t.dim()) if t.shape[i] != shape[i])
        if t.shape[axis] % parts or shape[axis] % parts:
            raise ValueError(f"{tuple(t.shape)} -> {shape}: axis {axis} does not hold {parts} equal parts")
        piece = (*shape[:axis], shape[axis] // parts, *shape[axis + 1 :])
        return torch.cat([pad_to(p, piece, fill) for p in t.chunk(parts, dim=axis)], dim=axis)
    out = torch.full(shape, fill, dtype=t.dtype)
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out


def _bad(fill: float) -> torch.Tensor:
    raise ValueError(f"FP8 weights are padded with zeros only, not {fill}")
