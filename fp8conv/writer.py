"""Atomic writers: a safetensors shard streamed tensor by tensor, and small JSON files.

Every file is written under a temporary name in the output directory, fsynced, then renamed, so a
reader never sees a half-written file under its final name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

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
    return final.with_name(f".{final.name}{TEMP_SUFFIX}")


class ShardWriter:
    """Writes the tensors of one planned shard in order; commit() makes the file appear."""

    def __init__(self, final_path: Path, specs: list[TensorSpec], metadata: dict[str, str]) -> None:
        self.final_path = final_path
        self.specs = specs
        self.temp = temp_path(final_path)
        self._next = 0
        self._pending = 0  # bytes still owed by the current tensor
        final_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.temp, "wb")  # noqa: SIM115 - closed in commit()/abort()
        self._write(safetensors_header(specs, metadata))

    def begin(self, name: str) -> None:
        if self._pending:
            raise RuntimeError(f"tensor {self.specs[self._next - 1].name} is incomplete")
        spec = self.specs[self._next]
        if spec.name != name:
            raise RuntimeError(f"writing {name} but the plan expects {spec.name} next")
        self._next += 1
        self._pending = spec.nbytes

    def write_bytes(self, data: memoryview | bytes) -> None:
        if len(data) > self._pending:
            raise RuntimeError(f"tensor {self.specs[self._next - 1].name} got more bytes than planned")
        self._write(data)
        self._pending -= len(data)

    def write_tensor(self, name: str, tensor: torch.Tensor) -> None:
        self.begin(name)
        spec = self.specs[self._next - 1]
        if tuple(tensor.shape) != spec.shape:
            raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} != planned {spec.shape}")
        self.write_bytes(as_writable_memoryview(tensor.contiguous()))

    def copy_range(self, name: str, fd: int, start: int, nbytes: int, buffer: bytearray) -> None:
        """Copy a tensor's raw bytes from another file, byte for byte."""
        self.begin(name)
        view = memoryview(buffer)
        done = 0
        while done < nbytes:
            n = os.preadv(fd, [view[: min(len(buffer), nbytes - done)]], start + done)
            if n == 0:
                raise OutputError("input ended while copying", tensor=name)
            self.write_bytes(view[:n])
            done += n

    def commit(self) -> None:
        if self._pending or self._next != len(self.specs):
            raise RuntimeError(f"{self.final_path.name}: not every planned tensor was written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.temp, self.final_path)
        except OSError as exc:
            self.abort()
            raise _output_error(exc, self.final_path) from exc

    def abort(self) -> None:
        self._file.close()
        self.temp.unlink(missing_ok=True)

    def _write(self, data: memoryview | bytes) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise _output_error(exc, self.final_path) from exc


def _output_error(exc: OSError, path: Path) -> OutputError:
    return OutputError(
        f"writing failed: {exc.strerror or exc}", shard=path.name, fix="free disk space and retry"
    )


def write_file_atomic(path: Path, data: bytes) -> None:
    temp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise _output_error(exc, path) from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
