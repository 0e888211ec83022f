"""Atomic writers: a safetensors shard streamed tensor by tensor, and small JSON files.

Every file is written under a temporary name in the output directory, fsynced, then renamed, so a
reader never sees a half-written file under its final name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .direct_io import ALIGN, aligned_empty, open_direct, round_up
from .dtypes import ELEMENT_BYTES
from .errors import OutputError
from .safetensors_file import TensorEntry, as_writable_memoryview
from .shard_reader import ShardReader, read_capacity

if TYPE_CHECKING:
    import torch

TEMP_SUFFIX = ".fp8conv-partial"
COPY_CHUNK_BYTES = 16 * 1024 * 1024
# A shard is written in aligned segments of this size, at most MAX_SEGMENTS of them in memory at once
SEGMENT_BYTES = 4 * 1024 * 1024
MAX_SEGMENTS = 8


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ELEMENT_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def safetensors_header(specs: Iterable[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header for tensors stored contiguously in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def temp_path(final: Path) -> Path:
    # the pid keeps processes apart: parts of a fan-out may write the same file (finalize) at once
    return final.with_name(f".{final.name}.{os.getpid()}{TEMP_SUFFIX}")


def temp_target(temp_name: str) -> str:
    """The final file name a temporary name stands for."""
    return temp_name.removeprefix(".").removesuffix(TEMP_SUFFIX).rsplit(".", 1)[0]


@dataclass
class _Segment:
    """An ALIGN-aligned piece of a shard being assembled in memory (or, once spilled, in the file)."""

    buffer: torch.Tensor | None  # None once spilled: its bytes go to the file as they come
    view: memoryview | None
    filled: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)  # filled byte ranges, for spilling


class ShardWriter:
    """Writes one planned shard. Every tensor's offset is known from the plan, so tensors may arrive
    in any order (a weight and its scale are computed together but laid out apart); commit() checks
    that every planned tensor arrived, then makes the file appear under its final name.

    The bytes are assembled in memory into aligned segments, each written with one direct write once
    complete (see direct_io: the page cache cost more CPU than the arithmetic). Where the filesystem
    has no direct I/O the same segments go through the page cache. Segments that would stay partial
    too long (a layout that does not follow production order, see ShardPlan.specs) are spilled: their
    bytes go to the file through the page cache as they come, so memory stays a few segments.

    The file's sha256 (for the manifest) is taken from the segments as they are written, so a finished
    shard is never read back: hashing a bf16 shard after the fact re-read every byte from disk and
    nearly doubled the run (measured, 4 GiB --to bf16: 22.8-25.4 s reading back, 12.5-15.1 s unhashed).
    A complete segment is written on an I/O thread and hashed on a hash thread while the caller goes on
    filling the next ones (measured, 4 GiB --to bf16: 10.5-10.9 s writing and hashing each segment
    before returning, 8.9 s in flight). Segments completed ahead of the hashed prefix are kept, up to
    the memory budget, or read back once the prefix reaches them."""

    def __init__(
        self, final_path: Path, specs: list[TensorSpec], metadata: dict[str, str], direct: bool = True
    ) -> None:
        self.final_path = final_path
        self.temp = temp_path(final_path)
        header = safetensors_header(specs, metadata)
        self._specs: dict[str, tuple[TensorSpec, int]] = {}
        offset = len(header)
        for spec in specs:
            self._specs[spec.name] = (spec, offset)
            offset += spec.nbytes
        self._written: dict[str, int] = {}  # bytes received per tensor
        self._size = offset
        self._segment_count = -(-offset // SEGMENT_BYTES)
        self._segments: dict[int, _Segment] = {}  # partial segments by index
        # complete, ahead of the hashed prefix: the kept buffer (None once dropped or spilled) and its write
        self._ahead: dict[int, tuple[torch.Tensor | None, Future[None] | None]] = {}
        # buffers whose write and hash are running, oldest first: the writing thread moves on meanwhile
        self._inflight: deque[tuple[torch.Tensor, list[Future[None]]]] = deque()
        self._free: list[torch.Tensor] = []  # segment buffers to reuse
        self._held = 0  # segment buffers not free: partial, kept ahead or in flight
        self._sha = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="fp8conv-hash")  # FIFO: file order
        self._io = ThreadPoolExecutor(1, thread_name_prefix="fp8conv-io")
        self._hashed = 0  # segments [0, _hashed) are handed to the hasher
        self._lock = threading.Lock()  # tensors may be written from more than one thread
        self.sha256 = ""  # hex digest, set by commit()
        final_path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._direct_fd = open_direct(self.temp, os.O_WRONLY) if direct else None
        self.direct = self._direct_fd is not None
        self._write(memoryview(header), 0)

    def _claim(self, name: str, nbytes: int | None = None) -> tuple[TensorSpec, int]:
        """Account for `nbytes` of tensor `name` (all of it when None)."""
        if name not in self._specs:
            raise RuntimeError(f"{name} is not planned for {self.final_path.name}")
        spec, offset = self._specs[name]
        done = self._written.get(name, 0) + (spec.nbytes if nbytes is None else nbytes)
        if done > spec.nbytes:
            raise RuntimeError(f"{name} got more bytes than planned")
        self._written[name] = done
        return spec, offset

    def write_part(self, name: str, byte_offset: int, part: torch.Tensor) -> None:
        """A band of rows of a tensor, at its byte offset within the tensor."""
        part = part.contiguous()  # held here: the memoryview does not keep a copy alive
        data = as_writable_memoryview(part)
        _, offset = self._claim(name, len(data))
        self._write(data, offset + byte_offset)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        spec, offset = self._claim(name)
        if tuple(tensor.shape) != spec.shape or tensor.element_size() != ELEMENT_BYTES[spec.dtype]:
            raise RuntimeError(f"{name}: {tensor.dtype}{tuple(tensor.shape)} is not the planned {spec}")
        tensor = tensor.contiguous()  # held here: the memoryview does not keep a copy alive
        self._write(as_writable_memoryview(tensor), offset)

    def copy_range(self, name: str, source: ShardReader, entry: TensorEntry, buffer: torch.Tensor) -> None:
        """Copy a tensor's raw bytes from an input shard, byte for byte, a buffer at a time (`buffer`:
        aligned_empty, its read_capacity() less is the chunk)."""
        spec, offset = self._claim(name)
        if entry.nbytes != spec.nbytes:
            raise RuntimeError(f"{name}: copying {entry.nbytes} bytes into a {spec.nbytes}-byte slot")
        chunk = buffer.numel() - read_capacity(0)
        for done in range(0, entry.nbytes, chunk):
            n = min(chunk, entry.nbytes - done)
            data = source.read(entry, entry.start + done, n, buffer)  # a view into buffer, held by the caller
            self._write(as_writable_memoryview(data), offset + done)

    def commit(self) -> None:
        missing = [n for n, (spec, _) in self._specs.items() if self._written.get(n, 0) != spec.nbytes]
        if missing:
            raise RuntimeError(f"{self.final_path.name}: {len(missing)} planned tensor(s) never written")
        if self._hashed != self._segment_count or self._segments or self._ahead:
            raise RuntimeError(f"{self.final_path.name}: hashed {self._hashed} of {self._segment_count} segments")
        try:
            while self._inflight:
                self._settle(self._inflight.popleft())
            self.sha256 = self._sha.hexdigest()
            os.ftruncate(self._fd, self._size)  # a last direct write ran to a whole page
            os.fsync(self._fd)
            self._shutdown()
            os.replace(self.temp, self.final_path)
        except OSError as exc:
            self.abort()
            raise _output_error(exc, self.final_path) from exc

    def abort(self) -> None:
        self._shutdown()
        self.temp.unlink(missing_ok=True)

    def _shutdown(self) -> None:
        """Let running writes and hashes finish (queued ones are dropped), then close the file."""
        for pool in (self._io, self._hasher):
            pool.shutdown(wait=True, cancel_futures=True)
        self._free.clear()  # the next shard's writer overlaps this one's commit: hand the memory back
        self._segments.clear()
        self._ahead.clear()
        self._inflight.clear()
        for fd in (self._fd, self._direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._direct_fd = -1, None

    def _write(self, data: memoryview, offset: int) -> None:
        """Place `data` at `offset`; write and hash every segment it completes. The caller may reuse
        its buffer once this returns."""
        with self._lock:
            try:
                pos = 0
                while pos < len(data):
                    index, lo = divmod(offset + pos, SEGMENT_BYTES)
                    n = min(len(data) - pos, self._segment_length(index) - lo)
                    segment = self._segments.get(index) or self._new_segment(index)
                    if segment.view is None:  # spilled
                        _pwrite_all(self._fd, data[pos : pos + n], offset + pos)
                    else:
                        segment.view[lo : lo + n] = data[pos : pos + n]
                        segment.runs.append((lo, lo + n))
                    segment.filled += n
                    if segment.filled > self._segment_length(index):
                        raise RuntimeError(f"{self.final_path.name}: bytes at {offset + pos} written twice")
                    if segment.filled == self._segment_length(index):
                        del self._segments[index]
                        self._complete(index, segment)
                    pos += n
            except OSError as exc:
                raise _output_error(exc, self.final_path) from exc

    def _segment_length(self, index: int) -> int:
        return min(SEGMENT_BYTES, self._size - index * SEGMENT_BYTES)

    def _new_segment(self, index: int) -> _Segment:
        if index < self._hashed or index in self._ahead:
            raise RuntimeError(f"{self.final_path.name}: segment {index} written twice")
        while self._held >= MAX_SEGMENTS:
            self._make_room()
        buffer = self._free.pop() if self._free else aligned_empty(SEGMENT_BYTES)
        self._held += 1
        segment = _Segment(buffer, as_writable_memoryview(buffer))
        self._segments[index] = segment
        return segment

    def _make_room(self) -> None:
        """Free one segment buffer: wait for the oldest write in flight, else drop a kept segment (it is in
        the file; read back when hashed), else spill the oldest partial one."""
        if self._inflight:
            self._settle(self._inflight.popleft())
            return
        kept = [i for i, (buffer, _) in self._ahead.items() if buffer is not None]
        if kept:
            furthest = max(kept)  # hashed last
            buffer, write = self._ahead[furthest]
            if write is not None:
                write.result()
            self._release(buffer)
            self._ahead[furthest] = (None, None)
            return
        index = min(i for i, s in self._segments.items() if s.view is not None)
        segment = self._segments[index]
        assert segment.view is not None and segment.buffer is not None
        base = index * SEGMENT_BYTES
        for lo, hi in segment.runs:
            _pwrite_all(self._fd, segment.view[lo:hi], base + lo)
        self._release(segment.buffer)
        segment.buffer, segment.view, segment.runs = None, None, []

    def _settle(self, item: tuple[torch.Tensor, list[Future[None]]]) -> None:
        """Wait for a buffer's write and hash (a failed write raises here), then free it."""
        buffer, futures = item
        for future in futures:
            future.result()
        self._release(buffer)

    def _release(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._free.append(buffer)
            self._held -= 1

    def _complete(self, index: int, segment: _Segment) -> None:
        """A segment is whole: write it (on the I/O thread) and hash it (on the hash thread) when it is
        next in file order, else keep it for the hash."""
        while self._inflight and all(f.done() for f in self._inflight[0][1]):
            self._settle(self._inflight.popleft())
        if segment.buffer is None or segment.view is None:  # spilled: already in the file
            self._ahead[index] = (None, None)
        else:
            write = self._io.submit(self._write_segment, index, segment.view)
            if index == self._hashed:
                hashing = self._hasher.submit(self._sha.update, segment.view[: self._segment_length(index)])
                self._hashed += 1
                self._inflight.append((segment.buffer, [write, hashing]))
            else:
                self._ahead[index] = (segment.buffer, write)
        self._catch_up()

    def _write_segment(self, index: int, view: memoryview) -> None:
        """On the I/O thread. Direct I/O the filesystem turns down at write time (EINVAL: an alignment it
        needs larger than ALIGN) sends this and every later segment through the page cache."""
        base, length = index * SEGMENT_BYTES, self._segment_length(index)
        done = 0
        if self._direct_fd is not None and self.direct:
            padded = round_up(length)  # the tail past the file's end is cut off at commit
            try:
                while done < padded:
                    n = os.pwrite(self._direct_fd, view[done:padded], base + done)
                    done += n
                    if n % ALIGN:  # an unaligned short write: the rest through the page cache
                        break
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
            done = min(done, length)
        _pwrite_all(self._fd, view[done:length], base + done)

    def _catch_up(self) -> None:
        """The hashed prefix reached segments completed earlier: hash them, reading back those not kept."""
        while self._hashed in self._ahead:
            index = self._hashed
            buffer, write = self._ahead.pop(index)
            length = self._segment_length(index)
            if buffer is not None:
                hashing = self._hasher.submit(self._sha.update, as_writable_memoryview(buffer)[:length])
                self._inflight.append((buffer, [f for f in (write, hashing) if f is not None]))
            else:
                chunk = os.pread(self._fd, length, index * SEGMENT_BYTES)
                if len(chunk) != length:
                    raise RuntimeError(f"{self.final_path.name}: short read back of segment {index}")
                self._hasher.submit(self._sha.update, chunk).result()  # one read-back in memory at a time
            self._hashed += 1


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _output_error(exc: OSError, path: Path) -> OutputError:
    where = {"shard": path.name} if path.suffix == ".safetensors" else {"file": path.name}  # config.json, a copy
    return OutputError(f"writing failed: {exc.strerror or exc}", **where, fix="free disk space and retry")


def _atomically(path: Path, fill: Callable[[BinaryIO], object]) -> None:
    """Write `path` under a temporary name, fsync, rename: it appears complete or not at all."""
    temp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise _output_error(exc, path) from exc


def write_file_atomic(path: Path, data: bytes) -> None:
    _atomically(path, lambda f: f.write(data))


def copy_file_atomic(src: Path, dest: Path) -> None:
    def fill(f: BinaryIO) -> None:
        with open(src, "rb") as fin:
            shutil.copyfileobj(fin, f, COPY_CHUNK_BYTES)

    _atomically(dest, fill)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
