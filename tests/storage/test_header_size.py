"""The space check counts each output shard's header (safetensors_header_size) instead of writing it: the
count must be the written header's length for every list of tensors a plan can make."""

from __future__ import annotations

import random

from fp8conv.storage.writer import TensorSpec, safetensors_header, safetensors_header_size

_NAMES = ["model.layers.0.mlp.up_proj.weight", "x", 'quo"te\\', "ünï ✓ 中", "a\nb", "__metadata__"]
_DTYPES = ["F8_E4M3", "F32", "BF16", "U8", "F8_E8M0", "I32"]


def _specs(rng: random.Random) -> list[TensorSpec]:
    specs = []
    for i in range(rng.choice([0, 1, 2, 7, 40])):
        name = rng.choice(_NAMES) + ("" if rng.random() < 0.1 else f".{i}")  # now and then a name twice
        shape = tuple(rng.choice([0, 1, 3, 128, 7168, 2**31]) for _ in range(rng.choice([0, 1, 2, 3])))
        specs.append(TensorSpec(name, rng.choice(_DTYPES), shape))
    return specs


def test_the_count_is_the_written_headers_length() -> None:
    rng = random.Random(3)
    for metadata in ({"format": "pt"}, {}, {"ké": 'v"'}):
        for _ in range(300):
            specs = _specs(rng)
            assert safetensors_header_size(specs, metadata) == len(safetensors_header(specs, metadata)), specs
