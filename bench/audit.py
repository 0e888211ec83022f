"""`fp8conv verify SRC OTHER` of another tool's output, timed beside the conversions that made it.

On a synthetic DeepSeek-shaped block-FP8 checkpoint: `convert --to bf16` and `--to channel` (whole
processes), then the audit of each output with its manifest removed (as another tool's output would be):
wall seconds and peak RSS of each process tree, one run after another on the same input. The audit reads
two checkpoints (the source and the output) and decodes both, so its floor is the read of both.
Writes bench/audit.json and bench/audit.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synth  # noqa: E402

from bench import dir_bytes, timed  # noqa: E402

CLI = [sys.executable, "-m", "fp8conv"]


def measure(size_gib: float, work: Path) -> dict:
    src = work / "src"
    if not src.exists():
        synth.build(src, size_gib)
    rows = {}
    for target in ("bf16", "channel"):
        out = work / target
        shutil.rmtree(out, ignore_errors=True)
        seconds, rss, err = timed([*CLI, "convert", str(src), "--to", target, "-o", str(out), "-q"])
        rows[f"convert --to {target}"] = {"seconds": seconds, "peak_rss_gib": rss / 2**30, "error": err}
        shutil.rmtree(out / ".fp8conv")
        seconds, rss, err = timed([*CLI, "verify", str(src), str(out), "--to", target])
        rows[f"verify (audit) of the {target} output"] = {"seconds": seconds, "peak_rss_gib": rss / 2**30, "error": err}
        shards = sorted(src.glob("*.safetensors")) + sorted(out.glob("*.safetensors"))
        seconds, rss, err = timed(["cat", *map(str, shards)])
        rows[f"read floor: cat of the source and the {target} output"] = {
            "seconds": seconds,
            "peak_rss_gib": rss / 2**30,
            "error": err,
        }
    return {"size_gib": size_gib, "input_bytes": dir_bytes(src), "rows": rows}


def markdown(doc: dict) -> str:
    lines = [
        f"# verify of another tool's output, {doc['size_gib']} GiB DeepSeek-shaped block FP8",
        "",
        "| run | wall | peak RSS |",
        "|---|---:|---:|",
    ]
    for name, r in doc["rows"].items():
        error = f" {r['error']}" if r["error"] else ""
        lines.append(f"| {name} | {r['seconds']:.1f} s | {r['peak_rss_gib']:.2f} GiB |{error}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gib", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--work", default="build/bench-audit")
    args = parser.parse_args()
    docs = []
    for size in args.size_gib:
        work = Path(args.work) / f"{size}g"
        work.mkdir(parents=True, exist_ok=True)
        docs.append(measure(size, work))
    (HERE / "audit.json").write_text(json.dumps(docs, indent=2))
    text = "\n".join(markdown(doc) for doc in docs)
    (HERE / "audit.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
