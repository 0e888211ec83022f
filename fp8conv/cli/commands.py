"""The command line: the only place that prints and chooses exit codes (1: bad input, 2: usage)."""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ..backends import DEVICES
from ..check.audit.provenance import rewritten_shards
from ..check.audit.structure import CLAIMS
from ..check.inspect_report import inspect
from ..dtypes import DEQUANT_TARGETS, FP8_MAX_GAUDI2, FP8_MAX_STANDARD
from ..errors import DEBUG_ENV, Fp8ConvError, OptionsError, PlanRefused
from ..options import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DEFAULT_PREFETCH,
    MXFP8_FORMATS,
    SCALE_DTYPES,
    SCALE_FORMATS,
    TARGETS,
    ConvertOptions,
    RunOptions,
    Tuning,
    options_from,
)
from ..output.finish import finalize, parse_part
from ..output.manifest import MANIFEST
from ..output.requant_report import merge_line, summary_line
from ..run import warm_start
from ..source.config import present
from .render import convert_summary, render_audit, render_plan, render_report
from .workers import WORKER_COMMAND, bind_to_parent, run_workers

if TYPE_CHECKING:
    from ..check.verify import VerifyResult
    from ..run.convert import ConvertResult


def _parse_block_size(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.replace("x", ",").split(",")
    try:
        bn, bk = (int(p) for p in parts)
    except ValueError:
        raise click.BadParameter("expected two positive integers, e.g. 128,128") from None
    if bn <= 0 or bk <= 0:
        raise click.BadParameter("expected two positive integers, e.g. 128,128")
    return (bn, bk)


BLOCK_SIZE_OPTION = click.option(
    "--block-size",
    callback=_parse_block_size,
    metavar="BN,BK",
    help="Assert the block size (e.g. 128,128) when config.json does not state it; every scale grid must agree.",
)


def _fail(exc: Fp8ConvError) -> NoReturn:
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exc()
    click.echo(f"error: {exc.one_line()}", err=True)
    if os.environ.get(DEBUG_ENV) == "1" and isinstance(exc, PlanRefused):  # every problem, one a line
        for more in exc.problems[1:]:
            click.echo(f"error: {more.one_line()}", err=True)
    if os.environ.get(DEBUG_ENV) != "1":
        click.echo(f"(set {DEBUG_ENV}=1 for the full traceback)", err=True)
    sys.exit(1)


class _Commands(click.Group):
    """The one place an Fp8ConvError becomes a one-line message and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Fp8ConvError as exc:
            _fail(exc)


@click.group(cls=_Commands)
@click.version_option(package_name="fp8conv")
def main() -> None:
    """Convert FP8 LLM checkpoints into formats other hardware and engines can run."""


REVISION_OPTION = click.option("--revision", default=None, help="Branch, tag or commit, for a Hub repo ID.")


@main.command("inspect")
@click.argument("checkpoint")
@BLOCK_SIZE_OPTION
@REVISION_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--scales",
    is_flag=True,
    help="Also read the scale tensors (only those) and list every zero, negative or NaN/Inf scale convert "
    "refuses; a Hub ID is downloaded first.",
)
def inspect_command(
    checkpoint: str, block_size: tuple[int, int] | None, revision: str | None, as_json: bool, scales: bool
) -> None:
    """Describe CHECKPOINT (a folder, a .safetensors file or a Hub repo ID) from its headers only
    (with --scales, its scale tensors too)."""
    report = inspect(checkpoint, block_size=block_size, revision=revision, scales=scales)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(render_report(report))


def _progress_bar(
    quiet: bool, desc: str = "converting", unit: str = "B"
) -> tuple[Callable[[int, int], None] | None, Callable[[], None]]:
    if quiet or not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            divisor = 1024 if unit == "B" else 1000
            bar["bar"] = tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=divisor, desc=desc)
        bar["bar"].update(done - bar["bar"].n)

    def close() -> None:
        if "bar" in bar:
            bar["bar"].close()

    return update, close


@main.command("convert")
@click.argument("checkpoint")
@click.option("--to", type=click.Choice(TARGETS), required=True, help="Target format.")
@click.option("-o", "--output", required=True, help="Output directory (must be empty, or --overwrite).")
@click.option(
    "--dtype",
    type=click.Choice(list(DEQUANT_TARGETS)),
    default=DEFAULT_DTYPE,
    show_default=True,
    help="Output dtype of dequantized weights (--to bf16).",
)
@BLOCK_SIZE_OPTION
@click.option(
    "--fp8-max",
    type=click.Choice([f"{FP8_MAX_STANDARD:g}", f"{FP8_MAX_GAUDI2:g}"]),
    default=None,
    help="FP8 range to quantize to (--to channel): 448 standard, 240 for Gaudi2 (marked in the config).",
)
@click.option(
    "--target",
    "hardware",
    type=click.Choice(["gaudi2", "gaudi3", "generic"]),
    default=None,
    help="Hardware shorthand: gaudi2 means --fp8-max 240; gaudi3 and generic mean 448.",
)
@click.option(
    "--scale-fmt",
    type=click.Choice(SCALE_FORMATS),
    default=None,
    help="--to block: ue8m0 writes power-of-two scales (DeepGEMM on Blackwell takes them as is).",
)
@click.option(
    "--scale-dtype",
    type=click.Choice(SCALE_DTYPES),
    default=None,
    help="With --scale-fmt ue8m0: store the power-of-two scales as float32 (the default, what every client "
    "reads) or float8_e8m0fnu (the default where the input stores them so, DeepSeek-V4's .scale).",
)
@click.option(
    "--mxfp8-format",
    type=click.Choice(MXFP8_FORMATS),
    default=None,
    help="--to mxfp8: the config's spelling, compressed-tensors mxfp8-quantized (the default) or ModelOpt MXFP8.",
)
@click.option(
    "--merge-lora",
    default=None,
    metavar="ADAPTER",
    help="Merge a PEFT LoRA adapter (a folder, or a Hub ID) into the weights it targets, in float32, before the "
    "one rounding to the target: a fine-tuned FP8 release stays FP8, with fresh scales where it changed.",
)
@click.option(
    "--merge-lora-sha256",
    default=None,
    metavar="HASH",
    help="With --merge-lora: refuse unless the adapter's files have this sha256 (the manifest records it; a "
    "pipeline pins the adapter it tested).",
)
@click.option(
    "--pad-for-tp",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="--to block: zero-pad MLP widths so each of N tensor-parallel ranks holds whole blocks.",
)
@click.option(
    "--pad-roles",
    default=None,
    metavar="ROLES",
    help="With --pad-for-tp: the MLP roles to pad, from dense,shared,routed (default: all; "
    "dense,shared when the routed experts run expert-parallel).",
)
@click.option(
    "--device",
    type=click.Choice(list(DEVICES)),
    default=DEFAULT_DEVICE,
    show_default=True,
    help="Where the arithmetic runs; auto is the CPU (the job is disk-bound).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="torch threads for the arithmetic (default: cores - 1, leaving a core for reading and writing).",
)
@click.option("--overwrite", is_flag=True, help="Replace the checkpoint in a non-empty output directory.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run: keep its finished shards that check out.")
@click.option(
    "--allow-nonfinite",
    is_flag=True,
    help="Convert weights whose scales hold NaN/Inf, listing them, instead of refusing.",
)
@click.option(
    "--no-space-check",
    "space_check",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Do not compare the planned output size with the free space.",
)
@click.option("--verify", "verify_after", is_flag=True, help="Read the output back and check it (fp8conv verify).")
@REVISION_OPTION
@click.option(
    "--part",
    default=None,
    metavar="I/N",
    help="Convert only the I-th of N parts of the shards (fan-out); the last part finalizes.",
)
@click.option(
    "--max-memory",
    default=None,
    metavar="SIZE",
    help="Cap on memory (e.g. 512M, 2G): large weights stream in smaller bands; refused up front if impossible.",
)
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes, each converting a byte-balanced part of the shards (--part I/N under the hood).",
)
@click.option(
    "--buffered-io",
    "direct_io",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Read and write through the page cache instead of direct I/O (O_DIRECT, the default where the "
    "filesystem has it: the page cache costs more CPU than the arithmetic).",
)
@click.option(
    "--stream",
    is_flag=True,
    help="Hub ID: fetch shards one by one (hf_hub_download) while earlier ones convert; plan from remote headers.",
)
@click.option(
    "--evict-input",
    is_flag=True,
    help="--stream: remove each input shard from the Hugging Face cache once every output reading it is written.",
)
@click.option(
    "--prefetch",
    type=click.IntRange(min=0),
    default=DEFAULT_PREFETCH,
    show_default=True,
    metavar="N",
    help="--stream: fetch the shards of up to N output shards ahead of the one being converted.",
)
@click.option(
    "--keep-model-card",
    is_flag=True,
    help="Copy README.md unchanged instead of appending a 'Converted with fp8conv' section.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Plan and check as a run would, print the plan (per output shard: tensors, bytes, how each job "
    "executes) and write nothing.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="With --dry-run: print the plan as one JSON object; with --to mxfp8, --to int8 or --scale-fmt ue8m0: the "
    "result and every tensor's requantization error.",
)
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary.")
@click.option(
    "--tuning",
    default=None,
    hidden=True,  # not a user option: how the work is cut (band and segment sizes), never the output's bytes
    metavar="JSON",
    help="RunOptions.tuning as a JSON object, e.g. '{\"convert_band_elements\": 3000}' (tests cut tiny weights small).",
)
def convert_command(
    checkpoint: str,
    output: str,
    hardware: str | None,
    threads: int | None,
    jobs: int,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
    **values: Any,
) -> None:
    """Convert CHECKPOINT (a folder, a .safetensors file or a Hub repo ID) into OUTPUT."""
    # every other parameter is named after a field of ConvertOptions or RunOptions and becomes it
    values["fp8_max"] = _fp8_range(values["fp8_max"], hardware)
    if jobs > 1 and values["part"] is not None:
        raise click.UsageError("-j N splits the work into parts itself: do not combine it with --part")
    # the runs with an error report
    reported = values["to"] in ("mxfp8", "int8") or values["scale_fmt"] or values["merge_lora"]
    if as_json and not dry_run and (jobs > 1 or quiet or not reported):
        raise click.UsageError(
            "--json prints the plan of --dry-run, or the result and error report of one --to mxfp8, --to int8, "
            "--scale-fmt ue8m0 or --merge-lora run (not with -j or -q): add --dry-run, or drop --json"
        )
    with _usage_errors():  # the parameters become the two values, which check themselves
        options, run = options_from(values, _OPTION_TEXT)
        workers = [replace(run, part=(i, jobs), verify_after=False) for i in range(1, jobs + 1)] if jobs > 1 else []
    if dry_run:
        _print_plan(checkpoint, output, options, run, jobs, as_json)
    elif workers:
        _convert_with_workers(checkpoint, output, options, workers, threads, quiet, run.verify_after)
    else:
        _convert_here(checkpoint, output, options, run, threads, quiet, as_json)


def _roles(text: str | None) -> tuple[str, ...] | None:
    return tuple(r.strip() for r in text.split(",") if r.strip()) if text is not None else None


# the option values convert's command line gives as text, and what makes each its field's value
_OPTION_TEXT: dict[str, Callable[[Any], Any]] = {
    "pad_roles": _roles,
    "part": lambda text: parse_part(text) if text else None,
    "max_memory": lambda text: parse_size(text) if text else None,
    "tuning": lambda text: _tuning(text) if text else Tuning(),
}


def _tuning(text: str) -> Tuning:
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OptionsError(f"--tuning is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise OptionsError("--tuning is not a JSON object")
    return Tuning.from_dict(values)


def _fp8_range(fp8_max: str | None, hardware: str | None) -> float:
    """--fp8-max, or what --target implies; the two must agree."""
    ranges = {"gaudi2": FP8_MAX_GAUDI2, "gaudi3": FP8_MAX_STANDARD, "generic": FP8_MAX_STANDARD}
    implied = f"{ranges[hardware]:g}" if hardware else None
    if fp8_max and implied and fp8_max != implied:
        raise click.UsageError(f"--target {hardware} means --fp8-max {implied}, not {fp8_max}")
    return float(fp8_max or implied or FP8_MAX_STANDARD)


@contextmanager
def _usage_errors() -> Iterator[None]:
    """Option values that do not fit together are usage errors (exit 2), not bad input (exit 1)."""
    try:
        yield
    except OptionsError as exc:
        raise click.UsageError(exc.one_line()) from None


def _convert_with_workers(
    checkpoint: str,
    output: str,
    options: ConvertOptions,
    workers: list[RunOptions],
    threads: int | None,
    quiet: bool,
    verify_after: bool,
) -> None:
    run_workers(checkpoint, output, options, workers, threads or 1, quiet)
    if verify_after:
        from ..check.verify import verify

        _report_verify(verify(checkpoint, output, tuning=workers[0].tuning))  # every worker's is the run's


def _convert_here(
    checkpoint: str,
    output: str,
    options: ConvertOptions,
    run: RunOptions,
    threads: int | None,
    quiet: bool,
    as_json: bool = False,
) -> None:
    # its threads and the bytes they read become the run's (convert closes them)
    warm = warm_start.WarmStart(run.tuning.piece_bytes)
    warm.torch()  # torch's import below then reads its files from the page cache
    if not (run.stream or run.part or run.resume or run.max_memory):  # the first input is read while torch loads
        warm.begin(checkpoint, options, direct=run.direct_io)
    from ..run.convert import convert

    _set_threads(threads)
    progress, close = _progress_bar(quiet or as_json)
    try:
        result = convert(checkpoint, output, options, run=replace(run, progress=progress), warm=warm)
    finally:
        close()
        warm.close()  # convert() closed it already; a no-op then
    if as_json:  # the result, the requantization error report included, as one object
        click.echo(json.dumps(asdict(result), indent=2, default=str))
        return
    _report_convert(result, quiet)


def _print_plan(
    checkpoint: str, output: str, options: ConvertOptions, run: RunOptions, jobs: int, as_json: bool
) -> None:
    """--dry-run: planned and checked as the run would be (its refusals exit 1 as they would), printed."""
    from ..run.dry_run import dry_run

    summary = dry_run(checkpoint, output, options, run=run, parts=jobs if jobs > 1 else None)
    if as_json:
        click.echo(json.dumps(summary.to_dict(), indent=2))
        return
    _echo_warnings(summary.warnings, summary.files_skipped, "would not be")
    click.echo(render_plan(summary))


def _set_threads(threads: int | None) -> None:
    """The process is the CLI's: it may size torch's thread pool (the library never touches it). On 2 cores,
    2 arithmetic threads starve the reader and writer threads and the whole run gets slower."""
    import torch

    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) - 1))


def _echo_warnings(warnings: list[str], files_skipped: list[tuple[str, str]], verb: str) -> None:
    """On stderr, even under --quiet; verb: "was not" after a run, "would not be" in a dry run's plan."""
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    for path, why in files_skipped:
        click.echo(f"warning: {path} {verb} copied: {why}", err=True)


def _report_convert(result: ConvertResult, quiet: bool) -> None:
    _echo_warnings(result.warnings, result.files_skipped, "was not")
    if not quiet:
        click.echo(convert_summary(result))
        for line in (merge_line(result.requantization), summary_line(result.requantization, result.target)):
            if line:
                click.echo(line)
    if result.streamed is not None and not quiet:
        click.echo(
            f"streamed: {len(result.streamed['fetched'])} shard(s) fetched, {len(result.streamed['evicted'])} "
            f"evicted, {result.streamed['waited_s']:.1f} s spent waiting for shards"
        )
    if result.verified is not None:
        _report_verify(result.verified)


def parse_size(text: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), flags=re.IGNORECASE)
    if not match:
        raise OptionsError(f"--max-memory {text!r} is not a size", fix="e.g. 512M or 2G")
    return int(float(match.group(1)) * units[match.group(2).upper()])


@main.command(WORKER_COMMAND, hidden=True)
@click.argument("job")
def part_worker_command(job: str) -> None:
    """One part of `convert -j N`: JOB is the JSON worker_job writes. Reports as `convert -q` does."""
    bind_to_parent()
    doc = json.loads(job)
    options, run = ConvertOptions.from_dict(doc["options"]), RunOptions.from_dict(doc["run"])
    from ..run.convert import convert

    _set_threads(doc["threads"])
    _report_convert(convert(doc["source"], doc["output"], options, run=run), quiet=True)


def _report_verify(result: VerifyResult) -> None:
    for failure in result.failures:
        click.echo(f"verify: {failure}", err=True)
    verdict = "ok" if result.ok else "FAILED"
    click.echo(
        f"verify {verdict}: {result.tensors_sampled} of {result.tensors_checked} tensors checked numerically, "
        f"structure of all, in {result.seconds:.1f} s"
    )
    if not result.ok:
        sys.exit(1)


@main.command("finalize")
@click.argument("output")
def finalize_command(output: str) -> None:
    """Check every part of a fan-out in OUTPUT, then write its manifest, index and config."""
    result = finalize(output)
    assert result is not None
    click.echo(f"finalized {result.output}: {result.parts} part(s), {result.shards} shard(s) checked")


@main.command("verify")
@click.argument("checkpoint")
@click.argument("output")
@click.option(
    "--sample",
    type=click.FloatRange(0.0, 1.0, min_open=True),
    default=1.0,
    show_default=True,
    help="Fraction of tensors whose numbers are checked (the structure is always checked whole).",
)
@click.option(
    "--to",
    "claimed",
    type=click.Choice(sorted(CLAIMS)),
    default=None,
    help="What OUTPUT should be (another tool's output; else read from its config and tensors).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: every tensor's verdict.")
def verify_command(checkpoint: str, output: str, sample: float, claimed: str | None, as_json: bool) -> None:
    """Check OUTPUT against CHECKPOINT: fp8conv's own output with the options in its manifest, or any other
    tool's output tensor by tensor against the exact values of CHECKPOINT."""
    from ..check.verify import verify

    rewritten = rewritten_shards(output)
    if claimed is None and present(Path(output) / MANIFEST) and not rewritten:
        result = verify(checkpoint, output, sample=sample)
        if as_json:
            click.echo(json.dumps(asdict(result), indent=2))
            sys.exit(0 if result.ok else 1)
        _report_verify(result)
        return
    from ..check.audit.audit import audit

    progress, close = _progress_bar(as_json, desc="verifying", unit=" values")
    try:
        report = audit(checkpoint, output, to=claimed, sample=sample, progress=progress)
    finally:
        close()
    if rewritten:
        report.notes.append(
            f"{MANIFEST} is fp8conv's, but {len(rewritten)} shard(s) it records have other sizes now "
            f"({rewritten[0]}...): another tool rewrote a copy, so it was audited as that tool's output"
        )
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(render_audit(report))
    if not report.ok:
        sys.exit(1)
