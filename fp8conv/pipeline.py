"""Run a plan: read one tensor (and its scale) at a time, rewrite it, stream it into its shard."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .backends import Backend, get_backend
from .backends.scales import all_powers_of_two
from .config import CONFIG_NAME
from .direct_io import aligned_empty
from .errors import OptionsError, PlanRefused
from .formats import classify
from .hub import looks_like_repo_id
from .index import INDEX_NAME
from .manifest import MANIFEST, Manifest, input_identity, load_manifest, resume_mismatch
from .options import ConvertOptions, ProgressCallback, RunOptions
from .parts import assign_parts, check_part, drop_other_splits, finalize, finish, part_path, with_scale_fmt
from .plan import SAFETENSORS_METADATA, Action, ConversionPlan, Job, plan_conversion
from .preflight import check_free_space, check_scales
from .provenance import model_card_note, source_record
from .report import inspect_invocation
from .rewrite.dequant import scale_grid
from .rewrite.jobs import run_job
from .safetensors_file import TensorEntry
from .shard_reader import ShardReader, read_capacity
from .shard_source import ShardSource
from .source import Checkpoint, open_checkpoint
from .stream import (
    BAND_WORKERS,
    BASE_BYTES,
    MIN_BAND_BYTES,
    BandStreamer,
    band_elements_for,
    streamable,
    whole_tensor_bytes,
)
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
from .writer import COPY_CHUNK_BYTES, TEMP_SUFFIX, ShardWriter, temp_target

WRITE_BEHIND = 2  # jobs whose output may wait for the writer thread


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


def convert(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    run: RunOptions | None = None,
) -> ConvertResult:
    """Convert the checkpoint at `source` into `output`: `options` say what the output is (the default:
    bf16), `run` how this run goes (see options.py). Raises Fp8ConvError subclasses on bad input."""
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
    band_elements = _check_memory_cap(ckpt, plan, max_memory)
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
        copied = sum((ckpt.root / rel).stat().st_size for rel in plan.copy_files)
        kept = sum((out / name).stat().st_size for name in keep)
        mine_bytes = sum(s.nbytes for s in plan.shards if s.name not in others)
        if feed_source is None or schedule is None:
            check_free_space(out, mine_bytes + copied - kept)
        else:
            sizes = {s.name: s.header.file_size for s in ckpt.index.shards}
            present = {name for name in sizes if feed_source.present(name)}
            held, count = schedule.peak_input(sizes, prefetch, evict_input, present)
            check_stream_space(out, mine_bytes + copied - kept, feed_source.root, held, count, prefetch, evict_input)
    _prepare_output(out, keep, others)
    if part is None or overwrite:  # records of another split (or of none: this run is whole) are stale
        drop_other_splits(out, part[1] if part else 0)
    manifest.save(out)
    if feed_source is not None:
        save_input_headers(out, ckpt, feed_source)
    run = _Run(ckpt, plan, backend, progress, manifest, band_elements, direct_io)
    stream_check = OutputCheck(ckpt.index, plan, out, 1.0, 20) if verify_after and schedule is not None else None
    with ExitStack() as stack:
        if feed_source is not None and schedule is not None:
            run.feed = _stream_feed(run, feed_source, schedule, prefetch, evict_input, allow_nonfinite, stream_check)
            stack.callback(run.feed.close)
            run.feed.start()
        run.execute(out, stack, skip=keep | others)
        if run.feed is not None:
            run.feed.finish()
            streamed = {"fetched": run.feed.fetched, "evicted": run.feed.evicted, "waited_s": run.feed.waited_s}
    exact, total = run.exactness
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
        if not with_scale_fmt(config, plan.claims_ue8m0, run.all_scales_pow2):
            plan.warnings.append("scale_fmt ue8m0 dropped: not every output scale is a power of two")
        finish(out, manifest, ckpt.root, plan.copy_files, index, config, plan.json_files, card_note)
        (out / HEADERS_FILE).unlink(missing_ok=True)  # --stream: only a resume needed them
    else:  # record what finalize needs; the last part to finish finalizes
        manifest.extra = {
            "complete": True,
            "all_scales_pow2": run.all_scales_pow2,  # finalize decides scale_fmt from every part
            "finalize": {
                "planned_shards": sorted(s.name for s in plan.shards),
                "copy_from": str(ckpt.root.resolve()),
                "copy_files": plan.copy_files,
                "json_files": plan.json_files,
                "index": index,
                "config": config,
                "claims_ue8m0": plan.claims_ue8m0,
                "model_card_note": card_note,
            },
            "source": record,
        }
        manifest.save(out)
        finalized = finalize(out, require_all=False) is not None
    verified = None
    if stream_check is not None:  # each shard was checked as it was committed, before its inputs went
        stream_check.documents()
        verified = stream_check.result(stream_check.seconds)
    elif verify_after and part is None:
        verified = verify(ckpt.root, out, options=options)
    if verified is not None:  # provenance: the output says it was checked, and how that went
        manifest.extra["verify"] = {
            "ok": verified.ok,
            "tensors_checked": verified.tensors_checked,
            "tensors_sampled": verified.tensors_sampled,
            "failures": verified.failures,
        }
        manifest.save(out)
    return ConvertResult(
        output=out,
        target=plan.target,
        shards=[s.name for s in plan.shards if s.name not in others],
        tensors_converted=run.converted,
        tensors_copied=run.copied,
        bytes_written=sum(s.nbytes for s in plan.shards if s.name not in others | keep),
        seconds=time.monotonic() - started,
        files_copied=list(plan.copy_files),
        files_skipped=list(plan.skipped_files),
        warnings=plan.warnings,
        verified=verified,
        packed_blocks_exact=run.exactness[0],
        packed_blocks_total=run.exactness[1],
        part=part,
        shards_kept=sorted(keep),
        finalized=finalized,
        streamed=streamed,
    )


class _Run:
    def __init__(
        self,
        ckpt: Checkpoint,
        plan: ConversionPlan,
        backend: Backend,
        progress: ProgressCallback | None,
        manifest: Manifest,
        band_elements: int,
        direct_io: bool,
    ) -> None:
        self.ckpt, self.plan, self.backend, self.progress = ckpt, plan, backend, progress
        self.manifest = manifest
        self.band_elements = band_elements
        self.converted = self.copied = self.done = 0
        self.all_scales_pow2 = True
        self.exactness = [0, 0]  # packed 4-bit weights quantized to FP8: exact blocks, all blocks
        self.direct_io = direct_io
        self.readers: dict[str, ShardReader] = {}
        self.readers_lock = threading.Lock()
        self.copy_buffer = aligned_empty(read_capacity(COPY_CHUNK_BYTES))
        self.streamer: BandStreamer | None = None
        self.feed: StreamFeed | None = None  # --stream: input shards arrive while the run goes on

    def reader_of(self, tensor: str, stack: ExitStack) -> ShardReader:
        """The reader of the input shard holding `tensor`, opened once."""
        shard_name = self.ckpt.index.shard_of(tensor).name
        with self.readers_lock:  # the reader thread and this one both open shards
            if shard_name not in self.readers:
                self.readers[shard_name] = ShardReader(self.ckpt.index.root / shard_name, self.direct_io)
                stack.callback(self.readers[shard_name].close)
            return self.readers[shard_name]

    def close_reader(self, shard_name: str) -> None:
        """Before an input shard is evicted: an open descriptor would keep its blocks allocated."""
        with self.readers_lock:
            reader = self.readers.pop(shard_name, None)
        if reader is not None:
            reader.close()

    def execute(self, out: Path, stack: ExitStack, skip: set[str]) -> None:
        """Three stages overlap: a reader thread fetches the next job's tensors, this thread computes,
        a writer thread writes the previous job's output. At most READ_AHEAD + WRITE_BEHIND + 1 jobs
        are in memory at once, so peak memory is a few tensors, whatever the checkpoint's size."""
        reader = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="fp8conv-read"))
        writer_pool = stack.enter_context(ThreadPoolExecutor(1, thread_name_prefix="fp8conv-write"))
        compute = stack.enter_context(ThreadPoolExecutor(BAND_WORKERS, thread_name_prefix="fp8conv-band"))
        self.streamer = BandStreamer(
            reader, writer_pool, self.backend, self.plan.options.fp8_max, self.band_elements, compute
        )
        commits: deque[Future[None]] = deque()  # a shard's fsync and rename overlap the next shard
        for shard in self.plan.shards:
            if shard.name in skip:  # finished by an interrupted run, size and hash checked
                self.done += shard.nbytes
                continue
            if self.feed is not None:
                self.feed.wait_for(shard.name)  # its input shards, companions' included, are on disk
            writer = ShardWriter(out / shard.name, shard.specs, SAFETENSORS_METADATA, self.direct_io)
            pending: deque[Future[None]] = deque()
            try:
                jobs = shard.jobs
                for job in jobs:  # their bands are read ahead, across jobs
                    entry = self.ckpt.index.entry(job.source)
                    if self._streamed(job, entry):
                        self.streamer.expect(job, entry, self.reader_of(job.source, stack))
                fetched = reader.submit(self._read_inputs, jobs[0], stack) if jobs else None
                for i, job in enumerate(jobs):
                    assert fetched is not None
                    inputs = fetched.result()
                    if i + 1 < len(jobs):
                        fetched = reader.submit(self._read_inputs, jobs[i + 1], stack)
                    write = self._compute(job, inputs, writer, stack)
                    pending.append(writer_pool.submit(write))
                    while len(pending) > WRITE_BEHIND:
                        pending.popleft().result()
                    self.done += job.nbytes
                    if self.progress:
                        self.progress(self.done, self.plan.output_bytes)
                while pending:
                    pending.popleft().result()
                self.streamer.flush()
                commits.append(writer_pool.submit(self._commit, writer, out, shard.name))
            except BaseException:
                for future in pending:
                    future.cancel()
                for future in pending:
                    if not future.cancelled():
                        future.exception()  # let a running write finish before the file goes
                with contextlib.suppress(BaseException):  # the first error is already on its way up
                    self.streamer.flush()
                writer.abort()
                raise
            finally:
                while len(commits) > 1 or (commits and commits[0].done()):
                    commits.popleft().result()
        while commits:
            commits.popleft().result()

    def _commit(self, writer: ShardWriter, out: Path, name: str) -> None:
        writer.commit()
        self.manifest.record_shard(out, name, writer.sha256)
        if self.feed is not None:
            self.feed.committed(name)

    def _is_raw_copy(self, job: Job) -> bool:
        return job.action is Action.COPY and _copied_file_to_file(job, self.ckpt.index.entry(job.source))

    def _read_inputs(self, job: Job, stack: ExitStack) -> dict[str, torch.Tensor]:
        if self._is_raw_copy(job):
            return {}  # copied file to file by the writer, never held whole
        names = [job.source] + ([job.fmt.scale] if job.fmt is not None and job.fmt.scale else [])
        names += [job.fmt.global_scale] if job.fmt is not None and job.fmt.global_scale else []
        if self._streamed(job, self.ckpt.index.entry(job.source)) or self._weight_bytes_kept(job):
            names = names[1:]  # the weight itself is streamed band by band, or copied file to file
        index = self.ckpt.index
        return {n: self.reader_of(n, stack).read_tensor(index.entry(n)) for n in names}

    def _streamed(self, job: Job, entry: TensorEntry) -> bool:
        """Rewritten band by band (BandStreamer), not whole."""
        return streamable(job, entry, self.band_elements)

    def _weight_bytes_kept(self, job: Job) -> bool:
        """Block FP8 kept as it is and not padded: its weight bytes go file to file."""
        return job.action is Action.KEEP_BLOCKS and _copied_file_to_file(job, self.ckpt.index.entry(job.source))

    def _compute(
        self, job: Job, inputs: dict[str, torch.Tensor], writer: ShardWriter, stack: ExitStack
    ) -> Callable[[], None]:
        """Do the arithmetic now; return the write, to run on the writer thread."""
        if self._weight_bytes_kept(job):
            assert job.fmt is not None and job.fmt.scale is not None
            entry = self.ckpt.index.entry(job.source)
            source = self.reader_of(job.source, stack)
            grid = scale_grid(inputs[job.fmt.scale], job.fmt, entry.shape).reshape(job.outputs[1].shape).contiguous()
            if self.all_scales_pow2:
                self.all_scales_pow2 = all_powers_of_two(grid)
            self.converted += 1

            def keep() -> None:
                writer.copy_range(job.spec.name, source, entry, self.copy_buffer)
                writer.write_tensor(job.outputs[1].name, grid)

            return keep
        if self._is_raw_copy(job):
            entry = self.ckpt.index.entry(job.source)
            source = self.reader_of(job.source, stack)
            self.copied += 1
            return lambda: writer.copy_range(job.spec.name, source, entry, self.copy_buffer)
        entry = self.ckpt.index.entry(job.source)
        if self._streamed(job, entry):
            assert self.streamer is not None and job.fmt is not None and job.fmt.scale is not None
            source = self.reader_of(job.source, stack)
            global_scale = inputs[job.fmt.global_scale] if job.fmt.global_scale else None
            scale = inputs[job.fmt.scale]
            new_scale = self.streamer.run(job, entry, source, scale, writer, global_scale, self.exactness)
            if new_scale is not None and self.all_scales_pow2:
                self.all_scales_pow2 = all_powers_of_two(new_scale)
            self.converted += 1
            return lambda: None
        tensors = run_job(job, inputs.__getitem__, self.backend, self.plan.options.fp8_max, self.exactness)
        if len(tensors) > 1 and self.all_scales_pow2:
            self.all_scales_pow2 = all_powers_of_two(tensors[1])
        self.converted += job.action is not Action.COPY
        self.copied += job.action is Action.COPY

        def write() -> None:
            for spec, tensor in zip(job.outputs, tensors, strict=True):
                writer.write_tensor(spec.name, tensor)

        return write


def _stream_feed(
    run: _Run,
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
    by_name = {s.name: s for s in run.plan.shards}
    cls = classify(run.ckpt.index, run.ckpt.config, run.plan.options.block_size)

    def arrived(name: str, path: Path) -> None:
        adopt_local_header(run.ckpt.index, name, path)

    def ready(output: str) -> None:
        weights = {job.source for job in by_name[output].jobs}
        problems, warnings = check_scales(run.ckpt, cls, allow_nonfinite, only_weights=weights)
        if problems:
            raise PlanRefused(problems)
        run.plan.warnings.extend(warnings)

    def after_commit(name: str) -> None:
        if check is not None:
            check.shard(by_name[name], None)

    return StreamFeed(
        source,
        schedule,
        ahead=prefetch,
        evict=evict,
        arrived=arrived,
        before_evict=run.close_reader,
        after_commit=after_commit,
        ready=ready,
    )


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


def _copied_file_to_file(job: Job, entry: TensorEntry) -> bool:
    """Unpadded copies and kept block-FP8 weights: their bytes go file to file, never held whole."""
    return job.action in (Action.COPY, Action.KEEP_BLOCKS) and job.spec.shape == entry.shape


def _check_memory_cap(ckpt: Checkpoint, plan: ConversionPlan, max_memory: int | None) -> int:
    """Band size under --max-memory; refuses, before anything is written, a cap that cannot hold the
    run or a tensor that would have to be rewritten whole (padded, 3-D, or quantized from bf16)."""
    band = band_elements_for(max_memory)
    if max_memory is None:
        return band
    if max_memory < BASE_BYTES + MIN_BAND_BYTES:
        raise OptionsError(
            f"--max-memory {max_memory} bytes is below what a run needs ({BASE_BYTES + MIN_BAND_BYTES} bytes)",
            fix="raise --max-memory",
        )
    budget = max_memory - BASE_BYTES
    for shard in plan.shards:
        for job in shard.jobs:
            entry = ckpt.index.entry(job.source)
            if _copied_file_to_file(job, entry) or streamable(job, entry, band):
                continue
            if whole_tensor_bytes(job, entry) > budget:
                raise OptionsError(
                    f"tensor {job.source} is rewritten whole and needs ~{whole_tensor_bytes(job, entry)} bytes, "
                    f"over --max-memory {max_memory} minus ~{BASE_BYTES} for the process",
                    fix="raise --max-memory",
                )
    return band


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
