"""Run a plan: read one tensor (and its scale) at a time, rewrite it, stream it into its shard."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from .backends import get_backend
from .config import CONFIG_NAME, dump_json
from .dtypes import DEQUANT_TARGETS
from .errors import OptionsError, OutputError
from .formats import classify
from .index import INDEX_NAME
from .plan import SAFETENSORS_METADATA, TARGETS, ConversionPlan, plan_dequantize
from .rewrite.dequant import dequantize
from .safetensors_file import read_tensor
from .source import Checkpoint, open_checkpoint
from .writer import COPY_CHUNK_BYTES, TEMP_SUFFIX, ShardWriter, fsync_dir, write_file_atomic

# progress(bytes_written_so_far, total_bytes_planned)
ProgressCallback = Callable[[int, int], None]


@dataclass
class ConvertResult:
    output: Path
    target: str
    shards: list[str]
    tensors_converted: int
    tensors_copied: int
    bytes_written: int
    seconds: float
    files_copied: list[str]
    files_skipped: list[tuple[str, str]]
    warnings: list[str] = field(default_factory=list)


def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    to: str = "bf16",
    dtype: str = "bfloat16",
    block_size: tuple[int, int] | None = None,
    overwrite: bool = False,
    device: str = "cpu",
    progress: ProgressCallback | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `source` into `output`. Raises Fp8ConvError subclasses on bad input."""
    started = time.monotonic()
    if to not in TARGETS:
        raise OptionsError(f"--to {to} is not one of {', '.join(TARGETS)}")
    if to != "bf16":
        raise OptionsError(f"--to {to} is not implemented yet in this version", fix="use --to bf16")
    backend = get_backend(device)
    ckpt = open_checkpoint(source)
    cls = classify(ckpt.index, ckpt.config, block_size)
    plan = plan_dequantize(ckpt, cls, dtype)
    out = Path(output)
    _check_output(ckpt, out, overwrite)
    _prepare_output(out)

    total, done = plan.output_bytes, 0
    out_dtype = DEQUANT_TARGETS[dtype][1]
    copy_buffer = bytearray(COPY_CHUNK_BYTES)
    converted = copied = 0
    with ExitStack() as stack:
        fds: dict[str, int] = {}

        def fd_of(shard_name: str) -> int:
            if shard_name not in fds:
                fds[shard_name] = os.open(ckpt.index.root / shard_name, os.O_RDONLY)
                stack.callback(os.close, fds[shard_name])
            return fds[shard_name]

        for shard in plan.shards:
            writer = ShardWriter(out / shard.name, shard.specs, SAFETENSORS_METADATA)
            try:
                for job in shard.jobs:
                    src_shard = ckpt.index.shard_of(job.source)
                    entry = src_shard.header.tensors[job.source]
                    if job.fmt is None:
                        writer.copy_range(
                            job.spec.name, fd_of(src_shard.name), entry.start, entry.nbytes, copy_buffer
                        )
                        copied += 1
                    else:
                        weight = read_tensor(fd_of(src_shard.name), entry, src_shard.name)
                        scale_name = job.fmt.scale
                        assert scale_name is not None  # convertible formats always have one
                        scale_shard = ckpt.index.shard_of(scale_name)
                        scale = read_tensor(
                            fd_of(scale_shard.name), ckpt.index.entry(scale_name), scale_shard.name
                        )
                        writer.write_tensor(
                            job.spec.name, dequantize(weight, scale, job.fmt, out_dtype, backend)
                        )
                        converted += 1
                    done += job.spec.nbytes
                    if progress:
                        progress(done, total)
                writer.commit()
            except BaseException:
                writer.abort()
                raise

    _copy_other_files(ckpt, out, plan)
    # index and config last: until they exist, the output does not look like a finished checkpoint
    if plan.write_index:
        write_file_atomic(out / INDEX_NAME, dump_json(plan.index_document()))
    if plan.config is not None:
        write_file_atomic(out / CONFIG_NAME, dump_json(plan.config))
    fsync_dir(out)
    return ConvertResult(
        output=out,
        target=plan.target,
        shards=[s.name for s in plan.shards],
        tensors_converted=converted,
        tensors_copied=copied,
        bytes_written=total,
        seconds=time.monotonic() - started,
        files_copied=list(plan.copy_files),
        files_skipped=list(plan.skipped_files),
        warnings=plan.warnings,
    )


def _check_output(ckpt: Checkpoint, out: Path, overwrite: bool) -> None:
    src = ckpt.root.resolve()
    dst = out.resolve()
    # a single-file input only owns its folder's top level; a directory input owns everything below it
    inside = dst == src or (not ckpt.single_file and src in dst.parents)
    if inside:
        raise OptionsError(
            f"output {out} is inside the input checkpoint {src}",
            fix="choose an output directory outside the input (the input is never modified)",
        )
    if dst in src.parents:
        raise OptionsError(
            f"output {out} contains the input checkpoint {src}",
            fix="choose an output directory that does not contain the input",
        )
    if dst.exists() and not dst.is_dir():
        raise OptionsError(f"output {out} exists and is not a directory", fix="choose another path")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise OptionsError(
            f"output directory {out} is not empty",
            fix="choose an empty directory, or pass --overwrite to replace its checkpoint",
        )


def _prepare_output(out: Path) -> None:
    """Make the directory; with --overwrite, first remove what would make a failed run look complete."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (INDEX_NAME, CONFIG_NAME):
        (out / stale).unlink(missing_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    for old in out.glob(f".*{TEMP_SUFFIX}"):
        old.unlink()


def _copy_other_files(ckpt: Checkpoint, out: Path, plan: ConversionPlan) -> None:
    for rel in plan.copy_files:
        dest = out / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ckpt.root / rel, dest)
        except OSError as exc:
            raise OutputError(f"copying failed: {exc.strerror or exc}", shard=rel) from exc
