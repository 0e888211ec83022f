"""The I/O floor: read every input byte and write as many output bytes as a conversion writes, with
the same method fp8conv uses, no arithmetic: direct I/O where the filesystem has it (reads of one
band, writes of one writer segment, from aligned reused buffers), else the page cache; fsync per file.
--buffered: everything through the page cache (what fp8conv --buffered-io does).
--concurrent: reads on a thread of their own while the outputs are written, paced like a conversion
(output bytes follow input bytes; reads run at most READ_AHEAD bands ahead), as fp8conv's pipeline
does; the plain floor reads a shard, then writes its output. The difference is what the disk charges
for reads and writes at the same time.
--import-torch (with --concurrent): also what any conversion process built on torch must pay before
its first write, and nothing else: `import torch` on the main thread (reads start at once, up to
fp8conv's 64 MiB warm-start read; reading further ahead measured slower, as the reads then compete with
the import's own ~1,000 files).
--unavoidable (with --concurrent): --import-torch, and every written byte hashed (sha256, on a thread of
its own, as fp8conv's writer does, for its manifest): what any torch-based converter that records its
output's sha256 must pay, and no more. No arithmetic: what is left between this and fp8conv is the
conversion's own cost.

It does not import fp8conv (torch alone takes ~1.4 s of CPU to import); bench.py checks that the sizes
below are fp8conv's.

    python bench/io_floor.py INPUT_DIR OUTPUT_DIR OUTPUT_BYTES [--buffered]
        [--concurrent [--import-torch | --unavoidable]]
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import queue
import sys
import threading
from pathlib import Path

ALIGN = 4096  # fp8conv.storage.direct_io.ALIGN
READ_BYTES = 1 << 22  # one FP8 band: fp8conv.options.Tuning.convert_band_elements
SEGMENT_BYTES = 4 * 1024 * 1024  # fp8conv.storage.writer.SEGMENT_BYTES
READ_AHEAD = 3  # fp8conv.plan.bands.READ_AHEAD
WARM_START_BYTES = 64 << 20  # fp8conv.run.warm_start: input read while torch imports


def open_direct(path: Path, flags: int) -> int | None:
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return None
        raise


class Pacing:
    """--concurrent: output bytes may follow the input bytes read; reads may run READ_AHEAD bands ahead
    of the input the outputs stand for."""

    def __init__(self, in_bytes: int, out_bytes: int, head_start: int = 0) -> None:
        self.in_bytes, self.ratio = in_bytes, out_bytes / in_bytes
        self.read = self.written = 0
        self.head_start = head_start  # bytes that may be read before the first write
        self.error: BaseException | None = None  # the read thread's: the writes must not wait for it
        self.cond = threading.Condition()

    def may_read(self) -> None:
        with self.cond:
            self.cond.wait_for(
                lambda: self.read <= self.written / self.ratio + max(READ_AHEAD * READ_BYTES, self.head_start)
            )

    def may_write(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(
                lambda: self.error or self.read >= self.in_bytes or self.written + n <= self.read * self.ratio
            )
            if self.error:
                raise RuntimeError("the read thread failed") from self.error

    def read_thread(self, shards: list[Path], direct: bool, read_view: memoryview) -> None:
        try:
            read_all(shards, direct, read_view, self)
        except BaseException as exc:
            with self.cond:
                self.error = exc
                self.cond.notify_all()
            raise

    def moved(self, read: int = 0, written: int = 0) -> None:
        with self.cond:
            self.read += read
            self.written += written
            self.cond.notify_all()


class Hashing:
    """sha256 of every written segment on a thread of its own (the bytes are the segment buffer's: their
    values do not change the cost)."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.sha = view, hashlib.sha256()
        self.todo: queue.Queue[int | None] = queue.Queue()
        self.done = threading.Semaphore(0)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            n = self.todo.get()
            if n is None:
                self.sha = hashlib.sha256()
                self.done.release()
            else:
                self.sha.update(self.view[:n])

    def add(self, n: int) -> None:
        self.todo.put(n)

    def finish(self) -> None:
        self.todo.put(None)
        self.done.acquire()


def read_all(shards: list[Path], direct: bool, read_view: memoryview, pacing: Pacing | None) -> None:
    for shard in shards:
        fd = (open_direct(shard, os.O_RDONLY) if direct else None) or os.open(shard, os.O_RDONLY)
        pos = 0
        while True:
            if pacing:
                pacing.may_read()
            n = os.preadv(fd, [read_view], pos)
            if not n:
                break
            pos += n
            if pacing:
                pacing.moved(read=n)
        os.close(fd)


def main() -> None:
    src, dst, out_bytes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    direct = "--buffered" not in sys.argv[4:]
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(src.glob("*.safetensors"))
    read_view = memoryview(mmap.mmap(-1, READ_BYTES))  # anonymous maps are page-aligned
    write_view = memoryview(mmap.mmap(-1, SEGMENT_BYTES))
    per_shard = -(-out_bytes // len(shards))
    pacing, reads, hashing = None, None, None
    if "--concurrent" in sys.argv[4:]:
        in_bytes = sum(shard.stat().st_size for shard in shards)
        unavoidable = "--unavoidable" in sys.argv[4:]
        imports = unavoidable or "--import-torch" in sys.argv[4:]
        pacing = Pacing(in_bytes, per_shard * len(shards), WARM_START_BYTES if imports else 0)
        reads = threading.Thread(target=pacing.read_thread, args=(shards, direct, read_view), daemon=True)
        reads.start()
        if unavoidable:
            hashing = Hashing(write_view)
        if imports:
            import torch  # noqa: F401  (the import a torch-based converter cannot write before)
    for shard in shards:
        if not pacing:
            read_all([shard], direct, read_view, None)
        path = dst / shard.name
        plain = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        ofd = (open_direct(path, os.O_WRONLY) if direct else None) or plain
        written = 0
        while written < per_shard:
            n = min(SEGMENT_BYTES, per_shard - written)
            if pacing:
                pacing.may_write(n)
            if hashing:
                hashing.add(n)
            written += os.pwrite(ofd, write_view[: -(-n // ALIGN) * ALIGN if ofd != plain else n], written)
            if pacing:
                pacing.moved(written=n)
        if hashing:
            hashing.finish()  # the shard's sha256 is recorded when it is committed
        os.ftruncate(plain, per_shard)  # a direct write ends on a whole page
        os.fsync(plain)
        if ofd != plain:
            os.close(ofd)
        os.close(plain)
    if reads:
        reads.join()


if __name__ == "__main__":
    main()
