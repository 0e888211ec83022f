"""Sources beyond a local folder: Hub repo IDs through a real huggingface_hub cache in offline mode,
remote headers for inspect, and symlinks (followed inside an HF cache, never out of a checkpoint)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.errors import CheckpointError
from tests.support.helpers import dir_snapshot
from tests.support.hf_cache import COMMIT, lay_out_hf_cache, remote_metadata


def _cli(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "hf-home")}
    return subprocess.run(
        [sys.executable, "-m", "fp8conv", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_hub_id_through_an_offline_cache(tiny, tmp_path):
    cache = tmp_path / "hub-cache"
    lay_out_hf_cache(tiny.path, cache, "acme/tiny-fp8")
    inspected = _cli(["inspect", "acme/tiny-fp8", "--json"], cache)
    assert inspected.returncode == 0, inspected.stderr
    assert '"format": "block-fp8"' in inspected.stdout
    done = _cli(["convert", "acme/tiny-fp8", "--revision", COMMIT, "--to", "bf16", "-o", str(tmp_path / "hub")], cache)
    assert done.returncode == 0, done.stderr
    fp8conv.convert(tiny.path, tmp_path / "local", ConvertOptions(to="bf16"))
    hub, local = dir_snapshot(tmp_path / "hub"), dir_snapshot(tmp_path / "local")
    # provenance differs (the model card note and the manifest's source); everything else is the same bytes
    provenance = {"README.md", ".fp8conv/manifest.json"}
    assert {k: v for k, v in hub.items() if k not in provenance} == {
        k: v for k, v in local.items() if k not in provenance
    }  # tokenizer etc. followed into blobs
    assert f"converted [`acme/tiny-fp8`](https://huggingface.co/acme/tiny-fp8) at revision `{COMMIT}`" in (
        hub["README.md"].decode()
    )
    source = json.loads(hub[".fp8conv/manifest.json"])["source"]
    assert source == {"repo_id": "acme/tiny-fp8", "revision": COMMIT, "commit": COMMIT}
    missing = _cli(["convert", "acme/other", "--to", "bf16", "-o", str(tmp_path / "x")], cache)
    assert missing.returncode == 1 and missing.stderr.startswith("error: acme/other cannot be fetched")
    assert len(missing.stderr.splitlines()) == 2  # the error line and the FP8CONV_DEBUG hint


def test_a_cache_snapshot_path_works_directly(tiny, tmp_path):
    snap = lay_out_hf_cache(tiny.path, tmp_path / "cache", "acme/tiny-fp8")
    result = fp8conv.convert(snap, tmp_path / "out", ConvertOptions(to="bf16"))
    assert result.files_skipped == [] and "tokenizer.json" in result.files_copied


def test_symlinks_out_of_a_checkpoint_are_not_followed(tiny, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.txt").write_text("not part of the model")
    (tiny.path / "tokenizer_extra.txt").symlink_to(outside / "secret.txt")
    result = fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert ("tokenizer_extra.txt", "a symlink out of the checkpoint, not followed") in result.files_skipped
    assert not (tmp_path / "out" / "tokenizer_extra.txt").exists()
    shard = tiny.path / tiny.shards[1]
    moved = outside / shard.name
    shard.rename(moved)
    shard.symlink_to(moved)
    with pytest.raises(CheckpointError, match="outside the checkpoint") as info:
        fp8conv.convert(tiny.path, tmp_path / "out2", ConvertOptions(to="bf16"))
    assert tiny.shards[1] in str(info.value)


def test_inspect_of_an_uncached_hub_id_reads_remote_headers_only(tiny, tmp_path, monkeypatch):
    """The network path is thin: huggingface_hub's remote safetensors metadata, adapted to headers."""
    import huggingface_hub

    from fp8conv.source import hub

    files = remote_metadata(tiny.path, tiny.shards)
    jsons = tmp_path / "json-only"
    jsons.mkdir()
    for name in ("config.json", "model.safetensors.index.json"):
        (jsons / name).write_bytes((tiny.path / name).read_bytes())
    calls = []

    def fake_snapshot(repo_id, revision, *, headers_only=False, cached_only=False):
        calls.append((headers_only, cached_only))
        if cached_only:
            raise CheckpointError("not cached")
        assert headers_only, "inspect must not download weights"
        return jsons

    monkeypatch.setattr(hub, "snapshot", fake_snapshot)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "get_safetensors_metadata",
        lambda self, repo, revision=None: SimpleNamespace(files_metadata=files),
    )
    remote, local = fp8conv.inspect("acme/remote"), fp8conv.inspect(tiny.path)
    assert calls == [(False, True), (True, False)]
    assert remote.format == local.format == "block-fp8"
    assert remote.to_dict() | {"source": ""} == local.to_dict() | {"source": ""}
