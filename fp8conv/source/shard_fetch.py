"""Where `convert --stream` gets its input shards from, one at a time: the Hugging Face Hub through
huggingface_hub's cache, or (tests, bench) a local folder delivered with a delay or a throttle.

A source hands out shards by their index names under `root`, and can evict one it delivered. Headers
are not its job: the plan is made from remote headers before any shard is fetched."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Protocol

from ..errors import CheckpointError

COPY_CHUNK = 4 << 20


class ShardSource(Protocol):
    root: Path  # fetched shards appear here under their index names

    def present(self, name: str) -> bool:
        """Already on disk (fetched by an earlier run, or cached): fetching it costs nothing."""
        ...

    def fetch(self, name: str, cancel: threading.Event) -> Path:
        """Blocks until the shard is complete at root/name; raises CheckpointError naming it."""
        ...

    def evict(self, name: str) -> None:
        """Remove the shard's bytes from disk: no output that needs it is left to write."""
        ...

    def provenance(self) -> dict[str, Any]:
        """Where the input comes from, for the manifest and the model card."""
        ...


class HubShardSource:
    """hf_hub_download per shard, pinned to the commit the plan was made from: huggingface_hub's cache,
    auth (HF_TOKEN or the stored login), offline mode and resumable downloads (`.incomplete` blobs)."""

    def __init__(self, repo_id: str, revision: str | None, snapshot: Path) -> None:
        self.repo_id, self.revision, self.root = repo_id, revision, snapshot
        self.commit = snapshot.name  # snapshots/<commit>: the revision, resolved once for every shard

    def present(self, name: str) -> bool:
        return (self.root / name).is_file()  # a dangling snapshot link (evicted blob) is not

    def fetch(self, name: str, cancel: threading.Event) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            path = Path(hf_hub_download(self.repo_id, name, revision=self.commit))
        except Exception as exc:  # huggingface_hub raises many kinds; each becomes one clear line
            raise CheckpointError(
                f"cannot be fetched from {self.repo_id}@{self.commit} ({type(exc).__name__}: {exc})".replace("\n", " "),
                shard=name,
                fix="check the network, HF_TOKEN or HF_HUB_OFFLINE; --resume continues where this stopped",
            ) from exc
        if path != self.root / name:
            raise CheckpointError(f"was downloaded to {path}, not into {self.root}", shard=name)
        return path

    def evict(self, name: str) -> None:
        evict_cached_file(self.root / name)

    def provenance(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


def evict_cached_file(link: Path) -> None:
    """Remove one file of a huggingface_hub snapshot: its symlink, and its blob unless another snapshot
    (another revision sharing the file) or another name still links to it."""
    if not link.is_symlink():  # a cache without symlinks (Windows) holds real files in the snapshot
        link.unlink(missing_ok=True)
        return
    blob = link.resolve()
    link.unlink()
    repo = link
    while repo.name != "snapshots" and repo != repo.parent:
        repo = repo.parent
    if repo.name != "snapshots" or blob.parent != repo.parent / "blobs":
        return  # not a blob of this cache: only the link was ours to remove
    for dirpath, _dirs, files in os.walk(repo):
        for fname in files:
            other = Path(dirpath) / fname
            if other.is_symlink() and other.resolve() == blob:
                return  # still used by another revision or name
    blob.unlink(missing_ok=True)
