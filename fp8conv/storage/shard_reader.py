"""Reading tensor bytes from an input shard: large reads with direct I/O, small ones through the page cache.

Large reads (weight bands, whole weights, raw copies) bypass the page cache (see direct_io). Small ones
(scales, norms, biases) stay buffered: the kernel's readahead batches them, where each direct read would
wait for the disk on its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..dtypes import ELEMENT_BYTES, torch_dtype
from .direct_io import ALIGN, aligned_empty, direct_transfer, open_direct, read_into, round_down, round_up
from .input_files import reopen
from .preread import Preread, file_key
from .safetensors_file import TensorEntry, as_writable_memoryview, file_ended, pread_into

if TYPE_CHECKING:
    import torch

DIRECT_MIN_BYTES = 1 << 20  # smaller reads go through the page cache (the default of options.Tuning's)


def read_capacity(nbytes: int) -> int:
    """Bytes a buffer for ShardReader.read of `nbytes` must hold: direct reads cover whole aligned pages."""
    return nbytes + 2 * ALIGN


class ShardReader:
    def __init__(
        self,
        path: Path,
        direct: bool = True,
        identity: tuple[int, int] | None = None,
        preread: Preread | None = None,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
    ) -> None:
        """`identity`: the (st_dev, st_ino) the plan's header was read from (input_files.reopen refuses
        any other file, such as a link swapped in since). `preread`: the run's bytes read ahead, if any.
        `direct_min_bytes`: reads smaller than this go through the page cache."""
        self.name = path.name
        self.fd = reopen(path, identity, where={"shard": path.name})
        self.direct_fd = open_direct(path, os.O_RDONLY) if direct else None
        if self.direct_fd is not None and os.fstat(self.direct_fd).st_ino != os.fstat(self.fd).st_ino:
            os.close(self.direct_fd)  # replaced between the two opens: read only what was checked
            self.direct_fd = None
        self.direct = self.direct_fd is not None  # False once the filesystem turns a direct read down
        self.key = file_key(self.fd)
        self.preread = preread
        self.direct_min_bytes = direct_min_bytes

    def close(self) -> None:
        if self.fd >= 0 and self.preread is not None:
            self.preread.forget(self.key)
        for fd in (self.fd, self.direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd, self.direct = -1, None, False

    def read(self, entry: TensorEntry, offset: int, nbytes: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """`nbytes` bytes of this shard from `offset` (inside `entry`'s data), as a uint8 tensor: a view into
        `buffer` when given, which must be aligned_empty() and hold read_capacity(nbytes) bytes."""
        if buffer is None:
            buffer = aligned_empty(read_capacity(nbytes))
        if buffer.numel() < read_capacity(nbytes) or buffer.data_ptr() % ALIGN:
            raise ValueError("read buffer is too small or not aligned")
        store = self.preread
        if (
            store is not None
            and store.holds(self.key)
            and store.take(self.key, offset, as_writable_memoryview(buffer[:nbytes]))
        ):
            return buffer[:nbytes]  # read while torch was loading
        if not self.direct or nbytes < self.direct_min_bytes:
            out = buffer[:nbytes]
            pread_into(self.fd, as_writable_memoryview(out), offset, entry, self.name)
            return out
        return self._read_direct(entry, offset, nbytes, buffer)

    def _read_direct(self, entry: TensorEntry, offset: int, nbytes: int, buffer: torch.Tensor) -> torch.Tensor:
        assert self.direct_fd is not None
        start = round_down(offset)
        head, need = offset - start, offset + nbytes - start
        view = as_writable_memoryview(buffer[: round_up(offset + nbytes) - start])
        done, self.direct = direct_transfer(read_into, self.direct_fd, view, start)
        if not self.direct:  # the filesystem wants more alignment: the page cache from now on
            return self.read(entry, offset, nbytes, buffer)
        if done < need:  # a short direct read is the end of the file
            raise file_ended(entry, self.name)
        return buffer[head : head + nbytes]

    def read_tensor(self, entry: TensorEntry) -> torch.Tensor:
        """One whole tensor, viewed as its dtype and shape."""
        raw = self.read(entry, entry.start, entry.nbytes)
        if raw.data_ptr() % ELEMENT_BYTES[entry.dtype]:  # a misaligned tensor in the file
            raw = raw.clone()
        return raw.view(torch_dtype(entry.dtype)).reshape(entry.shape)
