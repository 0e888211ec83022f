"""Shared by several test modules (carried out of tests/source/test_sources.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

from fp8conv.storage.header import read_header

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hf_cache(ckpt: Path, cache: Path, repo_id: str) -> Path:
    """What huggingface_hub writes: blobs by hash, a snapshot of relative symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    for src in sorted(p for p in ckpt.rglob("*") if p.is_file()):
        rel = src.relative_to(ckpt)
        blob = hashlib.sha256(src.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(src.read_bytes())
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo / "blobs" / blob, link.parent))
    return snap


def remote_metadata(ckpt: Path, shards: list[str]) -> dict[str, SimpleNamespace]:
    """Each shard's header as huggingface_hub's get_safetensors_metadata returns it (offsets relative to the
    data), for tests that stand in for reading headers remotely."""
    files = {}
    for shard in shards:
        header = read_header(ckpt / shard)
        tensors = {
            n: SimpleNamespace(
                dtype=e.dtype,
                shape=list(e.shape),
                data_offsets=(e.start - header.data_start, e.start - header.data_start + e.nbytes),
            )
            for n, e in header.tensors.items()
        }
        files[shard] = SimpleNamespace(tensors=tensors, metadata={"format": "pt"})
    return files
