"""KV-cache scales (ModelOpt `k_proj.k_scale`, compressed-tensors `self_attn.k_scale` / `k_proj.output_scale`):
dropped from a bf16 output, which has no quantization_config, and named in a warning (the output loads in
transformers with no unexpected key); kept in channel and block FP8 outputs, whose fp8 / compressed-tensors
config makes vLLM load them for an FP8 KV cache."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions

from .helpers import fp8, load_dir, write_checkpoint
from .test_modelopt import EXCLUDED, PRODUCER, _logits, build_modelopt

transformers = pytest.importorskip("transformers")

KV_SCALES = [f"model.layers.{i}.self_attn.{p}_proj.{p}_scale" for i in range(2) for p in "kv"]


def test_modelopt_kv_scales_are_dropped_from_a_bf16_output_that_transformers_loads(tmp_path):
    nested = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDED, "kv_cache_quant_algo": "FP8"}
    build_modelopt(tmp_path / "c", None, {"producer": PRODUCER, "quantization": nested})
    tensors = load_dir(tmp_path / "c") | {name: torch.tensor(0.0625 * (i + 1)) for i, name in enumerate(KV_SCALES)}
    for shard in (tmp_path / "c").glob("*.safetensors"):
        shard.unlink()
    write_checkpoint(tmp_path / "c", tensors, json.loads((tmp_path / "c" / "config.json").read_text()), shards=3)

    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    assert not set(KV_SCALES) & set(got)
    warning = next(w for w in result.warnings if "KV-cache scale" in w)
    assert warning.startswith("4 KV-cache scale tensor(s) dropped (model.layers.0.self_attn.k_proj.k_scale, ")
    assert "and 1 more" in warning and "a bf16 output has no quantization_config" in warning
    _logits(tmp_path / "out")  # asserts no missing and no unexpected key
    assert fp8conv.verify(tmp_path / "c", tmp_path / "out").ok


@pytest.mark.parametrize("to", ["channel", "block"])
def test_kv_scales_are_kept_in_fp8_outputs(tmp_path, to):
    """vLLM's Fp8Config and CompressedTensorsConfig give every attention layer a KV-cache method, with or
    without kv_cache_scheme, and load these names into it: the FP8 outputs keep them, byte for byte."""
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.125),
    }
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": fp8((16, 32)),
        "model.layers.0.self_attn.k_proj.weight_scale": torch.ones(16, 1),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
        **scales,
    }
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama", "quantization_config": qc})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to))
    got = load_dir(tmp_path / "out")
    assert all(torch.equal(got[n], t) for n, t in scales.items())
    assert not [w for w in result.warnings if "KV-cache" in w]

    fp8conv.convert(tmp_path / "c", tmp_path / "bf16", ConvertOptions(to="bf16"))
    assert not set(scales) & set(load_dir(tmp_path / "bf16"))


def test_a_bf16_model_parameter_named_like_a_kv_scale_is_kept(tmp_path):
    """Without a quantization_config nothing is a KV-cache scale: a model's own `k_scale` is copied."""
    tensors = {"model.layers.0.self_attn.k_scale": torch.ones(4), "x.weight": torch.ones(4, 4)}
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama"})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "model.layers.0.self_attn.k_scale" in load_dir(tmp_path / "out")
    assert not [w for w in result.warnings if "KV-cache" in w]
