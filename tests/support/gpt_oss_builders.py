"""Shared by several test modules (carried out of tests/rewrite/test_gpt_oss_bands.py)."""

from __future__ import annotations

import torch

from tests.support.helpers import write_checkpoint
from tests.support.packing import e2m1_value, e8m0_value, group_scaled, pack_nibbles, random_codes, random_e8m0

GPT_OSS_CONFIG = {
    "model_type": "gpt_oss",
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.router"]},
}

GPT_OSS_SHAPES = {  # [E, N, K] as stored: N odd, K = 3 groups; several experts; one expert too small to stream
    "model.layers.0.mlp.experts.gate_up_proj": (3, 37, 96),
    "model.layers.0.mlp.experts.down_proj": (5, 64, 64),
    "model.layers.1.mlp.experts.gate_up_proj": (1, 8, 32),
}


def build_gpt_oss(path, shapes: dict[str, tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """The checkpoint over two shards (each scale in the other shard than its blocks); returns the float64
    value of every expert tensor as transformers holds it, [E, K, N], from the definitions."""
    tensors, truth = {}, {}
    for seed, (name, (e, n, k)) in enumerate(shapes.items()):
        codes = random_codes((e, n, k), seed)
        scales = random_e8m0((e, n, k // 32), seed, 100, 150)
        tensors[name + "_blocks"] = pack_nibbles(codes).reshape(e, n, k // 32, 16)
        tensors[name + "_scales"] = scales
        truth[name] = group_scaled(e2m1_value(codes), e8m0_value(scales), 32).transpose(1, 2)
    tensors["model.layers.0.mlp.router.weight"] = torch.randn(3, 37).to(torch.bfloat16)
    write_checkpoint(path, tensors, GPT_OSS_CONFIG, shards=2)
    return truth
