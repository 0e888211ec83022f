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
from fp8conv.output.manifest import Manifest
from tests.support.helpers import dir_snapshot
from tests.support.synthetic import TinyModelShape

# 128-wide everywhere: every weight whole 128x128 blocks, ~0.7 MB, so a ue8m0 run takes a fraction of a second
SMALL = TinyModelShape(
    vocab_size=16,
    hidden_size=128,
    intermediate_size=128,
    moe_intermediate_size=128,
    n_routed_experts=2,
    kv_lora_rank=128,
    q_lora_rank=128,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
)

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


@pytest.mark.parametrize("foreign", ["notes.txt", ".fp8conv/notes.txt", "model-00001-of-00002.safetensors", "sub/x"])
def test_resume_without_a_manifest_refuses_what_no_run_wrote_and_leaves_it(tiny, tmp_path, foreign):
    """A killed run's bookkeeping (its lock, a temporary) beside a file fp8conv never writes before its
    first manifest save: not an interrupted run's, so --resume refuses it by name and touches nothing."""
    out = tmp_path / "out"
    (out / ".fp8conv").mkdir(parents=True)
    (out / ".fp8conv" / "lock").write_text("{}\n")
    (out / ".fp8conv" / ".manifest.json.4242.fp8conv-partial").write_text("{")
    (out / foreign).parent.mkdir(parents=True, exist_ok=True)
    (out / foreign).write_text("theirs")
    before = dir_snapshot(out)
    with pytest.raises(OptionsError) as info:
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    named = foreign if foreign.startswith(".fp8conv") else foreign.split("/")[0]
    assert f"has no .fp8conv/manifest.json to resume from, and holds {named}, which" in info.value.one_line()
    assert dir_snapshot(out) == before
    (out / foreign).unlink()  # what is left is the killed run's own: resumed, i.e. started afresh
    if foreign.startswith("sub"):
        (out / "sub").rmdir()
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    fp8conv.convert(tiny.path, tmp_path / "single", ConvertOptions(to="bf16"))
    assert dir_snapshot(out) == dir_snapshot(tmp_path / "single")


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


class _Interrupted(Exception):
    """Raised where the run would be killed: after the first shard is recorded, before the second is."""


def _interrupt_after_first_shard(monkeypatch) -> None:
    real = Manifest.record_shard

    def record_shard(self, out, name, sha256, extra=None):
        if self.shards:
            raise _Interrupted(name)
        real(self, out, name, sha256, extra)

    monkeypatch.setattr(Manifest, "record_shard", record_shard)


def _requantization(out, record=".fp8conv/manifest.json") -> dict:
    return json.loads((out / record).read_text()).get("requantization", {})


@pytest.mark.parametrize(
    ("options", "part"),
    [
        (ConvertOptions(to="block", scale_fmt="ue8m0"), None),
        (ConvertOptions(to="mxfp8"), None),
        (ConvertOptions(to="block", scale_fmt="ue8m0"), (1, 2)),  # a part retried with --resume
        (ConvertOptions(to="int8"), None),
        (ConvertOptions(to="int8"), (1, 2)),
    ],
)
def test_a_resumed_run_reports_the_kept_shards_requantization(make_tiny, tmp_path, monkeypatch, options, part):
    """The manifest's requantization record after an interrupted run and --resume holds the kept shards'
    tensors too: the bytes an uninterrupted run writes (the error figures are deterministic)."""
    ckpt = make_tiny(num_shards=4 if part else 2, shape=SMALL)  # float32 block scales: every block searched
    single = fp8conv.convert(ckpt.path, tmp_path / "single", options)
    out = tmp_path / "out"
    record = f".fp8conv/part-{part[0]}-of-{part[1]}.json" if part else ".fp8conv/manifest.json"
    with monkeypatch.context() as patched:
        _interrupt_after_first_shard(patched)
        with pytest.raises(_Interrupted):
            fp8conv.convert(ckpt.path, out, options, run=RunOptions(part=part))
    (first,) = json.loads((out / record).read_text())["shards"]
    saved = _requantization(out, record)["tensors"]  # saved with the shard's entry, before the end
    assert saved and set(saved) == {n for n in single.requantization["tensors"] if n in _names_in(out / first)}
    resumed = fp8conv.convert(ckpt.path, out, options, run=RunOptions(part=part, resume=True))
    assert resumed.shards_kept == [first]
    if part:
        mine = set().union(*(_names_in(out / name) for name in resumed.shards))  # this part's tensors, kept ones too
        assert set(resumed.requantization["tensors"]) == mine & set(single.requantization["tensors"])
        fp8conv.convert(ckpt.path, out, options, run=RunOptions(part=(2, 2)))
    else:
        assert resumed.requantization == single.requantization
    assert _requantization(out) == single.requantization
    snapshot = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert snapshot == dir_snapshot(tmp_path / "single")  # the manifest's bytes included


def _names_in(shard) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        return set(f.keys())


def test_resume_redoes_a_kept_shard_without_its_reports_and_refuses_a_damaged_record(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2, shape=SMALL)
    options = ConvertOptions(to="block", scale_fmt="ue8m0")
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, options)
    expected = dir_snapshot(out)
    manifest = out / ".fp8conv" / "manifest.json"
    doc = json.loads(manifest.read_text())
    tensors = doc["requantization"]["tensors"]
    dropped = next(iter(tensors))  # one shard's report lost (a record cut by hand): that shard is redone
    cut = {k: v for k, v in tensors.items() if k != dropped}
    manifest.write_text(json.dumps({**doc, "requantization": {**doc["requantization"], "tensors": cut}}))
    (out / "config.json").unlink()  # as if interrupted before the end
    resumed = fp8conv.convert(ckpt.path, out, options, run=RunOptions(resume=True))
    assert len(resumed.shards_kept) == 1 and dropped not in _names_in(out / resumed.shards_kept[0])
    assert dir_snapshot(out) == expected
    damaged = {**tensors, dropped: {**tensors[dropped], "saturated": -1}}
    manifest.write_text(json.dumps({**doc, "requantization": {"tensors": damaged}}))
    with pytest.raises(OptionsError, match="is damaged: requantization is not a requantization record") as exc:
        fp8conv.convert(ckpt.path, out, options, run=RunOptions(resume=True))
    assert str(manifest) in str(exc.value) and "requantization" in str(exc.value) and "\n" not in str(exc.value)
