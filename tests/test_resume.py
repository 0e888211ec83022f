"""Crash safety: SIGKILL mid-run, then --resume, gives the bytes of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.errors import OptionsError

from .helpers import dir_snapshot

SLOW_CONVERT = """
import sys, time
import fp8conv
def slow(done, total):
    time.sleep(0.05)  # after each tensor: slow enough to be killed mid-run
fp8conv.convert(sys.argv[1], sys.argv[2], fp8conv.ConvertOptions(to="channel"), run=fp8conv.RunOptions(progress=slow))
"""


def _finished(out) -> list[str]:
    try:
        return list(json.loads((out / ".fp8conv" / "manifest.json").read_text())["shards"])
    except (OSError, ValueError):
        return []


def test_sigkill_then_resume_is_byte_identical(tiny, tmp_path):
    fp8conv.convert(tiny.path, tmp_path / "reference", ConvertOptions(to="channel"))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, str(tiny.path), str(out)])
    deadline = time.monotonic() + 120
    while not _finished(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = _finished(out)
    assert finished == [tiny.shards[0]], "the test must kill the run after its first shard"
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    kept = (out / tiny.shards[0]).stat()
    kept_file = (kept.st_ino, kept.st_mtime_ns)  # an inode alone may be reused by a rewrite
    with pytest.raises(OptionsError, match="not empty"):
        fp8conv.convert(tiny.path, out, ConvertOptions(to="channel"))  # neither --resume nor --overwrite
    assert fp8conv.convert(tiny.path, out, ConvertOptions(to="channel"), run=RunOptions(resume=True)).shards_kept == [
        tiny.shards[0]
    ]
    now = (out / tiny.shards[0]).stat()
    assert (now.st_ino, now.st_mtime_ns) == kept_file  # the finished shard was kept, not redone
    assert dir_snapshot(out) == dir_snapshot(tmp_path / "reference")


def test_resume_redoes_a_damaged_shard(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    expected = dir_snapshot(out)
    shard = out / tiny.shards[1]
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 1
    shard.write_bytes(bytes(raw))
    (out / "config.json").unlink()  # as if interrupted before the end
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    assert dir_snapshot(out) == expected


def test_resume_refuses_other_options_or_a_changed_input(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    with pytest.raises(OptionsError, match="option dtype was 'bfloat16', now 'float16'"):
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16", dtype="float16"), run=RunOptions(resume=True))
    config = json.loads((tiny.path / "config.json").read_text())
    config["rope_theta"] = 50000.0
    (tiny.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(OptionsError, match="the input changed"):
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(OptionsError, match=r"no \.fp8conv/manifest\.json to resume from"):
        fp8conv.convert(tiny.path, foreign, ConvertOptions(to="bf16"), run=RunOptions(resume=True))


def test_verify_checks_the_manifest_hashes(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    manifest = json.loads((out / ".fp8conv" / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == tiny.shards and manifest["options"]["to"] == "bf16"
    manifest["shards"][tiny.shards[0]]["sha256"] = "0" * 64
    (out / ".fp8conv" / "manifest.json").write_text(json.dumps(manifest))
    result = fp8conv.verify(tiny.path, out, sample=0.1)
    assert not result.ok and any("sha256 differs" in f for f in result.failures)
    assert os.path.exists(out / tiny.shards[0])
