"""The bench's I/O floor writes what it is told, in every mode, and never waits on itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import dir_snapshot, fp8, write_checkpoint

FLOOR = Path(__file__).resolve().parents[2] / "bench" / "io_floor.py"


@pytest.mark.parametrize(
    "mode",
    [
        [],
        ["--concurrent"],
        ["--buffered"],
        ["--buffered", "--concurrent"],
        ["--concurrent", "--import-torch"],
        ["--concurrent", "--unavoidable"],
    ],
    ids=["direct", "concurrent", "buffered", "buffered-concurrent", "import-torch", "unavoidable"],
)
@pytest.mark.parametrize("out_ratio", [2.0, 0.5])
def test_io_floor_writes_the_output_size_per_shard(tmp_path: Path, mode: list[str], out_ratio: float) -> None:
    # 3 shards of 4-8 MiB: several reads of one band per shard, so --concurrent paces across shards
    src = write_checkpoint(tmp_path / "in", {f"w{i}": fp8((2048, 2048 + 512 * i), seed=i) for i in range(5)}, shards=3)
    before = dir_snapshot(src)
    in_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    out_bytes = int(in_bytes * out_ratio) + 12345  # not a whole number of pages
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(FLOOR), str(src), str(out), str(out_bytes), *mode], check=True, timeout=120)
    per_shard = -(-out_bytes // 3)
    assert {p.name: p.stat().st_size for p in out.glob("*.safetensors")} == {
        p.name: per_shard for p in src.glob("*.safetensors")
    }
    assert dir_snapshot(src) == before


@pytest.mark.parametrize("mode", [[], ["--concurrent"]], ids=["direct", "concurrent"])
def test_io_floor_fails_on_a_read_error_instead_of_waiting(tmp_path: Path, mode: list[str]) -> None:
    src = write_checkpoint(tmp_path / "in", {"w": fp8((1024, 1024))}, shards=1)
    (src / "model-00002-of-00002.safetensors").mkdir()  # reading it fails (EISDIR) after the first shard
    done = subprocess.run(
        [sys.executable, str(FLOOR), str(src), str(tmp_path / "out"), str(8 << 20), *mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "IsADirectoryError" in done.stderr


def test_bench_table_sets_the_whole_process_against_the_floor_of_reads_and_writes_at_once() -> None:
    sys.path.insert(0, str(FLOOR.parent))
    import bench

    def variant(seconds: float, **extra: float) -> dict:
        return {"median_s": seconds, "times_s": [seconds], "peak_rss_bytes": 0, **extra}

    v = {
        "fp8conv --to bf16": variant(4.6, concurrent_floor_s=4.0, ratio_to_concurrent_floor=1.15, target_ratio=1.15),
        "fp8conv --to channel": variant(3.6, concurrent_floor_s=2.5, ratio_to_concurrent_floor=1.44, target_ratio=1.35),
        "fp8conv --to block": variant(3.0, concurrent_floor_s=2.5, ratio_to_concurrent_floor=1.2),
        bench.STARTUP: variant(1.5),
    }
    for r in v.values():
        r.setdefault("import_floor_s", 4.2)
        r.setdefault("import_floor_ratio", 1.05)
        r.setdefault("unavoidable_floor_s", 4.5)
        r.setdefault("unavoidable_floor_ratio", 1.12)
    v["fp8conv --to channel"].update(import_floor_s=3.5, import_floor_ratio=1.4)
    text = bench.markdown({"machine": "m", "runs": {"2 GiB": {"input_bytes": 2**31, "variants": v}}})
    assert "| fp8conv --to bf16 | 4.60 | 4.00 | 1.15 | <= 1.15: met | 4.20 (1.05) | 4.50 (1.12) |" in text
    # the floor with torch's import alone over the target: no torch-based converter can meet it
    assert (
        "| fp8conv --to channel | 3.60 | 2.50 | 1.44 | <= 1.35: missed; out of reach with torch "
        "(its import alone: 1.40) | 3.50 (1.40) | 4.50 (1.12) |"
    ) in text
    assert "| fp8conv --to block | 3.00 | 2.50 | 1.20 | - | 4.20 (1.05) | 4.50 (1.12) |" in text
    assert "Start-up alone (the CLI and torch imported): 1.50 s." in text
