"""Nothing looks finished unless it is: a run, a part or finalize killed with SIGKILL at the points that
matter leaves no index or config.json, and --resume or finalize again removes its temporaries and gives
the bytes of an uninterrupted run; a `-j` parent's death ends its workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.storage.out_dir import TEMP_SUFFIX
from tests.support.helpers import dir_snapshot

# kills this process at the n-th commit of a file named argv[3] (a temporary written, not yet renamed)
KILL_AT_COMMIT = """
import os, signal, sys
import fp8conv
from fp8conv.storage.out_dir import OutDir
name, nth, seen = sys.argv[3], int(sys.argv[4]), []
real = OutDir.commit
def commit(self, temp):
    if temp.final == name:
        seen.append(1)
        if len(seen) == nth:
            os.kill(os.getpid(), signal.SIGKILL)
    real(self, temp)
OutDir.commit = commit
if sys.argv[5] == "finalize":
    fp8conv.finalize(sys.argv[2])
else:
    fp8conv.convert(sys.argv[1], sys.argv[2], fp8conv.ConvertOptions(to="bf16"))
"""


def _killed_at(src: Path, out: Path, name: str, nth: int, what: str = "convert") -> None:
    done = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, str(src), str(out), name, str(nth), what], timeout=300)
    assert done.returncode == -signal.SIGKILL


def _temporaries(out: Path) -> list[str]:
    return sorted(p.relative_to(out).as_posix() for p in out.rglob(f"*{TEMP_SUFFIX}"))


def _looks_finished(out: Path) -> bool:
    return (out / "config.json").exists() or (out / "model.safetensors.index.json").exists()


@pytest.mark.parametrize(
    ("name", "nth"),
    [
        ("manifest.json", 2),  # saving the manifest after the first shard is committed
        ("model-00002-of-00002.safetensors", 1),  # the last shard written, not yet renamed
        ("model.safetensors.index.json", 1),  # index and config written, neither renamed
    ],
)
def test_a_run_killed_leaves_nothing_finished_and_resumes_to_the_same_bytes(make_tiny, tmp_path, name, nth):
    ckpt = make_tiny(num_shards=2)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    out = tmp_path / "out"
    _killed_at(ckpt.path, out, name, nth)
    assert _temporaries(out)  # the kill left its temporary behind
    assert not _looks_finished(out)
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    assert _temporaries(out) == []
    assert dir_snapshot(out) == dir_snapshot(tmp_path / "single")


def test_finalize_killed_mid_copy_is_finished_by_running_it_again(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    out = tmp_path / "out"
    for i in (1, 2):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(i, 2)))
    (out / "config.json").unlink()
    (out / "model.safetensors.index.json").unlink()
    (out / "tokenizer.json").unlink()
    _killed_at(ckpt.path, out, "tokenizer.json", 1, "finalize")
    assert _temporaries(out) and not _looks_finished(out)
    fp8conv.finalize(out)
    assert _temporaries(out) == []
    finished = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert finished == dir_snapshot(tmp_path / "single")


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _loads_torch(pid: int) -> bool:
    try:
        return "libtorch" in (Path("/proc") / str(pid) / "maps").read_text()
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_workers_die_with_their_parent(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    fp8conv_cli = Path(sys.executable).parent / "fp8conv"
    parent = subprocess.Popen([str(fp8conv_cli), "convert", str(ckpt.path), "--to", "bf16", "-o", str(out), "-j", "2"])
    deadline = time.monotonic() + 120
    workers: list[int] = []
    # both workers past their start (bind_to_parent runs first) and loading torch: still far from done
    while not (len(workers) == 2 and all(_loads_torch(w) for w in workers)) and time.monotonic() < deadline:
        workers = _children(parent.pid)
        time.sleep(0.005)
    assert len(workers) == 2
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(w) for w in workers)
    assert not _looks_finished(out)
