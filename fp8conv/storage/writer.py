"""Atomic writers: a safetensors shard streamed tensor by tensor, and small JSON files.

Every file is written under a temporary name in the output directory, fsynced, then renamed, so a
reader never sees a half-written file under its final name.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from itertools import accumulate
from operator import attrgetter, mul
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Generic, TypeVar

from ..dtypes import ELEMENT_BYTES
from ..errors import OutputError
from ..threads import settle
from .direct_io import aligned_empty, direct_transfer, open_direct, round_up
from .out_dir import OutDir, TempFile, temp_path
from .safetensors_file import TensorEntry, as_writable_memoryview
from .shard_reader import ShardReader, read_capacity

if TYPE_CHECKING:
    import torch

COPY_CHUNK_BYTES = 16 * 1024 * 1024
# A shard is written in aligned segments of this size, at most MAX_SEGMENTS of them in memory at once
# (the defaults of options.Tuning, which a run hands its writers)
SEGMENT_BYTES = 4 * 1024 * 1024
MAX_SEGMENTS = 8
T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape, start=ELEMENT_BYTES[self.dtype])  # in C: summed over a plan's 200k


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


# the text around each tensor's entry in a header, but for its name, dtype, shape and two offsets
_ENTRY_TEXT = len(',:{"dtype":,"shape":,"data_offsets":[,]}')
_NAME, _DTYPE, _SHAPE = attrgetter("name"), attrgetter("dtype"), attrgetter("shape")


def safetensors_header_size(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> int:
    """len(safetensors_header(specs, metadata)), counted rather than written, for the space check: each
    column (names, dtypes, shapes, offsets) encoded as one JSON array in C, its brackets and commas taken
    off. Writing every header of a release's 200k tensors to measure it cost 0.3 s of a dry run."""
    names = list(map(_NAME, specs))
    if not names or "__metadata__" in names or len(set(names)) != len(names):
        return len(safetensors_header(specs, metadata))  # as the writer's dict makes of them
    shapes = list(map(_SHAPE, specs))
    ends = list(accumulate(map(mul, map(ELEMENT_BYTES.__getitem__, map(_DTYPE, specs)), map(math.prod, shapes))))
    columns = (names, list(map(_DTYPE, specs)), shapes, [0, *ends[:-1]], ends)
    raw = len('{"__metadata__":}') + len(json.dumps(metadata, separators=(",", ":"))) + _ENTRY_TEXT * len(names)
    raw += sum(len(json.dumps(column, separators=(",", ":"))) - 1 - len(column) for column in columns)
    return 8 + raw + (-(8 + raw) % 8)


class ShardLayout:
    """Where each planned tensor's bytes go in a shard file (the header first), and how many arrived."""

    def __init__(self, name: str, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        self.name = name  # the file's name, for messages
        self.header = safetensors_header(specs, metadata)
        self._slots: dict[str, tuple[TensorSpec, int]] = {}
        offset = len(self.header)
        for spec in specs:
            self._slots[spec.name] = (spec, offset)
            offset += spec.nbytes
        self.size = offset
        self._received: dict[str, int] = {}

    def claim(self, name: str, nbytes: int | None = None) -> tuple[TensorSpec, int]:
        """Account for `nbytes` of tensor `name` (all of it when None); its spec and file offset."""
        if name not in self._slots:
            raise RuntimeError(f"{name} is not planned for {self.name}")
        spec, offset = self._slots[name]
        done = self._received.get(name, 0) + (spec.nbytes if nbytes is None else nbytes)
        if done > spec.nbytes:
            raise RuntimeError(f"{name} got more bytes than planned")
        self._received[name] = done
        return spec, offset

    def missing(self) -> list[str]:
        """Planned tensors not (or not wholly) received."""
        return [n for n, (spec, _) in self._slots.items() if self._received.get(n, 0) != spec.nbytes]


@dataclass
class Segment:
    """An ALIGN-aligned piece of a file being assembled in memory (or, once spilled, in the file)."""

    index: int
    buffer: torch.Tensor | None  # None once spilled: its bytes go to the file as they come
    view: memoryview | None
    filled: int = 0
    runs: list[tuple[int, int]] = field(default_factory=list)  # filled byte ranges, for spilling


class SegmentAssembler:
    """Bytes of a file arriving in any order, gathered into segments of `segment_bytes` (the last one
    shorter): a segment is handed back once every byte of it has arrived. Each byte arrives once."""

    def __init__(self, size: int, segment_bytes: int, name: str = "") -> None:
        self.size, self.segment_bytes, self.name = size, segment_bytes, name  # name: the file's, for messages
        self.count = -(-size // segment_bytes)
        self.partial: dict[int, Segment] = {}  # by index
        self._completed: set[int] = set()

    def length(self, index: int) -> int:
        return min(self.segment_bytes, self.size - index * self.segment_bytes)

    def place(
        self,
        data: memoryview,
        offset: int,
        new_buffer: Callable[[], torch.Tensor],
        spilled_write: Callable[[memoryview, int], None],
    ) -> Iterator[Segment]:
        """Put `data` at file `offset`, yielding each segment it completes as it completes: iterate it
        to the end, and hand a segment's buffer on before the next is taken. A new segment's buffer
        comes from new_buffer(); bytes of a spilled segment go to spilled_write(data, offset)."""
        pos = 0
        while pos < len(data):
            index, lo = divmod(offset + pos, self.segment_bytes)
            length = self.length(index)
            n = min(len(data) - pos, length - lo)
            segment = self.partial.get(index) or self._open(index, new_buffer)
            if segment.view is None:
                spilled_write(data[pos : pos + n], offset + pos)
            else:
                segment.view[lo : lo + n] = data[pos : pos + n]
                segment.runs.append((lo, lo + n))
            segment.filled += n
            if segment.filled > length:
                raise RuntimeError(f"{self.name}: bytes at {offset + pos} written twice")
            if segment.filled == length:
                del self.partial[index]
                self._completed.add(index)
                pos += n
                yield segment
            else:
                pos += n

    def _open(self, index: int, new_buffer: Callable[[], torch.Tensor]) -> Segment:
        if index in self._completed:
            raise RuntimeError(f"{self.name}: segment {index} written twice")
        buffer = new_buffer()  # may spill a partial segment: this one is not in `partial` yet
        segment = Segment(index, buffer, as_writable_memoryview(buffer))
        self.partial[index] = segment
        return segment

    def spill_oldest(self, write: Callable[[memoryview, int], None]) -> torch.Tensor | None:
        """Write the bytes of the first partial segment still in memory with write(data, offset) and
        hand back its buffer (None when there is none); its later bytes are written as they come."""
        held = [i for i, s in self.partial.items() if s.view is not None]
        if not held:
            return None
        segment = self.partial[min(held)]
        assert segment.view is not None and segment.buffer is not None
        base = segment.index * self.segment_bytes
        for lo, hi in segment.runs:
            write(segment.view[lo:hi], base + lo)
        buffer = segment.buffer
        segment.buffer, segment.view, segment.runs = None, None, []
        return buffer


class OrderedHash(Generic[T]):
    """The sha256 of a file whose segments are completed in any order: a segment is hashed once every
    segment before it is. complete() says which segments are next in file order; update() takes their
    bytes in that order. Segments completed ahead wait here, each with the caller's payload."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self.next = 0  # segments [0, next) are handed out to be hashed
        self.waiting: dict[int, T] = {}  # completed ahead of the prefix

    def complete(self, index: int, payload: T) -> list[tuple[int, T]]:
        """Segment `index` is whole: the segments to hash now, in order, with their payloads."""
        if index < self.next or index in self.waiting:
            raise RuntimeError(f"segment {index} completed twice")
        self.waiting[index] = payload
        ready = []
        while self.next in self.waiting:
            ready.append((self.next, self.waiting.pop(self.next)))
            self.next += 1
        return ready

    def update(self, data: memoryview | bytes) -> None:
        self._sha.update(data)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class ShardFile:
    """A file written under a temporary name beside its final one, which it takes only on commit():
    after every byte is written and fsynced. Whole segments go with direct I/O where the filesystem
    allows it (see direct_io), everything else through the page cache. Writes may come from several threads;
    commit() and abort() once they are done."""

    def __init__(self, final_path: Path, direct: bool = True, within: OutDir | None = None) -> None:
        """`within`: the output directory final_path is in, opened once: the temporary is then created
        there exclusively, following no link (see out_dir)."""
        self.final_path = final_path
        self.temp = temp_path(final_path)
        self.within = within
        self._temp: TempFile | None = None
        if within is not None:
            self._temp = within.create_temp(final_path.relative_to(within.path))
            self.fd = self._temp.fd
            # the open file itself, reopened for direct writes: no name that a link could replace
            proc = Path(f"/proc/self/fd/{self.fd}")
            self.direct_fd = open_direct(proc, os.O_WRONLY) if direct and proc.exists() else None
        else:
            final_path.parent.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            self.direct_fd = open_direct(self.temp, os.O_WRONLY) if direct else None
        self.direct = self.direct_fd is not None  # False once the filesystem turns a direct write down

    def write(self, data: memoryview, offset: int) -> None:
        """Through the page cache."""
        try:
            _pwrite_all(self.fd, data, offset)
        except OSError as exc:
            raise _output_error(exc, self.final_path) from exc

    def write_segment(self, view: memoryview, offset: int, length: int) -> None:
        """`length` bytes of `view` at an ALIGN-aligned `offset`; `view` must hold them rounded up to
        ALIGN (the tail past the file's end is cut off at commit). Direct I/O the filesystem turns down
        at write time (EINVAL: it needs a larger alignment) sends this and every later write through the
        page cache."""
        done = 0
        if self.direct_fd is not None and self.direct:
            try:  # a short write leaves the rest to the page cache; EINVAL, every later write too
                done, self.direct = direct_transfer(os.pwrite, self.direct_fd, view[: round_up(length)], offset)
            except OSError as exc:
                raise _output_error(exc, self.final_path) from exc
            done = min(done, length)
        self.write(view[done:length], offset + done)

    def read(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self.fd, nbytes, offset)
        if len(data) != nbytes:
            raise RuntimeError(f"{self.final_path.name}: short read back at {offset}")
        return data

    def commit(self, size: int) -> None:
        """Cut the file to `size`, fsync it, give it its final name."""
        try:
            os.ftruncate(self.fd, size)  # a last direct write ran to a whole page
            os.fsync(self.fd)
            if self.within is not None and self._temp is not None:
                self._close_direct()
                temp, self.fd = self._temp, -1
                self.within.commit(temp)  # closes and renames it; removes it when that fails
                return
            self.close()
            os.replace(self.temp, self.final_path)
        except OSError as exc:
            self.abort()
            raise _output_error(exc, self.final_path) from exc

    def _close_direct(self) -> None:
        if self.direct_fd is not None and self.direct_fd >= 0:
            os.close(self.direct_fd)
        self.direct_fd = None

    def close(self) -> None:
        self._close_direct()
        if self.within is not None and self._temp is not None:
            self._temp.fd = -1  # closed here, with the rest
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def abort(self) -> None:
        self.close()
        if self.within is not None and self._temp is not None:
            self.within.abort(self._temp)
            return
        self.temp.unlink(missing_ok=True)


class ShardWriter:
    """Writes one planned shard. Every tensor's offset is known from the plan, so tensors may arrive
    in any order (a weight and its scale are computed together but laid out apart); commit() checks
    that every planned tensor arrived, then makes the file appear under its final name. It puts the
    parts above together: ShardLayout, SegmentAssembler, OrderedHash, ShardFile.

    The bytes are assembled in memory into aligned segments, each written with one direct write once
    complete (see direct_io: the page cache cost more CPU than the arithmetic). Where the filesystem
    has no direct I/O the same segments go through the page cache. Segments that would stay partial
    too long (a layout that does not follow production order, see ShardPlan.specs) are spilled: their
    bytes go to the file through the page cache as they come, so memory stays a few segments.

    The file's sha256 (for the manifest) is taken from the segments as they are written, so a finished
    shard is never read back: hashing a bf16 shard after the fact re-read every byte from disk and
    nearly doubled the run (measured, 4 GiB --to bf16: 22.8-25.4 s reading back, 12.5-15.1 s unhashed).
    A complete segment is written on the `io` executor and hashed on the `hasher` one while the caller
    goes on filling the next ones (measured, 4 GiB --to bf16: 10.5-10.9 s writing and hashing each
    segment before returning, 8.9 s in flight); the scheduler owns those threads, and without them both
    run on the caller's thread. Segments completed ahead of the hashed prefix are kept, up to the memory
    budget, or read back once the prefix reaches them."""

    def __init__(
        self,
        final_path: Path,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        direct: bool = True,
        io: Executor | None = None,
        hasher: Executor | None = None,
        max_segments: int = MAX_SEGMENTS,  # fewer under --max-memory (bands.write_limits)
        within: OutDir | None = None,  # the output directory, opened once (see ShardFile)
        segment_bytes: int = SEGMENT_BYTES,  # a multiple of direct_io.ALIGN
    ) -> None:
        self.final_path = final_path
        self.max_segments = max_segments
        self.layout = ShardLayout(final_path.name, specs, metadata)
        self.assembler = SegmentAssembler(self.layout.size, segment_bytes, final_path.name)
        # per segment completed ahead of the hash: its kept buffer (None once dropped or spilled), its write
        self.hash: OrderedHash[tuple[torch.Tensor | None, Future[None] | None]] = OrderedHash()
        self._io = io or _INLINE
        self._hasher = hasher or _INLINE  # FIFO: file order
        # buffers whose write and hash are running, oldest first: the writing thread moves on meanwhile
        self._inflight: deque[tuple[torch.Tensor, list[Future[None]]]] = deque()
        self._free: list[torch.Tensor] = []  # segment buffers to reuse
        self.buffers_held = 0  # segment buffers not free: partial, kept ahead or in flight
        self._lock = threading.Lock()  # tensors may be written from more than one thread
        self.sha256 = ""  # hex digest, set by commit()
        self.file = ShardFile(final_path, direct, within)
        self._write(memoryview(self.layout.header), 0)

    @property
    def direct(self) -> bool:
        return self.file.direct

    def write_part(self, name: str, byte_offset: int, part: torch.Tensor) -> None:
        """A band of rows of a tensor, at its byte offset within the tensor."""
        part = part.contiguous()  # held here: the memoryview does not keep a copy alive
        data = as_writable_memoryview(part)
        _, offset = self.layout.claim(name, len(data))
        self._write(data, offset + byte_offset)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        spec, offset = self.layout.claim(name)
        if tuple(tensor.shape) != spec.shape or tensor.element_size() != ELEMENT_BYTES[spec.dtype]:
            raise RuntimeError(f"{name}: {tensor.dtype}{tuple(tensor.shape)} is not the planned {spec}")
        tensor = tensor.contiguous()  # held here: the memoryview does not keep a copy alive
        self._write(as_writable_memoryview(tensor), offset)

    def copy_range(self, name: str, source: ShardReader, entry: TensorEntry, buffer: torch.Tensor) -> None:
        """Copy a tensor's raw bytes from an input shard, byte for byte, a buffer at a time (`buffer`:
        aligned_empty, its read_capacity() less is the chunk)."""
        spec, offset = self.layout.claim(name)
        if entry.nbytes != spec.nbytes:
            raise RuntimeError(f"{name}: copying {entry.nbytes} bytes into a {spec.nbytes}-byte slot")
        chunk = buffer.numel() - read_capacity(0)
        for done in range(0, entry.nbytes, chunk):
            n = min(chunk, entry.nbytes - done)
            data = source.read(entry, entry.start + done, n, buffer)  # a view into buffer, held by the caller
            self._write(as_writable_memoryview(data), offset + done)

    def commit(self) -> None:
        missing = self.layout.missing()
        if missing:
            raise RuntimeError(f"{self.final_path.name}: {len(missing)} planned tensor(s) never written")
        if self.hash.next != self.assembler.count or self.assembler.partial or self.hash.waiting:
            raise RuntimeError(f"{self.final_path.name}: hashed {self.hash.next} of {self.assembler.count} segments")
        try:
            while self._inflight:
                self._settle(self._inflight.popleft())
            self.sha256 = self.hash.hexdigest()
            self._release_all()
            self.file.commit(self.layout.size)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError):
                raise _output_error(exc, self.final_path) from exc
            raise

    def abort(self) -> None:
        """Let this shard's running writes and hashes finish (queued ones are dropped), remove the file."""
        # the io and hash pools are shared with the shard being committed: only this shard's own are dropped
        futures = [f for _, fs in self._inflight for f in fs]
        settle(futures + [w for _, w in self.hash.waiting.values() if w is not None])
        self._release_all()
        self.file.abort()

    def _release_all(self) -> None:
        """The next shard's writer overlaps this one's commit: hand the memory back."""
        self._free.clear()
        self.assembler.partial.clear()
        self.hash.waiting.clear()
        self._inflight.clear()

    def _write(self, data: memoryview, offset: int) -> None:
        """Place `data` at `offset`; write and hash every segment it completes. The caller may reuse
        its buffer once this returns."""
        with self._lock:
            try:
                for segment in self.assembler.place(data, offset, self._new_buffer, self.file.write):
                    self._complete(segment)
            except OSError as exc:
                raise _output_error(exc, self.final_path) from exc

    def _new_buffer(self) -> torch.Tensor:
        while self.buffers_held >= self.max_segments:
            self._make_room()
        self.buffers_held += 1
        return self._free.pop() if self._free else aligned_empty(self.assembler.segment_bytes)

    def _make_room(self) -> None:
        """Free one segment buffer: wait for the oldest write in flight, else drop a kept segment (it is in
        the file; read back when hashed), else spill the oldest partial one."""
        if self._inflight:
            self._settle(self._inflight.popleft())
            return
        kept = [i for i, (buffer, _) in self.hash.waiting.items() if buffer is not None]
        if kept:
            furthest = max(kept)  # hashed last
            buffer, write = self.hash.waiting[furthest]
            if write is not None:
                write.result()
            self._release(buffer)
            self.hash.waiting[furthest] = (None, None)
            return
        self._release(self.assembler.spill_oldest(self.file.write))

    def _settle(self, item: tuple[torch.Tensor, list[Future[None]]]) -> None:
        """Wait for a buffer's write and hash (a failed write raises here), then free it."""
        buffer, futures = item
        for future in futures:
            future.result()
        self._release(buffer)

    def _release(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._free.append(buffer)
            self.buffers_held -= 1

    def _complete(self, segment: Segment) -> None:
        """A segment is whole: write it (on the I/O executor); hash it (on the hash executor) and every
        segment it lets through in file order, reading back those no longer kept."""
        while self._inflight and all(f.done() for f in self._inflight[0][1]):
            self._settle(self._inflight.popleft())
        write = None
        if segment.view is not None:  # else spilled: already in the file
            base, length = segment.index * self.assembler.segment_bytes, self.assembler.length(segment.index)
            write = self._io.submit(self.file.write_segment, segment.view, base, length)
        for index, (buffer, written) in self.hash.complete(segment.index, (segment.buffer, write)):
            length = self.assembler.length(index)
            if buffer is not None:
                hashing = self._hasher.submit(self.hash.update, as_writable_memoryview(buffer)[:length])
                self._inflight.append((buffer, [f for f in (written, hashing) if f is not None]))
            else:  # one read-back in memory at a time
                chunk = self.file.read(index * self.assembler.segment_bytes, length)
                self._hasher.submit(self.hash.update, chunk).result()


class _InlineExecutor(Executor):
    """Runs each task on the caller's thread, at submit(): a ShardWriter used without a scheduler."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)
        return future


_INLINE = _InlineExecutor()


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


def write_file_atomic(path: Path, data: bytes, within: OutDir | None = None) -> None:
    """`within`: the output directory `path` is in, opened once: nothing on the way is followed."""
    if within is not None:
        within.write_file(path.relative_to(within.path), data)
        return
    _atomically(path, lambda f: f.write(data))


def open_input_file(src: Path) -> BinaryIO:
    """An input file to copy, opened only when it is a regular file: a FIFO would hang the run and a
    device would be copied until the disk is full (input_files.reopen refuses both)."""
    from .input_files import reopen

    fd = reopen(src, None, where={"file": src.name})
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def copy_file_atomic(src: Path, dest: Path, within: OutDir | None = None) -> None:
    if within is None:

        def fill(f: BinaryIO) -> None:
            with open_input_file(src) as fin:
                shutil.copyfileobj(fin, f, COPY_CHUNK_BYTES)

        _atomically(dest, fill)
        return
    temp = within.create_temp(dest.relative_to(within.path))
    try:
        with open_input_file(src) as fin:
            while chunk := fin.read(COPY_CHUNK_BYTES):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(temp.fd, view) :]
    except OSError as exc:
        within.abort(temp)
        raise _output_error(exc, dest) from exc
    except BaseException:
        within.abort(temp)
        raise
    within.commit(temp)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
