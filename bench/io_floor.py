"""The I/O floor: read every input byte and write as many output bytes as a conversion writes, with
the same method fp8conv uses (pread, pwrite from a reused buffer, fsync per file), no arithmetic.

    python bench/io_floor.py INPUT_DIR OUTPUT_DIR OUTPUT_BYTES
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CHUNK = 16 * 1024 * 1024


def main() -> None:
    src, dst, out_bytes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    per_shard = -(-out_bytes // len(shards))
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY)
        size = os.fstat(fd).st_size
        pos = 0
        while pos < size:
            pos += os.preadv(fd, [view], pos)
        os.close(fd)
        ofd = os.open(dst / shard.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        written = 0
        while written < per_shard:
            written += os.pwrite(ofd, view[: min(CHUNK, per_shard - written)], written)
        os.fsync(ofd)
        os.close(ofd)


if __name__ == "__main__":
    main()
