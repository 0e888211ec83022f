"""warm_start: the CLI reads the run's first input bytes while torch loads; the run takes them from memory."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from fp8conv import convert
from fp8conv.cli.commands import main
from fp8conv.model.classify import classify
from fp8conv.plan.conversion import ConvertOptions, plan_conversion
from fp8conv.run import warm_start
from fp8conv.source.checkpoint import open_checkpoint
from fp8conv.storage.preread import Preread
from fp8conv.storage.shard_reader import ShardReader
from tests.support.synthetic import build_tiny_deepseek

PIECE = 4096


def _fetch(path: Path, limit: int) -> Preread:
    """What warm start reads ahead for a bf16 run of `path`, in a store of its own (of PIECE pieces)."""
    warm = warm_start.WarmStart(PIECE)
    thread = warm.begin(str(path), ConvertOptions("bf16"), limit=limit)
    assert thread is not None
    thread.join()
    warm.close()
    return warm.preread


def _first_shard_reads(path: Path) -> list[tuple[Path, object, int, int]]:
    """The reads a run makes of its first output shard's inputs, in 1000-byte steps (across pieces)."""
    ckpt = open_checkpoint(path)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions("bf16"))
    reads = []
    for job in plan.shards[0].jobs:
        entry = ckpt.index.entry(job.source)
        shard = ckpt.index.root / ckpt.index.shard_of(job.source).name
        reads += [
            (shard, entry, o, min(1000, entry.start + entry.nbytes - o))
            for o in range(entry.start, entry.start + entry.nbytes, 1000)
        ]
    return reads


def _count_takes(monkeypatch) -> list[bool]:
    """What each take() answered (True: served from memory)."""
    answers: list[bool] = []
    real_take = Preread.take

    def take(*args) -> bool:
        answers.append(real_take(*args))
        return answers[-1]

    monkeypatch.setattr(Preread, "take", take)
    return answers


def test_reads_inside_the_fetched_bytes_come_from_memory_and_are_the_files(tmp_path, monkeypatch):
    ckpt = build_tiny_deepseek(tmp_path / "ckpt").path
    store = _fetch(ckpt, limit=6 * PIECE)
    held = store.held_bytes()
    assert 0 < held <= 6 * PIECE
    served = _count_takes(monkeypatch)
    readers: dict[Path, ShardReader] = {}
    for shard, entry, offset, n in _first_shard_reads(ckpt):
        reader = readers.setdefault(shard, ShardReader(shard, direct=True, preread=store))
        with open(shard, "rb") as f:
            f.seek(offset)
            expected = f.read(n)
        assert bytes(reader.read(entry, offset, n).numpy()) == expected, (shard.name, entry.name, offset)
    assert sum(served) * 1000 >= held - 2 * PIECE  # nearly every fetched byte was taken from memory
    assert store.held_bytes() == 0  # each piece dropped once its bytes were taken
    for reader in readers.values():
        reader.close()


def _overwrite_keeping_identity(shard: Path, offset: int, n: int) -> bytes:
    """Put other bytes at [offset, offset + n) of `shard`, its size and mtime as before (the store's key
    for it unchanged); the bytes it held there."""
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(offset)
        before = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in before))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    return before


def test_a_read_is_served_from_the_runs_store_not_the_disk_nor_another_runs(tmp_path):
    ckpt = build_tiny_deepseek(tmp_path / "ckpt").path
    store = _fetch(ckpt, limit=2 * PIECE)
    shard, entry, offset, n = _first_shard_reads(ckpt)[0]
    fetched = _overwrite_keeping_identity(shard, offset, n)  # what the disk holds differs from the store now
    on_disk = bytes(b ^ 0xFF for b in fetched)
    other = ShardReader(shard, preread=Preread())  # another run's store: empty, whatever this one holds
    assert bytes(other.read(entry, offset, n).numpy()) == on_disk
    other.close()
    alone = ShardReader(shard)  # a reader handed no store reads the disk
    assert bytes(alone.read(entry, offset, n).numpy()) == on_disk
    alone.close()
    assert store.held_bytes() > 0  # neither took from this run's store
    reader = ShardReader(shard, preread=store)
    assert bytes(reader.read(entry, offset, n).numpy()) == fetched
    reader.close()
    assert store.held_bytes() == 0  # a closed reader's file is forgotten


def test_a_file_changed_since_is_read_from_disk(tmp_path):
    ckpt = build_tiny_deepseek(tmp_path / "ckpt").path
    store = _fetch(ckpt, limit=2 * PIECE)
    shard = _first_shard_reads(ckpt)[0][0]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    reader = ShardReader(shard, preread=store)
    assert store.held_bytes() > 0 and not store.holds(reader.key)
    reader.close()


@pytest.mark.parametrize("target", ["bf16", "channel"])
def test_convert_cli_output_is_the_same_with_the_bytes_fetched_ahead(tmp_path, monkeypatch, target):
    ckpt = build_tiny_deepseek(tmp_path / "ckpt").path
    served = _count_takes(monkeypatch)
    cli_out, lib_out = tmp_path / "cli", tmp_path / "lib"
    r = CliRunner().invoke(main, ["convert", str(ckpt), "--to", target, "-o", str(cli_out), "-q"])
    assert r.exit_code == 0, r.output
    assert any(served), "the CLI run took nothing from what was fetched ahead"
    served.clear()
    convert(ckpt, lib_out, ConvertOptions(to=target))  # the library alone fetches nothing ahead
    assert not any(served)
    names = sorted(p.name for p in lib_out.glob("*.safetensors"))
    assert names and names == sorted(p.name for p in cli_out.glob("*.safetensors"))
    for name in names:
        assert (cli_out / name).read_bytes() == (lib_out / name).read_bytes(), name


def test_nothing_is_fetched_for_a_missing_path(tmp_path):
    assert warm_start.WarmStart().begin(str(tmp_path / "nope"), ConvertOptions("bf16")) is None


def test_the_page_cache_probe_tells_cached_from_not(tmp_path):
    """warm_torch hints nothing when torch's files are cached; the probe must see the difference.

    Whether the page is resident is told independently, by mincore(2) on a mapping of the file.
    """
    path = tmp_path / "file"
    path.write_bytes(b"x" * 8192)
    assert not warm_start.page_cached(tmp_path / "missing")
    path.read_bytes()
    if not _nowait_reads(path):
        pytest.skip(f"{tmp_path}'s filesystem refuses RWF_NOWAIT reads (tmpfs): the probe cannot tell, says not cached")
    assert _first_page_resident(path) and warm_start.page_cached(path)
    if not _dropped_from_page_cache(path):
        pytest.skip(f"{tmp_path}'s filesystem keeps pages after DONTNEED (tmpfs, some overlays): no uncached file")
    assert not warm_start.page_cached(path)


def _nowait_reads(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        return True
    except OSError as error:
        return error.errno != errno.EOPNOTSUPP
    finally:
        os.close(fd)


def _dropped_from_page_cache(path: Path) -> bool:
    """Advise the kernel to drop `path`'s pages until the probe says they are gone, for up to ~3 s.

    DONTNEED is advice: a loaded host (writeback under way) may keep a page a while, and tmpfs never drops
    one. The probe's own answer decides; the test then asserts it once more by itself.
    """
    for _ in range(60):
        os.sync()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages, written back: dropped
        finally:
            os.close(fd)
        if not _first_page_resident(path):
            return True
        time.sleep(0.05)
    return False


def _first_page_resident(path: Path) -> bool:
    """mincore(2) of the file's first page, through a mapping that touches none of it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            vector = ctypes.create_string_buffer(1)
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return bool(vector.raw[0] & 1)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
