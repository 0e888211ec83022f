"""Packed 4-bit weights written band by band (the band workers, reused buffers) are the same files as
written whole, and the float64 definitions' values rounded once: MXFP4 (DeepSeek-V4), compressed-tensors
NVFP4 (global scale divided) and INT4, ModelOpt NVFP4 (global scale multiplied), to bf16 and float32."""

from __future__ import annotations

import pytest
import torch

import fp8conv
from fp8conv.model.classify import PACKED, Kind
from fp8conv.options import Tuning
from tests.support.helpers import dir_snapshot, load_dir
from tests.support.packed_builders import NVFP4_SHAPES, build_int4, build_nvfp4, build_v4
from tests.support.packing import e2m1_value, e8m0_value, group_scaled
from tests.support.reference import quantize_exact_reference, quantize_reference, same_bits

INT4_SHAPES = {"model.layers.0.mlp.gate_proj": (37, 96), "model.layers.0.mlp.down_proj": (96, 64)}
BUILDERS = {
    "mxfp4 (v4)": lambda path: build_v4(path, layers=1),
    "int4": lambda path: build_int4(path, INT4_SHAPES),
    "nvfp4 compressed-tensors": lambda path: build_nvfp4(path, NVFP4_SHAPES, 1 / 2688.0),
    "nvfp4 modelopt": lambda path: build_nvfp4(path, NVFP4_SHAPES, 1 / 2688.0, modelopt=True),
}


TARGETS = [
    ("bf16", "bfloat16"),
    ("bf16", "float32"),
    ("bf16", "float16"),
    ("channel", "bfloat16"),
    ("block", "bfloat16"),
]


@pytest.mark.parametrize(("to", "dtype"), TARGETS)
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_packed_weights_stream_in_bands_with_identical_output(tmp_path, monkeypatch, kind, to, dtype):
    from fp8conv.rewrite.banded import BandedJob

    _, truth = BUILDERS[kind](tmp_path / "c")
    whole = fp8conv.convert(
        tmp_path / "c",
        tmp_path / "whole",
        fp8conv.ConvertOptions(to=to, dtype=dtype),
        run=fp8conv.RunOptions(verify_after=True),
    )
    streamed = []
    real_init = BandedJob.__init__  # one per job the plan streams in bands
    # bands of a few rows (of 128 for blocks), the last one short; float32 pieces smaller than a band
    monkeypatch.setattr(
        BandedJob, "__init__", lambda self, job, *a: streamed.append(job.fmt.kind) or real_init(self, job, *a)
    )
    bands = fp8conv.convert(
        tmp_path / "c",
        tmp_path / "bands",
        fp8conv.ConvertOptions(to=to, dtype=dtype),
        run=fp8conv.RunOptions(verify_after=True, tuning=Tuning(convert_band_elements=700, packed_chunk_elements=200)),
    )
    assert bands.verified is not None and bands.verified.ok, bands.verified
    packed = [name for name in truth if ".attn." not in name and "shared_experts" not in name]  # V4's FP8 ones
    assert len([k for k in streamed if k in PACKED]) == len(packed) > 0
    assert dir_snapshot(tmp_path / "whole") == dir_snapshot(tmp_path / "bands")
    assert (bands.packed_blocks_exact, bands.packed_blocks_total) == (
        whole.packed_blocks_exact,
        whole.packed_blocks_total,
    )
    got = load_dir(tmp_path / "bands")
    if to == "bf16":
        for name, value in truth.items():
            assert same_bits(got[name], value.to(torch.float32).to(getattr(torch, dtype))), name
    else:
        assert bands.packed_blocks_total > 0
        for name in packed:
            block = (128, 128) if to == "block" else None
            if block and kind == "mxfp4 (v4)":  # E8M0 scales: blocks a power of two holds exactly take it
                q_ref, s_ref, _ = quantize_exact_reference(truth[name].to(torch.float32), block)
            else:
                q_ref, s_ref = quantize_reference(truth[name].to(torch.float32), block)
            base = name.removesuffix(".weight")
            (scale_name,) = [n for n in got if n.startswith(base + ".") and n != name and "scale" in n]
            assert same_bits(got[name], q_ref) and same_bits(got[scale_name], s_ref.reshape(got[scale_name].shape)), (
                name
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_mxfp4_decode_is_the_definition_for_every_code_pair_and_scale_byte(dtype):
    """All 256 bytes (16 x 16 codes, low nibble first) under every E8M0 byte but NaN's 255: the edges
    0 (2^-127, a float32 subnormal), 1, 2, 252, 253, 254 (6 x 2^127 overflows) included, one per row
    (an odd count). The definition: the float64 product, rounded once to float32 (exact, or
    inf), then once to the output dtype."""
    from fp8conv.backends import get_backend
    from fp8conv.rewrite.unpack import code_values

    scale_bytes = torch.arange(255, dtype=torch.uint8).reshape(1, 255, 1).expand(1, 255, 16).contiguous()
    codes = torch.arange(256, dtype=torch.uint8).repeat(255, 1).reshape(1, 255, 256)  # 512 values per row
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(1, 255, 512)
    expected = group_scaled(e2m1_value(nibbles), e8m0_value(scale_bytes), 32).to(torch.float32).to(dtype)
    for device in ("cpu", "reference"):
        out = torch.empty(1, 255, 512, dtype=dtype)
        get_backend(device).decode_4bit(codes, code_values(Kind.MXFP4), scale_bytes, 32, out)
        assert same_bits(out, expected), device


@pytest.mark.parametrize("to", ["bf16", "channel"])
def test_packed_experts_stay_under_the_lowest_memory_cap(tmp_path, to):
    """16M-value MXFP4 experts (32 MiB of bf16 each; rewritten whole, one would need ~100 MB, and the cap
    refused them) stream in bands under the lowest --max-memory accepted. To bf16 the output comes 4x
    faster than the input and the writer fills its segments: counted, and fewer under a cap (before,
    8 of them uncounted: 276-277 MiB against the then lowest cap, 272 MiB)."""

    from fp8conv.plan.bands import lowest_max_memory
    from tests.support.helpers import peak_rss_kib, write_checkpoint
    from tests.support.packed_builders import v4_config

    gen = torch.Generator().manual_seed(7)
    tensors = {}
    for e in range(3):
        name = f"layers.0.ffn.experts.{e}.w1"
        codes = torch.randint(0, 256, (4096, 2048), generator=gen, dtype=torch.uint8)
        tensors[name + ".weight"] = codes.view(torch.int8)
        exponents = torch.randint(112, 122, (4096, 128), generator=gen, dtype=torch.uint8)
        tensors[name + ".scale"] = exponents.view(torch.float8_e8m0fnu)
    src = write_checkpoint(tmp_path / "in", tensors, v4_config())
    cap = lowest_max_memory()
    peak = peak_rss_kib(src, tmp_path / "out", to, max_memory=cap)
    assert peak * 1024 <= cap, f"peak {peak} KiB over the {cap} byte cap"
    got = load_dir(tmp_path / "out")
    assert got["layers.0.ffn.experts.2.w1.weight"].shape == (4096, 4096)
