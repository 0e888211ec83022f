"""inspect's DeepGEMM line: whether every block scale is a power of two in 128x128 blocks, so DeepGEMM on
Blackwell (UE8M0 scales only) takes the checkpoint as it is, with no requantization at load."""

from __future__ import annotations

import os

from ..dtypes import UE8M0_SCALE_DTYPES
from ..model.classify import Classification, Kind
from ..source.checkpoint import Checkpoint
from ..storage.safetensors_file import read_tensor

DEEPGEMM_BLOCK = (128, 128)


def deepgemm_readiness(ckpt: Checkpoint, cls: Classification, read_scales: bool) -> str | None:
    """'yes', 'no: why (a tensor named)', or 'unknown: ...' (float scales, unread); None: no block FP8."""
    blocks = [f for f in cls.weights.values() if f.kind is Kind.BLOCK and f.scale is not None]
    if not blocks:
        return None
    for fmt in blocks:
        if fmt.block != DEEPGEMM_BLOCK:
            return f"no: {fmt.weight} is in {fmt.block[0]}x{fmt.block[1]} blocks, DeepGEMM's are 128x128"
    float_scaled = [f for f in blocks if ckpt.index.entry(f.scale).dtype not in UE8M0_SCALE_DTYPES]
    if not float_scaled:
        return "yes (every block scale stored as E8M0)"
    if not read_scales:
        return f"unknown: {len(float_scaled)} block scale tensor(s) stored as floats (--scales reads them)"
    from ..backends.scales import all_powers_of_two  # torch: only --scales reads tensors

    for fmt in float_scaled:
        assert fmt.scale is not None
        shard = ckpt.index.shard_of(fmt.scale)
        fd = os.open(ckpt.index.root / shard.name, os.O_RDONLY)
        try:
            scale = read_tensor(fd, ckpt.index.entry(fmt.scale), shard.name)
        finally:
            os.close(fd)
        if not all_powers_of_two(scale):
            return (
                f"no: {fmt.scale} holds scales that are not powers of two (vLLM requantizes at every load; "
                "fp8conv convert --to block --scale-fmt ue8m0 does it once)"
            )
    return "yes (every block scale a power of two)"
