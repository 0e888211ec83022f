"""Zero-padding along the MLP width for --pad-for-tp: the padded model computes the same function."""

from __future__ import annotations

import torch


def pad_to(t: torch.Tensor, shape: tuple[int, ...], fill: float = 0.0) -> torch.Tensor:
    """`t` in the leading corner of a `shape` tensor filled with `fill` (0 for weights, 1 for new scales)."""
    if tuple(t.shape) == shape:
        return t
    if t.dtype == torch.float8_e4m3fn:  # fill via the bytes: 0x00 is +0.0
        return pad_to(t.view(torch.uint8), shape, fill).view(torch.float8_e4m3fn) if fill == 0 else _bad(fill)
    out = torch.full(shape, fill, dtype=t.dtype)
    out[tuple(slice(0, d) for d in t.shape)] = t
    return out


def _bad(fill: float) -> torch.Tensor:
    raise ValueError(f"FP8 weights are padded with zeros only, not {fill}")
