"""Shared by several test modules (carried out of tests/model/test_packed.py)."""

from __future__ import annotations

import math

import torch

from tests.support.helpers import fp8, write_checkpoint
from tests.support.packing import (
    e2m1_value,
    e8m0_value,
    group_scaled,
    pack_int32,
    pack_nibbles,
    random_codes,
    random_e4m3_scales,
    random_e8m0,
)
from tests.support.reference import dequant_block_reference

V4_EXPERTS = {  # [out, in]: K = 320 and 96, neither a multiple of 128
    "w1": (96, 320),
    "w2": (320, 96),
    "w3": (96, 320),
}

V4_LINEARS = {"attn.wq_a": (200, 320), "attn.wkv": (130, 320), "ffn.shared_experts.w1": (96, 320)}


def v4_config(**extra) -> dict:
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    return {
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": qc,
    } | extra


def build_v4(path, config=None, layers: int = 2, experts: int = 2, shards: int = 3, scale_low: int = 118):
    """A tiny DeepSeek-V4-shaped checkpoint; returns (tensors, truth): truth is the float64 value of every
    quantized weight, from the definitions."""
    tensors: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(64, 320).to(torch.bfloat16),
        "head.weight": torch.randn(64, 320).to(torch.bfloat16),
        "norm.weight": torch.ones(320, dtype=torch.bfloat16),
    }
    truth: dict[str, torch.Tensor] = {}
    seed = 0
    for i in range(layers):
        p = f"layers.{i}."
        tensors[p + "attn_norm.weight"] = torch.ones(320, dtype=torch.bfloat16)
        tensors[p + "hc_attn_fn"] = torch.randn(4, 320)  # float32, copied
        tensors[p + "attn.attn_sink"] = torch.randn(2)
        tensors[p + "ffn.gate.weight"] = torch.randn(experts, 320).to(torch.bfloat16)
        for name, (n, k) in V4_LINEARS.items():
            seed += 1
            q = fp8((n, k), seed)
            scale = random_e8m0((math.ceil(n / 128), math.ceil(k / 128)), seed, 110, 122)
            tensors[p + name + ".weight"] = q
            tensors[p + name + ".scale"] = scale.view(torch.float8_e8m0fnu)
            truth[p + name + ".weight"] = dequant_block_reference(
                q, e8m0_value(scale).to(torch.float32), (128, 128), torch.float32
            ).to(torch.float64)
        for e in range(experts):
            for w, (n, k) in V4_EXPERTS.items():
                seed += 1
                name = f"{p}ffn.experts.{e}.{w}"
                codes = random_codes((n, k), seed)
                if (i, e, w) == (0, 0, "w2"):
                    codes[:128] = 0  # an all-zero block (and rows): requantized exactly
                scale = random_e8m0((n, k // 32), seed, scale_low, scale_low + 12)
                tensors[name + ".weight"] = pack_nibbles(codes).view(torch.int8)
                tensors[name + ".scale"] = scale.view(torch.float8_e8m0fnu)
                truth[name + ".weight"] = group_scaled(e2m1_value(codes), e8m0_value(scale), 32)
    write_checkpoint(path, tensors, v4_config() if config is None else config, shards=shards)
    return tensors, truth


def packed_builders_ct_config(fmt: str, weights: dict) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "format": fmt}
    qc = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }
    return {"model_type": "deepseek_v3", "torch_dtype": "bfloat16", "quantization_config": qc}


INT4_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}


def build_int4(path, shapes: dict[str, tuple[int, int]], seed: int = 0):
    tensors, truth = {"lm_head.weight": torch.randn(8, 64).to(torch.bfloat16)}, {}
    for i, (base, (n, k)) in enumerate(shapes.items()):
        codes = random_codes((n, k), seed + i)
        scale = (torch.rand(n, k // 32, generator=torch.Generator().manual_seed(i)) + 0.01).to(torch.bfloat16)
        tensors[base + ".weight_packed"] = pack_int32(codes)
        tensors[base + ".weight_scale"] = scale
        tensors[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        truth[base + ".weight"] = group_scaled(codes.to(torch.float64) - 8, scale.to(torch.float64), 32)
    write_checkpoint(path, tensors, packed_builders_ct_config("pack-quantized", INT4_WEIGHTS), shards=2)
    return tensors, truth


def build_nvfp4(path, shapes, global_scale: float, modelopt: bool = False):
    tensors, truth = {}, {}
    global_scale = float(torch.tensor(global_scale, dtype=torch.float32))  # the value stored
    for i, (base, (n, k)) in enumerate(shapes.items()):
        codes = random_codes((n, k), 10 + i)
        scale = random_e4m3_scales((n, k // 16), i)
        scale[0, 0] = 0.0  # an all-zero group's scale (amax / 6 = 0) is legal
        exact = group_scaled(e2m1_value(codes), scale.to(torch.float64), 16)
        if modelopt:
            tensors[base + ".weight"] = pack_nibbles(codes)
            tensors[base + ".weight_scale_2"] = torch.tensor(global_scale)
            tensors[base + ".input_scale"] = torch.tensor(1.0)
            truth[base + ".weight"] = exact * global_scale
        else:
            tensors[base + ".weight_packed"] = pack_nibbles(codes)
            tensors[base + ".weight_global_scale"] = torch.tensor([global_scale])
            tensors[base + ".input_global_scale"] = torch.tensor([1.0])
            truth[base + ".weight"] = exact / global_scale
        tensors[base + ".weight_scale"] = scale
    if modelopt:
        qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
        config = {"model_type": "llama", "torch_dtype": "bfloat16", "quantization_config": qc}
    else:
        config = packed_builders_ct_config("nvfp4-pack-quantized", NVFP4_WEIGHTS)
    write_checkpoint(path, tensors, config, shards=2)
    return tensors, truth


NVFP4_SHAPES = {"model.layers.0.self_attn.q_proj": (24, 64), "model.layers.0.mlp.down_proj": (64, 48)}
