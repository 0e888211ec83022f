"""ShardWriter: tensors arrive in any order and in parts; the file is a valid safetensors file and the
sha256 taken while writing is the file's."""

from __future__ import annotations

import hashlib
import os
import random

import pytest
import torch
from safetensors.torch import load_file

from fp8conv.writer import ShardWriter, TensorSpec


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
