"""Fan-out: N parts as separate processes on one output give exactly what a single run gives."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv.cli import main
from fp8conv.errors import OptionsError
from fp8conv.parts import assign_parts, parse_part
from fp8conv.plan import ShardPlan

from .helpers import dir_snapshot


@pytest.mark.parametrize(("to", "count"), [("bf16", 2), ("channel", 3), ("block", 4)])
def test_parts_as_processes_equal_a_single_run(make_tiny, tmp_path, to, count):
    ckpt = make_tiny(num_shards=4, dialect="ue8m0-u8" if to == "block" else "block")
    fp8conv.convert(ckpt.path, tmp_path / "single", to=to)
    out = tmp_path / "fanout"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fp8conv",
                "convert",
                str(ckpt.path),
                "--to",
                to,
                "-o",
                str(out),
                "--part",
                f"{i}/{count}",
                "-q",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(1, count + 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    single, fanned = dir_snapshot(tmp_path / "single"), dir_snapshot(out)
    fanned = {k: v for k, v in fanned.items() if not k.startswith(".fp8conv/part-")}
    assert fanned == single  # shards, index, config (scale_fmt too), copied files and manifest


def test_finalize_waits_for_every_part_and_checks_hashes(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, to="bf16", part=(1, 2))
    assert not (out / "config.json").exists()  # part 2 has not run: not finalized
    with pytest.raises(OptionsError, match="parts 2/2 have not finished"):
        fp8conv.finalize(out)
    fp8conv.convert(tiny.path, out, to="bf16", part=(2, 2))
    assert (out / "config.json").exists()  # the last part finalized
    (out / "config.json").unlink()
    first = sorted(out.glob("model-*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:-1] + b"\x00")
    result = CliRunner().invoke(main, ["finalize", str(out)])
    assert result.exit_code == 1 and "does not match its part's hash" in result.stderr
    assert not (out / "config.json").exists()


def test_part_assignment_is_balanced_and_deterministic():
    from fp8conv.plan import Action, Job
    from fp8conv.writer import TensorSpec

    sizes = {"s0": 50, "s1": 40, "s2": 30, "s3": 20, "s4": 10}
    plans = [ShardPlan(n, [Job("t", Action.COPY, (TensorSpec("t", "U8", (b,)),))]) for n, b in sizes.items()]
    assert assign_parts(plans, 2) == [["s0", "s3", "s4"], ["s1", "s2"]]
    assert assign_parts(plans, 2) == assign_parts(list(reversed(plans)), 2)
    assert parse_part("3/8") == (3, 8)
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(OptionsError):
            parse_part(bad)
    assert json.dumps(assign_parts(plans, 5)) == '[["s0"], ["s1"], ["s2"], ["s3"], ["s4"]]'


def test_jobs_flag_runs_worker_processes(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=4)
    fp8conv.convert(ckpt.path, tmp_path / "single", to="bf16")
    out = tmp_path / "jobs"
    cmd = [
        sys.executable,
        "-m",
        "fp8conv",
        "convert",
        str(ckpt.path),
        "--to",
        "bf16",
        "-o",
        str(out),
        "-j",
        "2",
        "--verify",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "with 2 worker processes" in done.stdout and "verify ok" in done.stdout
    fanned = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert fanned == dir_snapshot(tmp_path / "single")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "is not empty" in again.stderr
    mixed = CliRunner().invoke(main, ["convert", str(ckpt.path), "--to", "bf16", "-o", "x", "-j", "2", "--part", "1/2"])
    assert mixed.exit_code == 2


def test_finalize_rereads_only_shards_touched_since_their_part_wrote_them(tiny, tmp_path, monkeypatch):
    """A part records each shard's mtime and inode beside its hash; finalize re-hashes a shard only when
    they changed (touched, or copied in from elsewhere) and the final manifest leaves them out."""
    import fp8conv.manifest as manifest_module

    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, to="bf16", part=(1, 2))
    fp8conv.convert(tiny.path, out, to="bf16", part=(2, 2))
    final = json.loads((out / ".fp8conv" / "manifest.json").read_text())
    assert all(set(entry) == {"size", "sha256"} for entry in final["shards"].values())
    hashed: list[str] = []
    real = manifest_module.file_sha256
    monkeypatch.setattr(manifest_module, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    fp8conv.finalize(out)
    assert hashed == []  # every shard is the file its part wrote
    shards = sorted(out.glob("model-*.safetensors"))
    st = shards[0].stat()
    os.utime(shards[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched, same bytes
    copy = shards[1].with_suffix(".copy")
    shutil.copyfile(shards[1], copy)
    os.replace(copy, shards[1])  # another inode, same bytes
    fp8conv.finalize(out)
    assert sorted(hashed) == [shards[0].name, shards[1].name]
    assert json.loads((out / ".fp8conv" / "manifest.json").read_text()) == final
