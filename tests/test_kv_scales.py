"""KV-cache scales (ModelOpt `k_proj.k_scale`, compressed-tensors `self_attn.k_scale` / `k_proj.output_scale`)
are dropped from every output, whose config declares no FP8 KV cache, and the run names them: a bf16 output
loads in transformers with no unexpected key."""

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
    assert "and 1 more" in warning and "--to bf16" in warning
    _logits(tmp_path / "out")  # asserts no missing and no unexpected key
    assert fp8conv.verify(tmp_path / "c", tmp_path / "out").ok


@pytest.mark.parametrize("to", ["channel", "block"])
def test_compressed_tensors_kv_scales_are_dropped_from_fp8_outputs(tmp_path, to):
    """The channel and block outputs' quantization_config carries no kv_cache_scheme: the scales go too."""
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": fp8((16, 32)),
        "model.layers.0.self_attn.k_proj.weight_scale": torch.ones(16, 1),
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.125),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
    }
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama", "quantization_config": qc})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to))
    got = load_dir(tmp_path / "out")
    assert not [n for n in got if n.endswith(("k_scale", "v_scale", "output_scale"))], sorted(got)
    assert "model.layers.0.input_layernorm.weight" in got
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert "kv_cache_scheme" not in written
    assert [w for w in result.warnings if "KV-cache scale" in w] == [
        f"3 KV-cache scale tensor(s) dropped (model.layers.0.self_attn.k_scale, model.layers.0.self_attn.v_proj."
        f"output_scale, model.layers.0.self_attn.v_scale): the --to {to} output's config.json declares no FP8 KV "
        "cache, so no engine would apply them (an FP8 KV cache run from the output uses uncalibrated scales "
        "unless calibrated again)"
    ]


def test_a_bf16_model_parameter_named_like_a_kv_scale_is_kept(tmp_path):
    """Without a quantization_config nothing is a KV-cache scale: a model's own `k_scale` is copied."""
    tensors = {"model.layers.0.self_attn.k_scale": torch.ones(4), "x.weight": torch.ones(4, 4)}
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama"})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "model.layers.0.self_attn.k_scale" in load_dir(tmp_path / "out")
    assert not [w for w in result.warnings if "KV-cache" in w]
