"""Shared by several test modules (carried out of tests/model/test_modelopt.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.helpers import write_checkpoint
from tests.support.packing import e2m1_value, group_scaled, pack_nibbles, random_codes, random_e4m3_scales

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 7, 42, 3, 99, 120, 17, 5]])

EXCLUDED = ["lm_head"]

PRODUCER = {"name": "modelopt", "version": "0.29.0"}


def tiny_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def build_modelopt(path, qconfig: dict | None, sidecar: dict | None) -> dict[str, torch.Tensor]:
    """Every Linear but lm_head ModelOpt NVFP4 (uint8 [N, K/2] low nibble first, e4m3 [N, K/16],
    float32 weight_scale_2, input_scale); returns the reference state dict (decoded by definition)."""
    config = tiny_llama()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    reference = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors = dict(reference)
    for i, (name, t) in enumerate(sorted(reference.items())):
        if t.dim() != 2 or not name.endswith("_proj.weight"):
            continue
        base, (n, k) = name.removesuffix(".weight"), t.shape
        codes = random_codes((n, k), 300 + i)
        scale = random_e4m3_scales((n, k // 16), 300 + i)
        global_scale = float(torch.tensor(1 / 2688.0 / (1 + i), dtype=torch.float32))
        tensors[name] = pack_nibbles(codes)
        tensors[base + ".weight_scale"] = scale
        tensors[base + ".weight_scale_2"] = torch.tensor(global_scale)
        tensors[base + ".input_scale"] = torch.tensor(0.25)
        # e2m1 x e4m3 is exact in float64; x weight_scale_2 rounded once to float32, then once to bf16
        value = group_scaled(e2m1_value(codes), scale.to(torch.float64), 16) * global_scale
        reference[name] = value.to(torch.float32).to(torch.bfloat16)
    config.save_pretrained(path)
    document = json.loads((path / "config.json").read_text())
    if qconfig is not None:
        document["quantization_config"] = qconfig
    write_checkpoint(path, tensors, document, shards=2)
    if sidecar is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(sidecar))
    return reference


def modelopt_logits(path) -> torch.Tensor:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # an input_scale left in the output is an unexpected key
    with torch.no_grad():
        return model(TOKENS).logits
