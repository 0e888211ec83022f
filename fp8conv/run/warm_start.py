"""Reading begins while torch loads.

`fp8conv convert` needs torch for the arithmetic only; reading headers and planning do not. So before the
CLI imports torch (~1.3 s of CPU, the GIL held most of that time) it starts, on threads of their own:
warm_torch(), readahead hints for torch's own files (from a cold page cache the import reads ~1,000
small files one at a time), and begin(): a thread that plans the run (~20 ms; convert() plans again
for itself) and reads what the run reads first: every scale tensor into the page cache (check_scales
reads them all before anything is written; readahead hints only) and the first PREFETCH_BYTES of the
first output shard's inputs into memory, with direct I/O like the run. File reads release the GIL, so
they go on while the import runs.

The fetched bytes wait in the run's store (WarmStart.preread, preread.py), handed to convert() with the
threads (WarmStart.threads, threads.py): the run's readers take them from it (the file's bytes, so the
output is the same), and the run's end cancels and joins whatever warm start still runs. At most
PREFETCH_BYTES are held at once. Nothing is fetched for --stream, --part, --resume or --max-memory runs,
nor for a Hub ID.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import queue
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ..storage.preread import PIECE_BYTES, Preread
from ..threads import RunThreads

if TYPE_CHECKING:
    from ..options import ConvertOptions
    from ..storage.safetensors_file import TensorEntry

TORCH_HINT_THREADS = 4  # the import reads its files one at a time; several hints keep the disk busy
PREFETCH_BYTES = 64 * 2**20  # ~what the run's band buffers hold by default (stream.py)


class WarmStart:
    """What the CLI starts for one run before torch loads: threads of the run's RunThreads, and the store
    of bytes they read ahead. convert(..., warm=) takes both over and closes them at its end."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        """`piece_bytes`: the store's unit of reading ahead (RunOptions.tuning.piece_bytes)."""
        self.threads = RunThreads()
        self.preread = Preread(piece_bytes)
        self.hinted: list[str] = []  # torch's files hinted so far (appended by the hint threads)

    def begin(
        self, source: str, options: ConvertOptions, *, direct: bool = True, limit: int = PREFETCH_BYTES
    ) -> threading.Thread | None:
        """Start fetching for a conversion of `source` (a local path) with `options`; returns the thread
        (for tests). Never raises: whatever is wrong with the input is for convert() to report."""
        if not Path(source).exists() or not hasattr(os, "posix_fadvise"):
            return None
        return self.threads.start("warm", self._fetch, source, options, direct, limit)

    def torch(self, *, even_if_cached: bool = False) -> threading.Thread | None:
        """Readahead for torch's compiled modules and extension libraries, before it is imported: from a
        cold page cache (a fresh node, the bench's dropped caches) the import otherwise reads ~1,000
        small files one after the other. libtorch_cpu.so (~430 MB, a fraction of it touched) is left out."""
        if "torch" in sys.modules:  # imported already (the CLI called in process)
            return None
        spec = importlib.util.find_spec("torch")  # finds the package without importing it
        if spec is None or spec.origin is None or not hasattr(os, "posix_fadvise"):
            return None
        return self.threads.start("warm", self._hint_torch, Path(spec.origin).parent, even_if_cached)

    def close(self) -> None:
        """Cancel and join what still runs (convert() does this; for a CLI run that never got there)."""
        self.threads.close()

    def _hint_torch(self, root: Path, even_if_cached: bool = False) -> None:
        """Walk torch's folders, hinting what is found on TORCH_HINT_THREADS threads as it is found;
        nothing when torch looks cached already (the hints would only compete with the import for the
        GIL). The walk stops when the run is cancelled."""
        tag = f".{sys.implementation.cache_tag}."
        probes = (f"__pycache__/__init__{tag}pyc", f"_decomp/__pycache__/decompositions{tag}pyc")
        if not even_if_cached and all(page_cached(root / p) for p in probes):
            return
        found: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        for _ in range(TORCH_HINT_THREADS):
            self.threads.start("warm-hint", _hint_files, found, self.hinted)
        try:
            for folder, _dirs, names in os.walk(root):
                if self.threads.cancelled.is_set():
                    break
                cached = folder.endswith("__pycache__")
                for name in names:
                    if (cached and tag in name) or _is_library(name):
                        found.put(os.path.join(folder, name))
        finally:
            for _ in range(TORCH_HINT_THREADS):
                found.put(None)

    def _fetch(self, source: str, options: ConvertOptions, direct: bool, limit: int) -> None:
        with contextlib.suppress(Exception):  # a failed prefetch only means the run reads it all itself
            for path, ranges in _first_reads(source, options, limit, self.preread.piece_bytes).items():
                if self.threads.cancelled.is_set():
                    return
                self.preread.read(path, ranges, direct, self.threads.cancelled)


def page_cached(path: Path) -> bool:
    """Whether the first byte of `path` is in the page cache: a read that may not wait for the disk."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT) == 1
    except (OSError, AttributeError):  # not cached (EAGAIN), or no RWF_NOWAIT here
        return False
    finally:
        os.close(fd)


def _is_library(name: str) -> bool:
    return name.endswith(".so") and name != "libtorch_cpu.so" and "test" not in name


def _hint_files(found: queue.SimpleQueue[str | None], hinted: list[str]) -> None:
    while (path := found.get()) is not None:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                hinted.append(path)
            finally:
                os.close(fd)


def _first_reads(
    source: str, options: ConvertOptions, limit: int, piece_bytes: int
) -> dict[Path, list[tuple[int, int]]]:
    """Plan the run, hint its scales into the page cache; the ranges of the first output shard's inputs
    to read ahead, by file, at most `limit` bytes' worth of pieces (of `piece_bytes`). Raises whatever is
    wrong with the input."""
    from ..model.classify import classify  # here, not at the top: --help and inspect import this module
    from ..plan.conversion import plan_conversion
    from ..source.checkpoint import open_checkpoint

    ckpt = open_checkpoint(source)
    cls = classify(ckpt.index, ckpt.classification_config(), options.block_size)
    if cls.problems:
        return {}
    plan = plan_conversion(ckpt, cls, options)
    if plan.problems or not plan.shards:
        return {}
    index = ckpt.index
    scales: dict[str, list[TensorEntry]] = {}
    for job in (j for s in plan.shards for j in s.jobs):
        for name in (job.fmt.scale, job.fmt.global_scale) if job.fmt else ():
            if name:
                scales.setdefault(index.shard_of(name).name, []).append(index.entry(name))
    first: dict[str, list[tuple[int, int]]] = {}  # the first output shard's tensors, in the run's order
    counted: set[tuple[str, int]] = set()  # pieces (shard, index) those take, at most limit's worth
    for job in plan.shards[0].jobs:
        entry, shard = index.entry(job.source), index.shard_of(job.source).name
        end = entry.start
        for i in range(entry.start // piece_bytes, -(-(entry.start + entry.nbytes) // piece_bytes)):
            if (shard, i) not in counted and (len(counted) + 1) * piece_bytes > limit:
                break
            counted.add((shard, i))
            end = min(entry.start + entry.nbytes, (i + 1) * piece_bytes)
        if end == entry.start:
            break
        first.setdefault(shard, []).append((entry.start, end - entry.start))
    _hint(index.root, scales)
    return {index.root / name: ranges for name, ranges in first.items()}


def _hint(root: Path, scales: dict[str, list[TensorEntry]]) -> None:
    """Readahead for the scales: the page cache fetches them while torch loads."""
    for name, entries in scales.items():
        fd = os.open(root / name, os.O_RDONLY)
        try:
            for entry in entries:
                os.posix_fadvise(fd, entry.start, entry.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
