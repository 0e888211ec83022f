"""ShardWriter: tensors arrive in any order and in parts; the file is a valid safetensors file and the
sha256 taken while writing is the file's."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

import fp8conv
import fp8conv.storage.writer as writer_module
from fp8conv import ConvertOptions
from fp8conv.storage.direct_io import aligned_empty
from fp8conv.storage.header import read_header
from fp8conv.storage.safetensors_file import TensorEntry, as_writable_memoryview
from fp8conv.storage.shard_reader import ShardReader, read_capacity
from fp8conv.storage.writer import (
    OrderedHash,
    SegmentAssembler,
    ShardFile,
    ShardLayout,
    ShardWriter,
    TensorSpec,
    safetensors_header,
)
from tests.support.helpers import direct_io_works, fp8, fp8_block_config, write_checkpoint


def specs_and_tensors() -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(300, 70, generator=gen).to(torch.bfloat16),
        "a.weight_scale": torch.rand(3, 1, generator=gen),
        "b.weight": torch.randint(0, 255, (129, 33), generator=gen, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "c.bias": torch.randn(7, generator=gen),
    }
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
    specs = [TensorSpec(n, dtypes[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    return specs, tensors


@pytest.fixture(params=["direct", "buffered"])
def direct(request, tmp_path) -> bool:
    if request.param == "direct" and not direct_io_works(tmp_path):
        pytest.skip("this filesystem has no direct I/O")
    return request.param == "direct"


def write_shuffled(path, seed: int, direct: bool, **sizes: int) -> tuple[ShardWriter, dict[str, torch.Tensor]]:
    """`sizes`: the writer's segment_bytes and max_segments, when not its defaults."""
    specs, tensors = specs_and_tensors()
    writer = ShardWriter(path, specs, {"format": "pt"}, direct=direct, **sizes)
    assert writer.direct == direct
    pieces: list[tuple[str, int, torch.Tensor]] = []
    for name, t in tensors.items():
        if t.dim() == 2 and t.shape[0] > 100:  # in row bands, as the streamer writes them
            rows = t.shape[0] // 3
            for r0 in range(0, t.shape[0], rows):
                band = t[r0 : r0 + rows]
                pieces.append((name, r0 * t.shape[1] * t.element_size(), band))
        else:
            pieces.append((name, -1, t))
    random.Random(seed).shuffle(pieces)  # seed 0.. put scales and later bands ahead of the prefix
    for name, offset, t in pieces:
        if offset < 0:
            writer.write_tensor(name, t)
        else:
            writer.write_part(name, offset, t)
    writer.commit()
    return writer, tensors


def check_shard(path, writer: ShardWriter, tensors: dict[str, torch.Tensor]) -> None:
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("seed", range(6))
def test_sha256_taken_while_writing_is_the_files(tmp_path, seed, direct):
    writer, tensors = write_shuffled(tmp_path / "s.safetensors", seed, direct)
    check_shard(tmp_path / "s.safetensors", writer, tensors)


@pytest.mark.parametrize("seed", range(4))
def test_tiny_segment_budget_spills_and_reads_back(tmp_path, seed, direct):
    """One-page segments and room for two: pieces in random order leave segments partial (spilled to the
    file through the page cache) and complete ahead of the hash (kept, dropped, read back)."""
    writer, tensors = write_shuffled(tmp_path / "s.safetensors", seed, direct, segment_bytes=4096, max_segments=2)
    check_shard(tmp_path / "s.safetensors", writer, tensors)
    assert writer.assembler.count > 10 and not writer.buffers_held  # every buffer came back


def test_bytes_written_twice_are_refused(tmp_path):
    spec = TensorSpec("x", "U8", (10_000,))
    writer = ShardWriter(tmp_path / "t.safetensors", [spec], {})
    writer.write_part("x", 0, torch.zeros(10_000, dtype=torch.uint8))  # the file's one segment, written
    with pytest.raises(RuntimeError, match="more bytes than planned"):  # the layout counts each tensor's bytes
        writer.write_part("x", 10, torch.zeros(100, dtype=torch.uint8))
    writer.abort()
    assert not list(tmp_path.iterdir())
    # below the layout, the assembler refuses bytes of a segment already complete, or overlapping ones
    assembler = SegmentAssembler(10_000, 4096, "t.safetensors")
    assert [s.index for s in assembler.place(memoryview(bytes(5000)), 0, _buffer, _no_spill)] == [0]
    with pytest.raises(RuntimeError, match=r"t\.safetensors: segment 0 written twice"):
        list(assembler.place(memoryview(bytes(100)), 10, _buffer, _no_spill))
    list(assembler.place(memoryview(bytes(3000)), 5000, _buffer, _no_spill))
    with pytest.raises(RuntimeError, match=r"t\.safetensors: bytes at 6000 written twice"):
        list(assembler.place(memoryview(bytes(500)), 6000, _buffer, _no_spill))


def _buffer() -> torch.Tensor:
    return aligned_empty(4096)


def _no_spill(data: memoryview, offset: int) -> None:
    raise AssertionError("nothing should be spilled")


def test_segment_assembler_hands_back_whole_segments_in_any_order():
    """Pieces in random order: each segment comes back once, when complete, holding the file's bytes; a
    spilled segment's bytes (those held, then those still to come) go to the spill write instead."""
    payload = os.urandom(5 * 4096 + 123)
    pieces = [(o, payload[o : o + 1000]) for o in range(0, len(payload), 1000)]
    random.Random(1).shuffle(pieces)
    assembler = SegmentAssembler(len(payload), 4096)
    assert assembler.count == 6 and assembler.length(5) == 123
    spilled = bytearray(len(payload))
    got: dict[int, bytes] = {}

    def spill(data: memoryview, offset: int) -> None:
        spilled[offset : offset + len(data)] = data

    for i, (offset, data) in enumerate(pieces):
        if i == len(pieces) // 2:
            assert assembler.partial
            assert assembler.spill_oldest(spill) is not None
        for segment in assembler.place(memoryview(data), offset, _buffer, spill):
            assert segment.index not in got
            length = assembler.length(segment.index)
            got[segment.index] = bytes(segment.view[:length]) if segment.view is not None else b""
    assert sorted(got) == list(range(6)) and not assembler.partial
    for index, data in got.items():
        lo, hi = index * 4096, index * 4096 + assembler.length(index)
        assert (data or bytes(spilled[lo:hi])) == payload[lo:hi]
    assert any(not data for data in got.values())  # one went by the spill write


def test_ordered_hash_is_the_files_sha256_whatever_the_completion_order():
    segments = [os.urandom(4096) for _ in range(7)] + [os.urandom(100)]
    order = list(range(len(segments)))
    random.Random(2).shuffle(order)
    hashing = OrderedHash[str]()
    for index in order:
        for ready, payload in hashing.complete(index, f"p{index}"):
            assert payload == f"p{ready}"  # the caller's payload comes back with its segment
            hashing.update(segments[ready])
    assert hashing.next == len(segments) and not hashing.waiting
    assert hashing.hexdigest() == hashlib.sha256(b"".join(segments)).hexdigest()
    with pytest.raises(RuntimeError, match="segment 3 completed twice"):
        hashing.complete(3, "again")


def test_shard_layout_places_tensors_after_the_header_and_counts_their_bytes():
    specs, _ = specs_and_tensors()
    layout = ShardLayout("s.safetensors", specs, {"format": "pt"})
    assert layout.header == safetensors_header(specs, {"format": "pt"}) and len(layout.header) % 8 == 0
    assert layout.size == len(layout.header) + sum(s.nbytes for s in specs)
    assert layout.claim("a.weight", 100) == (specs[0], len(layout.header))
    assert layout.claim("b.weight")[1] == len(layout.header) + specs[0].nbytes + specs[1].nbytes
    assert layout.missing() == ["a.weight", "a.weight_scale", "c.bias"]
    with pytest.raises(RuntimeError, match="more bytes than planned"):
        layout.claim("a.weight")
    with pytest.raises(RuntimeError, match=r"d\.weight is not planned for s\.safetensors"):
        layout.claim("d.weight")


def test_shard_file_appears_only_on_commit(tmp_path, direct):
    """Under a temporary name until commit(), which cuts a last direct write's page tail off; abort()
    leaves nothing."""
    final = tmp_path / "f.safetensors"
    sink = ShardFile(final, direct)
    assert sink.direct == direct and sink.temp.parent == tmp_path and not final.exists()
    segment = aligned_empty(8192)
    segment.copy_(torch.randint(0, 256, (8192,), dtype=torch.uint8))
    view = as_writable_memoryview(segment)
    sink.write_segment(view, 0, 4096)
    sink.write_segment(view[4096:], 4096, 1000)  # the last, short one: written to a whole page
    sink.write(memoryview(b"tail"), 5096)
    assert sink.read(4096, 10) == bytes(view[4096:4106])
    assert not final.exists()
    sink.commit(5100)
    assert final.read_bytes() == bytes(view[:5096]) + b"tail" and not sink.temp.exists()
    aborted = ShardFile(tmp_path / "g.safetensors", direct)
    aborted.write(memoryview(b"x" * 10), 0)
    aborted.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors"]


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 20])
def test_copy_range_is_hashed_too(tmp_path, chunk, direct):
    src = tmp_path / "raw.bin"
    payload = os.urandom(3 * 4096 + 5000)
    src.write_bytes(payload)
    entry = TensorEntry("x", "U8", (5000,), 4096 + 7, 5000)  # starts and ends mid-page
    writer = ShardWriter(tmp_path / "c.safetensors", [TensorSpec("x", "U8", (5000,))], {}, direct=direct)
    source = ShardReader(src, direct, direct_min_bytes=0)  # direct reads for every size
    try:
        writer.copy_range("x", source, entry, aligned_empty(read_capacity(chunk)))
    finally:
        source.close()
    writer.commit()
    raw = (tmp_path / "c.safetensors").read_bytes()
    assert writer.sha256 == hashlib.sha256(raw).hexdigest()
    assert load_file(tmp_path / "c.safetensors")["x"].numpy().tobytes() == payload[4096 + 7 : 4096 + 7 + 5000]


@pytest.mark.parametrize("to", ["channel", "block"])
@pytest.mark.parametrize(
    ("shapes", "in_production_order"),
    [
        ([(256, 128), (130, 64)], True),  # real-model-like: every tensor aligned in production order
        ([(3, 5), (130, 64)], False),  # a 15-byte weight: a float32 scale after it would be misaligned
    ],
)
def test_layout_and_manifest_hash(tmp_path, to, shapes, in_production_order):
    """Production order (weight, then its scale) when it keeps every tensor aligned, else larger
    elements first; either way the manifest's sha256 is each shard file's."""
    tensors: dict[str, torch.Tensor] = {}
    for i, shape in enumerate(shapes):
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = fp8(shape, seed=i)
        tensors[f"model.layers.{i}.mlp.down_proj.weight_scale_inv"] = (
            torch.rand(-(-shape[0] // 128), -(-shape[1] // 128)) + 0.5
        )
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(shape[1], dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "in", tensors, fp8_block_config())
    out = tmp_path / "out"
    fp8conv.convert(src, out, ConvertOptions(to=to))
    manifest = json.loads((out / ".fp8conv" / "manifest.json").read_text())
    for shard in out.glob("*.safetensors"):
        raw = shard.read_bytes()
        assert manifest["shards"][shard.name]["sha256"] == hashlib.sha256(raw).hexdigest()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        header.pop("__metadata__", None)
        by_offset = sorted(header, key=lambda n: header[n]["data_offsets"][0])
        sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1}
        assert all(header[n]["data_offsets"][0] % sizes[header[n]["dtype"]] == 0 for n in by_offset)
        weights = [n for n in by_offset if n.endswith("proj.weight")]
        # production order puts each weight's scale right after it
        scale_follows = all(by_offset[by_offset.index(w) + 1].startswith(w) for w in weights)
        assert scale_follows == in_production_order


def test_direct_io_turned_down_at_write_or_read_time_falls_back(tmp_path, monkeypatch):
    """A filesystem that opens with O_DIRECT but refuses the I/O itself (EINVAL: it wants a larger
    alignment): the same bytes go through the page cache, from then on."""
    if not direct_io_works(tmp_path):
        pytest.skip("this filesystem has no direct I/O")
    refused: set[int] = set()
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def pwrite(fd, data, offset):
        if fd in refused:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    def preadv(fd, buffers, offset):
        if fd in refused:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "preadv", preadv)
    specs, tensors = specs_and_tensors()
    path = tmp_path / "s.safetensors"
    writer = ShardWriter(path, specs, {"format": "pt"}, direct=True, segment_bytes=8192)
    assert writer.file.direct_fd is not None
    refused.add(writer.file.direct_fd)
    for name, t in tensors.items():
        writer.write_tensor(name, t)
    writer.commit()
    assert not writer.direct
    check_shard(path, writer, tensors)

    header = read_header(path)
    source = ShardReader(path, True, direct_min_bytes=0)
    assert source.direct_fd is not None
    refused.add(source.direct_fd)
    try:
        got = source.read_tensor(header.tensors["a.weight"])
        fell_back = not source.direct  # read before close(), which clears it whatever happened
    finally:
        source.close()
    assert fell_back and torch.equal(got.view(torch.uint8), tensors["a.weight"].view(torch.uint8))


def test_a_failed_write_names_a_shard_as_shard_and_another_file_as_file(tmp_path, monkeypatch):
    from fp8conv.errors import OutputError

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for name, field in [("config.json", "file"), ("model-00001-of-00002.safetensors", "shard")]:
        with pytest.raises(OutputError) as info:
            writer_module.write_file_atomic(tmp_path / name, b"{}")
        assert (info.value.shard, info.value.file) == ((name, None) if field == "shard" else (None, name))
        assert (
            info.value.one_line() == f"in {name}: writing failed: No space left on device — free disk space and retry"
        )
        assert not (tmp_path / name).exists()
