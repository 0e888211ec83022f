"""ShardWriter: tensors arrive in any order and in parts; the file is a valid safetensors file and the
sha256 taken while writing is the file's."""

from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file

import fp8conv
from fp8conv.writer import ShardWriter, TensorSpec

from .helpers import fp8, fp8_block_config, write_checkpoint


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


@pytest.mark.parametrize("seed", range(6))
def test_sha256_taken_while_writing_is_the_files(tmp_path, seed):
    specs, tensors = specs_and_tensors()
    writer = ShardWriter(tmp_path / "s.safetensors", specs, {"format": "pt"})
    pieces: list[tuple[str, int, torch.Tensor | None]] = []
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
    path = tmp_path / "s.safetensors"
    assert writer.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(path)
    for name, t in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8))


def test_copy_range_is_hashed_too(tmp_path):
    src = tmp_path / "raw.bin"
    payload = os.urandom(5000)
    src.write_bytes(payload)
    spec = TensorSpec("x", "U8", (5000,))
    writer = ShardWriter(tmp_path / "c.safetensors", [spec], {})
    fd = os.open(src, os.O_RDONLY)
    try:
        writer.copy_range("x", fd, 0, 5000, bytearray(1024))  # several chunks through one small buffer
    finally:
        os.close(fd)
    writer.commit()
    assert writer.sha256 == hashlib.sha256((tmp_path / "c.safetensors").read_bytes()).hexdigest()


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
    fp8conv.convert(src, out, to=to)
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
