"""Headers and index: read without tensor bytes, and every inconsistency refused by name."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.errors import CheckpointError
from fp8conv.storage.header import read_header
from fp8conv.storage.safetensors_file import read_tensor
from tests.support.helpers import direct_io_works, fp8, write_checkpoint, write_raw_safetensors
from tests.support.reference import same_bits


def test_read_tensor_matches_safetensors(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {
        "a": fp8((3, 5)),  # 15 bytes: the tensors after it are not naturally aligned in the input
        "b": torch.randn(7, dtype=torch.bfloat16),
        "c": torch.randn(2, 3),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(1.5),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    header = read_header(tmp_path / "x.safetensors")
    fd = os.open(tmp_path / "x.safetensors", os.O_RDONLY)
    try:
        for name, expected in load_file(tmp_path / "x.safetensors").items():
            assert same_bits(read_tensor(fd, header.tensors[name], "x.safetensors"), expected), name
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_shard_reader_reads_what_safetensors_reads(tmp_path, monkeypatch, direct):
    """Direct reads for every size (the default keeps small ones buffered): unaligned starts and ends,
    tensors misaligned for their dtype, an empty one; then a truncated file, refused by name."""
    from safetensors.torch import load_file, save_file

    from fp8conv.storage import shard_reader

    direct_reads: list[int] = []
    real_direct = shard_reader.ShardReader._read_direct
    monkeypatch.setattr(
        shard_reader.ShardReader,
        "_read_direct",
        lambda self, entry, offset, nbytes, buffer: (
            direct_reads.append(nbytes) or real_direct(self, entry, offset, nbytes, buffer)
        ),
    )

    gen = torch.Generator().manual_seed(3)
    tensors = {
        "a": fp8((3, 5)),
        "b": torch.randn(7, dtype=torch.bfloat16),
        "big": torch.randn(3000, 7, generator=gen),  # spans several pages
        "c": torch.randn(2, 3),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    header = read_header(path)
    reader = shard_reader.ShardReader(path, direct, direct_min_bytes=0)
    went_direct = reader.direct_fd is not None
    assert went_direct == (direct and direct_io_works(tmp_path))
    try:
        for name, expected in load_file(path).items():
            assert same_bits(reader.read_tensor(header.tensors[name]), expected), name
    finally:
        reader.close()
    assert len(direct_reads) == (len(tensors) if went_direct else 0)  # each tensor, the empty one too
    raw = path.read_bytes()
    big = header.tensors["big"]
    path.write_bytes(raw[: big.start + big.nbytes - 100])
    reader = shard_reader.ShardReader(path, direct, direct_min_bytes=0)
    try:
        with pytest.raises(CheckpointError, match="file ended before") as info:
            reader.read_tensor(big)
        assert "big" in str(info.value) and "x.safetensors" in str(info.value)
    finally:
        reader.close()


def _convert(path, tmp_path):
    return fp8conv.convert(path, tmp_path / "out", ConvertOptions(to="bf16"))


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "truncated"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, "needs 16"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
        ({"w": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4, "dtype 'Q4'"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "not a list of sizes"),
        (["not", "an", "object"], b"", "not a JSON object"),
    ],
)
def test_broken_headers_are_refused_by_name(tmp_path, header, data, match):
    d = tmp_path / "c"
    d.mkdir()
    write_raw_safetensors(d / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=match) as info:
        _convert(d, tmp_path)
    assert "model.safetensors" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_oversized_or_garbage_header(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    write_raw_safetensors(d / "model.safetensors", {}, b"", header_len=2**40)
    with pytest.raises(CheckpointError, match="header length"):
        _convert(d, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        _convert(d, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(CheckpointError, match="too short"):
        _convert(d, tmp_path)


def _with_index(tmp_path, mutate):
    tensors = {"a.weight": torch.ones(2), "b.weight": torch.ones(3), "c.weight": torch.ones(1)}
    path = write_checkpoint(tmp_path / "c", tensors, shards=2)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    mutate(index)
    index_path.write_text(json.dumps(index))
    return path


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda i: i["weight_map"].update({"a.weight": "model-00009-of-00009.safetensors"}),
            "does not exist",
        ),
        (lambda i: i["weight_map"].update({"a.weight": "../escape.safetensors"}), "inside the checkpoint"),
        (lambda i: i["weight_map"].update({"a.weight": "/etc/passwd.safetensors"}), "inside the checkpoint"),
        (
            lambda i: i["weight_map"].update({"a.weight": "model-00002-of-00002.safetensors"}),
            "does not hold it",
        ),
        (lambda i: i["weight_map"].pop("c.weight"), "missing from model.safetensors.index.json"),
        (
            lambda i: i["weight_map"].update({"ghost.weight": "model-00001-of-00002.safetensors"}),
            "ghost.weight",
        ),
        (lambda i: i.pop("weight_map"), "no 'weight_map'"),
    ],
)
def test_index_inconsistencies_are_refused(tmp_path, mutate, match):
    path = _with_index(tmp_path, mutate)
    with pytest.raises(CheckpointError, match=match):
        _convert(path, tmp_path)
    assert not (tmp_path / "out").exists()


def test_duplicate_tensor_across_shards(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "c"
    d.mkdir()
    save_file({"a.weight": torch.ones(2)}, str(d / "one.safetensors"))
    save_file({"a.weight": torch.ones(2)}, str(d / "two.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("appears in both one.safetensors and two.safetensors")) as info:
        _convert(d, tmp_path)
    assert "a.weight" in str(info.value)


def test_config_must_be_a_json_object(tmp_path):
    path = write_checkpoint(tmp_path / "c", {"a.weight": torch.ones(2)}, config=None)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not an object"):
        _convert(path, tmp_path)
    (path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=re.escape("config.json: is not valid JSON")):
        _convert(path, tmp_path)


def test_missing_checkpoint_and_hub_ids(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        fp8conv.inspect(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="cannot be fetched from the Hugging Face Hub") as info:
        fp8conv.inspect("deepseek-ai/DeepSeek-V3")  # offline in tests, and not in the cache
    assert "\n" not in str(info.value)
