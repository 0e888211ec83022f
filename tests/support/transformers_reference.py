"""Shared by several test modules (carried out of tests/cli/test_engines.py)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 7, 42, 3, 99, 250, 17, 5]])

MTP_PREFIX = "model.layers.2."  # transformers' DeepseekV3 has no MTP layer: it reports these as unexpected


def reference_model_dir(tmp_path, ckpt_path, dequantized: dict[str, torch.Tensor]):
    """The same model with plain bf16 weights computed by the tests' own reference, no quantization."""
    from safetensors.torch import save_file

    ref = tmp_path / "reference-model"
    ref.mkdir()
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt_path / "config.json").read_text())
    config.pop("quantization_config", None)
    (ref / "config.json").write_text(json.dumps(config))
    return ref


def transformers_logits(path, dtype=torch.bfloat16, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, output_loading_info=True, **kwargs
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(MTP_PREFIX) for k in info["unexpected_keys"]), info["unexpected_keys"]
    with torch.no_grad():
        return model(TOKENS).logits.float()
