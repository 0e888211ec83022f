"""Tiny random models built with transformers, then quantized by this file's own code to the block FP8
layouts the published checkpoints have (DeepSeek-V3, Qwen3-30B-A3B-FP8, Qwen3-8B-FP8): every Linear of
the decoder layers as float8_e4m3fn `X.weight` plus float32 `X.weight_scale_inv` [ceil(N/128), ceil(K/128)]
(zero-padded to whole blocks for the amax, cropped after); embeddings, norms, lm_head and the MoE
routers stay bf16; DeepSeek's e_score_correction_bias is float32. Two shards and an index."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0

# The keys published DeepSeek-V3 configs have and transformers 5 does not write (vLLM needs them).
DEEPSEEK_PUBLISHED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _config(kind: str):
    import transformers

    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=2, max_position_embeddings=256)
    common.update(tie_word_embeddings=False, initializer_range=0.05)
    if kind == "deepseek_v3":
        # q_lora_rank 128: vLLM fuses q_a_proj with kv_a_proj_with_mqa, so block FP8 needs whole blocks there.
        # 4 heads of 64 + 64 (rope): q_b_proj, kv_b_proj and o_proj are whole blocks per TP-2 rank, as the
        # published 128 heads are; moe 192 and dense 384 are not: what --pad-for-tp 2 fixes.
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=384,
            moe_intermediate_size=192,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            kv_lora_rank=512,
            q_lora_rank=128,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=1,
            num_nextn_predict_layers=0,
        )
    # Qwen3: 4 heads and 2 KV heads of 128, so q, k, v and o_proj's input are whole blocks per TP-2 rank.
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            intermediate_size=384,
            moe_intermediate_size=192,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
        )
    if kind == "qwen3":
        return transformers.Qwen3Config(
            **common, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=128
        )
    raise ValueError(kind)


KINDS = ("deepseek_v3", "qwen3_moe", "qwen3")


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    gn, gk = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = torch.zeros(gn * BLOCK, gk * BLOCK)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, BLOCK, gk, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * BLOCK, gk * BLOCK)[:n, :k].contiguous(), scale


def _quantized(name: str, t: torch.Tensor) -> bool:
    """Every Linear of the decoder layers but the MoE router (`mlp.gate`), as the published files have it."""
    return name.startswith("model.layers.") and t.dim() == 2 and not name.endswith("mlp.gate.weight")


def build_fp8(kind: str, root: Path, seed: int = 0) -> Path:
    """The published block FP8 layout of a random tiny `kind` model, in root/<kind>-fp8."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).to(torch.bfloat16)
    if kind == "deepseek_v3":  # transformers starts the bias at zero: make the router's correction matter
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.data.uniform_(-0.05, 0.05)
    src = root / f"{kind}-transformers"
    model.save_pretrained(src)
    tensors = {}
    for name, t in load_file(src / "model.safetensors").items():
        if _quantized(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_block(t)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = t.float()
        else:
            tensors[name] = t
    out = root / f"{kind}-fp8"
    out.mkdir()
    names = sorted(tensors)
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = json.loads((src / "config.json").read_text())
    if kind == "deepseek_v3":
        config.update(DEEPSEEK_PUBLISHED)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
