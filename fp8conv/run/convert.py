"""convert(): the run prepare() decided and checked (prepare.py: plan, strategies, every refusal), then its
first writes, the scheduler's run, and the files that make the output complete (manifest, index, config) last."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..backends import Backend, get_backend
from ..check.verify import OutputCheck, VerifyResult, verify
from ..errors import PlanRefused
from ..model.classify import classify
from ..options import ConvertOptions, RunOptions
from ..output.finish import drop_other_splits, finalize, finish, shard_parts, with_scale_fmt
from ..output.leftovers import live_temporary, remove_temporaries
from ..output.manifest import Manifest
from ..output.requant_ledger import Ledger
from ..output.requant_report import merge_warning, requant_record
from ..plan.conversion import ConversionPlan
from ..plan.preflight import check_scales
from ..rewrite.lora_merge import AdapterTensors
from ..source.checkpoint import Checkpoint
from ..source.config import CONFIG_NAME
from ..source.index import INDEX_NAME
from ..source.shard_fetch import ShardSource
from ..storage.lock import OutputLock
from ..storage.out_dir import OutDir
from ..storage.preread import Preread
from ..threads import RunThreads
from .prepare import PreparedRun, check_locked_output, prepare
from .scheduler import InputReaders, RunTotals, Scheduler
from .streaming import HEADERS_FILE, Schedule, StreamFeed, adopt_local_header, save_input_headers
from .warm_start import WarmStart

FanOut = tuple[dict[str, int], tuple[int, int]]  # every shard's part, and this run's part


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
    # --to mxfp8 / --scale-fmt ue8m0: {"summary": ..., "tensors": {weight: TensorError as a dict}}
    requantization: dict[str, Any] | None = None


def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    run: RunOptions | None = None,
    warm: WarmStart | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `source` into `output`: `options` say what the output is (the default:
    bf16), `run` how this run goes (see options.py). Raises Fp8ConvError subclasses on bad input.
    `warm`: what the CLI started before torch loaded (warm_start.py); its threads become the run's,
    cancelled and joined when convert() returns or raises."""
    threads = warm.threads if warm is not None else RunThreads()
    with threads:  # no thread of the run outlives it
        return _convert(source, output, options, run, threads, warm.preread if warm is not None else None)


def _convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None,
    run: RunOptions | None,
    threads: RunThreads,
    preread: Preread | None,
) -> ConvertResult:
    started = time.monotonic()
    options = options or ConvertOptions()
    how = run or RunOptions()  # both checked themselves when made
    backend = get_backend(how.device)
    prep = prepare(source, output, options, how)  # every refusal, before anything is written
    if prep.adapter is not None:  # --merge-lora: its tensors, read as the merged weights need them
        prep.adapter_tensors = AdapterTensors(prep.adapter)
    try:
        return _convert_prepared(prep, options, how, backend, threads, preread, started)
    finally:
        if prep.adapter_tensors is not None:
            prep.adapter_tensors.close()


def _convert_prepared(
    prep: PreparedRun,
    options: ConvertOptions,
    how: RunOptions,
    backend: Backend,
    threads: RunThreads,
    preread: Preread | None,
    started: float,
) -> ConvertResult:
    # OUT opened once and locked for the whole run: nothing written through a link, one run at a time
    with OutDir.open(prep.out) as within, OutputLock.for_run(within, how.part, "convert"):
        prep.manifest.within = within
        _start_output(prep, how, within)
        stream_check = None
        if how.verify_after and prep.schedule is not None:  # --stream: each shard checked as it is committed
            verify_band = how.tuning.verify_band_elements
            stream_check = OutputCheck(prep.ckpt.index, prep.plan, prep.out, 1.0, 20, verify_band, prep.adapter_tensors)
        warnings = list(prep.warnings)  # the plan's and the scales', then what the run finds, in order
        totals, streamed = _execute(prep, backend, how, stream_check, within, warnings, threads, preread)
        warnings += _exactness_warning(prep.plan, totals.exactness)
        requantization = requant_record({**prep.kept_reports, **totals.requant_errors})  # kept shards' too
        if requantization is not None:  # in the manifest, which the files written last save
            prep.manifest.extra["requantization"] = requantization
        rounded_away = merge_warning(requantization)  # --merge-lora: a fine-tune the rounding took away
        if rounded_away is not None:
            warnings.append(rounded_away)
        finalized = _finish_output(prep, totals.all_scales_pow2, how.part, within, warnings)
        verified = _verified(prep, options, how, stream_check)
    plan, others = prep.plan, prep.others
    return ConvertResult(
        output=prep.out,
        target=plan.target,
        shards=[s.name for s in plan.shards if s.name not in others],
        tensors_converted=totals.converted,
        tensors_copied=totals.copied,
        bytes_written=sum(s.nbytes for s in plan.shards if s.name not in others | prep.keep),
        seconds=time.monotonic() - started,
        files_copied=list(plan.copy_files),
        files_skipped=list(plan.skipped_files),
        warnings=warnings,
        verified=verified,
        packed_blocks_exact=totals.exactness[0],
        packed_blocks_total=totals.exactness[1],
        part=how.part,
        shards_kept=sorted(prep.keep),
        finalized=finalized,
        streamed=streamed,
        requantization=requantization,
    )


def _start_output(prep: PreparedRun, how: RunOptions, within: OutDir) -> None:
    """The first writes, under the lock: OUT checked again (another run may have filled it since
    prepare() looked), cleaned of what would make a failed run look complete, then the manifest naming
    the options and input the shards to come are of."""
    out, part = prep.out, how.part
    check_locked_output(within, how.overwrite or how.resume or part is not None)
    fanout = None if part is None else (shard_parts(prep.plan.shards, part[1]), part)
    _prepare_output(within, prep.keep, prep.others, fanout)
    if part is None or how.overwrite:  # records of another split (or of none: this run is whole) are stale
        drop_other_splits(out, part[1] if part else 0, within)
    prep.manifest.save(out)
    if prep.feed_source is not None:
        save_input_headers(out, prep.ckpt, prep.feed_source, within)


def _execute(
    prep: PreparedRun,
    backend: Backend,
    how: RunOptions,
    stream_check: OutputCheck | None,
    within: OutDir,
    warnings: list[str],
    threads: RunThreads,
    preread: Preread | None,
) -> tuple[RunTotals, dict[str, Any] | None]:
    """The scheduler's run of the plan (with --stream, inside the feed that fetches and evicts shards);
    its totals and, streaming, what was fetched, evicted and waited for. The feed's scale checks add
    their warnings to `warnings`, the run's own list (never the plan's). Every thread is stopped and
    joined before it returns or raises: nothing runs while the output is finished or the lock let go."""
    ckpt, plan, out = prep.ckpt, prep.plan, prep.out
    readers = InputReaders(ckpt.index, how.direct_io, preread, how.tuning.direct_min_bytes)
    streamed: dict[str, Any] | None = None
    with ExitStack() as stack:
        stack.callback(readers.close_all)
        stack.callback(threads.close)  # before the readers close: no read is running then
        feed: StreamFeed | None = None
        if prep.feed_source is not None and prep.schedule is not None:
            feed = _stream_feed(
                ckpt, plan, readers, prep.feed_source, prep.schedule, how, stream_check, warnings, threads
            )
            feed.start()
        scheduler = Scheduler(
            ckpt.index,
            prep.run,
            backend,
            readers,
            how.direct_io,
            how.progress,
            how.max_memory,
            threads=threads,
            tuning=how.tuning,
            adapter=prep.adapter_tensors,
        )
        ledger = Ledger(plan, prep.kept_reports, scheduler.totals.requant_errors)
        committed = _on_commit(out, prep.manifest, feed, ledger)
        totals = scheduler.run(out, prep.keep | prep.others, feed.wait_for if feed else None, committed, within)
        if feed is not None:
            feed.finish()
            streamed = {"fetched": feed.fetched, "evicted": feed.evicted, "waited_s": feed.waited_s}
    return totals, streamed


def _exactness_warning(plan: ConversionPlan, exactness: tuple[int, int]) -> list[str]:
    """Packed 4-bit weights, or FP8 under power-of-two scales in another block geometry, requantized to FP8:
    how many output blocks (rows) kept every value, when some did not."""
    exact, total = exactness
    if not total:
        return []
    unit = "rows" if plan.options.row_scaled else f"{_out_block_text(plan)} blocks"
    head = f"weights requantized to FP8 from 4-bit values or power-of-two scales: {exact} of {total} {unit} exact"
    if exact == total:  # nothing lost: the summary line says so (cli.render.convert_summary)
        return []
    if plan.options.to == "channel":
        return [f"{head}, {total - exact} lost bits (their amax / 448 scales put values between FP8 steps)"]
    return [
        f"{head}, {total - exact} lost bits: no power of two holds every value of those blocks (amax / 448 "
        "scales there); the others have power-of-two scales"
    ]


def _finish_output(
    prep: PreparedRun, all_scales_pow2: bool, part: tuple[int, int] | None, within: OutDir, warnings: list[str]
) -> bool:
    """The files that make the output complete (config, index, copies, manifest), written last; a part
    records what they need instead, and the last part to finish writes them. False: parts unfinished.
    A scale_fmt dropped is a warning added to `warnings`."""
    ckpt, plan, out, manifest = prep.ckpt, prep.plan, prep.out, prep.manifest
    config = plan.config
    index = plan.index_document() if plan.write_index else None
    if part is None:
        if not with_scale_fmt(config, plan.claims_ue8m0, all_scales_pow2):
            warnings.append("scale_fmt ue8m0 dropped: not every output scale is a power of two")
        finish(out, manifest, ckpt.root, plan.copy_files, index, config, plan.json_files, prep.card_note, within)
        within.unlink(HEADERS_FILE)  # --stream: only a resume needed them
        return True
    # a part records what finalize needs; the last part to finish finalizes
    requantization = manifest.extra.get("requantization")  # this part's tensors: finalize merges every part's
    manifest.extra = _finalize_record(ckpt, plan, all_scales_pow2, index, prep.card_note, prep.record)
    if requantization is not None:
        manifest.extra["requantization"] = requantization
    manifest.save(out)
    return finalize(out, require_all=False, within=within, part=part) is not None


def _verified(
    prep: PreparedRun, options: ConvertOptions, how: RunOptions, stream_check: OutputCheck | None
) -> VerifyResult | None:
    """--verify: the output read back and checked, and the manifest saying so (provenance)."""
    verified = None
    if stream_check is not None:  # each shard was checked as it was committed, before its inputs went
        stream_check.documents()
        verified = stream_check.result(stream_check.seconds)
    elif how.verify_after and how.part is None:
        verified = verify(prep.ckpt.root, prep.out, options=options, tuning=how.tuning)
    if verified is not None:  # provenance: the output says it was checked, and how that went
        prep.manifest.extra["verify"] = _verify_record(verified)
        prep.manifest.save(prep.out)
    return verified


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
    how: RunOptions,
    check: OutputCheck | None,
    warnings: list[str],
    threads: RunThreads,
) -> StreamFeed:
    """The hooks --stream adds to a run: a shard's arrival (its own header checked and adopted), an
    output shard's scales checked once its inputs are there (before it is converted), the per-shard
    verify after a commit, and closing a shard's reader before it is evicted."""
    by_name = {s.name: s for s in plan.shards}
    cls = classify(ckpt.index, ckpt.classification_config(), plan.options.block_size)

    def arrived(name: str, path: Path) -> None:
        adopt_local_header(ckpt.index, name, path)

    def ready(output: str) -> None:
        weights = {job.source for job in by_name[output].jobs}
        problems, found = check_scales(ckpt, cls, how.allow_nonfinite, only_weights=weights)
        if problems:
            raise PlanRefused(problems)
        warnings.extend(found)

    def after_commit(name: str) -> None:
        if check is not None:
            check.shard(by_name[name], None)

    return StreamFeed(
        source,
        schedule,
        threads,
        ahead=how.prefetch,
        evict=how.evict_input,
        arrived=arrived,
        before_evict=readers.close,
        after_commit=after_commit,
        ready=ready,
    )


def _on_commit(out: Path, manifest: Manifest, feed: StreamFeed | None, ledger: Ledger) -> Callable[[str, str], None]:
    """What follows a shard's commit: the manifest records it, with its tensors' requantization reports
    in the same save (what --resume carries for a kept shard); --stream may evict its inputs."""

    def committed(name: str, sha256: str) -> None:
        record = ledger.committed(name)
        manifest.record_shard(out, name, sha256, None if record is None else {"requantization": record})
        if feed is not None:
            feed.committed(name)

    return committed


def _out_block_text(plan: ConversionPlan) -> str:
    block = next((j.out_block for s in plan.shards for j in s.jobs if j.out_block), None)
    return f"{block[0]}x{block[1]}" if block else ""


def _prepare_output(within: OutDir, keep: set[str], others: set[str], fanout: FanOut | None) -> None:
    """First remove what would make a failed run look complete (index, config), stale shards and
    temporary files (a killed run's, anywhere in OUT); keep the shards a resumed run already finished,
    and never touch the shards of other parts of a fan-out, nor what they are writing now. Every name
    is removed itself: a link is never followed."""
    for stale in (INDEX_NAME, CONFIG_NAME):
        within.unlink(stale)
    for name in within.names():
        if name.endswith(".safetensors") and name not in keep | others:
            within.unlink(name)
    if fanout is None:  # a whole run holds OUT alone: every temporary is a killed run's
        remove_temporaries(within, lambda rel: True)
    else:
        shard_parts, part = fanout
        remove_temporaries(within, lambda rel: not live_temporary(within, rel, shard_parts, part, finalizing=False))
