"""Checks that need a little data before the long run: every scale finite and positive, and room on disk.

Scales are small (about 1/16384 of the weights for 128x128 blocks), so reading them all first costs
seconds and turns a NaN scale into a refusal instead of a checkpoint full of NaN weights.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, OutputError
from ..model.classify import CONVERTIBLE, PACKED, Classification, Kind, WeightFormat
from ..source.checkpoint import Checkpoint
from ..storage.input_files import reopen
from ..storage.safetensors_file import read_tensor

if TYPE_CHECKING:
    import torch


def check_scales(
    ckpt: Checkpoint, cls: Classification, allow_nonfinite: bool, only_weights: set[str] | None = None
) -> tuple[list[CheckpointError], list[str]]:
    """(problems, warnings): NaN/Inf scales are refused (listed as warnings with allow_nonfinite);
    zero and negative scales are always refused. `only_weights`: those weights' scales only (--stream
    checks an output shard's as soon as the input shards holding them are there, before converting it)."""
    problems: list[CheckpointError] = []
    warnings: list[str] = []
    fds: dict[str, int] = {}

    def read(name: str) -> torch.Tensor:
        shard = ckpt.index.shard_of(name)
        if shard.name not in fds:
            where = {"shard": shard.name}  # the very file the plan's header came from
            fds[shard.name] = reopen(ckpt.index.root / shard.name, shard.header.identity, where=where)
        return read_tensor(fds[shard.name], ckpt.index.entry(name), shard.name)

    try:
        for fmt in cls.weights.values():
            if fmt.kind not in CONVERTIBLE | PACKED or fmt.scale is None:
                continue
            if only_weights is not None and fmt.weight not in only_weights:
                continue
            shard = ckpt.index.shard_of(fmt.scale)
            if fmt.kind in PACKED:
                problems += _packed_companion_problems(fmt, read, ckpt)
            stored = read(fmt.scale)
            found, noted = _scale_problems(fmt, stored, shard.name, allow_nonfinite)
            weight_dtype = ckpt.index.entry(fmt.weight).dtype
            if not found and not noted and (too_big := _overflow_problem(fmt, stored, weight_dtype, shard.name)):
                (warnings.append(f"{too_big} (--allow-nonfinite)") if allow_nonfinite else problems.append(too_big))
            problems += found
            warnings += noted
    finally:
        for fd in fds.values():
            os.close(fd)
    return problems, warnings


def _scale_problems(
    fmt: WeightFormat, stored: torch.Tensor, shard: str, allow_nonfinite: bool
) -> tuple[list[CheckpointError], list[str]]:
    """One weight's scale: its NaN/Inf values (a warning with allow_nonfinite), then its zero or negative ones."""
    import torch  # here, not at the top: planning and --dry-run never load torch

    from ..backends.scales import E8M0_NAN, scale_to_float32

    problems: list[CheckpointError] = []
    warnings: list[str] = []
    if stored.dtype in (torch.uint8, torch.float8_e8m0fnu):
        # E8M0 by its bits: 2^(b-127) is positive, byte 255 is NaN (refused below by the scale's
        # name); counted on the bytes, ~10x faster than through float32 (MXFP4 has 1 per 32 weights)
        scale = None
        nonfinite = int(torch.count_nonzero(stored.view(torch.uint8) == E8M0_NAN))  # sum() holds int64s
    else:
        scale = scale_to_float32(stored)
        nonfinite = int((~torch.isfinite(scale)).sum())
    if nonfinite:
        what = f"has {nonfinite} NaN/Inf value(s) of {stored.numel()}"
        if allow_nonfinite:
            warnings.append(f"{fmt.scale} {what}: the weight is converted with them (--allow-nonfinite)")
        else:
            problems.append(
                CheckpointError(
                    what,
                    tensor=fmt.scale,
                    shard=shard,
                    fix="the checkpoint is damaged: re-download it, or convert anyway with --allow-nonfinite",
                )
            )
    if scale is None:
        return problems, warnings
    finite = scale[torch.isfinite(scale)]
    # a 4-bit group of zeros legitimately has scale 0 (NVFP4 writes amax / 6 = 0)
    bad = int((finite < 0).sum() if fmt.kind in PACKED else (finite <= 0).sum())
    if bad:
        problems.append(
            CheckpointError(
                f"has {bad} zero or negative value(s); scales multiply the weights and must be positive",
                tensor=fmt.scale,
                shard=shard,
                fix="the checkpoint is damaged; re-download it",
            )
        )
    return problems, warnings


# The largest magnitude a stored weight code can have, by the weight's dtype (MXFP4: e2m1's 6).
CODE_MAX = {"F8_E4M3": 448.0, "F8_E4M3FNUZ": 240.0, "F8_E5M2": 57344.0, "F8_E5M2FNUZ": 57344.0}
MXFP4_CODE_MAX = 6.0
BF16_MAX = 3.3895313892515355e38  # below float32's: the bound every target (bf16, or float32 math) fits


def _overflow_problem(fmt: WeightFormat, stored: torch.Tensor, weight_dtype: str, shard: str) -> CheckpointError | None:
    """A finite scale so large that the largest weight code times it leaves bfloat16's range: the
    converted weight (or a channel output's weight_scale) would be Inf. Refused by the scale's name
    before the run, rather than fp8conv refusing its own output after it. A bound on the worst code, not
    the codes stored: only absurd scales (> 7.5e35 for e4m3) are refused."""
    import torch  # here, not at the top: planning and --dry-run never load torch

    from ..backends.scales import E8M0_NAN, scale_to_float32

    code_max = MXFP4_CODE_MAX if fmt.kind in (Kind.MXFP4, Kind.MXFP4_GPT_OSS) else CODE_MAX.get(weight_dtype)
    if code_max is None or stored.numel() == 0:  # NVFP4's scales come with a global scale; INT4's are unbounded
        return None
    if stored.dtype in (torch.uint8, torch.float8_e8m0fnu):  # the largest exponent byte that is not NaN
        bits = stored.view(torch.uint8).reshape(-1)
        bits = bits[bits != E8M0_NAN]
        largest = 2.0 ** (int(bits.max()) - 127) if bits.numel() else 0.0
    else:
        largest = float(scale_to_float32(stored).abs().max())
    if largest * code_max <= BF16_MAX:
        return None
    return CheckpointError(
        f"has a value of {largest:.4g}: times the largest {weight_dtype} code ({code_max:g}) it is beyond "
        "bfloat16's range, so the converted weight would hold Inf",
        tensor=fmt.scale,
        shard=shard,
        fix="the checkpoint is damaged; re-download it",
    )


def _packed_companion_problems(fmt: WeightFormat, read, ckpt: Checkpoint) -> list[CheckpointError]:
    """NVFP4's global scale finite and positive; compressed-tensors' weight_shape equal to the unpacked shape."""
    import torch  # here, not at the top: planning and --dry-run never load torch

    problems = []
    if fmt.global_scale is not None:
        g = read(fmt.global_scale).to(torch.float32).reshape(-1)
        if not bool(torch.isfinite(g).all()) or not bool((g > 0).all()):
            problems.append(
                CheckpointError(
                    f"is {g.tolist()}; a global scale must be finite and positive",
                    tensor=fmt.global_scale,
                    shard=ckpt.index.shard_of(fmt.global_scale).name,
                    fix="the checkpoint is damaged; re-download it",
                )
            )
    if fmt.shape_tensor is not None:
        stored = tuple(int(v) for v in read(fmt.shape_tensor).tolist())
        if stored != fmt.shape:
            problems.append(
                CheckpointError(
                    f"says the unpacked weight is {list(stored)} but {fmt.weight} unpacks to {list(fmt.shape or ())} "
                    "(K must be a multiple of 8, with no padding codes)",
                    tensor=fmt.shape_tensor,
                    shard=ckpt.index.shard_of(fmt.shape_tensor).name,
                    fix="fp8conv refuses packed weights whose K is not a whole number of int32 words",
                )
            )
    return problems


@dataclass(frozen=True)
class HeldInput:
    """--stream: the input a run holds at once in the cache (`shards` of them, fetched `ahead`)."""

    root: Path
    nbytes: int
    shards: int
    ahead: int
    evict: bool


def check_free_space(out: Path, output_bytes: int, held: HeldInput | None = None) -> None:
    """The one free-space check: the output (and, streaming, the input held at once) against its
    filesystem's free space; together when both are on one filesystem. The refusal names the numbers."""
    out_probe = _existing(out)
    what = f"the output needs {output_bytes} bytes ({output_bytes / 2**30:.2f} GiB)"
    fix = "free space or choose another output; --no-space-check skips this check"
    checks = [(out_probe, output_bytes, "")]
    if held is not None:
        in_probe = _existing(held.root)
        how = (
            f"{held.shards} input shard(s) at most, fetched {held.ahead} ahead and evicted once converted"
            if held.evict
            else "every input shard, kept in the cache (no --evict-input)"
        )
        what += f" and the input {held.nbytes} bytes ({held.nbytes / 2**30:.2f} GiB: {how}),"
        fix = "free space, choose another output or cache (HF_HUB_CACHE), pass --evict-input or a smaller --prefetch; "
        fix += "--no-space-check skips this check"
        total = output_bytes + held.nbytes
        if os.stat(out_probe).st_dev == os.stat(in_probe).st_dev:
            checks = [(out_probe, total, f" {total} bytes ({total / 2**30:.2f} GiB) in all,")]
        else:
            checks.append((in_probe, held.nbytes, ""))
    for probe, needed, in_all in checks:
        free = shutil.disk_usage(probe).free
        if free < needed:
            raise OutputError(f"{what}{in_all} but {probe} has {free} bytes ({free / 2**30:.2f} GiB) free", fix=fix)


def _existing(path: Path) -> Path:
    """`path`, or its nearest parent that exists (where the output will be made)."""
    return path if path.exists() else next(p for p in path.parents if p.exists())
