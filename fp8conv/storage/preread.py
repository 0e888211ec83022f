"""Input bytes read ahead of the run, held in memory until the run's reader asks for them.

warm_start fills a run's store while torch loads (Preread.read()); the run's readers (handed the store:
InputReaders, ShardReader) give a read that lies inside what was fetched to take(), which copies it from
memory; the bytes are the file's, so the output is the same. Each piece is dropped as soon as its bytes
have been taken, the rest when the run's reader of that file closes (forget()). A module of its own so
that the reader depends on this store only, not on the planning warm_start does.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .direct_io import direct_transfer, open_direct, read_into

PIECE_BYTES = 4 * 2**20  # unit of fetching and of release, ALIGN-aligned (the default of options.Tuning's)

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


class Preread:
    """One run's store: warm start fills it (read()) while torch loads, the run's readers take from it."""

    def __init__(self, piece_bytes: int = PIECE_BYTES) -> None:
        """`piece_bytes`: the unit of fetching and of release, a multiple of direct_io.ALIGN."""
        self.piece_bytes = piece_bytes
        self._lock = threading.Lock()
        self._pieces: dict[FileKey, dict[int, _Piece]] = {}  # by file, by piece index (offset // piece_bytes)

    def holds(self, key: FileKey) -> bool:
        """Anything fetched of this file (a cheap check before take())."""
        return bool(self._pieces.get(key))

    def take(self, key: FileKey, offset: int, out: memoryview) -> bool:
        """Fill `out` with the file's bytes from `offset` if they were all fetched; False leaves it to the disk."""
        end, size = offset + len(out), self.piece_bytes
        if end <= offset:
            return False
        spans = range(offset // size, (end - 1) // size + 1)
        with self._lock:
            pieces = self._pieces.get(key, {})
            found = [pieces.get(i) for i in spans]
        whole = all(p is not None for p in found)
        for piece in found:  # a piece still being read is waited for: its bytes are on their way
            if piece is not None:
                piece.ready.wait()
                data = piece.data
                whole = whole and data is not None and piece.start + len(data) >= min(end, piece.start + size)
        if whole:
            for piece in found:
                assert piece is not None and piece.data is not None
                lo, hi = max(offset, piece.start), min(end, piece.start + size)
                out[lo - offset : hi - offset] = piece.data[lo - piece.start : hi - piece.start]
        with self._lock:  # bytes read from the disk instead are not asked for again either
            for i, piece in zip(spans, found, strict=True):
                if piece is not None:
                    piece.taken += min(end, piece.start + size) - max(offset, piece.start)
                    if piece.taken >= piece.want:
                        self._pieces.get(key, {}).pop(i, None)
        return whole

    def forget(self, key: FileKey) -> None:
        """The run is done with this file: drop whatever of it is still held."""
        with self._lock:
            self._pieces.pop(key, None)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(p.data or b"") for pieces in self._pieces.values() for p in pieces.values())

    def read(
        self, path: Path, ranges: list[tuple[int, int]], direct: bool, cancelled: threading.Event | None = None
    ) -> None:
        """Register the pieces of `ranges` first (take() waits for one being read), then read them in
        order; once `cancelled` is set the rest are left to the disk."""
        fd = os.open(path, os.O_RDONLY)
        direct_fd = open_direct(path, os.O_RDONLY) if direct else None
        dfd = -1 if direct_fd is None else direct_fd
        todo: list[_Piece] = []
        size = self.piece_bytes
        try:
            key = file_key(fd)
            with self._lock:
                pieces = self._pieces.setdefault(key, {})
                for offset, nbytes in ranges:
                    for i in range(offset // size, (offset + nbytes - 1) // size + 1):
                        lo, hi = max(offset, i * size), min(offset + nbytes, (i + 1) * size)
                        if i not in pieces:
                            pieces[i] = _Piece(start=i * size, want=0)
                            todo.append(pieces[i])
                        pieces[i].want += hi - lo
            for piece in todo:
                if cancelled is not None and cancelled.is_set():
                    break
                piece.data, dfd = _read_piece(fd, dfd, piece.start, size)
                piece.ready.set()
        finally:
            for piece in todo:
                piece.ready.set()  # after a failed or cancelled read: take() finds no data, the disk serves it
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)


def _read_piece(fd: int, dfd: int, start: int, size: int) -> tuple[memoryview, int]:
    """`size` bytes from `start` (fewer at the end of the file), into page-aligned memory; the direct
    descriptor to use next (-1 once the filesystem turned a direct read down)."""
    buf = memoryview(mmap.mmap(-1, size))  # anonymous maps are page-aligned, as O_DIRECT wants
    done = 0
    if dfd >= 0:
        done, usable = direct_transfer(read_into, dfd, buf, start)
        if usable:  # all of it, or a short read: the end of the file
            return buf[:done], dfd
        dfd = -1  # the filesystem wants more alignment of a direct read: the page cache from here
    while done < size and (n := os.preadv(fd, [buf[done:]], start + done)):
        done += n
    return buf[:done], dfd
