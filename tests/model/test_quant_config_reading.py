"""quantization_config read the way engines read it: quant_method compared as vLLM compares it (lowercased,
compressed_tensors hyphenated), ModelOpt's exclude_modules matched as the wildcards vLLM's ModelOpt reader
takes them for (fnmatch)."""

from __future__ import annotations

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.model.classify import Kind, classify
from fp8conv.model.quant_config import module_matches
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import fp8, load_dir, write_checkpoint
from tests.support.packing import pack_nibbles, random_codes, random_e4m3_scales, random_e8m0

CT_CHANNEL = {
    "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
}


def _gpt_oss(path, method: str):
    codes = random_codes((2, 8, 64), 1)
    tensors = {
        "model.layers.0.mlp.experts.down_proj_blocks": pack_nibbles(codes).reshape(2, 8, 2, 16),
        "model.layers.0.mlp.experts.down_proj_scales": random_e8m0((2, 8, 2), 1),
    }
    return write_checkpoint(path, tensors, {"quantization_config": {"quant_method": method}})


def _modelopt(path, method: str):
    tensors = {
        "x.weight": pack_nibbles(random_codes((4, 32), 2)),
        "x.weight_scale": random_e4m3_scales((4, 2), 2),
        "x.weight_scale_2": torch.tensor(0.5),
    }
    qc = {"quant_method": method, "quant_algo": "NVFP4", "group_size": 16}
    return write_checkpoint(path, tensors, {"quantization_config": qc})


def _fp8_block(path, method: str):
    qc = {"quant_method": method, "fmt": "e4m3", "weight_block_size": [128, 128]}
    tensors = {"x.weight": fp8((200, 130)), "x.weight_scale_inv": torch.ones(2, 2)}
    return write_checkpoint(path, tensors, {"quantization_config": qc})


def _ct_channel(path, method: str):
    tensors = {"x.weight": fp8((6, 8)), "x.weight_scale": torch.ones(6, 1)}
    return write_checkpoint(path, tensors, {"quantization_config": {"quant_method": method, **CT_CHANNEL}})


@pytest.mark.parametrize(
    ("build", "method", "kind"),
    [
        (_gpt_oss, "MXFP4", Kind.MXFP4_GPT_OSS),
        (_modelopt, "Modelopt", Kind.NVFP4_MODELOPT),
        (_modelopt, "ModelOpt_FP4", Kind.NVFP4_MODELOPT),
        (_fp8_block, "FP8", Kind.BLOCK),
        (_ct_channel, "Compressed-Tensors", Kind.CHANNEL),
        (_ct_channel, "compressed_tensors", Kind.CHANNEL),
    ],
)
def test_quant_method_is_read_case_insensitively_as_vllm_does(tmp_path, build, method, kind):
    ckpt = open_checkpoint(build(tmp_path / "c", method))
    cls = classify(ckpt.index, ckpt.config)
    assert cls.problems == [], [p.one_line() for p in cls.problems]
    assert {w.kind for w in cls.weights.values()} == {kind}
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert all(t.dtype == torch.bfloat16 for t in load_dir(tmp_path / "out").values())


def test_quant_method_nvfp4_is_refused_naming_the_layouts_fp8conv_reads(tmp_path):
    ckpt = open_checkpoint(_modelopt(tmp_path / "c", "NVFP4"))
    message = classify(ckpt.index, ckpt.config).problems[0].one_line()
    assert "quant_method 'NVFP4' names no NVFP4 checkpoint layout" in message
    assert "nvfp4-pack-quantized" in message and "not supported" not in message


@pytest.mark.parametrize(
    ("module", "patterns", "listed"),
    [
        ("model.layers.3.mlp.down_proj", ["model.layers.*.mlp*"], True),
        ("model.layers.3.mlp.experts.7.w1", ["model.layers.*.mlp.experts*"], True),
        ("model.layers.3.self_attn.o_proj", ["model.layers.*.mlp*"], False),
        ("model.layers.3.self_attn.o_proj", ["*self_attn*"], True),
        ("model.layers.12.self_attn.q_proj", ["model.layers.1?.self_attn.q_proj"], True),
        ("model.layers.2.self_attn.q_proj", ["model.layers.1?.self_attn.q_proj"], False),
        ("model.layers.0.self_attn.q_proj", ["model.layers.*.self_attn"], True),  # a parent module listed
        ("lm_head", ["lm_head"], True),
        ("model.layers.0.mlp.gate", ["re:.*mlp\\.gate$"], True),
        ("model.layers.0.mlp.gate_proj", ["gate"], False),
    ],
)
def test_not_converted_patterns_match_wildcards(module, patterns, listed):
    assert module_matches(module, patterns) is listed


def test_modelopt_exclude_wildcard_is_checked_against_the_weights(tmp_path):
    """A weight that is NVFP4 although a wildcard in exclude_modules lists it is warned about, by name."""
    tensors = {}
    for base in ("model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj"):
        tensors[base + ".weight"] = pack_nibbles(random_codes((4, 32), 3))
        tensors[base + ".weight_scale"] = random_e4m3_scales((4, 2), 3)
        tensors[base + ".weight_scale_2"] = torch.tensor(0.5)
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    qc["exclude_modules"] = ["model.layers.*.mlp*"]
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors, {"quantization_config": qc}))
    warnings = classify(ckpt.index, ckpt.config).warnings
    assert warnings == [
        "model.layers.0.mlp.down_proj.weight is nvfp4-modelopt although config.json lists its module as not converted"
    ]
