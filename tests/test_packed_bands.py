"""Packed 4-bit weights written band by band (the band workers, reused buffers) are the same files as
written whole, and the float64 definitions' values rounded once: MXFP4 (DeepSeek-V4), compressed-tensors
NVFP4 (global scale divided) and INT4, ModelOpt NVFP4 (global scale multiplied), to bf16 and float32."""

from __future__ import annotations

import pytest
import torch

import fp8conv
from fp8conv.formats import PACKED

from .helpers import dir_snapshot, load_dir
from .reference import same_bits
from .test_packed import NVFP4_SHAPES, build_int4, build_nvfp4, build_v4

INT4_SHAPES = {"model.layers.0.mlp.gate_proj": (37, 96), "model.layers.0.mlp.down_proj": (96, 64)}
BUILDERS = {
    "mxfp4 (v4)": lambda path: build_v4(path, layers=1),
    "int4": lambda path: build_int4(path, INT4_SHAPES),
    "nvfp4 compressed-tensors": lambda path: build_nvfp4(path, NVFP4_SHAPES, 1 / 2688.0),
    "nvfp4 modelopt": lambda path: build_nvfp4(path, NVFP4_SHAPES, 1 / 2688.0, modelopt=True),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", list(BUILDERS))
def test_packed_weights_stream_in_bands_with_identical_output(tmp_path, monkeypatch, kind, dtype):
    import fp8conv.rewrite.unpack as unpack
    import fp8conv.stream as stream

    _, truth = BUILDERS[kind](tmp_path / "c")
    fp8conv.convert(tmp_path / "c", tmp_path / "whole", to="bf16", dtype=dtype)
    streamed = []
    real_run = stream.BandStreamer.run
    # bands of a few rows, the last one short; NVFP4's float32 pieces smaller than a band
    monkeypatch.setattr(stream, "BAND_ELEMENTS", 700)
    monkeypatch.setattr(unpack, "GLOBAL_SCALE_CHUNK", 200)
    monkeypatch.setattr(
        stream.BandStreamer, "run", lambda self, job, *a: streamed.append(job.fmt.kind) or real_run(self, job, *a)
    )
    fp8conv.convert(tmp_path / "c", tmp_path / "bands", to="bf16", dtype=dtype)
    packed = [name for name in truth if ".attn." not in name and "shared_experts" not in name]  # V4's FP8 ones
    assert len([k for k in streamed if k in PACKED]) == len(packed) > 0
    assert dir_snapshot(tmp_path / "whole") == dir_snapshot(tmp_path / "bands")
    got = load_dir(tmp_path / "bands")
    for name, value in truth.items():
        assert same_bits(got[name], value.to(torch.float32).to(getattr(torch, dtype))), name
