"""`make bench`: fp8conv against the I/O floor, the plain-torch way and compressed-tensors, side by side.

Every variant runs as its own process, alternating, `--reps` times; the table reports medians, the
ratio to the I/O floor of the same output size, throughput (input + output bytes) and the peak RSS of
the whole process tree (polled from /proc). A second table sets each conversion against what the floor
leaves out: the same bytes read and written at once (io_floor.py --concurrent); that plus torch's import
before the first write, which any torch-based converter pays (--import-torch); and that plus the output's
sha256, which any such converter recording it pays (--unavoidable). A target below the import's own ratio
is out of reach for every converter that computes with torch, and the table says so. Writes
bench/results.json and bench/results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import io_floor  # noqa: E402
import plan_scale  # noqa: E402
import synth  # noqa: E402

import fp8conv  # noqa: E402
from fp8conv.options import DEFAULT_TUNING  # noqa: E402
from fp8conv.plan import bands as stream  # noqa: E402
from fp8conv.storage import direct_io, writer  # noqa: E402

# the floor does not import fp8conv (torch's import alone costs ~1.4 s of CPU), so it states the sizes
assert (io_floor.ALIGN, io_floor.SEGMENT_BYTES) == (direct_io.ALIGN, writer.SEGMENT_BYTES)
assert DEFAULT_TUNING.convert_band_elements == io_floor.READ_BYTES  # one FP8 band
assert io_floor.READ_AHEAD == stream.READ_AHEAD


TARGETS = ("bf16", "channel", "block")
# what a conversion pays before its first read: the CLI and torch (importing the CLI alone no longer loads it)
STARTUP = "fp8conv start-up alone (import fp8conv.cli.commands, fp8conv.run.convert)"
# issue 14: at 2 GiB the whole `fp8conv convert` process within this many times the floor of the same
# bytes read and written at once
WHOLE_PROCESS_TARGET = {"bf16": 1.15, "channel": 1.35}
TARGET_GIB = 2.0
# issues 38 and 41: the power-of-two targets and INT8 against --to channel, which does the same
# dequantize-requantize work, side by side on the same input (time ratio), and their peak RSS
CHANNEL_LIKE_TARGETS = {
    "fp8conv --to block --scale-fmt ue8m0": ["--to", "block", "--scale-fmt", "ue8m0"],
    "fp8conv --to mxfp8": ["--to", "mxfp8"],
    "fp8conv --to int8": ["--to", "int8"],
}
CHANNEL_RATIO_GOAL = 1.3
RSS_GOAL = 0.5 * 2**30


def floor_name(target: str) -> str:
    return f"I/O floor ({target} output size)"


def concurrent_floor_name(target: str) -> str:
    return f"I/O floor, reads and writes at once ({target} output size)"


def import_floor_name(target: str) -> str:
    return f"I/O floor at once + torch's import ({target} output size)"


def unavoidable_floor_name(target: str) -> str:
    return f"I/O floor at once + torch's import + output sha256 ({target} output size)"


def tree_rss_bytes(pid: int) -> int:
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            continue
    return total


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS of the process tree, and the tail of stderr (for failures).

    The previous run's dirty pages are flushed first and, where allowed (root), the page cache is dropped
    (untimed): no run pays for another's writeback or reads what another left cached."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def poll() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_bytes(proc.pid))
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - start
    poller.join()
    if proc.returncode != 0:
        return (
            float("nan"),
            peak[0],
            err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}",
        )
    return seconds, peak[0], ""


def run_alternating(commands: dict[str, list[str]], reps: int, out: Path) -> dict[str, dict]:
    """Every command once per repetition, in turn; medians over the runs that succeeded."""
    results: dict[str, dict] = {name: {"times_s": [], "peak_rss_bytes": 0, "error": ""} for name in commands}
    for _ in range(reps):
        for name, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            seconds, peak, err = timed(cmd)
            results[name]["times_s"].append(seconds)
            results[name]["peak_rss_bytes"] = max(results[name]["peak_rss_bytes"], peak)
            results[name]["error"] = results[name]["error"] or err
    shutil.rmtree(out, ignore_errors=True)
    for r in results.values():
        times = [t for t in r["times_s"] if t == t]
        r["median_s"] = statistics.median(times) if times else None
    return results


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def selected(name: str, only: list[str]) -> bool:
    """A variant runs when no --only was given or its name contains one of them (its floor comes along)."""
    return not only or any(o in name for o in only)


def run_size(
    size_gib: float,
    reps: int,
    work: Path,
    with_baselines: bool,
    only: list[str],
    device: str | None,
    stream_rate_mb: float | None = None,
) -> dict:
    src = synth.build(work / f"in-{size_gib:g}", size_gib)
    in_bytes = dir_bytes(src)
    py = sys.executable
    out = work / "out"
    variants: dict[str, tuple[list[str], str | None]] = {}
    outputs: dict[str, int] = {}
    report = fp8conv.inspect(src)
    for target, extra in (("bf16", []), ("channel", []), ("block", ["--pad-for-tp", "8"])):
        label = f"fp8conv --to {target}" + (" --pad-for-tp 8" if extra else "")
        variants[label] = (
            [py, "-m", "fp8conv", "convert", str(src), "--to", target, "-o", str(out), "-q", *extra],
            target,
        )
        outputs[target] = report.estimated_output_bytes[target]
        if device:  # the same conversion on another backend, e.g. --device cuda on a GPU machine
            variants[f"{label} --device {device}"] = (
                [*variants[label][0], "--device", device],
                target,
            )
        floor_cmd = [py, str(HERE / "io_floor.py"), str(src), str(out), str(outputs[target])]
        variants[floor_name(target)] = (floor_cmd, None)
        # what the floor leaves out: reads and writes at the same time (a conversion cannot read all of a
        # shard before writing it); with fp8conv's start-up (torch's import, STARTUP below)
        variants[concurrent_floor_name(target)] = ([*floor_cmd, "--concurrent"], target)
        # and what any torch-based converter that records its output's sha256 must add to it
        variants[import_floor_name(target)] = ([*floor_cmd, "--concurrent", "--import-torch"], target)
        variants[unavoidable_floor_name(target)] = ([*floor_cmd, "--concurrent", "--unavoidable"], target)
    for label, args in CHANNEL_LIKE_TARGETS.items():
        variants[label] = ([py, "-m", "fp8conv", "convert", str(src), *args, "-o", str(out), "-q"], None)
    # what direct I/O buys: the same conversion and floor through the page cache
    variants["fp8conv --to bf16 --buffered-io"] = (
        [py, "-m", "fp8conv", "convert", str(src), "--to", "bf16", "-o", str(out), "-q", "--buffered-io"],
        "bf16",
    )
    variants["I/O floor, page cache (bf16 output size)"] = (
        [py, str(HERE / "io_floor.py"), str(src), str(out), str(outputs["bf16"]), "--buffered"],
        "bf16",
    )
    variants[STARTUP] = ([py, "-c", "import fp8conv.cli.commands, fp8conv.run.convert"], None)
    variants["fp8conv --to bf16 -j 2"] = (
        [py, "-m", "fp8conv", "convert", str(src), "--to", "bf16", "-o", str(out), "-q", "-j", "2"],
        "bf16",
    )
    if stream_rate_mb:  # --stream against download-then-convert; no network here, so a throttled local copy
        throttled = f"throttled local source at {stream_rate_mb:g} MB/s standing in for the network"
        for mode, label in (
            ("stream", f"fp8conv --to bf16 --stream --evict-input, {throttled}"),
            ("then", f"download then convert (fp8conv --to bf16), {throttled}"),
            ("download", f"download alone, {throttled}"),
        ):
            cmd = [py, str(HERE / "stream_source.py"), str(src), str(out), str(work / "staging")]
            variants[label] = ([*cmd, "--rate-mb", f"{stream_rate_mb:g}", "--mode", mode], None)
    if with_baselines:
        variants["plain torch --to bf16"] = ([py, str(HERE / "plain_torch.py"), str(src), str(out)], "bf16")
        variants["compressed-tensors --to bf16 (ragged shapes)"] = (
            [py, str(HERE / "ct_convert.py"), str(src), str(out)],
            "bf16",
        )
    variants = {name: v for name, v in variants.items() if selected(name, only) or name == STARTUP}  # ~1.5 s
    results = run_alternating({name: cmd for name, (cmd, _target) in variants.items()}, reps, out)
    for target in TARGETS:
        floor_s = results[floor_name(target)]["median_s"] if floor_name(target) in results else None
        for name, (_cmd, t) in variants.items():
            if t == target and floor_s and results[name]["median_s"]:
                results[name]["ratio_to_floor"] = results[name]["median_s"] / floor_s
                results[name]["gb_per_s"] = (in_bytes + outputs[target]) / results[name]["median_s"] / 1e9
        label = next((n for n in variants if n.startswith(f"fp8conv --to {target}")), "")
        conversion, concurrent, imported, unavoidable = (
            results.get(n, {}).get("median_s")
            for n in (label, concurrent_floor_name(target), import_floor_name(target), unavoidable_floor_name(target))
        )
        if conversion and concurrent and imported and unavoidable:
            results[label]["concurrent_floor_s"] = concurrent
            results[label]["ratio_to_concurrent_floor"] = conversion / concurrent
            results[label]["import_floor_s"] = imported
            results[label]["import_floor_ratio"] = imported / concurrent
            results[label]["unavoidable_floor_s"] = unavoidable
            results[label]["unavoidable_floor_ratio"] = unavoidable / concurrent
            results[label]["ratio_to_unavoidable_floor"] = conversion / unavoidable
            if target in WHOLE_PROCESS_TARGET and size_gib == TARGET_GIB:
                results[label]["target_ratio"] = WHOLE_PROCESS_TARGET[target]
    channel = results.get("fp8conv --to channel", {}).get("median_s")
    for label in CHANNEL_LIKE_TARGETS:
        if channel and results.get(label, {}).get("median_s"):
            results[label]["ratio_to_channel"] = results[label]["median_s"] / channel
    shutil.rmtree(src)
    return {"input_bytes": in_bytes, "output_bytes": outputs, "variants": results}


def run_aligned(size_gib: float, reps: int, work: Path) -> dict:
    """compressed-tensors fails on ragged shapes, so it is also timed on an all-aligned checkpoint."""
    src = synth.build(work / "aligned", size_gib, ragged=False)
    py = sys.executable
    out = work / "out"
    out_bytes = fp8conv.inspect(src).estimated_output_bytes["bf16"]
    variants = {
        "fp8conv --to bf16": [py, "-m", "fp8conv", "convert", str(src), "--to", "bf16", "-o", str(out), "-q"],
        "compressed-tensors --to bf16": [py, str(HERE / "ct_convert.py"), str(src), str(out)],
        floor_name("bf16"): [py, str(HERE / "io_floor.py"), str(src), str(out), str(out_bytes)],
    }
    results = run_alternating(variants, reps, out)
    in_bytes = dir_bytes(src)
    floor_s = results[floor_name("bf16")]["median_s"]
    for r in results.values():
        if r["median_s"]:
            r["ratio_to_floor"] = r["median_s"] / floor_s
            r["gb_per_s"] = (in_bytes + out_bytes) / r["median_s"] / 1e9
    shutil.rmtree(src)
    return {"input_bytes": in_bytes, "output_bytes": {"bf16": out_bytes}, "variants": results}


def run_v4(size_gib: float, reps: int, work: Path) -> dict:
    """DeepSeek-V4-shaped: MXFP4 experts (0.5 byte per weight in, 2 out) and block FP8 for the rest."""
    src = synth.build_v4(work / "v4", size_gib)
    py = sys.executable
    out = work / "out"
    outputs = {t: fp8conv.inspect(src).estimated_output_bytes[t] for t in ("bf16", "block")}
    variants: dict[str, list[str]] = {}
    for target in ("bf16", "block"):
        variants[f"fp8conv --to {target}"] = [
            py,
            "-m",
            "fp8conv",
            "convert",
            str(src),
            "--to",
            target,
            "-o",
            str(out),
            "-q",
        ]
        variants[floor_name(target)] = [py, str(HERE / "io_floor.py"), str(src), str(out), str(outputs[target])]
    # issue 15's bf16 target is against the plain floor; this shows what torch's import and the output's
    # sha256 alone add to reads and writes at once
    unavoidable = unavoidable_floor_name("bf16")
    variants[unavoidable] = [*variants[floor_name("bf16")], "--concurrent", "--unavoidable"]
    results = run_alternating(variants, reps, out)
    in_bytes = dir_bytes(src)
    for target, name in (("bf16", "fp8conv --to bf16"), ("block", "fp8conv --to block"), ("bf16", unavoidable)):
        floor_s = results[floor_name(target)]["median_s"]
        r = results[name]
        if floor_s and r["median_s"]:
            r["ratio_to_floor"] = r["median_s"] / floor_s
            r["gb_per_s"] = (in_bytes + outputs[target]) / r["median_s"] / 1e9
    shutil.rmtree(src)
    return {"input_bytes": in_bytes, "output_bytes": outputs, "variants": results}


def target_verdict(r: dict) -> str:
    """Met or missed; and out of reach when the floor with torch's import alone, which does no arithmetic
    and hashes nothing, is already over the target."""
    goal = r.get("target_ratio")
    if not goal:
        return "-"
    verdict = f"<= {goal:.2f}: {'met' if r['ratio_to_concurrent_floor'] <= goal else 'missed'}"
    if r["import_floor_ratio"] > goal:
        verdict += f"; out of reach with torch (its import alone: {r['import_floor_ratio']:.2f})"
    return verdict


def markdown(doc: dict) -> str:
    lines = [f"Machine: {doc['machine']}", ""]
    for title, section in doc["runs"].items():
        lines += [
            f"### {title}: {section['input_bytes'] / 2**30:.2f} GiB in",
            "",
            "| variant | median s | x I/O floor | GB/s (in+out) | peak RSS MiB | runs |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for name, r in section["variants"].items():
            med = f"{r['median_s']:.2f}" if r.get("median_s") else "failed"
            ratio = f"{r['ratio_to_floor']:.2f}" if r.get("ratio_to_floor") else ("1.00" if "floor" in name else "-")
            gbps = f"{r['gb_per_s']:.2f}" if r.get("gb_per_s") else "-"
            runs = ", ".join("fail" if t != t else f"{t:.1f}" for t in r["times_s"])
            lines.append(f"| {name} | {med} | {ratio} | {gbps} | {r['peak_rss_bytes'] / 2**20:.0f} | {runs} |")
            if r.get("error"):
                lines.append(f"| ↳ error | {r['error'][:150]} | | | | |")
        explained = {n: r for n, r in section["variants"].items() if r.get("ratio_to_concurrent_floor")}
        if explained:  # the whole `fp8conv convert` process against the floor of reading and writing at once
            startup = section["variants"].get(STARTUP, {}).get("median_s")
            lines += [
                "",
                "| whole process, start to exit | s | floor, reads and writes at once, s | x that floor | target "
                "| that floor + torch's import, s (x floor) | + output sha256 too, s (x floor) |",
                "|---|---:|---:|---:|---|---:|---:|",
            ]
            for name, r in explained.items():
                cells = [
                    f"{r['median_s']:.2f}",
                    f"{r['concurrent_floor_s']:.2f}",
                    f"{r['ratio_to_concurrent_floor']:.2f}",
                    target_verdict(r),
                    f"{r['import_floor_s']:.2f} ({r['import_floor_ratio']:.2f})",
                    f"{r['unavoidable_floor_s']:.2f} ({r['unavoidable_floor_ratio']:.2f})",
                ]
                lines.append(f"| {name} | {' | '.join(cells)} |")
            if startup:
                lines.append(f"\nStart-up alone (the CLI and torch imported): {startup:.2f} s.")
        against_channel = {n: r for n, r in section["variants"].items() if r.get("ratio_to_channel")}
        if against_channel:  # issues 38 and 41's targets, side by side with --to channel in this run
            lines += [
                "",
                f"| target (power-of-two scales, INT8) | s | x --to channel (goal <= {CHANNEL_RATIO_GOAL}) | peak RSS "
                f"GiB (goal < {RSS_GOAL / 2**30:.1f}) |",
                "|---|---:|---:|---:|",
            ]
            for name, r in against_channel.items():
                ratio, rss = r["ratio_to_channel"], r["peak_rss_bytes"]
                lines.append(
                    f"| {name} | {r['median_s']:.2f} | {ratio:.2f}: "
                    f"{'met' if ratio <= CHANNEL_RATIO_GOAL else 'missed'} "
                    f"| {rss / 2**30:.2f}: {'met' if rss < RSS_GOAL else 'missed'} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sizes", default="2,8", help="input sizes in GiB, comma separated (issue 14's targets are at 2 GiB)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", default="build/bench")
    parser.add_argument("--no-baselines", action="store_true", help="skip plain torch and compressed-tensors")
    parser.add_argument("--device", default=None, help="also time fp8conv with --device DEVICE (e.g. cuda)")
    parser.add_argument("--no-v4", action="store_true", help="skip the DeepSeek-V4-shaped (MXFP4 + FP8) case")
    parser.add_argument("--v4-only", action="store_true", help="run only the DeepSeek-V4-shaped case")
    parser.add_argument(
        "--no-plan-scale", action="store_true", help="skip inspect/--dry-run at release scale (bench/plan_scale.py)"
    )
    parser.add_argument(
        "--stream-rate",
        type=float,
        default=None,
        metavar="MB_S",
        help="also time --stream against download-then-convert, a local source throttled to MB_S MB/s "
        "standing in for the network (select them alone with --only stream --only download)",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only variants whose name contains this (repeatable), e.g. --only channel",
    )
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sizes = [float(s) for s in args.sizes.split(",")]
    doc = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, "
        f"torch {__import__('torch').__version__}, fp8conv {fp8conv.__version__}",
        "reps": args.reps,
        "runs": {},
    }
    if not args.no_v4 and not args.only:  # at the smallest size: the experts quadruple on the way out
        doc["runs"][f"DeepSeek-V4-like (MXFP4 experts + block FP8), {min(sizes):g} GiB"] = run_v4(
            min(sizes), args.reps, work
        )
    for i, size in enumerate([] if args.v4_only else sizes):
        baselines = not args.no_baselines and i == len(sizes) - 1
        doc["runs"][f"DeepSeek-like shapes, {size:g} GiB"] = run_size(
            size, args.reps, work, baselines, args.only, args.device, args.stream_rate
        )
        print(f"done {size:g} GiB", file=sys.stderr)
    if not args.no_baselines and not args.only and not args.v4_only:
        doc["runs"][f"all-aligned shapes, {sizes[-1]:g} GiB"] = run_aligned(sizes[-1], args.reps, work)
    import ue8m0  # here: it computes with torch, which the timed runs' parent does not load before them

    if not args.only and not args.v4_only:  # power-of-two scales against vLLM's load-time requantization
        doc["ue8m0"] = ue8m0.measure()
    stem = "results-only" if args.only or args.v4_only else "results"  # a partial run never replaces the full table
    stem += f"-{args.device}" if args.device else ""
    (HERE / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (HERE / f"{stem}.md").write_text(markdown(doc) + "\n" + ue8m0.markdown(doc.get("ue8m0")))
    print(markdown(doc) + "\n" + ue8m0.markdown(doc.get("ue8m0")))
    if not args.no_plan_scale and not args.only and not args.v4_only:  # writes bench/plan-scale.json and .md
        print(plan_scale.markdown(plan_scale.run(work / "plan-scale", plan_scale.LAYOUTS, args.reps)))


if __name__ == "__main__":
    main()
