"""convert --stream: shards through a real huggingface_hub cache in offline mode (and planned from remote
headers), the order shards arrive and go in with a scale in another shard, the disk bound, and resume
after a SIGKILL, with a local source that delivers shards with a delay."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import CheckpointError, OptionsError, OutputError, PlanRefused
from fp8conv.source.shard_fetch import evict_cached_file
from tests.support.helpers import dir_snapshot
from tests.support.hf_cache import COMMIT, lay_out_hf_cache, remote_metadata
from tests.support.local_shards import LocalShardSource

REPO = "acme/tiny-fp8"
PROVENANCE = {"README.md", ".fp8conv/manifest.json"}  # differ between a Hub and a local source


def without_provenance(snapshot: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in snapshot.items() if k not in PROVENANCE}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_stream_through_an_offline_hub_cache_evicts_what_it_converted(tiny, tmp_path, hf_cache):
    """hf_hub_download per shard from the cache; each blob goes once its outputs are written, except
    one that another revision still links to."""
    snap = lay_out_hf_cache(tiny.path, hf_cache, REPO)
    repo = snap.parent.parent
    shared = snap / tiny.shards[2]
    other = repo / "snapshots" / ("f" * 40) / tiny.shards[2]  # another revision sharing the blob
    other.parent.mkdir(parents=True)
    other.symlink_to(os.path.relpath(shared.resolve(), other.parent))
    blobs = {name: (snap / name).resolve() for name in tiny.shards}

    result = fp8conv.convert(
        REPO,
        tmp_path / "out",
        ConvertOptions(to="bf16"),
        run=RunOptions(stream=True, evict_input=True, verify_after=True),
    )
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="bf16"))
    got = dir_snapshot(tmp_path / "out")
    assert without_provenance(got) == without_provenance(dir_snapshot(tmp_path / "local"))
    assert result.verified is not None and result.verified.ok and result.verified.tensors_sampled == 73
    for name in tiny.shards:
        assert not (snap / name).exists() and not (snap / name).is_symlink()
    assert not blobs[tiny.shards[0]].exists() and not blobs[tiny.shards[1]].exists()
    assert blobs[tiny.shards[2]].exists() and other.read_bytes() == (tiny.path / tiny.shards[2]).read_bytes()
    assert (snap / "tokenizer.json").is_file()  # the small files stay in the cache
    manifest = json.loads(got[".fp8conv/manifest.json"])
    assert manifest["source"] == {
        "repo_id": REPO,
        "revision": None,
        "commit": COMMIT,
        "stream": {"prefetch": 1, "evict_input": True},
    }
    assert manifest["input"]["commit"] == COMMIT and manifest["verify"]["ok"] is True
    card = got["README.md"].decode()
    assert card.startswith((tiny.path / "README.md").read_text().rstrip("\n"))
    assert f"converted [`{REPO}`](https://huggingface.co/{REPO}) at revision `{COMMIT}` to bfloat16" in card


def test_stream_cli_offline_and_keep_model_card(tiny, tmp_path):
    cache = tmp_path / "hub-cache"
    lay_out_hf_cache(tiny.path, cache, REPO)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    args = [sys.executable, "-m", "fp8conv", "convert", REPO, "--to", "channel", "--stream", "--keep-model-card"]
    done = subprocess.run([*args, "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "README.md").read_bytes() == (tiny.path / "README.md").read_bytes()
    assert (cache / f"models--acme--tiny-fp8/snapshots/{COMMIT}" / tiny.shards[0]).is_file()  # not evicted
    runner = CliRunner()
    local = runner.invoke(main, ["convert", str(tiny.path), "--to", "bf16", "--stream", "-o", str(tmp_path / "x")])
    assert local.exit_code == 1 and "is a local checkpoint" in local.stderr
    bad = runner.invoke(main, ["convert", str(tiny.path), "--to", "bf16", "--evict-input", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "--evict-input needs --stream" in bad.stderr


def test_stream_plans_from_remote_headers_before_any_download(tiny, tmp_path, hf_cache, monkeypatch):
    """Shards not in the cache: their headers come from huggingface_hub's remote metadata (offsets
    relative to the data), and a refusal happens before any shard is downloaded."""
    import huggingface_hub

    snap = lay_out_hf_cache(tiny.path, hf_cache, REPO)
    for name in tiny.shards:  # only the small files are cached
        (snap / name).resolve().unlink()
        (snap / name).unlink()
    files = remote_metadata(tiny.path, tiny.shards)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "get_safetensors_metadata",
        lambda self, repo, revision=None: SimpleNamespace(files_metadata=files),
    )
    downloads = []

    def fake_download(repo_id, filename, revision=None):  # what hf_hub_download leaves: a blob and a link
        assert (repo_id, revision) == (REPO, COMMIT)
        downloads.append(filename)
        blob = snap.parent.parent / "blobs" / f"blob-{filename}"
        blob.write_bytes((tiny.path / filename).read_bytes())
        (snap / filename).symlink_to(os.path.relpath(blob, snap))
        return str(snap / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("not empty")
    with pytest.raises(OptionsError, match="is not empty"):
        fp8conv.convert(REPO, tmp_path / "busy", ConvertOptions(to="bf16"), run=RunOptions(stream=True))
    assert downloads == []
    fp8conv.convert(REPO, tmp_path / "out", ConvertOptions(to="channel"), run=RunOptions(stream=True, evict_input=True))
    assert downloads == tiny.shards
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="channel"))
    assert without_provenance(dir_snapshot(tmp_path / "out")) == without_provenance(dir_snapshot(tmp_path / "local"))


class RecordingSource(LocalShardSource):
    """A local source with a delay that records when each shard is fetched and evicted, and how many
    are on disk at once."""

    def __init__(self, origin: Path, staging: Path, events: list, **kwargs) -> None:
        super().__init__(origin, staging, **kwargs)
        self.events = events
        self.lock = threading.Lock()
        self.held = self.peak = 0

    def fetch(self, name, cancel):
        with self.lock:
            self.events.append(("fetch", name))
            self.held += 1
            self.peak = max(self.peak, self.held)
        path = super().fetch(name, cancel)
        self.events.append(("arrived", name))
        return path

    def evict(self, name):
        super().evict(name)
        with self.lock:
            self.events.append(("evict", name))
            self.held -= 1


@pytest.fixture
def recorded_commits(monkeypatch):
    from fp8conv.output.manifest import Manifest

    events: list = []
    real = Manifest.record_shard

    def record(self, out, name, sha256, extra=None):
        real(self, out, name, sha256, extra)
        events.append(("commit", name))

    monkeypatch.setattr(Manifest, "record_shard", record)
    return events


def test_stream_order_with_a_scale_in_another_shard(tiny, tmp_path, recorded_commits):
    """Output 0 reads a scale stored in input 1: it waits for both; input 1 stays until output 1 is
    written too; fetching the next shard overlaps converting the current one; at most two input shards
    are on disk at once (what the plan computed)."""
    events = recorded_commits
    s0, s1, s2 = tiny.shards
    assert tiny.moved_scale is not None
    source = RecordingSource(tiny.path, tmp_path / "staging", events, delay_s=0.3)
    fp8conv.convert(
        tiny.path,
        tmp_path / "out",
        ConvertOptions(to="bf16"),
        run=RunOptions(stream=source, evict_input=True, prefetch=1),
    )
    order = [e for e in events if e[0] != "fetch"]
    assert order.index(("commit", s0)) > order.index(("arrived", s1))  # the moved scale was there first
    assert order.index(("evict", s0)) > order.index(("commit", s0))
    assert order.index(("evict", s1)) > order.index(("commit", s1))  # output 1 reads it too
    assert order.index(("evict", s2)) > order.index(("commit", s2))
    assert events.index(("fetch", s2)) > events.index(("commit", s0))  # no further ahead than --prefetch 1
    assert source.peak == 2 and list(source.root.iterdir()) == []
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="bf16"))
    assert dir_snapshot(tmp_path / "out") == dir_snapshot(tmp_path / "local") | {
        ".fp8conv/manifest.json": (tmp_path / "out" / ".fp8conv" / "manifest.json").read_bytes()
    }
    # --prefetch 2: input 2 is downloaded while output 0 is converted
    events.clear()
    source = RecordingSource(tiny.path, tmp_path / "staging2", events, delay_s=0.3)
    fp8conv.convert(
        tiny.path,
        tmp_path / "out2",
        ConvertOptions(to="bf16"),
        run=RunOptions(stream=source, evict_input=True, prefetch=2),
    )
    assert events.index(("fetch", s2)) < events.index(("commit", s0)) and source.peak == 3


def test_stream_disk_bound_is_refused_with_both_numbers(tiny, tmp_path, monkeypatch):
    import fp8conv.plan.preflight as preflight

    sizes = [(tiny.path / s).stat().st_size for s in tiny.shards]
    reference = fp8conv.convert(tiny.path, tmp_path / "ref", ConvertOptions(to="bf16"))
    copied = sum((tiny.path / f).stat().st_size for f in reference.files_copied)
    output = reference.bytes_written + copied
    for evict, held in ((True, max(sizes[0] + sizes[1], sizes[1] + sizes[2])), (False, sum(sizes))):
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p, n=output + held - 1: SimpleNamespace(free=n))
        source = LocalShardSource(tiny.path, tmp_path / f"staging-{evict}", log=tmp_path / f"log-{evict}")
        with pytest.raises(OutputError) as info:
            fp8conv.convert(
                tiny.path,
                tmp_path / f"out-{evict}",
                ConvertOptions(to="bf16"),
                run=RunOptions(stream=source, evict_input=evict),
            )
        message = info.value.one_line()
        assert f"the output needs {output} bytes" in message and f"the input {held} bytes" in message
        assert f"{output + held} bytes" in message and f"has {output + held - 1} bytes" in message
        assert not (tmp_path / f"out-{evict}").exists() and not (tmp_path / f"log-{evict}").exists()  # nothing fetched
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p, n=output + held: SimpleNamespace(free=n))
        fp8conv.convert(
            tiny.path,
            tmp_path / f"out-{evict}",
            ConvertOptions(to="bf16"),
            run=RunOptions(stream=source, evict_input=evict),
        )


def test_stream_checks_each_shard_as_it_arrives(make_tiny, tmp_path):
    """A NaN scale in the last shard: refused by name when it arrives; no index or config written."""
    import torch
    from safetensors.torch import load_file, save_file

    tiny = make_tiny()
    last = tiny.path / tiny.shards[2]
    tensors = load_file(last)
    scale = next(n for n in tensors if n.endswith("weight_scale_inv"))
    tensors[scale] = tensors[scale].clone()
    tensors[scale].view(-1)[0] = torch.nan
    save_file(tensors, str(last), metadata={"format": "pt"})
    source = LocalShardSource(tiny.path, tmp_path / "staging")
    with pytest.raises(PlanRefused) as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(stream=source))
    assert scale in str(info.value) and tiny.shards[2] in str(info.value)
    assert not (tmp_path / "out" / "config.json").exists()
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_a_shard_that_differs_from_the_plan_is_refused(tiny, tmp_path):
    class Swapped(LocalShardSource):
        def fetch(self, name, cancel):
            path = super().fetch(name, cancel)
            if name == tiny.shards[1]:
                path.write_bytes((tiny.path / tiny.shards[2]).read_bytes())
            return path

    with pytest.raises(CheckpointError, match="differs from the header the plan was made from") as info:
        fp8conv.convert(
            tiny.path,
            tmp_path / "out",
            ConvertOptions(to="bf16"),
            run=RunOptions(stream=Swapped(tiny.path, tmp_path / "st")),
        )
    assert tiny.shards[1] in str(info.value)


KILLED_RUN = """
import sys
from pathlib import Path
import fp8conv
from tests.support.local_shards import LocalShardSource
origin, staging, out, log = map(Path, sys.argv[1:5])
source = LocalShardSource(origin, staging, delay_s=float(sys.argv[5]), log=log)
fp8conv.convert(
    origin,
    out,
    fp8conv.ConvertOptions(to="channel"),
    run=fp8conv.RunOptions(stream=source, evict_input=True, resume=len(sys.argv) > 6),
)
"""


def test_stream_resume_after_sigkill_refetches_only_what_is_missing(tiny, tmp_path):
    out, staging, log = tmp_path / "out", tmp_path / "staging", tmp_path / "fetched"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    args = [sys.executable, str(script), str(tiny.path), str(staging), str(out), str(log)]
    env = {**os.environ, "PYTHONPATH": str(Path(fp8conv.__file__).parent.parent)}
    proc = subprocess.Popen([*args, "1.5"], env=env)
    manifest = out / ".fp8conv" / "manifest.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (manifest.is_file() and json.loads(manifest.read_text())["shards"]):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(json.loads(manifest.read_text())["shards"])
    s0, s1, s2 = tiny.shards
    # output 1 reads only input 1, already there for output 0's moved scale: it may be written too;
    # output 2 waits for input 2, 1.5 s away
    assert done in ([s0], [s0, s1]) and not (out / "config.json").exists()
    needed = {s1, s2} - set(done)  # the inputs the unfinished outputs read
    first_run = log.read_text().split()
    log.unlink()
    on_disk = {n for n in os.listdir(staging) if n.endswith(".safetensors")}
    resumed = subprocess.run([*args, "0", "--resume"], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    refetched = log.read_text().split() if log.exists() else []
    # inputs only finished outputs read are never needed again; what the killed run had finished
    # fetching is not fetched twice
    assert set(refetched) <= needed and not on_disk & set(refetched)
    assert set(refetched) | (on_disk & needed) == needed and set(first_run) >= on_disk
    fp8conv.convert(tiny.path, tmp_path / "ref", ConvertOptions(to="channel"))
    got, ref = dir_snapshot(out), dir_snapshot(tmp_path / "ref")
    assert without_provenance(got) == without_provenance(ref) and got["README.md"] == ref["README.md"]
    assert json.loads(got[".fp8conv/manifest.json"])["shards"] == json.loads(ref[".fp8conv/manifest.json"])["shards"]
    assert list(staging.glob("*.safetensors")) == []


def test_evicting_a_cache_file_keeps_blobs_other_links_use(tmp_path):
    repo = tmp_path / "models--a--b"
    (repo / "blobs").mkdir(parents=True)
    blob = repo / "blobs" / "abc"
    blob.write_bytes(b"x")
    links = [repo / "snapshots" / rev / "m.safetensors" for rev in ("r1", "r2")]
    for link in links:
        link.parent.mkdir(parents=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    evict_cached_file(links[0])
    assert not links[0].is_symlink() and blob.exists() and links[1].read_bytes() == b"x"
    evict_cached_file(links[1])
    assert not blob.exists() and not links[1].is_symlink()


def test_model_card_note_replaces_an_old_one(tiny, tmp_path):
    first = fp8conv.convert(tiny.path, tmp_path / "bf16", ConvertOptions(to="bf16")).output
    fp8conv.convert(first, tmp_path / "block", ConvertOptions(to="block"))
    card = (tmp_path / "block" / "README.md").read_text()
    assert card.count("## Converted with fp8conv") == 1 and "to block FP8 (128x128 blocks" in card
    assert "converted a local copy (folder `bf16`, revision unknown)" in card
    fp8conv.convert(tiny.path, tmp_path / "kept", ConvertOptions(to="bf16", keep_model_card=True))
    assert (tmp_path / "kept" / "README.md").read_bytes() == (tiny.path / "README.md").read_bytes()


def test_resume_after_eviction_plans_offline_from_the_saved_headers(tiny, tmp_path, hf_cache, monkeypatch):
    """An interrupted streamed run evicted input 0; offline, the resume plans from the headers that run
    saved (the shard is gone from the cache and the Hub is out of reach) and never fetches it again."""
    from fp8conv.run.streaming import HEADERS_FILE
    from fp8conv.source.shard_fetch import HubShardSource

    snap = lay_out_hf_cache(tiny.path, hf_cache, REPO)
    real_fetch = HubShardSource.fetch
    fetched = []

    def failing_fetch(self, name, cancel):
        if name == tiny.shards[2]:
            raise CheckpointError("network down", shard=name)
        fetched.append(name)
        return real_fetch(self, name, cancel)

    monkeypatch.setattr(HubShardSource, "fetch", failing_fetch)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="network down"):
        fp8conv.convert(REPO, out, ConvertOptions(to="bf16"), run=RunOptions(stream=True, evict_input=True))
    assert not (snap / tiny.shards[0]).exists() and (out / HEADERS_FILE).is_file()
    monkeypatch.setattr(HubShardSource, "fetch", real_fetch)
    headers = (out / HEADERS_FILE).read_bytes()
    (out / HEADERS_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"shard\(s\) are not in the cache \(model-00001-of-00003") as info:
        fp8conv.convert(
            REPO, out, ConvertOptions(to="bf16"), run=RunOptions(stream=True, evict_input=True, resume=True)
        )
    assert "headers cannot be read remotely" in str(info.value)
    (out / HEADERS_FILE).write_bytes(headers)
    result = fp8conv.convert(
        REPO, out, ConvertOptions(to="bf16"), run=RunOptions(stream=True, evict_input=True, resume=True)
    )
    assert result.streamed is not None and tiny.shards[0] not in result.streamed["fetched"]
    assert not (out / HEADERS_FILE).exists()
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="bf16"))
    assert without_provenance(dir_snapshot(out)) == without_provenance(dir_snapshot(tmp_path / "local"))


def test_stream_a_single_file_repo_without_index(make_tiny, tmp_path, hf_cache):
    tiny = make_tiny(num_shards=1, with_index=False)
    snap = lay_out_hf_cache(tiny.path, hf_cache, REPO)
    result = fp8conv.convert(
        REPO, tmp_path / "out", ConvertOptions(to="channel"), run=RunOptions(stream=True, evict_input=True)
    )
    assert result.shards == ["model.safetensors"] and not (snap / "model.safetensors").exists()
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="channel"))
    assert without_provenance(dir_snapshot(tmp_path / "out")) == without_provenance(dir_snapshot(tmp_path / "local"))


def test_stream_refuses_an_index_without_weight_map_by_name(tiny, tmp_path, hf_cache):
    """The streamed plan reads the index as a local checkpoint does: a broken one is one named refusal."""
    snap = lay_out_hf_cache(tiny.path, hf_cache, REPO)
    index = snap / "model.safetensors.index.json"
    index.unlink()
    index.write_text(json.dumps({"metadata": {}, "weights": {}}))
    with pytest.raises(CheckpointError, match="has no 'weight_map' object") as refused:
        fp8conv.convert(REPO, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(stream=True))
    assert "model.safetensors.index.json" in refused.value.one_line()
    assert not (tmp_path / "out").exists()
