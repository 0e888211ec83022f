"""Atomic writers: a safetensors shard streamed tensor by tensor, and small JSON files.

Every file is written under a temporary name in the output directory, fsynced, then renamed, so a
reader never sees a half-written file under its final name.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from .dtypes import ELEMENT_BYTES
from .errors import OutputError
from .safetensors_file import as_writable_memoryview

TEMP_SUFFIX = ".fp8conv-partial"
COPY_CHUNK_BYTES = 16 * 1024 * 1024


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


class ShardWriter:
    """Writes one planned shard. Every tensor's offset is known from the plan, so tensors may arrive
    in any order (a weight and its scale are computed together but laid out apart); commit() checks
    that every planned tensor arrived, then makes the file appear under its final name.

    The file's sha256 (for the manifest) is taken from the bytes as they are written, so a finished
    shard is never read back: hashing a bf16 shard after the fact re-read every byte from disk and
    nearly doubled the run (measured, 4 GiB --to bf16: 22.8-25.4 s reading back, 12.5-15.1 s unhashed).
    The hash runs on its own thread while the same bytes are pwritten, so the two share no core's
    time. Bytes written ahead of the hashed prefix (in a layout that does not follow production
    order, see ShardPlan.specs) are noted and read back once the prefix reaches them."""

    def __init__(self, final_path: Path, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
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
        self._sha = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="fp8conv-hash")  # in file order, FIFO
        self._hashed = 0  # bytes [0, _hashed) are handed to the hasher
        self._ahead: dict[int, int] = {}  # written but not yet hashed: offset -> length
        self._hash_lock = threading.Lock()  # tensors may be written from more than one thread
        self.sha256 = ""  # hex digest, set by commit()
        final_path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._pwrite(memoryview(header), 0)

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
        data = as_writable_memoryview(part.contiguous())
        _, offset = self._claim(name, len(data))
        self._pwrite(data, offset + byte_offset)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        spec, offset = self._claim(name)
        if tuple(tensor.shape) != spec.shape or tensor.element_size() != ELEMENT_BYTES[spec.dtype]:
            raise RuntimeError(f"{name}: {tensor.dtype}{tuple(tensor.shape)} is not the planned {spec}")
        self._pwrite(as_writable_memoryview(tensor.contiguous()), offset)

    def copy_range(self, name: str, fd: int, start: int, nbytes: int, buffer: bytearray) -> None:
        """Copy a tensor's raw bytes from another file, byte for byte."""
        spec, offset = self._claim(name)
        if nbytes != spec.nbytes:
            raise RuntimeError(f"{name}: copying {nbytes} bytes into a {spec.nbytes}-byte slot")
        view = memoryview(buffer)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[: min(len(buffer), nbytes - done)]], start + done)
            if n == 0:
                raise OutputError("input ended while copying", tensor=name)
            self._pwrite(view[:n], offset + done)
            done += n

    def commit(self) -> None:
        missing = [n for n, (spec, _) in self._specs.items() if self._written.get(n, 0) != spec.nbytes]
        if missing:
            raise RuntimeError(f"{self.final_path.name}: {len(missing)} planned tensor(s) never written")
        if self._hashed != self._size or self._ahead:
            raise RuntimeError(f"{self.final_path.name}: hashed {self._hashed} of {self._size} bytes")
        self._hasher.shutdown(wait=True)
        self.sha256 = self._sha.hexdigest()
        try:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            os.replace(self.temp, self.final_path)
        except OSError as exc:
            self.abort()
            raise _output_error(exc, self.final_path) from exc

    def abort(self) -> None:
        self._hasher.shutdown(wait=True, cancel_futures=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.temp.unlink(missing_ok=True)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        with self._hash_lock:
            hashing: Future[None] | None = None
            if offset == self._hashed:  # next in file order: hashed while it is written
                hashing = self._hasher.submit(self._sha.update, data)
                self._hashed += len(data)
        start, length = offset, len(data)
        try:
            while len(data):
                n = os.pwrite(self._fd, data, offset)
                data, offset = data[n:], offset + n
            with self._hash_lock:
                if hashing is None:
                    if start < self._hashed:
                        raise RuntimeError(f"{self.final_path.name}: bytes at {start} written twice")
                    self._ahead[start] = length
                self._catch_up()
        except OSError as exc:
            raise _output_error(exc, self.final_path) from exc
        finally:
            if hashing is not None:
                hashing.result()  # the caller may reuse its buffer once this returns

    def _catch_up(self) -> None:
        """The hashed prefix reached bytes written earlier: read them back (under the lock)."""
        while self._hashed in self._ahead:
            end = self._hashed + self._ahead.pop(self._hashed)
            while self._hashed < end:
                chunk = os.pread(self._fd, min(COPY_CHUNK_BYTES, end - self._hashed), self._hashed)
                if not chunk:
                    raise RuntimeError(f"{self.final_path.name}: short read back at {self._hashed}")
                self._hasher.submit(self._sha.update, chunk).result()  # one chunk in memory at a time
                self._hashed += len(chunk)


def _output_error(exc: OSError, path: Path) -> OutputError:
    return OutputError(f"writing failed: {exc.strerror or exc}", shard=path.name, fix="free disk space and retry")


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
