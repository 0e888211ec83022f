"""Tiny checkpoints in the layouts of late-2026 releases (../shared/RELEASES-LATE-2026.md), built from the
facts and the loaders' code, never with fp8conv's: each builder returns the exact decode by name.

- Inkling (RedHatAI/Inkling-FP8-dynamic): transformers' own InklingForConditionalGeneration, saved (so in
  the release's names: `model.llm.layers.N.mlp.experts.w13_weight` [E, 2I, H] with gate and up rows
  interleaved, reverted by transformers' conversion mapping on save), then quantized as llm-compressor's
  model_free_ptq FP8_DYNAMIC does it: per-row amax / 448 channel FP8, a 2-D `X.weight` with
  `X.weight_scale` [N, 1], a 3-D fused parameter `P` with `P_scale` [E, out, 1] (the flat spelling vLLM's
  Inkling mapper passes through); the model card's ignore list (unembed, embed, norms, attention, gates,
  convolutions, towers) stays bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.reference import quantize_reference

FP8 = torch.float8_e4m3fn
INKLING_IGNORE = [
    "model.llm.unembed",
    "model.llm.embed",
    "re:.*norm.*",
    "re:.*bias$",
    "re:.*\\.attn$",
    "re:.*\\.attn\\..*",
    "re:.*sconv$",
    "re:.*gate.*",
    "re:.*global_scale$",
    "re:model\\.visual\\..*",
    "re:model\\.audio\\..*",
]
# what the release quantizes: the dense MLP (2-D) and the routed and shared experts (3-D, fused)
INKLING_FP8 = (
    "mlp.w13_dn.weight",
    "mlp.w2_md.weight",
    "experts.w13_weight",
    "experts.w2_weight",
    "_w13_weight",
    "_w2_weight",
)


def inkling_model(path: Path):
    """A tiny InklingForConditionalGeneration (one dense layer, one MoE layer of 4 experts and a shared
    one, expert width 192: 1.5 blocks of 128), saved by transformers in the release's names."""
    from transformers.models.inkling import configuration_inkling as c
    from transformers.models.inkling import modeling_inkling as m

    text = {
        "vocab_size": 256,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 32,
        "intermediate_size": 256,
        "moe_intermediate_size": 192,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "d_rel": 8,
        "rel_extent": 64,
        "sliding_window_size": 16,
        "mlp_layer_types": ["dense", "sparse"],
    }
    vision = {
        "text_hidden_size": 128,
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 4,
    }
    audio = {"text_hidden_size": 128, "n_mel_bins": 8, "mel_vocab_size": 16}
    config = c.InklingConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        image_token_id=250,
        audio_token_id=251,
        image_bos_token_id=252,
        audio_bos_token_id=253,
    )
    torch.manual_seed(11)
    model = m.InklingForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return model


def build_inkling_fp8(path: Path) -> dict[str, torch.Tensor]:
    """The release: channel FP8 where model_free_ptq puts it, bf16 elsewhere. Returns every tensor's exact
    value (float32(q) * float32(scale) for FP8, the bf16 tensor otherwise)."""
    from safetensors.torch import load_file, save_file

    inkling_model(path)
    tensors = load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.to(torch.bfloat16) if t.is_floating_point() else t
        if not name.endswith(INKLING_FP8):
            out[name], truth[name] = t, t
            continue
        w = t.to(torch.float32) * 3  # weights of the size FP8 is for (transformers initializes at 0.02)
        rows = w.reshape(-1, w.shape[-1])
        q, scale = quantize_reference(rows, None)
        out[name] = q.reshape(w.shape)
        out[name + "_scale"] = scale.reshape(*w.shape[:-1], 1)  # X.weight -> X.weight_scale; P -> P_scale
        truth[name] = q.to(torch.float32).reshape(w.shape) * scale.reshape(*w.shape[:-1], 1)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                },
            }
        },
        "ignore": INKLING_IGNORE,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return truth
