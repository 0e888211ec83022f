"""Reading begins while torch loads.

`fp8conv convert` needs torch for the arithmetic only; reading headers and planning do not. So before the
CLI imports torch (~1.3 s of CPU, the GIL held most of that time) it starts, on threads of their own:
warm_torch(), readahead hints for torch's own files (from a cold page cache the import reads ~1,000
small files one at a time), and begin(): a thread that plans the run (~20 ms; convert() plans again
for itself) and reads what the run reads first: every scale tensor into the page cache (check_scales
reads them all before anything is written; readahead hints only) and the first PREFETCH_BYTES of the
first output shard's inputs into memory, with direct I/O like the run. File reads release the GIL, so
they go on while the import runs.

ShardReader.read hands a read that lies inside what was fetched to take(), which copies it from memory;
the bytes are the file's, so the output is the same. Held at once: at most PREFETCH_BYTES, each piece
dropped as soon as its bytes have been taken, the rest when the run's reader of that file closes
(forget()). Nothing is fetched for --stream, --part, --resume or --max-memory runs, nor for a Hub ID.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .direct_io import ALIGN, open_direct

if TYPE_CHECKING:
    from .options import ConvertOptions
    from .safetensors_file import TensorEntry

TORCH_HINT_THREADS = 4  # the import reads its files one at a time; several hints keep the disk busy
PREFETCH_BYTES = 64 * 2**20  # ~what the run's band buffers hold by default (stream.py)
PIECE_BYTES = 4 * 2**20  # unit of fetching and of release; ALIGN-aligned file offsets

FileKey = tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns: same file, unchanged


def file_key(fd: int) -> FileKey:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class _Piece:
    start: int  # file offset of data[0]
    want: int  # bytes of this piece the run is expected to take; dropped once taken
    ready: threading.Event = field(default_factory=threading.Event)
    data: memoryview | None = None  # None until read, or when the read failed
    taken: int = 0


_lock = threading.Lock()
_pieces: dict[FileKey, dict[int, _Piece]] = {}  # by file, by piece index (offset // PIECE_BYTES)


def begin(
    source: str,
    options: ConvertOptions,
    *,
    direct: bool = True,
    limit: int = PREFETCH_BYTES,
) -> threading.Thread | None:
    """Start fetching for a conversion of `source` (a local path) with `options`; returns the thread (for
    tests). Never raises: whatever is wrong with the input is for convert() to report."""
    if not Path(source).exists() or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_fetch, args=(source, options, direct, limit), name="fp8conv-warm", daemon=True)
    thread.start()
    return thread


def warm_torch() -> threading.Thread | None:
    """Readahead for torch's compiled modules and extension libraries, before it is imported: from a
    cold page cache (a fresh node, the bench's dropped caches) the import otherwise reads ~1,000 small
    files one after the other. libtorch_cpu.so (~430 MB, a fraction of it touched) is left out."""
    if "torch" in sys.modules:  # imported already (the CLI called in process)
        return None
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or spec.origin is None or not hasattr(os, "posix_fadvise"):
        return None
    thread = threading.Thread(target=_hint_torch, args=(Path(spec.origin).parent,), name="fp8conv-warm", daemon=True)
    thread.start()
    return thread


def _hint_torch(root: Path) -> None:
    """Walk torch's folders, hinting what is found on TORCH_HINT_THREADS threads as it is found; nothing
    when torch looks cached already (the hints would only compete with the import for the GIL)."""
    tag = f".{sys.implementation.cache_tag}."
    if all(_cached(root / p) for p in (f"__pycache__/__init__{tag}pyc", f"_decomp/__pycache__/decompositions{tag}pyc")):
        return
    found: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    hints = [threading.Thread(target=_hint_files, args=(found,), daemon=True) for _ in range(TORCH_HINT_THREADS)]
    for hint in hints:
        hint.start()
    try:
        for folder, _dirs, names in os.walk(root):
            cached = folder.endswith("__pycache__")
            for name in names:
                if (cached and tag in name) or _is_library(name):
                    found.put(os.path.join(folder, name))
    finally:
        for _ in hints:
            found.put(None)


def _cached(path: Path) -> bool:
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


def _hint_files(found: queue.SimpleQueue[str | None]) -> None:
    while (path := found.get()) is not None:
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def holds(key: FileKey) -> bool:
    """Anything fetched of this file (a cheap check before take())."""
    return bool(_pieces.get(key))


def take(key: FileKey, offset: int, out: memoryview) -> bool:
    """Fill `out` with the file's bytes from `offset` if they were all fetched; False leaves it to the disk."""
    end = offset + len(out)
    if end <= offset:
        return False
    spans = range(offset // PIECE_BYTES, (end - 1) // PIECE_BYTES + 1)
    with _lock:
        pieces = _pieces.get(key, {})
        found = [pieces.get(i) for i in spans]
    whole = all(p is not None for p in found)
    for piece in found:  # a piece still being read is waited for: its bytes are on their way
        if piece is not None:
            piece.ready.wait()
            data = piece.data
            whole = whole and data is not None and piece.start + len(data) >= min(end, piece.start + PIECE_BYTES)
    if whole:
        for piece in found:
            assert piece is not None and piece.data is not None
            lo, hi = max(offset, piece.start), min(end, piece.start + PIECE_BYTES)
            out[lo - offset : hi - offset] = piece.data[lo - piece.start : hi - piece.start]
    with _lock:  # bytes read from the disk instead are not asked for again either
        for i, piece in zip(spans, found, strict=True):
            if piece is not None:
                piece.taken += min(end, piece.start + PIECE_BYTES) - max(offset, piece.start)
                if piece.taken >= piece.want:
                    _pieces.get(key, {}).pop(i, None)
    return whole


def forget(key: FileKey) -> None:
    """The run is done with this file: drop whatever of it is still held."""
    with _lock:
        _pieces.pop(key, None)


def forget_all() -> None:
    with _lock:
        _pieces.clear()


def held_bytes() -> int:
    with _lock:
        return sum(len(p.data or b"") for pieces in _pieces.values() for p in pieces.values())


def _fetch(source: str, options: ConvertOptions, direct: bool, limit: int) -> None:
    from .formats import classify  # here: ShardReader imports this module for take()
    from .plan import plan_conversion
    from .source import open_checkpoint

    with contextlib.suppress(Exception):  # a failed prefetch only means the run reads it all itself
        ckpt = open_checkpoint(source)
        cls = classify(ckpt.index, ckpt.config, options.block_size)
        if cls.problems:
            return
        plan = plan_conversion(ckpt, cls, options)
        if plan.problems or not plan.shards:
            return
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
            for i in range(entry.start // PIECE_BYTES, -(-(entry.start + entry.nbytes) // PIECE_BYTES)):
                if (shard, i) not in counted and (len(counted) + 1) * PIECE_BYTES > limit:
                    break
                counted.add((shard, i))
                end = min(entry.start + entry.nbytes, (i + 1) * PIECE_BYTES)
            if end == entry.start:
                break
            first.setdefault(shard, []).append((entry.start, end - entry.start))
        _hint(index.root, scales)
        for name, ranges in first.items():
            _read(index.root / name, ranges, direct)


def _hint(root: Path, scales: dict[str, list[TensorEntry]]) -> None:
    """Readahead for the scales: the page cache fetches them while torch loads."""
    for name, entries in scales.items():
        fd = os.open(root / name, os.O_RDONLY)
        try:
            for entry in entries:
                os.posix_fadvise(fd, entry.start, entry.nbytes, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _read(path: Path, ranges: list[tuple[int, int]], direct: bool) -> None:
    """Register the pieces of `ranges` first (take() waits for one being read), then read them in order."""
    fd = os.open(path, os.O_RDONLY)
    direct_fd = open_direct(path, os.O_RDONLY) if direct else None
    dfd = -1 if direct_fd is None else direct_fd
    todo: list[_Piece] = []
    try:
        key = file_key(fd)
        with _lock:
            pieces = _pieces.setdefault(key, {})
            for offset, nbytes in ranges:
                for i in range(offset // PIECE_BYTES, (offset + nbytes - 1) // PIECE_BYTES + 1):
                    lo, hi = max(offset, i * PIECE_BYTES), min(offset + nbytes, (i + 1) * PIECE_BYTES)
                    if i not in pieces:
                        pieces[i] = _Piece(start=i * PIECE_BYTES, want=0)
                        todo.append(pieces[i])
                    pieces[i].want += hi - lo
        for piece in todo:
            piece.data, dfd = _read_piece(fd, dfd, piece.start)
            piece.ready.set()
    finally:
        for piece in todo:
            piece.ready.set()  # after a failed read: take() finds no data and leaves it to the disk
        os.close(fd)
        if direct_fd is not None:
            os.close(direct_fd)


def _read_piece(fd: int, dfd: int, start: int) -> tuple[memoryview, int]:
    """PIECE_BYTES from `start` (fewer at the end of the file), into page-aligned memory; the direct
    descriptor to use next (-1 once the filesystem turned a direct read down)."""
    buf = memoryview(mmap.mmap(-1, PIECE_BYTES))  # anonymous maps are page-aligned, as O_DIRECT wants
    done = 0
    while done < PIECE_BYTES:
        try:
            n = os.preadv(dfd if dfd >= 0 else fd, [buf[done:]], start + done)
        except OSError:
            if dfd < 0:
                raise
            dfd = -1  # the filesystem wants more alignment of a direct read: the page cache from here
            continue
        if n == 0 or (dfd >= 0 and n % ALIGN):  # a short direct read ends at the end of the file
            done += n
            break
        done += n
    return buf[:done], dfd
