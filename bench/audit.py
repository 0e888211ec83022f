"""`fp8conv verify SRC OTHER` of another tool's output, timed beside the conversions that made it.

On a synthetic DeepSeek-shaped block-FP8 checkpoint: `convert --to bf16` and `--to channel` (whole
processes), then the audit of each output with its manifest removed (as another tool's output would be):
wall seconds and peak RSS of each process tree, side by side in each round on the same input. The audit reads
two checkpoints (the source and the output) and decodes both, so its floor is the read of both.
Writes bench/audit.json and bench/audit.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synth  # noqa: E402

from bench import dir_bytes, timed  # noqa: E402

CLI = [sys.executable, "-m", "fp8conv"]


def measure(size_gib: float, work: Path, reps: int) -> dict:
    """Each target's conversion, the audit of its output and the cat floor, one after another, `reps`
    times over (side by side in each round: the machine's noise falls on all three alike)."""
    src = work / "src"
    if not src.exists():
        synth.build(src, size_gib)
    runs: dict[str, list[tuple[float, int, str]]] = {}
    for _ in range(reps):
        for target in ("bf16", "channel"):
            out = work / target
            shutil.rmtree(out, ignore_errors=True)
            convert = [*CLI, "convert", str(src), "--to", target, "-o", str(out), "-q"]
            runs.setdefault(f"convert --to {target}", []).append(timed(convert))
            shutil.rmtree(out / ".fp8conv")
            verify = [*CLI, "verify", str(src), str(out), "--to", target]
            runs.setdefault(f"verify (audit) of the {target} output", []).append(timed(verify))
            shards = sorted(src.glob("*.safetensors")) + sorted(out.glob("*.safetensors"))
            floor = f"read floor: cat of the source and the {target} output"
            runs.setdefault(floor, []).append(timed(["cat", *map(str, shards)]))
    rows = {
        name: {
            "seconds": statistics.median(s for s, _, _ in done),
            "runs": [round(s, 2) for s, _, _ in done],
            "peak_rss_gib": max(rss for _, rss, _ in done) / 2**30,
            "error": next((e for _, _, e in done if e), ""),
        }
        for name, done in runs.items()
    }
    return {"size_gib": size_gib, "reps": reps, "input_bytes": dir_bytes(src), "rows": rows}


def markdown(doc: dict) -> str:
    lines = [
        f"# verify of another tool's output, {doc['size_gib']} GiB DeepSeek-shaped block FP8",
        "",
        f"median of {doc['reps']} rounds, each running the three side by side; caches dropped before each run",
        "",
        "| run | median wall | runs | peak RSS |",
        "|---|---:|---|---:|",
    ]
    for name, r in doc["rows"].items():
        error = f" {r['error']}" if r["error"] else ""
        runs = ", ".join(f"{s:.1f}" for s in r["runs"])
        lines.append(f"| {name} | {r['seconds']:.1f} s | {runs} | {r['peak_rss_gib']:.2f} GiB |{error}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gib", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--work", default="build/bench-audit")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    docs = []
    for size in args.size_gib:
        work = Path(args.work) / f"{size}g"
        work.mkdir(parents=True, exist_ok=True)
        docs.append(measure(size, work, args.reps))
    (HERE / "audit.json").write_text(json.dumps(docs, indent=2))
    text = "\n".join(markdown(doc) for doc in docs)
    (HERE / "audit.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
