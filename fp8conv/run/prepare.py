"""Everything a run decides before it writes a byte: the input opened, classified and planned, each job's
strategy chosen, and every refusal the options, the input and the output directory call for. convert()
executes what prepare() returns; `convert --dry-run` prints it. No torch here: only reading the scale
values (check_scales, skipped by a dry run) needs it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..check.inspect_report import inspect_invocation
from ..errors import OptionsError, PlanRefused
from ..model.classify import classify
from ..options import ConvertOptions, RunOptions
from ..output.finish import assign_parts, check_part, part_path
from ..output.leftovers import first_foreign_entry
from ..output.manifest import MANIFEST, Manifest, input_identity, load_manifest, resume_mismatch
from ..output.provenance import model_card_note, source_record
from ..output.requant_ledger import kept_reports
from ..output.requant_report import TensorError, errors_of_record, requant_record
from ..output.sizes import output_bytes
from ..plan.bands import band_buffer_bytes, band_elements_for, bands_held, fixed_bytes, held_bytes, lowest_max_memory
from ..plan.conversion import ConversionPlan, Strategy, plan_conversion
from ..plan.lora_merge import merge_options, with_lora_merge
from ..plan.preflight import HeldInput, check_free_space, check_scales
from ..plan.strategy import RunPlan, choose_strategies
from ..records import collector_paused
from ..source.checkpoint import Checkpoint, open_checkpoint
from ..source.hub import looks_like_repo_id
from ..source.lora_adapter import LoraAdapter
from ..source.shard_fetch import ShardSource
from ..storage.lock import LOCK_DIR, LOCK_NAME
from ..storage.out_dir import OutDir, check_output_path
from ..version import __version__
from .streaming import Schedule, make_schedule, open_stream, stream_identity

if TYPE_CHECKING:
    from ..rewrite.lora_merge import AdapterTensors


@dataclass
class PreparedRun:
    """A run decided and checked: what it reads, the plan it executes, and what it leaves alone."""

    ckpt: Checkpoint
    plan: ConversionPlan
    run: RunPlan  # how this run executes each of the plan's jobs
    warnings: tuple[str, ...]  # the plan's, then what reading the scales found
    out: Path
    manifest: Manifest
    record: dict[str, Any]  # where the input came from (the manifest's "source")
    card_note: str | None  # the model card's "Converted with fp8conv" section
    feed_source: ShardSource | None  # --stream: where the shards come from
    schedule: Schedule | None  # --stream: when each shard is fetched and evicted
    keep: set[str]  # --resume: shards an interrupted run finished that still check out
    others: set[str]  # --part: shards other parts of a fan-out convert
    band_elements: int  # a BANDED job's band size, from --max-memory
    # --resume: the kept shards' requantization reports, from the interrupted run's record
    kept_reports: dict[str, TensorError] = field(default_factory=dict)
    adapter: LoraAdapter | None = None  # --merge-lora's
    adapter_tensors: AdapterTensors | None = None  # its tensors' reader, made by convert() (torch)


@collector_paused()
def prepare(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions,
    how: RunOptions,
    *,
    dry_run: bool = False,
) -> PreparedRun:
    """The checks and decisions of convert(), in its order, up to the first write. `dry_run`: nothing is
    downloaded (a Hub ID must be in the cache, or --stream) and the scale values are not read (torch would be)."""
    options, adapter = merge_options(options)  # --merge-lora: the adapter, checked before the base is read
    ckpt, feed_source = _open(source, output, how, dry_run)
    read_scales = feed_source is None and not dry_run
    plan, warnings, adapter = _plan(ckpt, options, how, read_scales, merge=(adapter, source))
    band_elements = band_elements_for(how.max_memory, how.tuning)
    run = choose_strategies(plan, ckpt.index, band_elements, how.max_memory is not None)  # how each job executes
    _check_memory_cap(ckpt, run, how)
    out = check_output_path(output)  # before Path(): Path("") is the working directory
    if out.is_dir():  # before any record in it is read: a link there is refused, never followed
        with OutDir.open(out, create=False) as existing:
            existing.refuse_links()
    identity = input_identity(ckpt) if feed_source is None else stream_identity(ckpt, feed_source)
    manifest = Manifest(__version__, Manifest.options_dict(options), identity)
    record = _source_record(source, ckpt, feed_source, how)
    manifest.extra["source"] = record
    card_note = None if options.keep_model_card else model_card_note(record, plan)
    others = _other_parts(out, plan, manifest, how) if how.part is not None else set()
    keep, kept = _resumable_shards(out, plan, manifest, how.part) if how.resume else (set(), {})
    _check_output(ckpt, out, how.overwrite or how.resume or how.part is not None)
    schedule = make_schedule(ckpt.index, plan, keep) if feed_source is not None else None
    if how.space_check:
        _check_space(ckpt, plan, manifest, card_note, out, keep, others, feed_source, schedule, how)
    return PreparedRun(
        ckpt,
        plan,
        run,
        warnings,
        out,
        manifest,
        record,
        card_note,
        feed_source,
        schedule,
        keep,
        others,
        band_elements,
        kept,
        adapter,
    )


def _open(
    source: str | os.PathLike[str], output: str | os.PathLike[str], how: RunOptions, dry_run: bool
) -> tuple[Checkpoint, ShardSource | None]:
    """The input, and with --stream the source its shards come from."""
    if how.stream is not False:
        return open_stream(source, how.revision, how.stream, Path(output) if how.resume else None)
    ckpt = open_checkpoint(source, revision=how.revision, headers_only=dry_run)
    if dry_run and not all(s.header.path.is_file() for s in ckpt.index.shards):  # read remotely: not downloaded
        raise OptionsError(
            f"--dry-run plans a Hub repo without --stream from its downloaded files, and {source} is not downloaded",
            fix="add --stream (it plans from the remote headers), or download the repo first",
        )
    return ckpt, None


def _plan(
    ckpt: Checkpoint,
    options: ConvertOptions,
    how: RunOptions,
    read_scales: bool,
    merge: tuple[LoraAdapter | None, str | os.PathLike[str]] = (None, ""),
) -> tuple[ConversionPlan, tuple[str, ...], LoraAdapter | None]:
    """Classified and planned (with --merge-lora, its adapter as the base stores its targets), with the
    plan's warnings and the scales'; refused with every problem the
    headers, options and scales show.
    Unread here, --stream checks an output shard's scales once its inputs are there."""
    block_size, revision = options.block_size, how.revision
    cls = classify(ckpt.index, ckpt.classification_config(), block_size)
    if cls.problems:
        raise PlanRefused(cls.problems, listed_by=inspect_invocation(block_size, revision))
    plan = plan_conversion(ckpt, cls, options)
    adapter, source = merge
    if adapter is not None:
        plan, adapter = with_lora_merge(plan, adapter, ckpt, str(source))  # its targets as the base stores them
    scale_problems, scale_warnings = check_scales(ckpt, cls, how.allow_nonfinite) if read_scales else ([], [])
    if plan.problems or scale_problems:  # a plan's problems depend on the options: no inspect lists them
        raise PlanRefused(
            [*plan.problems, *scale_problems],
            listed_by=None if plan.problems else inspect_invocation(block_size, revision, scales=True),
        )
    return plan, (*plan.warnings, *scale_warnings), adapter


def _source_record(
    source: str | os.PathLike[str], ckpt: Checkpoint, feed_source: ShardSource | None, how: RunOptions
) -> dict[str, Any]:
    """The manifest's record of where the input came from (a Hub repo and commit, or a local path)."""
    is_hub_id = isinstance(source, str) and looks_like_repo_id(source)
    record = feed_source.provenance() if feed_source is not None else {}
    record = record or source_record(source, ckpt.root, how.revision, is_hub_id)
    if feed_source is not None:
        record["stream"] = {"prefetch": how.prefetch, "evict_input": how.evict_input}
    return record


def _other_parts(out: Path, plan: ConversionPlan, manifest: Manifest, how: RunOptions) -> set[str]:
    """--part I/N: the shards other parts convert; this part's manifest is its own file, checked against
    the other parts' already in `out`."""
    assert how.part is not None
    mine = assign_parts(plan.shards, how.part[1])[how.part[0] - 1]
    manifest.path = part_path(out, how.part).relative_to(out)
    manifest.record_stat = True
    check_part(out, how.part, manifest, overwrite=how.overwrite)
    return {s.name for s in plan.shards} - set(mine)


def _check_space(
    ckpt: Checkpoint,
    plan: ConversionPlan,
    manifest: Manifest,
    card_note: str | None,
    out: Path,
    keep: set[str],
    others: set[str],
    feed_source: ShardSource | None,
    schedule: Any,
    how: RunOptions,
) -> None:
    """Refuse up front when this run's output (and, streaming, its input's peak) will not fit."""
    copied = [(ckpt.root / rel).stat().st_size for rel in plan.copy_files]
    written = [s for s in plan.shards if s.name not in others | keep]
    mine_bytes = output_bytes(plan, written, copied, manifest, card_note)  # headers, index, manifest too
    if feed_source is None or schedule is None:
        check_free_space(out, mine_bytes)
        return
    sizes = {s.name: s.header.file_size for s in ckpt.index.shards}
    present = {name for name in sizes if feed_source.present(name)}
    held, count = schedule.peak_input(sizes, how.prefetch, how.evict_input, present)
    tensor_bytes = sum(s.nbytes for s in plan.shards if s.name not in others) + sum(copied)  # --stream: as before
    kept = sum((out / name).stat().st_size for name in keep)
    check_free_space(out, tensor_bytes - kept, HeldInput(feed_source.root, held, count, how.prefetch, how.evict_input))


def _check_output(ckpt: Checkpoint, out: Path, overwrite: bool) -> None:
    check_output_path(out)
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
    if not overwrite:
        check_output_empty(out)


def check_locked_output(within: OutDir, lenient: bool) -> None:
    """Once OUT is open and locked: no link (or device, FIFO) anywhere in it, and, without --overwrite,
    --resume or --part, still empty but for the lock just taken (another run may have filled it
    between prepare()'s look and the lock)."""
    within.refuse_links()
    if lenient:
        return
    extra = [n for n in within.names() if n != LOCK_DIR.name]
    extra += [f"{LOCK_DIR}/{n}" for n in within.names(LOCK_DIR) if n != LOCK_NAME.name]
    if extra:
        raise OptionsError(
            f"output directory {within.path} is not empty (another run wrote {extra[0]} meanwhile)",
            fix="choose an empty directory, or pass --overwrite to replace its checkpoint",
        )


def check_output_empty(out: Path) -> None:
    """A run without --overwrite (or --resume) starts in an empty or new directory; -j's parent checks it
    once, before its parts start filling the directory side by side."""
    if out.is_dir() and any(out.iterdir()):
        raise OptionsError(
            f"output directory {out} is not empty",
            fix="choose an empty directory, or pass --overwrite to replace its checkpoint",
        )


def _check_memory_cap(ckpt: Checkpoint, run: RunPlan, how: RunOptions) -> None:
    """Refuses, before anything is written, a --max-memory cap that cannot hold the run or a tensor the
    plan rewrites whole (padded, 3-D, or quantized from bf16) or streams in whole gpt-oss experts that
    would not fit under it."""
    max_memory = how.max_memory
    if max_memory is None:
        return
    lowest = lowest_max_memory(how.tuning)
    if max_memory < lowest:
        raise OptionsError(
            f"--max-memory {max_memory} bytes is below what a run needs ({lowest} bytes)",
            fix="raise --max-memory",
        )
    fixed = fixed_bytes(max_memory, how.tuning)  # the process and the writer's buffers
    budget = max_memory - fixed
    for job in run.jobs():
        held = held_bytes(job, ckpt.index.entry(job.source))
        if held is not None and held[1] > budget:
            raise OptionsError(
                f"tensor {job.source} {held[0]} and needs ~{held[1]} bytes, "
                f"over --max-memory {max_memory} minus ~{fixed} for the process and the writer",
                fix="raise --max-memory",
            )
    banded = [(job, ckpt.index.entry(job.source)) for job in run.jobs() if job.strategy is Strategy.BANDED]
    bands = bands_held(banded)
    if bands > budget:  # the largest bands of the run's jobs, held together
        largest = max(banded, key=lambda pair: sum(band_buffer_bytes(*pair)))[0].source
        raise OptionsError(
            f"tensor {largest} streams in bands that, with the run's other bands, need ~{bands} bytes, "
            f"over --max-memory {max_memory} minus ~{fixed} for the process and the writer",
            fix=f"raise --max-memory to {-(-(fixed + bands) // 2**20)}M or more",
        )


def _resumable_shards(
    out: Path, plan: ConversionPlan, manifest: Manifest, part: tuple[int, int] | None
) -> tuple[set[str], dict[str, TensorError]]:
    """Shards an interrupted run finished that still check out, with their requantization reports;
    refuses other options or input. A part resumes from its own record only: the other parts may not
    have started, or be running."""
    if not (out / manifest.path).is_file():
        if part is None and out.is_dir():
            _refuse_resume_without_manifest(out)
        return set(), {}  # nothing finished yet: the run starts afresh
    old = load_manifest(out, manifest.path)
    mismatch = resume_mismatch(old, manifest)
    if mismatch:
        raise OptionsError(f"cannot resume {out}: {mismatch}", fix="convert again with --overwrite")
    intact = {s.name for s in plan.shards if old.shard_intact(out, s.name)}
    keep, reports = kept_reports(plan, intact, errors_of_record(old.extra.get("requantization")) or {})
    manifest.shards = {name: old.shards[name] for name in keep}
    record = requant_record(reports)
    if record is not None:  # saved with the kept shards' entries from the run's first save on
        manifest.extra["requantization"] = record
    return keep, reports


def _refuse_resume_without_manifest(out: Path) -> None:
    """--resume of a whole run into an OUT with no manifest: an interrupted run's bookkeeping alone (its
    lock files and temporaries: killed before its first manifest save) is started afresh; the parts of a
    fan-out, or anything fp8conv did not write, are refused."""
    if any((out / MANIFEST.parent).glob("part-*-of-*.json")):
        raise OptionsError(
            f"{out} has no {MANIFEST} to resume from",
            fix="it holds parts of a fan-out: resume each with --part I/N --resume, or run fp8conv finalize",
        )
    with OutDir.open(out, create=False) as within:
        foreign = first_foreign_entry(within)
    if foreign is not None:
        raise OptionsError(
            f"{out} has no {MANIFEST} to resume from, and holds {foreign}, which no fp8conv run wrote there",
            fix="convert into an empty directory, or use --overwrite",
        )
