"""A stand-in for the network: --stream's shards fetched from a local folder (tests and `make bench`)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from fp8conv.errors import CheckpointError
from fp8conv.source.shard_fetch import COPY_CHUNK


class LocalShardSource:
    """Shards copied from a local folder into `staging`, after `delay_s` and at `bytes_per_s` at most:
    a stand-in for the network in tests and in `make bench`. `log`, when given, gets one line per shard
    actually copied (what a resumed run refetched)."""

    def __init__(
        self,
        origin: Path,
        staging: Path,
        *,
        delay_s: float = 0.0,
        bytes_per_s: float | None = None,
        log: Path | None = None,
    ) -> None:
        self.origin, self.root = Path(origin), Path(staging)
        self.delay_s, self.bytes_per_s, self.log = delay_s, bytes_per_s, log
        self.root.mkdir(parents=True, exist_ok=True)

    def present(self, name: str) -> bool:
        return (self.root / name).is_file()

    def fetch(self, name: str, cancel: threading.Event) -> Path:
        target = self.root / name
        if target.is_file():
            return target
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(name + "\n")
        partial = target.with_name(target.name + ".incomplete")
        started = time.monotonic()
        if cancel.wait(self.delay_s):
            raise CheckpointError("fetch cancelled", shard=name)
        done = 0
        with open(self.origin / name, "rb") as src, open(partial, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                dst.write(chunk)
                done += len(chunk)
                if self.bytes_per_s:  # sleep until the throttled rate has caught up
                    ahead = started + self.delay_s + done / self.bytes_per_s - time.monotonic()
                    if ahead > 0 and cancel.wait(ahead):
                        raise CheckpointError("fetch cancelled", shard=name)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(partial, target)
        return target

    def evict(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def provenance(self) -> dict[str, Any]:
        return {"path": str(self.origin.resolve())}
