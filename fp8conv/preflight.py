"""Checks that need a little data before the long run: every scale finite and positive, and room on disk.

Scales are small (about 1/16384 of the weights for 128x128 blocks), so reading them all first costs
seconds and turns a NaN scale into a refusal instead of a checkpoint full of NaN weights.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .errors import CheckpointError, OutputError
from .formats import CONVERTIBLE, Classification
from .rewrite.scales import scale_to_float32
from .safetensors_file import read_tensor
from .source import Checkpoint


def check_scales(
    ckpt: Checkpoint, cls: Classification, allow_nonfinite: bool, only_shard: str | None = None
) -> tuple[list[CheckpointError], list[str]]:
    """(problems, warnings): NaN/Inf scales are refused (listed as warnings with allow_nonfinite);
    zero and negative scales are always refused. `only_shard`: the scales stored in that shard only
    (--stream checks each shard's scales as it arrives, before any output needs them)."""
    problems: list[CheckpointError] = []
    warnings: list[str] = []
    fds: dict[str, int] = {}
    try:
        for fmt in cls.weights.values():
            if fmt.kind not in CONVERTIBLE or fmt.scale is None:
                continue
            shard = ckpt.index.shard_of(fmt.scale)
            if only_shard is not None and shard.name != only_shard:
                continue
            if shard.name not in fds:
                fds[shard.name] = os.open(ckpt.index.root / shard.name, os.O_RDONLY)
            scale = scale_to_float32(read_tensor(fds[shard.name], ckpt.index.entry(fmt.scale), shard.name))
            nonfinite = int((~torch.isfinite(scale)).sum())
            if nonfinite:
                what = f"has {nonfinite} NaN/Inf value(s) of {scale.numel()}"
                if allow_nonfinite:
                    warnings.append(f"{fmt.scale} {what}: the weight is converted with them (--allow-nonfinite)")
                else:
                    problems.append(
                        CheckpointError(
                            what,
                            tensor=fmt.scale,
                            shard=shard.name,
                            fix="the checkpoint is damaged: re-download it, or convert anyway with --allow-nonfinite",
                        )
                    )
            bad = int((scale[torch.isfinite(scale)] <= 0).sum())
            if bad:
                problems.append(
                    CheckpointError(
                        f"has {bad} zero or negative value(s); scales multiply the weights and must be positive",
                        tensor=fmt.scale,
                        shard=shard.name,
                        fix="the checkpoint is damaged; re-download it",
                    )
                )
    finally:
        for fd in fds.values():
            os.close(fd)
    return problems, warnings


def check_free_space(out: Path, needed_bytes: int) -> None:
    probe = out if out.exists() else next(p for p in out.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise OutputError(
            f"the output needs {needed_bytes} bytes ({needed_bytes / 2**30:.2f} GiB) but {probe} has {free} "
            f"bytes ({free / 2**30:.2f} GiB) free",
            fix="free space or choose another output; --no-space-check skips this check",
        )
