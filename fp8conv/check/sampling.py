"""Which tensors a `--sample F` check judges: a deterministic fraction by name, the same on every run and
machine (verify of fp8conv's outputs and the audit of any other tool's)."""

from __future__ import annotations

import zlib


def sampled(name: str, fraction: float) -> bool:
    return fraction >= 1 or (zlib.crc32(name.encode()) % 10_000) < fraction * 10_000
