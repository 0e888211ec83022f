"""convert(): options and input checked, the plan and its strategies, the scheduler's run, then the files that
make the output complete (manifest, index, config) last."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backends import get_backend
from .config import CONFIG_NAME
from .errors import OptionsError, PlanRefused
from .formats import classify
from .hub import looks_like_repo_id
from .index import INDEX_NAME
from .manifest import MANIFEST, Manifest, input_identity, load_manifest, resume_mismatch
from .options import ConvertOptions, RunOptions
from .parts import assign_parts, check_part, drop_other_splits, finalize, finish, part_path, with_scale_fmt
from .plan import ConversionPlan, plan_conversion
from .preflight import check_free_space, check_scales
from .provenance import model_card_note, source_record
from .report import inspect_invocation
from .scheduler import InputReaders, Scheduler
from .shard_source import ShardSource
from .source import Checkpoint, open_checkpoint
from .strategy import choose_strategies
from .stream import BASE_BYTES, MIN_BAND_BYTES, band_elements_for, held_bytes
from .streaming import (
    HEADERS_FILE,
    Schedule,
    StreamFeed,
    adopt_local_header,
    check_stream_space,
    make_schedule,
    open_stream,
    save_input_headers,
    stream_identity,
)
from .verify import OutputCheck, VerifyResult, verify
from .version import __version__
from .writer import TEMP_SUFFIX, temp_target


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
    verified: VerifyResult | None = None  # with verify_after
    # packed 4-bit weights quantized to FP8: output blocks (rows for --to channel) that give back every
    # 4-bit value exactly, of all such blocks; the rest lost bits
    packed_blocks_exact: int = 0
    packed_blocks_total: int = 0
    # --part I/N: shards, tensors and bytes are this part's; bytes_written leaves out shards_kept
    part: tuple[int, int] | None = None
    shards_kept: list[str] = field(default_factory=list)  # finished by an earlier run, checked, not redone
    finalized: bool = True  # False for a part while other parts are unfinished
    streamed: dict[str, Any] | None = None  # --stream: shards fetched and evicted, seconds waited for them


# over 60 lines: a run's steps in their order, each one call; the execution itself is Scheduler.run
def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    run: RunOptions | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `source` into `output`: `options` say what the output is (the default:
    bf16), `run` how this run goes (see options.py). Raises Fp8ConvError subclasses on bad input."""
    # Over 60 lines: the run's steps in the order they happen (refusals before anything is written, the
    # scheduler, then config, index and manifest); the self-contained steps are the helpers below.
    started = time.monotonic()
    options = options or ConvertOptions()
    how = run or RunOptions()  # both checked themselves when made
    block_size, keep_model_card = options.block_size, options.keep_model_card
    overwrite, resume, part, device, revision = how.overwrite, how.resume, how.part, how.device, how.revision
    allow_nonfinite, space_check, verify_after = how.allow_nonfinite, how.space_check, how.verify_after
    max_memory, direct_io, progress = how.max_memory, how.direct_io, how.progress
    stream, evict_input, prefetch = how.stream, how.evict_input, how.prefetch
    backend = get_backend(device)
    feed_source: ShardSource | None = None
    if stream is not False:
        ckpt, feed_source = open_stream(source, revision, stream, Path(output) if resume else None)
    else:
        ckpt = open_checkpoint(source, revision=revision)
    cls = classify(ckpt.index, ckpt.config, block_size)
    if cls.problems:
        raise PlanRefused(cls.problems, listed_by=inspect_invocation(block_size, revision))
    plan = plan_conversion(ckpt, cls, options)
    # --stream: an output shard's scales are checked once its inputs are there (the data is not here yet)
    scale_problems, scale_warnings = check_scales(ckpt, cls, allow_nonfinite) if feed_source is None else ([], [])
    if plan.problems or scale_problems:  # a plan's problems depend on the options: no inspect lists them
        raise PlanRefused(
            plan.problems + scale_problems,
            listed_by=None if plan.problems else inspect_invocation(block_size, revision, scales=True),
        )
    plan.warnings += scale_warnings
    choose_strategies(plan, ckpt.index, band_elements_for(max_memory))  # how each job executes, once
    _check_memory_cap(ckpt, plan, max_memory)
    streamed: dict[str, Any] | None = None
    out = Path(output)
    identity = input_identity(ckpt) if feed_source is None else stream_identity(ckpt, feed_source)
    manifest = Manifest(__version__, Manifest.options_dict(options), identity)
    is_hub_id = isinstance(source, str) and looks_like_repo_id(source)
    record = feed_source.provenance() if feed_source is not None else {}
    record = record or source_record(source, ckpt.root, revision, is_hub_id)
    if feed_source is not None:
        record["stream"] = {"prefetch": prefetch, "evict_input": evict_input}
    manifest.extra["source"] = record
    card_note = None if keep_model_card else model_card_note(record, plan)
    others: set[str] = set()  # shards other parts of a fan-out convert
    if part is not None:
        mine = assign_parts(plan.shards, part[1])[part[0] - 1]
        others = {s.name for s in plan.shards} - set(mine)
        manifest.path = part_path(out, part).relative_to(out)
        manifest.record_stat = True
        check_part(out, part, manifest, overwrite=overwrite)
    keep = _resumable_shards(out, plan, manifest, part) if resume else set()
    _check_output(ckpt, out, overwrite or resume or part is not None)
    schedule = make_schedule(ckpt.index, plan, keep) if feed_source is not None else None
    if space_check:
        _check_space(ckpt, plan, out, keep, others, feed_source, schedule, how)
    _prepare_output(out, keep, others)
    if part is None or overwrite:  # records of another split (or of none: this run is whole) are stale
        drop_other_splits(out, part[1] if part else 0)
    manifest.save(out)
    if feed_source is not None:
        save_input_headers(out, ckpt, feed_source)
    readers = InputReaders(ckpt.index, direct_io)
    stream_check = OutputCheck(ckpt.index, plan, out, 1.0, 20) if verify_after and schedule is not None else None
    with ExitStack() as stack:
        stack.callback(readers.close_all)
        feed: StreamFeed | None = None
        if feed_source is not None and schedule is not None:
            feed = _stream_feed(
                ckpt, plan, readers, feed_source, schedule, prefetch, evict_input, allow_nonfinite, stream_check
            )
            stack.callback(feed.close)
            feed.start()
        totals = Scheduler(ckpt.index, plan, backend, readers, direct_io, progress).run(
            out, keep | others, feed.wait_for if feed else None, _on_commit(out, manifest, feed)
        )
        if feed is not None:
            feed.finish()
            streamed = {"fetched": feed.fetched, "evicted": feed.evicted, "waited_s": feed.waited_s}
    exact, total = totals.exactness
    if total:
        unit = "rows" if options.to == "channel" else f"{_out_block_text(plan)} blocks"
        plan.warnings.append(
            f"packed 4-bit weights requantized to FP8: {exact} of {total} {unit} exact, {total - exact} lost bits "
            "(their amax / 448 scales put 4-bit values between FP8 steps)"
        )
    finalized = True
    config = plan.config
    index = plan.index_document() if plan.write_index else None
    if part is None:
        if not with_scale_fmt(config, plan.claims_ue8m0, totals.all_scales_pow2):
            plan.warnings.append("scale_fmt ue8m0 dropped: not every output scale is a power of two")
        finish(out, manifest, ckpt.root, plan.copy_files, index, config, plan.json_files, card_note)
        (out / HEADERS_FILE).unlink(missing_ok=True)  # --stream: only a resume needed them
    else:  # record what finalize needs; the last part to finish finalizes
        manifest.extra = _finalize_record(ckpt, plan, totals.all_scales_pow2, index, card_note, record)
        manifest.save(out)
        finalized = finalize(out, require_all=False) is not None
    verified = None
    if stream_check is not None:  # each shard was checked as it was committed, before its inputs went
        stream_check.documents()
        verified = stream_check.result(stream_check.seconds)
    elif verify_after and part is None:
        verified = verify(ckpt.root, out, options=options)
    if verified is not None:  # provenance: the output says it was checked, and how that went
        manifest.extra["verify"] = _verify_record(verified)
        manifest.save(out)
    return ConvertResult(
        output=out,
        target=plan.target,
        shards=[s.name for s in plan.shards if s.name not in others],
        tensors_converted=totals.converted,
        tensors_copied=totals.copied,
        bytes_written=sum(s.nbytes for s in plan.shards if s.name not in others | keep),
        seconds=time.monotonic() - started,
        files_copied=list(plan.copy_files),
        files_skipped=list(plan.skipped_files),
        warnings=plan.warnings,
        verified=verified,
        packed_blocks_exact=totals.exactness[0],
        packed_blocks_total=totals.exactness[1],
        part=part,
        shards_kept=sorted(keep),
        finalized=finalized,
        streamed=streamed,
    )


def _check_space(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    out: Path,
    keep: set[str],
    others: set[str],
    feed_source: ShardSource | None,
    schedule: Any,
    how: RunOptions,
) -> None:
    """Refuse up front when this run's output (and, streaming, its input's peak) will not fit."""
    copied = sum((ckpt.root / rel).stat().st_size for rel in plan.copy_files)
    kept = sum((out / name).stat().st_size for name in keep)
    mine_bytes = sum(s.nbytes for s in plan.shards if s.name not in others)
    if feed_source is None or schedule is None:
        check_free_space(out, mine_bytes + copied - kept)
        return
    sizes = {s.name: s.header.file_size for s in ckpt.index.shards}
    present = {name for name in sizes if feed_source.present(name)}
    held, count = schedule.peak_input(sizes, how.prefetch, how.evict_input, present)
    check_stream_space(out, mine_bytes + copied - kept, feed_source.root, held, count, how.prefetch, how.evict_input)


def _finalize_record(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    all_scales_pow2: bool,
    index: dict[str, Any] | None,
    card_note: str | None,
    record: dict[str, Any],
) -> dict[str, Any]:
    """A part's manifest: what `finalize` needs to write config, index and copies once all parts are done."""
    return {
        "complete": True,
        "all_scales_pow2": all_scales_pow2,  # finalize decides scale_fmt from every part
        "finalize": {
            "planned_shards": sorted(s.name for s in plan.shards),
            "copy_from": str(ckpt.root.resolve()),
            "copy_files": plan.copy_files,
            "json_files": plan.json_files,
            "index": index,
            "config": plan.config,
            "claims_ue8m0": plan.claims_ue8m0,
            "model_card_note": card_note,
        },
        "source": record,
    }


def _verify_record(verified: VerifyResult) -> dict[str, Any]:
    return {
        "ok": verified.ok,
        "tensors_checked": verified.tensors_checked,
        "tensors_sampled": verified.tensors_sampled,
        "failures": verified.failures,
    }


def _stream_feed(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    readers: InputReaders,
    source: ShardSource,
    schedule: Schedule,
    prefetch: int,
    evict: bool,
    allow_nonfinite: bool,
    check: OutputCheck | None,
) -> StreamFeed:
    """The hooks --stream adds to a run: a shard's arrival (its own header checked and adopted), an
    output shard's scales checked once its inputs are there (before it is converted), the per-shard
    verify after a commit, and closing a shard's reader before it is evicted."""
    by_name = {s.name: s for s in plan.shards}
    cls = classify(ckpt.index, ckpt.config, plan.options.block_size)

    def arrived(name: str, path: Path) -> None:
        adopt_local_header(ckpt.index, name, path)

    def ready(output: str) -> None:
        weights = {job.source for job in by_name[output].jobs}
        problems, warnings = check_scales(ckpt, cls, allow_nonfinite, only_weights=weights)
        if problems:
            raise PlanRefused(problems)
        plan.warnings.extend(warnings)

    def after_commit(name: str) -> None:
        if check is not None:
            check.shard(by_name[name], None)

    return StreamFeed(
        source,
        schedule,
        ahead=prefetch,
        evict=evict,
        arrived=arrived,
        before_evict=readers.close,
        after_commit=after_commit,
        ready=ready,
    )


def _on_commit(out: Path, manifest: Manifest, feed: StreamFeed | None) -> Callable[[str, str], None]:
    """What follows a shard's commit: the manifest records it; --stream may evict its inputs."""

    def committed(name: str, sha256: str) -> None:
        manifest.record_shard(out, name, sha256)
        if feed is not None:
            feed.committed(name)

    return committed


def _out_block_text(plan: ConversionPlan) -> str:
    block = next((j.out_block for s in plan.shards for j in s.jobs if j.out_block), None)
    return f"{block[0]}x{block[1]}" if block else ""


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


def _check_memory_cap(ckpt: Checkpoint, plan: ConversionPlan, max_memory: int | None) -> None:
    """Refuses, before anything is written, a --max-memory cap that cannot hold the run or a tensor the
    plan rewrites whole (padded, 3-D, or quantized from bf16) or streams in whole gpt-oss experts that
    would not fit under it."""
    if max_memory is None:
        return
    if max_memory < BASE_BYTES + MIN_BAND_BYTES:
        raise OptionsError(
            f"--max-memory {max_memory} bytes is below what a run needs ({BASE_BYTES + MIN_BAND_BYTES} bytes)",
            fix="raise --max-memory",
        )
    budget = max_memory - BASE_BYTES
    for shard in plan.shards:
        for job in shard.jobs:
            held = held_bytes(job, ckpt.index.entry(job.source))
            if held is not None and held[1] > budget:
                raise OptionsError(
                    f"tensor {job.source} {held[0]} and needs ~{held[1]} bytes, "
                    f"over --max-memory {max_memory} minus ~{BASE_BYTES} for the process",
                    fix="raise --max-memory",
                )


def _resumable_shards(out: Path, plan: ConversionPlan, manifest: Manifest, part: tuple[int, int] | None) -> set[str]:
    """Shards an interrupted run finished that still check out; refuses other options or input. A part
    resumes from its own record only: the other parts may not have started, or be running."""
    if not (out / manifest.path).is_file():
        if part is None and out.is_dir() and any(out.iterdir()):
            fanout = any((out / MANIFEST.parent).glob("part-*-of-*.json"))
            raise OptionsError(
                f"{out} has no {MANIFEST} to resume from",
                fix="it holds parts of a fan-out: resume each with --part I/N --resume, or run fp8conv finalize"
                if fanout
                else "convert into an empty directory, or use --overwrite",
            )
        return set()
    old = load_manifest(out, manifest.path)
    mismatch = resume_mismatch(old, manifest)
    if mismatch:
        raise OptionsError(f"cannot resume {out}: {mismatch}", fix="convert again with --overwrite")
    keep = {s.name for s in plan.shards if old.shard_intact(out, s.name)}
    manifest.shards = {name: old.shards[name] for name in keep}
    return keep


def _prepare_output(out: Path, keep: set[str], others: set[str]) -> None:
    """Make the directory; first remove what would make a failed run look complete (index, config),
    stale shards and temporary files; keep the shards a resumed run already finished, and never touch
    the shards (or temporary files) of other parts of a fan-out."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (INDEX_NAME, CONFIG_NAME):
        (out / stale).unlink(missing_ok=True)
    for old in out.glob("*.safetensors"):  # missing_ok: parts of a fan-out clean up side by side
        if old.name not in keep and old.name not in others:
            old.unlink(missing_ok=True)
    for old in out.glob(f".*{TEMP_SUFFIX}"):
        if temp_target(old.name) not in others:
            old.unlink(missing_ok=True)
