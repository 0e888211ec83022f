"""The I/O floor: read every input byte and write as many output bytes as a conversion writes, with
the same method fp8conv uses, no arithmetic: direct I/O where the filesystem has it (reads of one
band, writes of one writer segment, from aligned reused buffers), else the page cache; fsync per file.
--buffered: everything through the page cache (what fp8conv --buffered-io does).

It does not import fp8conv (torch alone takes ~1.4 s of CPU to import); bench.py checks that the sizes
below are fp8conv's.

    python bench/io_floor.py INPUT_DIR OUTPUT_DIR OUTPUT_BYTES [--buffered]
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
from pathlib import Path

ALIGN = 4096  # fp8conv.direct_io.ALIGN
READ_BYTES = 1 << 22  # one FP8 band: fp8conv.stream.BAND_ELEMENTS
SEGMENT_BYTES = 4 * 1024 * 1024  # fp8conv.writer.SEGMENT_BYTES


def open_direct(path: Path, flags: int) -> int | None:
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


def main() -> None:
    src, dst, out_bytes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    direct = "--buffered" not in sys.argv[4:]
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    read_view = memoryview(mmap.mmap(-1, READ_BYTES))  # anonymous maps are page-aligned
    write_view = memoryview(mmap.mmap(-1, SEGMENT_BYTES))
    per_shard = -(-out_bytes // len(shards))
    for shard in shards:
        fd = (open_direct(shard, os.O_RDONLY) if direct else None) or os.open(shard, os.O_RDONLY)
        pos = 0
        while n := os.preadv(fd, [read_view], pos):
            pos += n
        os.close(fd)
        path = dst / shard.name
        plain = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ofd = (open_direct(path, os.O_WRONLY) if direct else None) or plain
        written = 0
        while written < per_shard:
            n = min(SEGMENT_BYTES, per_shard - written)
            written += os.pwrite(ofd, write_view[: -(-n // ALIGN) * ALIGN if ofd != plain else n], written)
        os.ftruncate(plain, per_shard)  # a direct write ends on a whole page
        os.fsync(plain)
        if ofd != plain:
            os.close(ofd)
        os.close(plain)


if __name__ == "__main__":
    main()
