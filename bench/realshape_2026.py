"""Header-only checkpoints of the 2026 releases at their REAL shapes (shared/RELEASES-2026.md), for the
real-shape sweep: `fp8conv inspect` (and --json) and `convert --dry-run` to every target.

Each layout uses the release's config values where the note gives them (C/S) and inferred values
(marked I below) where it does not; layer counts are the real ones unless a cut keeps the per-layer
pattern (then num_hidden_layers says the cut). Written with bench/plan_scale.py's header writer.

    python bench/realshape_2026.py --list
    python bench/realshape_2026.py --build LAYOUT DIR
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_scale import Tensor, bf16, fp8, write_header_only
from plan_scale import layout as bench_layout

Layout = tuple[list[Tensor], dict, dict[str, dict]]  # tensors, config.json, extra JSON files


def f32(name: str, shape: tuple[int, ...]) -> list[Tensor]:
    return [(name, "F32", shape)]


def per_tensor(name: str, shape: tuple[int, ...], scale: str = "weight_scale", act: str | None = "input_scale"):
    out = [(name + ".weight", "F8_E4M3", shape), (name + "." + scale, "F32", ())]
    return out + ([(name + "." + act, "F32", ())] if act else [])


def channel(name: str, shape: tuple[int, int], scale_dtype: str = "BF16") -> list[Tensor]:
    return [(name + ".weight", "F8_E4M3", shape), (name + ".weight_scale", scale_dtype, (shape[0], 1))]


def mxfp8(name: str, shape: tuple[int, int], scale: str = "weight_scale_inv") -> list[Tensor]:
    return [(name + ".weight", "F8_E4M3", shape), (name + "." + scale, "U8", (shape[0], shape[1] // 32))]


def modules_of(tensors: list[Tensor], want: Callable[[str, str, tuple[int, ...]], bool]) -> list[str]:
    """Modules (a name less its last part) of tensors ending .weight / .bias that `want` picks, in order."""
    seen: dict[str, None] = {}
    for name, dtype, shape in tensors:
        if name.endswith((".weight", ".bias")) and want(name, dtype, shape):
            seen.setdefault(name.rsplit(".", 1)[0], None)
    return list(seen)


def _bf16_modules(tensors: list[Tensor]) -> list[str]:
    return modules_of(tensors, lambda n, d, s: d in ("BF16", "F32") and "experts." not in n)


# ---------------------------------------------------------------------------------------------------
# Qwen3.5 / 3.6 / 3.8 (qwen3_5_moe, qwen3_5): hybrid gated-delta-net 3 : 1 full attention


def _qwen_layer(p: str, g: dict, full: bool, moe: bool, scale: str = "BF16") -> Iterator[Tensor]:
    h = g["hidden"]
    yield from bf16(p + "input_layernorm.weight", (h,))
    yield from bf16(p + "post_attention_layernorm.weight", (h,))
    if full:
        hd = g["head_dim"]
        yield from fp8(p + "self_attn.q_proj", (2 * g["heads"] * hd, h), scale)  # attn_output_gate
        yield from fp8(p + "self_attn.k_proj", (g["kv"] * hd, h), scale)
        yield from fp8(p + "self_attn.v_proj", (g["kv"] * hd, h), scale)
        yield from fp8(p + "self_attn.o_proj", (h, g["heads"] * hd), scale)
        yield from bf16(p + "self_attn.q_norm.weight", (hd,))
        yield from bf16(p + "self_attn.k_norm.weight", (hd,))
    else:
        a = p + "linear_attn."
        key, value, vh = g["lk"] * 128, g["lv"] * 128, g["lv"]
        yield from fp8(a + "in_proj_qkv", (2 * key + value, h), scale)
        yield from fp8(a + "in_proj_z", (value, h), scale)
        yield from bf16(a + "in_proj_b.weight", (vh, h))
        yield from bf16(a + "in_proj_a.weight", (vh, h))
        yield from bf16(a + "conv1d.weight", (2 * key + value, 1, 4))
        yield from fp8(a + "out_proj", (h, value), scale)
        yield from f32(a + "A_log", (vh,))
        yield from bf16(a + "dt_bias", (vh,))
        yield from bf16(a + "norm.weight", (128,))
    if not moe:
        i = g["inter"]
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from fp8(p + "mlp." + proj, shape, scale)
        return
    i, s = g["moe"], g["shared"]
    yield from bf16(p + "mlp.gate.weight", (g["experts"], h))
    for e in range(g["experts"]):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from fp8(f"{p}mlp.experts.{e}.{proj}", shape, scale)
    for proj, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
        yield from fp8(f"{p}mlp.shared_expert.{proj}", shape, scale)
    yield from bf16(p + "mlp.shared_expert_gate.weight", (1, h))


def _qwen_vision(out_hidden: int) -> list[Tensor]:
    """Qwen3.5's vision tower: depth 27, hidden 1152, intermediate 4304, patch 16, merge 2 (333 tensors)."""
    vh, vi = 1152, 4304
    out = bf16("model.visual.patch_embed.proj.weight", (vh, 3, 2, 16, 16)) + bf16(
        "model.visual.patch_embed.proj.bias", (vh,)
    )
    out += bf16("model.visual.pos_embed.weight", (2304, vh))
    for b in range(27):
        v = f"model.visual.blocks.{b}."
        for name, shape in (
            ("attn.qkv", (3 * vh, vh)),
            ("attn.proj", (vh, vh)),
            ("mlp.linear_fc1", (vi, vh)),
            ("mlp.linear_fc2", (vh, vi)),
        ):
            out += bf16(v + name + ".weight", shape) + bf16(v + name + ".bias", (shape[0],))
        for norm in ("norm1", "norm2"):
            out += bf16(v + norm + ".weight", (vh,)) + bf16(v + norm + ".bias", (vh,))
    m = "model.visual.merger."
    out += bf16(m + "norm.weight", (vh,)) + bf16(m + "norm.bias", (vh,))
    out += bf16(m + "linear_fc1.weight", (4 * vh, 4 * vh)) + bf16(m + "linear_fc1.bias", (4 * vh,))
    out += bf16(m + "linear_fc2.weight", (out_hidden, 4 * vh)) + bf16(m + "linear_fc2.bias", (out_hidden,))
    return out


def qwen3_5(g: dict, moe: bool, vision: bool, text_only: bool = False) -> Layout:
    h, layers = g["hidden"], g["layers"]
    lm = "model." if text_only else "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (g["vocab"], h))
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    for i in range(layers):
        tensors += _qwen_layer(f"{lm}layers.{i}.", g, types[i] == "full_attention", moe)
    tensors += bf16(lm + "norm.weight", (h,)) + bf16("lm_head.weight", (g["vocab"], h))
    tensors += _qwen_layer("mtp.layers.0.", g, True, moe)
    tensors += bf16("mtp.fc.weight", (h, 2 * h))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors += bf16(f"mtp.{norm}.weight", (h,))
    if vision:
        tensors += _qwen_vision(h)
    text = {
        "model_type": ("qwen3_5_moe_text" if moe else "qwen3_5_text"),
        "hidden_size": h,
        "num_hidden_layers": layers,
        "layer_types": types,
        "full_attention_interval": 4,
        "num_attention_heads": g["heads"],
        "num_key_value_heads": g["kv"],
        "head_dim": g["head_dim"],
        "attn_output_gate": True,
        "linear_num_key_heads": g["lk"],
        "linear_num_value_heads": g["lv"],
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1,
        "vocab_size": g["vocab"],
        "rms_norm_eps": 1e-6,
        "dtype": "bfloat16",
    }
    if moe:
        text |= {"moe_intermediate_size": g["moe"], "shared_expert_intermediate_size": g["shared"]}
        text |= {"num_experts": g["experts"], "num_experts_per_tok": g["topk"]}
    else:
        text["intermediate_size"] = g["inter"]
    ignore = _bf16_modules(tensors)
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ignore,
    }
    if text_only:
        config = {"architectures": ["Qwen3_5MoeForCausalLM"], **text, "quantization_config": quant}
        return tensors, config, {}
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    vcfg = {"model_type": kind, "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": h}
    vcfg |= {"num_heads": 16, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = {"architectures": [arch], "model_type": kind, "text_config": text, "vision_config": vcfg}
    config |= {"image_token_id": 248056, "quantization_config": quant}
    return tensors, config, {}


QWEN_397B = dict(hidden=4096, layers=60, moe=1024, shared=1024, experts=512, topk=10, heads=32, kv=2)
QWEN_397B |= dict(head_dim=256, lk=16, lv=64, vocab=248320)
QWEN_35B = dict(hidden=2048, layers=40, moe=512, shared=512, experts=256, topk=8, heads=16, kv=2)
QWEN_35B |= dict(head_dim=256, lk=16, lv=32, vocab=248320)
QWEN_27B = dict(hidden=5120, layers=64, inter=17408, heads=24, kv=4, head_dim=256, lk=16, lv=48, vocab=248320)
# Qwen3.8-2.4T-A95B: 92 layers (69 linear), 512 experts (S); hidden 8192 / moe 2048 / heads (I, from 2.4T)
QWEN_2T = dict(hidden=8192, layers=92, moe=2048, shared=2048, experts=512, topk=16, heads=64, kv=4)
QWEN_2T |= dict(head_dim=256, lk=16, lv=64, vocab=248320)


# ---------------------------------------------------------------------------------------------------
# GLM-5.2 (glm_moe_dsa): bench/plan_scale's tensors (118,629), the release's full config


def glm52() -> Layout:
    tensors, _ = bench_layout("glm5.2")
    indexer_layers = [i for i in range(78) if i < 3 or (i >= 6 and i % 4 == 2)]
    ignore = ["model.embed_tokens", "lm_head"]
    ignore += [f"model.layers.{i}.self_attn.indexers_proj" for i in range(79)]
    ignore += [f"model.layers.{i}.mlp.gate" for i in range(3, 79)]
    ignore += [m for m in _bf16_modules(tensors) if "norm" in m][:400]
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ignore,
    }
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "index_topk": 2048,
        "index_topk_freq": 4,
        "indexer_types": ["full" if i in indexer_layers else "shared" for i in range(78)],
        "vocab_size": 154880,
        "max_position_embeddings": 1048576,
        "dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# MiniMax-M3-MXFP8 (minimax_m3_vl): 60 layers, 3 dense + 57 MoE, top-4 + 1 shared (S); hidden 6144, 128 experts
# of 3072, dense 12288, shared 3072 (shared_intermediate_size), 64 heads / 4 KV x 128 (transformers 5.24 defaults)


def minimax_m3() -> Layout:
    h, i, dense, experts, heads, kv, hd, vocab = 6144, 3072, 12288, 128, 64, 4, 128, 200064
    lm = "language_model.model."
    tensors = bf16(lm + "embed_tokens.weight", (vocab, h))
    for layer in range(60):
        p = f"{lm}layers.{layer}."
        tensors += bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        a = p + "self_attn."
        for proj, shape in (("q_proj", (heads * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h))):
            tensors += mxfp8(a + proj, shape)
        tensors += mxfp8(a + "o_proj", (h, heads * hd))
        tensors += bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        tensors += bf16(a + "index_q_proj.weight", (32 * 128, h)) + bf16(a + "index_k_proj.weight", (128, h))
        tensors += bf16(a + "index_q_norm.weight", (128,)) + bf16(a + "index_k_norm.weight", (128,))
        if layer < 3:
            for proj, shape in (("gate_proj", (dense, h)), ("up_proj", (dense, h)), ("down_proj", (h, dense))):
                tensors += mxfp8(p + "mlp." + proj, shape)
            continue
        m = p + "block_sparse_moe."
        tensors += f32(m + "gate.weight", (experts, h)) + f32(m + "e_score_correction_bias", (experts,))
        for e in range(experts):
            for w, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
                tensors += mxfp8(f"{m}experts.{e}.{w}", shape)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            tensors += mxfp8(f"{m}shared_experts.{proj}", shape)
    tensors += bf16(lm + "norm.weight", (h,)) + bf16("language_model.lm_head.weight", (vocab, h))
    vh, vi = 1280, 5120
    for b in range(32):
        v = f"vision_tower.vision_model.encoder.layers.{b}."
        for name, shape in (
            ("self_attn.q_proj", (vh, vh)),
            ("self_attn.k_proj", (vh, vh)),
            ("self_attn.v_proj", (vh, vh)),
            ("self_attn.out_proj", (vh, vh)),
            ("mlp.fc1", (vi, vh)),
            ("mlp.fc2", (vh, vi)),
        ):
            tensors += bf16(v + name + ".weight", shape) + bf16(v + name + ".bias", (shape[0],))
        for norm in ("layer_norm1", "layer_norm2"):
            tensors += bf16(v + norm + ".weight", (vh,)) + bf16(v + norm + ".bias", (vh,))
    tensors += bf16("vision_tower.vision_model.embeddings.patch_embedding.weight", (vh, 3, 14, 14))
    tensors += bf16("patch_merge_mlp.linear_1.weight", (4 * vh, 4 * vh)) + bf16(
        "patch_merge_mlp.linear_2.weight", (vh, 4 * vh)
    )
    tensors += bf16("multi_modal_projector.linear_1.weight", (h, vh)) + bf16(
        "multi_modal_projector.linear_2.weight", (h, h)
    )
    ignored = _bf16_modules(tensors)
    quant = {"quant_method": "mxfp8", "ignored_layers": ignored}
    text = {
        "architectures": ["MiniMaxM3ForCausalLM"],
        "hidden_size": h,
        "intermediate_size": i,
        "dense_intermediate_size": dense,
        "shared_intermediate_size": i,
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 57,
        "first_k_dense_replace": 3,
        "num_hidden_layers": 60,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": vocab,
    }
    config = {"architectures": ["MiniMaxM3VLForConditionalGeneration"], "model_type": "minimax_m3_vl"}
    config |= {"text_config": text, "vision_config": {"hidden_size": vh}, "quantization_config": quant}
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# Nemotron-3 Super 120B-A12B FP8 (nemotron_h, ModelOpt FP8 per-tensor): names C; widths I


NEMOTRON_SUPER = dict(h=4096, layers=88, experts=512, latent=1024, moe_i=2688, shared_i=5376, mamba_heads=128)
NEMOTRON_SUPER |= dict(pattern=("MEMEMEM*E" * 10)[:88])
# Nemotron-3-Nano-30B-A3B: hidden 2688, 52 layers, 128 experts of 1856 + a shared 3712, no latent (I)
NEMOTRON_NANO = dict(h=2688, layers=52, experts=128, latent=None, moe_i=1856, shared_i=3712, mamba_heads=64)
NEMOTRON_NANO |= dict(pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")


def nemotron3_super(kv_scales: bool = True, g: dict = NEMOTRON_SUPER) -> Layout:
    h, layers, experts, latent, moe_i, shared_i = (
        g["h"],
        g["layers"],
        g["experts"],
        g["latent"],
        g["moe_i"],
        g["shared_i"],
    )
    mamba_heads, mamba_hd, state, groups = g["mamba_heads"], 64, 128, 8
    heads, kv, hd, vocab = 32, 2, 128, 131072
    d_inner = mamba_heads * mamba_hd
    pattern = g["pattern"]  # Mamba / (latent) MoE / attention
    tensors = bf16("backbone.embeddings.weight", (vocab, h))

    def attention(p: str) -> list[Tensor]:
        out: list[Tensor] = []
        for proj, shape in (("q_proj", (heads * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h))):
            out += per_tensor(p + proj, shape)
        out += per_tensor(p + "o_proj", (h, heads * hd))
        if kv_scales:
            out += f32(p + "k_proj.k_scale", ()) + f32(p + "v_proj.v_scale", ())
        return out

    def moe(p: str) -> list[Tensor]:
        out = f32(p + "gate.weight", (experts, h)) + f32(p + "gate.e_score_correction_bias", (experts,))
        for e in range(experts):
            out += per_tensor(f"{p}experts.{e}.up_proj", (moe_i, latent or h))
            out += per_tensor(f"{p}experts.{e}.down_proj", (latent or h, moe_i))
        out += per_tensor(p + "shared_experts.up_proj", (shared_i, h))
        out += per_tensor(p + "shared_experts.down_proj", (h, shared_i))
        if latent:
            out += bf16(p + "fc1_latent_proj.weight", (latent, h)) + bf16(p + "fc2_latent_proj.weight", (h, latent))
        return out

    for layer, kind in enumerate(pattern):
        p = f"backbone.layers.{layer}."
        tensors += bf16(p + "norm.weight", (h,))
        m = p + "mixer."
        if kind == "M":
            conv = d_inner + 2 * groups * state
            tensors += per_tensor(m + "in_proj", (2 * d_inner + 2 * groups * state + mamba_heads, h))
            tensors += bf16(m + "conv1d.weight", (conv, 1, 4)) + bf16(m + "conv1d.bias", (conv,))
            for small in ("A_log", "D", "dt_bias"):
                tensors += f32(m + small, (mamba_heads,))
            tensors += bf16(m + "norm.weight", (d_inner,))
            tensors += per_tensor(m + "out_proj", (h, d_inner))
        elif kind == "*":
            tensors += attention(m)
        else:
            tensors += moe(m)
    tensors += bf16("backbone.norm_f.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    for i, kind in enumerate("*E"):  # the MTP block (mtp_hybrid_override_pattern "*E", I)
        p = f"mtp.layers.{i}."
        tensors += bf16(p + "norm.weight", (h,))
        tensors += attention(p + "mixer.") if kind == "*" else moe(p + "mixer.")
    tensors += bf16("mtp.layers.0.enorm.weight", (h,)) + bf16("mtp.layers.0.hnorm.weight", (h,))
    tensors += bf16("mtp.layers.0.eh_proj.weight", (h, 2 * h)) + bf16("mtp.layers.1.final_layernorm.weight", (h,))
    exclude = ["lm_head", "backbone.embeddings"] + [
        m for m in _bf16_modules(tensors) if m.endswith("mixer.gate") or "latent" in m or "eh_proj" in m
    ]
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_scales else None, "exclude_modules": exclude}
    sidecar = {"producer": {"name": "modelopt", "version": "0.39.0"}, "quantization": quant}
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "hybrid_override_pattern": pattern,
        "mtp_hybrid_override_pattern": "*E",
        "intermediate_size": 21504,
        "moe_intermediate_size": moe_i,
        "moe_shared_expert_intermediate_size": shared_i,
        "moe_latent_size": latent,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 22,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "mamba_num_heads": mamba_heads,
        "mamba_head_dim": mamba_hd,
        "ssm_state_size": state,
        "n_groups": groups,
        "conv_kernel": 4,
        "num_nextn_predict_layers": 1,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "modelopt", **quant},
    }
    return tensors, config, {"hf_quant_config.json": sidecar}


# ---------------------------------------------------------------------------------------------------
# Step-3.5-Flash-FP8 (step3p5): 45 layers, hidden 4096, 11264 dense, 288 experts x 1280 stacked 3-D,
# share_expert_dim 1280 (C/S); 64 heads / 8 groups x 128, first 3 layers dense, 3 MTP layers (I)


def step3p5() -> Layout:
    h, layers, inter, moe_i, experts, heads, groups, hd, vocab = 4096, 45, 11264, 1280, 288, 64, 8, 128, 128896
    tensors = bf16("model.embed_tokens.weight", (vocab, h))

    def stacked(name: str, e: int, n: int, k: int) -> list[Tensor]:
        grid = (e, math.ceil(n / 128), math.ceil(k / 128))
        return [(name + ".weight", "F8_E4M3", (e, n, k)), (name + ".weight_scale_inv", "F32", grid)]

    def layer(p: str, moe: bool, mtp: bool) -> list[Tensor]:
        out = bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        a = p + "self_attn."
        out += (
            fp8(a + "q_proj", (heads * hd, h))
            + fp8(a + "k_proj", (groups * hd, h))
            + fp8(a + "v_proj", (groups * hd, h))
        )
        out += fp8(a + "o_proj", (h, heads * hd)) + bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        out += bf16(a + "g_proj.weight", (heads, h))
        if not moe:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out += fp8(p + "mlp." + proj, shape)
        else:
            out += f32(p + "moe.gate.weight", (experts, h)) + f32(p + "moe.router_bias", (experts,))
            out += stacked(p + "moe.gate_proj", experts, moe_i, h) + stacked(p + "moe.up_proj", experts, moe_i, h)
            out += stacked(p + "moe.down_proj", experts, h, moe_i)
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                out += fp8(p + "share_expert." + proj, shape)
        if mtp:
            out += bf16(p + "eh_proj.weight", (h, 2 * h))
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                out += bf16(p + norm + ".weight", (h,))
            out += bf16(p + "shared_head.output.weight", (vocab, h))
        return out

    for i in range(layers + 3):
        tensors += layer(f"model.layers.{i}.", i >= 3, i >= layers)
    tensors += bf16("model.norm.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    ignore = [m for m in _bf16_modules(tensors) if "norm" not in m]
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ignore,
    }
    config = {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": h,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_i,
        "share_expert_dim": moe_i,
        "moe_num_experts": experts,
        "moe_top_k": 8,
        "moe_layers_enum": ",".join(str(i) for i in range(3, layers)),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 3,
        "num_attention_heads": heads,
        "num_attention_groups": groups,
        "head_dim": hd,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# MiMo-V2-Flash (mimo_v2_flash, native block FP8): kv 4 / SWA kv 8, head_dim 192, v 128 (S); hidden 4096,
# 48 layers (5 SWA : 1 full), 256 experts x 2048, dense layer 0 of 16384, 64 heads, 3 MTP layers (I).
# Per-head fused K/V scales (k rows kv*2, v rows kv*1) on the full-attention layers and the MTP layers.


def mimo_v2_flash() -> Layout:
    h, layers, moe_i, inter, experts, hd, vhd, vocab = 4096, 48, 2048, 16384, 256, 192, 128, 152576
    pattern = [0 if i % 6 == 0 else 1 for i in range(layers)]  # 1: sliding window; layer 0 full (I)
    tensors = bf16("model.embed_tokens.weight", (vocab, h))

    def attention(a: str, swa: bool, per_head: bool) -> list[Tensor]:
        heads, kv = (64, 8) if swa else (64, 4)
        out = fp8(a + "q_proj", (heads * hd, h)) + fp8(a + "o_proj", (h, heads * vhd))
        if per_head:
            out += [
                (a + "k_proj.weight", "F8_E4M3", (kv * hd, h)),
                (a + "k_proj.weight_scale_inv", "F32", (kv * 2, 32)),
            ]
            out += [
                (a + "v_proj.weight", "F8_E4M3", (kv * vhd, h)),
                (a + "v_proj.weight_scale_inv", "F32", (kv * 1, 32)),
            ]
        else:
            out += fp8(a + "k_proj", (kv * hd, h)) + fp8(a + "v_proj", (kv * vhd, h))
        if swa:
            out += f32(a + "attention_sink_bias", (heads,))
        return out

    def layer(p: str, swa: bool, moe: bool) -> list[Tensor]:
        out = bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        out += attention(p + "self_attn.", swa, per_head=not swa)
        if not moe:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out += fp8(p + "mlp." + proj, shape)
            return out
        out += f32(p + "mlp.gate.weight", (experts, h)) + f32(p + "mlp.gate.e_score_correction_bias", (experts,))
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                out += fp8(f"{p}mlp.experts.{e}.{proj}", shape)
        return out

    for i in range(layers):
        tensors += layer(f"model.layers.{i}.", pattern[i] == 1, i > 0)
    tensors += bf16("model.norm.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    for i in range(3):
        p = f"model.mtp.layers.{i}."
        tensors += bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        tensors += attention(p + "self_attn.", True, per_head=False)
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            tensors += fp8(p + "mlp." + proj, shape)
        tensors += (
            bf16(p + "eh_proj.weight", (h, 2 * h)) + bf16(p + "enorm.weight", (h,)) + bf16(p + "hnorm.weight", (h,))
        )
        tensors += bf16(p + "final_layernorm.weight", (h,))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quant["ignored_layers"] = [m for m in _bf16_modules(tensors) if "norm" not in m]
    config = {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_i,
        "n_routed_experts": experts,
        "num_experts_per_tok": 8,
        "moe_layer_freq": [0] + [1] * (layers - 1),
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": hd,
        "v_head_dim": vhd,
        "swa_num_attention_heads": 64,
        "swa_num_key_value_heads": 8,
        "swa_head_dim": hd,
        "swa_v_head_dim": vhd,
        "hybrid_layer_pattern": pattern,
        "num_nextn_predict_layers": 3,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# Mistral-Small-4-119B-2603 (mistral4, HF format): per-tensor FP8, fused 3-D experts with a scale per
# gate/up half [E, 2, 1] (S/I); MLA, hidden 4096, 36 layers, 128 experts x 2048 + 1 shared, vision (I)


def mistral_small4() -> Layout:
    h, layers, experts, moe_i, heads, vocab = 4096, 36, 128, 2048, 32, 131072
    lm = "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (vocab, h))

    def pt(name: str, shape: tuple[int, int]) -> list[Tensor]:
        return per_tensor(name, shape, "weight_scale_inv", "activation_scale")

    for layer in range(layers):
        p = f"{lm}layers.{layer}."
        tensors += bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        a = p + "self_attn."
        tensors += pt(a + "q_a_proj", (1024, h)) + bf16(a + "q_a_layernorm.weight", (1024,))
        tensors += pt(a + "q_b_proj", (heads * 128, 1024)) + pt(a + "kv_a_proj_with_mqa", (256 + 64, h))
        tensors += bf16(a + "kv_a_layernorm.weight", (256,)) + pt(a + "kv_b_proj", (heads * 192, 256))
        tensors += pt(a + "o_proj", (h, heads * 128))
        m = p + "mlp."
        tensors += bf16(m + "gate.weight", (experts, h))
        x = m + "experts."
        tensors += [
            (x + "gate_up_proj", "F8_E4M3", (experts, 2 * moe_i, h)),
            (x + "gate_up_proj_scale_inv", "F32", (experts, 2, 1)),
        ]
        tensors += [
            (x + "down_proj", "F8_E4M3", (experts, h, moe_i)),
            (x + "down_proj_scale_inv", "F32", (experts, 1, 1)),
        ]
        tensors += f32(x + "gate_up_proj_activation_scale", (experts,)) + f32(
            x + "down_proj_activation_scale", (experts,)
        )
        for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
            tensors += pt(m + "shared_experts." + proj, shape)
    tensors += bf16(lm + "norm.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    vh, vi = 1024, 4096
    tensors += bf16("model.vision_tower.patch_conv.weight", (vh, 3, 14, 14)) + bf16(
        "model.vision_tower.ln_pre.weight", (vh,)
    )
    for b in range(24):
        v = f"model.vision_tower.transformer.layers.{b}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += bf16(v + "attention." + proj + ".weight", (vh, vh))
        for proj, shape in (("gate_proj", (vi, vh)), ("up_proj", (vi, vh)), ("down_proj", (vh, vi))):
            tensors += bf16(v + "feed_forward." + proj + ".weight", shape)
        tensors += bf16(v + "attention_norm.weight", (vh,)) + bf16(v + "ffn_norm.weight", (vh,))
    tensors += bf16("model.multi_modal_projector.norm.weight", (vh,))
    tensors += bf16("model.multi_modal_projector.patch_merger.merging_layer.weight", (vh, 4 * vh))
    tensors += bf16("model.multi_modal_projector.linear_1.weight", (h, vh)) + bf16(
        "model.multi_modal_projector.linear_2.weight", (h, h)
    )
    quant = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}
    quant["modules_to_not_convert"] = ["lm_head", "model.vision_tower", "model.multi_modal_projector"] + [
        f"{lm}layers.{i}.mlp.gate" for i in range(layers)
    ]
    text = {
        "model_type": "mistral4",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "moe_intermediate_size": moe_i,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 4,
        "num_attention_heads": heads,
        "q_lora_rank": 1024,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": vocab,
    }
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "text_config": text}
    config |= {"vision_config": {"model_type": "pixtral", "hidden_size": vh}, "quantization_config": quant}
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# Hy3-FP8 (hy_v3): names C (mlp.router.gate, mlp.expert_bias, mlp.shared_mlp); sizes transformers 5.24's defaults:
# hidden 4096, 80 layers (first dense 13312), 192 experts x 1536 + 1 shared, 64 heads / 8 KV x 128


def hy3() -> Layout:
    h, layers, inter, moe_i, experts, heads, kv, hd, vocab = 4096, 80, 13312, 1536, 192, 64, 8, 128, 120832
    tensors = bf16("model.embed_tokens.weight", (vocab, h))
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors += bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        a = p + "self_attn."
        tensors += (
            fp8(a + "q_proj", (heads * hd, h)) + fp8(a + "k_proj", (kv * hd, h)) + fp8(a + "v_proj", (kv * hd, h))
        )
        tensors += (
            fp8(a + "o_proj", (h, heads * hd)) + bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        )
        if layer == 0:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                tensors += fp8(p + "mlp." + proj, shape)
            continue
        tensors += f32(p + "mlp.router.gate.weight", (experts, h)) + f32(p + "mlp.expert_bias", (experts,))
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                tensors += fp8(f"{p}mlp.experts.{e}.{proj}", shape)
        for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
            tensors += fp8(p + "mlp.shared_mlp." + proj, shape)
    tensors += bf16("model.norm.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quant["modules_to_not_convert"] = ["lm_head", "model.embed_tokens"] + [
        f"model.layers.{i}.mlp.router.gate" for i in range(1, layers)
    ]
    config = {
        "architectures": ["HYV3ForCausalLM"],
        "model_type": "hy_v3",
        "hidden_size": h,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_i,
        "num_experts": experts,
        "num_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# Ling-3.0-flash-fp8 (bailing_moe_v3): fused query_key_value, word_embeddings, suffix exclusions, ue8m0
# (C); sizes of Ling-flash-2.0 (I): hidden 4096, 32 layers (first dense 9216), 256 experts x 1024 + 1
# shared, 32 heads / 4 KV x 128, MTP layer 32


def ling3_flash() -> Layout:
    h, layers, inter, moe_i, experts, heads, kv, hd, vocab = 4096, 32, 9216, 1024, 256, 32, 4, 128, 157184
    tensors = bf16("model.word_embeddings.weight", (vocab, h))

    def layer(p: str, dense: bool) -> list[Tensor]:
        out = bf16(p + "input_layernorm.weight", (h,)) + bf16(p + "post_attention_layernorm.weight", (h,))
        a = p + "attention."
        out += fp8(a + "query_key_value", ((heads + 2 * kv) * hd, h)) + fp8(a + "dense", (h, heads * hd))
        out += bf16(a + "query_layernorm.weight", (hd,)) + bf16(a + "key_layernorm.weight", (hd,))
        if dense:
            for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
                out += fp8(p + "mlp." + proj, shape)
            return out
        out += f32(p + "mlp.gate.weight", (experts, h)) + f32(p + "mlp.gate.expert_bias", (experts,))
        for e in range(experts):
            for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                out += fp8(f"{p}mlp.experts.{e}.{proj}", shape)
        for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
            out += fp8(p + "mlp.shared_experts." + proj, shape)
        return out

    for i in range(layers):
        tensors += layer(f"model.layers.{i}.", i == 0)
    p = f"model.layers.{layers}."  # MTP
    tensors += layer(p, False) + bf16(p + "eh_proj.weight", (h, 2 * h))
    for norm in ("enorm", "hnorm", "final_layernorm"):
        tensors += bf16(p + norm + ".weight", (h,))
    tensors += bf16("model.norm.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quant |= {"scale_fmt": "ue8m0", "modules_to_not_convert": ["lm_head", "word_embeddings", "mlp.gate", "eh_proj"]}
    config = {
        "architectures": ["BailingMoeV3ForCausalLM"],
        "model_type": "bailing_moe_v3",
        "hidden_size": h,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_i,
        "num_experts": experts,
        "num_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# gemma-4-31B-it-FP8-dynamic (gemma4, compressed-tensors channel FP8 + dynamic token activations): I for
# sizes: hidden 5376, 60 layers (5 sliding : 1 global), 21504, 32 heads / 16 KV x 256 (global 4 KV x 512)


def gemma4_31b() -> Layout:
    h, layers, inter, heads, vocab = 5376, 60, 21504, 32, 262144
    lm = "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (vocab, h))
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    for layer in range(layers):
        p = f"{lm}layers.{layer}."
        kv, hd = (4, 512) if types[layer] == "full_attention" else (16, 256)
        a = p + "self_attn."
        tensors += channel(a + "q_proj", (heads * hd, h)) + channel(a + "k_proj", (kv * hd, h))
        if types[layer] != "full_attention":
            tensors += channel(a + "v_proj", (kv * hd, h))
        tensors += channel(a + "o_proj", (h, heads * hd))
        tensors += bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            tensors += channel(p + "mlp." + proj, shape)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            tensors += bf16(p + norm + ".weight", (h,))
        tensors += bf16(p + "layer_scalar", (1,))
    tensors += bf16(lm + "norm.weight", (h,))
    vh, vi = 1152, 4304
    tensors += bf16("model.vision_tower.patch_embedder.input_proj.weight", (vh, 3 * 16 * 16))
    tensors += bf16("model.vision_tower.patch_embedder.position_embedding_table", (2, 10240, vh))
    for b in range(27):
        v = f"model.vision_tower.encoder.layers.{b}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += bf16(v + "self_attn." + proj + ".linear.weight", (vh, vh))
        for proj, shape in (("gate_proj", (vi, vh)), ("up_proj", (vi, vh)), ("down_proj", (vh, vi))):
            tensors += bf16(v + "mlp." + proj + ".linear.weight", shape)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ):
            tensors += bf16(v + norm + ".weight", (vh,))
    tensors += bf16("model.embed_vision.embedding_projection.weight", (h, vh))
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "output_activations": None}
    ignore = ["lm_head", "re:.*vision_tower.*", "re:.*embed_vision.*"]
    quant = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ignore,
    }
    text = {
        "model_type": "gemma4_text",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 16,
        "num_global_key_value_heads": 4,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "layer_types": types,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    config |= {"vision_config": {"model_type": "gemma4_vision", "hidden_size": vh}, "quantization_config": quant}
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V4-Flash-0731 (deepseek_v4, DeepSeek's own names): block FP8 linears with E8M0 128x128 `.scale`,
# MXFP4 routed experts (int8 codes [N, K/2] + E8M0 [N, K/32]), a DSpark draft at mtp.0.* (S). Sizes I:
# hidden 4096, 43 layers (2 sliding, then CSA 4 / HCA 128 alternately; 3 hash-routed), 256 experts x 2048,
# 64 heads x 512, q_lora 1024, o_groups 8 x o_lora 1024, indexer 64 x 128, hc_mult 4


def deepseek_v4_flash() -> Layout:
    h, layers, experts, moe_i, heads, hd, vocab, hc = 4096, 43, 256, 2048, 64, 512, 129280, 4
    ratios = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(layers - 2)]

    def e8(name: str, shape: tuple[int, int]) -> list[Tensor]:
        grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
        return [(name + ".weight", "F8_E4M3", shape), (name + ".scale", "F8_E8M0", grid)]

    def fp4(name: str, shape: tuple[int, int]) -> list[Tensor]:
        return [
            (name + ".weight", "I8", (shape[0], shape[1] // 2)),
            (name + ".scale", "F8_E8M0", (shape[0], shape[1] // 32)),
        ]

    def block(p: str, ratio: int, hash_routed: bool) -> list[Tensor]:
        out = bf16(p + "attn_norm.weight", (h,)) + bf16(p + "ffn_norm.weight", (h,))
        for hcn in ("attn", "ffn"):
            out += f32(f"{p}hc_{hcn}_fn", ((2 + hc) * hc, hc * h)) + f32(f"{p}hc_{hcn}_base", ((2 + hc) * hc,))
            out += f32(f"{p}hc_{hcn}_scale", (3,))
        a = p + "attn."
        out += e8(a + "wq_a", (1024, h)) + bf16(a + "q_norm.weight", (1024,)) + e8(a + "wq_b", (heads * hd, 1024))
        out += e8(a + "wkv", (hd, h)) + bf16(a + "kv_norm.weight", (hd,))
        out += (
            e8(a + "wo_a", (8 * 1024, heads * hd // 8)) + e8(a + "wo_b", (h, 8 * 1024)) + f32(a + "attn_sink", (heads,))
        )
        if ratio:
            coff = 2 if ratio == 4 else 1
            c = a + "compressor."
            out += f32(c + "ape", (ratio, coff * hd)) + bf16(c + "wkv.weight", (coff * hd, h))
            out += bf16(c + "wgate.weight", (coff * hd, h)) + bf16(c + "norm.weight", (hd,))
        if ratio == 4:
            x = a + "indexer."
            out += e8(x + "wq_b", (64 * 128, 1024)) + bf16(x + "weights_proj.weight", (64, h))
            c = x + "compressor."
            out += f32(c + "ape", (4, 2 * 128)) + bf16(c + "wkv.weight", (2 * 128, h))
            out += bf16(c + "wgate.weight", (2 * 128, h)) + bf16(c + "norm.weight", (128,))
        f = p + "ffn."
        out += bf16(f + "gate.weight", (experts, h))
        out += [(f + "gate.tid2eid", "I64", (vocab, 6))] if hash_routed else f32(f + "gate.bias", (experts,))
        for e in range(experts):
            for w, shape in (("w1", (moe_i, h)), ("w2", (h, moe_i)), ("w3", (moe_i, h))):
                out += fp4(f"{f}experts.{e}.{w}", shape)
        for w, shape in (("w1", (moe_i, h)), ("w2", (h, moe_i)), ("w3", (moe_i, h))):
            out += e8(f"{f}shared_experts.{w}", shape)
        return out

    tensors = bf16("embed.weight", (vocab, h))
    for i in range(layers):
        tensors += block(f"layers.{i}.", ratios[i], i < 3)
    tensors += bf16("norm.weight", (h,)) + bf16("head.weight", (vocab, h))
    tensors += f32("hc_head_fn", (hc, hc * h)) + f32("hc_head_base", (hc,)) + f32("hc_head_scale", (1,))
    m = "mtp.0."
    tensors += block(m, 0, False)
    tensors += e8(m + "main_proj", (h, 2 * h)) + bf16(m + "main_norm.weight", (h,))
    tensors += bf16(m + "markov_head.weight", (h, h)) + bf16(m + "confidence_head.weight", (1, h))
    tensors += bf16(m + "enorm.weight", (h,)) + bf16(m + "hnorm.weight", (h,)) + bf16(m + "norm.weight", (h,))
    tensors += f32(m + "hc_head_fn", (hc, hc * h)) + f32(m + "hc_head_base", (hc,)) + f32(m + "hc_head_scale", (1,))
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0"}
    quant["weight_block_size"] = [128, 128]
    config = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": vocab,
        "hidden_size": h,
        "moe_intermediate_size": moe_i,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": hd,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "qk_rope_head_dim": 64,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "compress_ratios": ratios,
        "num_hash_layers": 3,
        "hc_mult": hc,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "num_nextn_predict_layers": 1,
        "dspark_num_layers": 1,
        "dspark_markov_order": 1,
        "torch_dtype": "bfloat16",
        "expert_dtype": "fp4",
        "quantization_config": quant,
    }
    return tensors, config, {}


# ---------------------------------------------------------------------------------------------------
# Kimi-K2.5 (kimi_k25, text kimi_k2): bench/plan_scale's tensors (INT4 routed experts), the text config's
# real width keys (DeepSeek-V3's), the quantization config at the top level this time


def kimi25() -> Layout:
    tensors, config = bench_layout("kimi-k2.5")
    text = dict(config["text_config"])
    quant = text.pop("quantization_config")
    text |= {
        "architectures": ["DeepseekV3ForCausalLM"],
        "intermediate_size": 18432,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_experts_per_tok": 8,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_attention_heads": 64,
        "vocab_size": 163840,
    }
    vision = {"model_type": "moonvit", "hidden_size": 1152, "num_hidden_layers": 27}
    top = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text}
    return tensors, top | {"vision_config": vision, "quantization_config": quant}, {}


# ---------------------------------------------------------------------------------------------------
# Variants: the same releases written the other ways their families are seen (sibling releases, other
# tools' saves), to find what one fixed layout per release would not


def _requant(tensors: list[Tensor], pick: Callable[[str], bool], fn: Callable[[str, tuple[int, ...]], list[Tensor]]):
    """Each block-FP8 weight `pick` selects (and its scale) replaced by fn(base, shape)."""
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        base = name.rsplit(".", 1)[0]
        if pick(name) and name.endswith(".weight") and dtype == "F8_E4M3":
            out += fn(base, shape)
        elif pick(name) and name.endswith(".weight_scale_inv"):
            continue
        else:
            out.append((name, dtype, shape))
    return out


def ling_mxfp4_experts() -> Layout:
    """Ling with `routed_experts_quant_method: mxfp4`: routed experts uint8 codes [N, K/2] + uint8 E8M0
    `weight_scale_inv` [N, K/32] (vLLM bailing_moe_v3)."""
    tensors, config, extra = ling3_flash()
    experts = re.compile(r"\.mlp\.experts\.\d+\.")

    def mx4(base: str, shape: tuple[int, ...]) -> list[Tensor]:
        n, k = shape
        return [(base + ".weight", "U8", (n, k // 2)), (base + ".weight_scale_inv", "U8", (n, k // 32))]

    tensors = _requant(tensors, lambda n: experts.search(n) is not None, mx4)
    config["quantization_config"] |= {"routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
    return tensors, config, extra


def qwen_quant_in_text(g: dict = QWEN_35B) -> Layout:
    """Qwen3.6-35B-A3B with float32 scales and quantization_config inside text_config (a re-save)."""
    tensors, config, extra = qwen3_5(g, moe=True, vision=True)
    tensors = [(n, "F32" if n.endswith("_scale_inv") else d, s) for n, d, s in tensors]
    config["text_config"]["quantization_config"] = config.pop("quantization_config")
    return tensors, config, extra


def glm51_all_indexers() -> Layout:
    """GLM-5.1-FP8: an indexer on every layer (GLM-5.2 has them on 22)."""
    tensors, config, extra = glm52()
    have = {n.split(".self_attn.")[0] for n, _, _ in tensors if ".self_attn.indexer." in n}
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        out.append((name, dtype, shape))
        if name.endswith(".self_attn.o_proj.weight_scale_inv") and name.split(".self_attn.")[0] not in have:
            x = name.split("o_proj.")[0] + "indexer."
            out += fp8(x + "wq_b", (4096, 2048), "F32") + fp8(x + "wk", (128, 6144), "F32")
            out += (
                bf16(x + "weights_proj.weight", (32, 6144))
                + bf16(x + "k_norm.weight", (128,))
                + bf16(x + "k_norm.bias", (128,))
            )
    config.pop("indexer_types")
    return out, config, extra


def mimo_v25_fused_qkv() -> Layout:
    """MiMo-V2.5 / V2.6 style: `attention_projection_layout: fused_qkv`, qkv_proj stored pre-sharded in
    config num_key_value_heads (4) chunks in every layer (vllm#57508, sglang _get_ckpt_qkv_shard_sizes),
    each chunk [Q_c; K_c; V_c] quantized alone: global chunks of 3392 rows (27 scale rows each, 108 for 106
    row blocks), sliding-window and MTP chunks of 3712 (29 each, 116 either way)."""
    tensors, config, extra = mimo_v2_flash()
    hd, vhd, h, chunks = 192, 128, 4096, 4
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        if ".self_attn.q_proj." in name or ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            if name.endswith(".self_attn.q_proj.weight"):
                a = name[: -len("q_proj.weight")]
                heads = shape[0] // hd
                kv = 8 if _mimo_swa(a, config) else 4
                per_chunk = max(1, kv // chunks)
                rows = heads // chunks * hd + per_chunk * hd + per_chunk * vhd
                out += [(a + "qkv_proj.weight", "F8_E4M3", (chunks * rows, h))]
                out += [(a + "qkv_proj.weight_scale_inv", "F32", (chunks * math.ceil(rows / 128), 32))]
            continue
        out.append((name, dtype, shape))
    config |= {
        "model_type": "mimo_v2",
        "architectures": ["MiMoV2ForCausalLM"],
        "attention_projection_layout": "fused_qkv",
    }
    config["quantization_config"]["ignored_layers"] = []
    return out, config, extra


def _mimo_swa(prefix: str, config: dict) -> bool:
    if ".mtp." in prefix:
        return True
    layer = int(prefix.split("layers.")[1].split(".")[0])
    return config["hybrid_layer_pattern"][layer] == 1


def gemma4_e4b() -> Layout:
    """gemma-4-E4B-it-FP8-dynamic: hidden 2560, 42 layers, the last 18 KV-sharing with double-wide MLPs
    (use_double_wide_mlp), per-layer embeddings, an audio tower (conformer) and vision (I for sizes)."""
    h, layers, inter, heads, vocab, shared = 2560, 42, 10240, 8, 262144, 18
    lm = "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (vocab, h)) + bf16(
        lm + "embed_tokens_per_layer.weight", (vocab, layers * 256)
    )
    tensors += bf16(lm + "per_layer_model_projection.weight", (layers * 256, h)) + bf16(
        lm + "per_layer_projection_norm.weight", (256,)
    )
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    for layer in range(layers):
        p = f"{lm}layers.{layer}."
        kv, hd = 2, 256
        a = p + "self_attn."
        tensors += channel(a + "q_proj", (heads * hd, h)) + channel(a + "k_proj", (kv * hd, h))
        tensors += channel(a + "v_proj", (kv * hd, h)) + channel(a + "o_proj", (h, heads * hd))
        tensors += bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        width = inter * (2 if layer >= layers - shared else 1)
        for proj, shape in (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))):
            tensors += channel(p + "mlp." + proj, shape)
        tensors += bf16(p + "per_layer_input_gate.weight", (256, h)) + bf16(p + "per_layer_projection.weight", (h, 256))
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_per_layer_input_norm",
        ):
            tensors += bf16(p + norm + ".weight", (h,))
    tensors += bf16(lm + "norm.weight", (h,))
    ah = 1536
    for b in range(12):
        u = f"model.audio_tower.layers.{b}."
        for ff in ("feed_forward1", "feed_forward2"):
            tensors += bf16(u + ff + ".ffw_layer_1.linear.weight", (4 * ah, ah)) + bf16(
                u + ff + ".ffw_layer_2.linear.weight", (ah, 4 * ah)
            )
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += bf16(u + "self_attn." + proj + ".linear.weight", (ah, ah))
        tensors += bf16(u + "lconv1d.depthwise_conv1d.weight", (ah, 1, 5)) + bf16(u + "norm_out.weight", (ah,))
    tensors += bf16("model.embed_audio.embedding_projection.weight", (h, ah))
    vh = 768
    for b in range(16):
        v = f"model.vision_tower.encoder.layers.{b}."
        for proj, shape in (("gate_proj", (4 * vh, vh)), ("up_proj", (4 * vh, vh)), ("down_proj", (vh, 4 * vh))):
            tensors += bf16(v + "mlp." + proj + ".linear.weight", shape)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += bf16(v + "self_attn." + proj + ".linear.weight", (vh, vh))
    tensors += bf16("model.embed_vision.embedding_projection.weight", (h, vh))
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    ignore = ["lm_head", "re:.*vision_tower.*", "re:.*audio_tower.*", "re:.*embed_vision.*", "re:.*embed_audio.*"]
    ignore += ["re:.*per_layer.*"]
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
    quant |= {"quantization_status": "compressed", "ignore": ignore}
    text = {
        "model_type": "gemma4_text",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "num_kv_shared_layers": shared,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 256,
        "layer_types": types,
        "vocab_size": vocab,
    }
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    config |= {"audio_config": {"model_type": "gemma4_audio", "hidden_size": ah, "num_hidden_layers": 12}}
    config |= {"vision_config": {"model_type": "gemma4_vision", "hidden_size": vh, "num_hidden_layers": 16}}
    return tensors, config | {"quantization_config": quant}, {}


def nemotron_nano_dense() -> Layout:
    """NVIDIA-Nemotron-Nano-9B-v2-FP8 style (nemotron_h, ModelOpt FP8, config.json only): Mamba, attention
    and non-gated MLP mixers (mixer.up_proj / down_proj, intermediate_size); hidden 4480, 56 layers,
    15680 (I)."""
    h, layers, inter, vocab = 4480, 56, 15680, 131072
    heads, kv, hd, mh, mhd, state, groups = 40, 8, 128, 128, 80, 128, 8
    d_inner = mh * mhd
    pattern = ("M-M-M*-M-M-M-M-" * 4)[:layers]
    tensors = bf16("backbone.embeddings.weight", (vocab, h))
    for layer, kind in enumerate(pattern):
        p = f"backbone.layers.{layer}."
        m = p + "mixer."
        tensors += bf16(p + "norm.weight", (h,))
        if kind == "M":
            conv = d_inner + 2 * groups * state
            tensors += per_tensor(m + "in_proj", (2 * d_inner + 2 * groups * state + mh, h))
            tensors += bf16(m + "conv1d.weight", (conv, 1, 4)) + bf16(m + "conv1d.bias", (conv,))
            for small in ("A_log", "D", "dt_bias"):
                tensors += f32(m + small, (mh,))
            tensors += bf16(m + "norm.weight", (d_inner,)) + per_tensor(m + "out_proj", (h, d_inner))
        elif kind == "*":
            for proj, shape in (("q_proj", (heads * hd, h)), ("k_proj", (kv * hd, h)), ("v_proj", (kv * hd, h))):
                tensors += per_tensor(m + proj, shape)
            tensors += per_tensor(m + "o_proj", (h, heads * hd))
        else:
            tensors += per_tensor(m + "up_proj", (inter, h)) + per_tensor(m + "down_proj", (h, inter))
    tensors += bf16("backbone.norm_f.weight", (h,)) + bf16("lm_head.weight", (vocab, h))
    quant = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None, "ignore": ["lm_head"]}
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": h,
        "num_hidden_layers": layers,
        "hybrid_override_pattern": pattern,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "mamba_num_heads": mh,
        "mamba_head_dim": mhd,
        "ssm_state_size": state,
        "n_groups": groups,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return tensors, config, {}


def step3p5_ct_block() -> Layout:
    """Step-3.5-Flash re-quantized by LLM-Compressor (FP8_BLOCK, compressed-tensors): per-expert
    `moe.experts.{E}.*`, scales `weight_scale`."""
    tensors, config, extra = step3p5()
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        if ".moe." in name and name.endswith(("_proj.weight", "_proj.weight_scale_inv")):
            base, proj = name.split(".moe.")[0] + ".moe.", name.split(".moe.")[1].split(".")[0]
            if name.endswith(".weight"):
                for e in range(shape[0]):
                    out += [(f"{base}experts.{e}.{proj}.weight", "F8_E4M3", shape[1:])]
                    grid = (math.ceil(shape[1] / 128), math.ceil(shape[2] / 128))
                    out += [(f"{base}experts.{e}.{proj}.weight_scale", "F32", grid)]
            continue
        out.append((name.replace("weight_scale_inv", "weight_scale"), dtype, shape))
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128], "symmetric": True}
    acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True, "symmetric": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    ignore = ["lm_head", "re:.*moe\\.gate$", "re:.*g_proj$", "re:.*eh_proj$", "re:.*shared_head.*"]
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
    config["quantization_config"] = quant | {"quantization_status": "compressed", "ignore": ignore}
    return out, config, extra


def mistral4_fp8_embedding() -> Layout:
    """Mistral-Small-4 with down_proj scales [E] and an FP8 embedding with weight_scale [1]."""
    tensors, config, extra = mistral_small4()
    out: list[Tensor] = []
    for name, dtype, shape in tensors:
        if name.endswith("down_proj_scale_inv"):
            out.append((name, dtype, (shape[0],)))
        elif name.endswith("embed_tokens.weight"):
            out += [(name, "F8_E4M3", shape), (name[: -len("weight")] + "weight_scale", "F32", (1,))]
        else:
            out.append((name, dtype, shape))
    return out, config, extra


def gemma4_26b_a4b(fused: bool) -> Layout:
    """gemma-4-26B-A4B: each layer has a dense MLP (intermediate_size 2112) AND 128 experts (moe_intermediate_size
    704) directly under the layer, `layers.L.experts.*` (transformers gemma4 Gemma4TextDecoderLayer.experts,
    no conversion mapping), routed by `layers.L.router.proj`. fused: the transformers-5 FineGrainedFP8 save
    (experts.gate_up_proj [E, 2I, H] + _scale_inv grid); else compressed-tensors FP8-dynamic with the experts
    linearized per expert (`experts.{E}.gate_proj`, as LLM-Compressor saves MoE). Sizes I."""
    h, layers, inter, moe_i, experts, heads, vocab = 2816, 30, 2112, 704, 128, 16, 262144
    lm = "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (vocab, h))
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]

    def lin(name: str, shape: tuple[int, int]) -> list[Tensor]:
        return fp8(name, shape) if fused else channel(name, shape)

    for layer in range(layers):
        p = f"{lm}layers.{layer}."
        kv, hd = (2, 512) if types[layer] == "full_attention" else (8, 256)
        a = p + "self_attn."
        tensors += lin(a + "q_proj", (heads * hd, h)) + lin(a + "k_proj", (kv * hd, h))
        tensors += lin(a + "v_proj", (kv * hd, h)) + lin(a + "o_proj", (h, heads * hd))
        tensors += bf16(a + "q_norm.weight", (hd,)) + bf16(a + "k_norm.weight", (hd,))
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            tensors += lin(p + "mlp." + proj, shape)
        tensors += bf16(p + "router.proj.weight", (experts, h)) + bf16(p + "router.scale", (h,))
        tensors += bf16(p + "router.per_expert_scale", (experts,))
        x = p + "experts."
        if fused:
            tensors += [(x + "gate_up_proj", "F8_E4M3", (experts, 2 * moe_i, h))]
            tensors += [
                (x + "gate_up_proj_scale_inv", "F32", (experts, math.ceil(2 * moe_i / 128), math.ceil(h / 128)))
            ]
            tensors += [(x + "down_proj", "F8_E4M3", (experts, h, moe_i))]
            tensors += [(x + "down_proj_scale_inv", "F32", (experts, math.ceil(h / 128), math.ceil(moe_i / 128)))]
        else:
            for e in range(experts):
                for proj, shape in (("gate_proj", (moe_i, h)), ("up_proj", (moe_i, h)), ("down_proj", (h, moe_i))):
                    tensors += channel(f"{x}{e}.{proj}", shape)
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "pre_feedforward_layernorm_2",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
        ):
            tensors += bf16(p + norm + ".weight", (h,))
        tensors += bf16(p + "layer_scalar", (1,))
    tensors += bf16(lm + "norm.weight", (h,))
    vh = 1152
    for b in range(27):
        v = f"model.vision_tower.encoder.layers.{b}."
        for proj, shape in (("gate_proj", (4304, vh)), ("up_proj", (4304, vh)), ("down_proj", (vh, 4304))):
            tensors += bf16(v + "mlp." + proj + ".linear.weight", shape)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += bf16(v + "self_attn." + proj + ".linear.weight", (vh, vh))
    tensors += bf16("model.embed_vision.embedding_projection.weight", (h, vh))
    text = {
        "model_type": "gemma4_text",
        "hidden_size": h,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_i,
        "num_experts": experts,
        "top_k_experts": 8,
        "enable_moe_block": True,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "layer_types": types,
        "vocab_size": vocab,
    }
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    config["vision_config"] = {"model_type": "gemma4_vision", "hidden_size": vh}
    if fused:
        quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        quant["modules_to_not_convert"] = ["lm_head", "model.vision_tower", "model.embed_vision"] + [
            f"{lm}layers.{i}.router.proj" for i in range(layers)
        ]
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        acts = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        quant = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
        quant |= {
            "quantization_status": "compressed",
            "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*embed_vision.*", "re:.*router.*"],
        }
    return tensors, config | {"quantization_config": quant}, {}


def step3p7_flash() -> Layout:
    """Step-3.7-Flash-FP8 (step3p7): Step-3.5's text layout on disk (model.layers.*, stacked moe.*, MTP at
    layers 45-47), the text config under text_config (model_type step3p5), a vision tower `vision_model.*`
    and `vit_large_projector` (transformers step3p7 conversion mapping); vision sizes I."""
    tensors, text, extra = step3p5()
    text.pop("quantization_config")
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    vh = 1536
    vision: list[Tensor] = bf16("vision_model.conv1.weight", (vh, 3, 14, 14))
    vision += bf16("vision_model.positional_embedding", (729, vh)) + bf16("vision_model.ln_pre.weight", (vh,))
    for b in range(47):
        v = f"vision_model.transformer.resblocks.{b}."
        vision += bf16(v + "attn.in_proj_weight", (3 * vh, vh)) + bf16(v + "attn.out_proj.weight", (vh, vh))
        vision += bf16(v + "mlp.c_fc.weight", (4 * vh, vh)) + bf16(v + "mlp.c_proj.weight", (vh, 4 * vh))
        vision += bf16(v + "ln_1.weight", (vh,)) + bf16(v + "ln_2.weight", (vh,)) + bf16(v + "ls_1.gamma", (vh,))
    vision += bf16("vision_model.vit_downsampler1.weight", (2 * vh, vh, 3, 3))
    vision += bf16("vision_model.vit_downsampler2.weight", (4 * vh, 2 * vh, 3, 3))
    vision += bf16("vit_large_projector.weight", (4096, 4 * vh))
    ignore = [m for m in _bf16_modules(tensors + vision) if "norm" not in m and "vision_model" not in m]
    quant["modules_to_not_convert"] = [*ignore, "vision_model"]
    text["model_type"] = "step3p5"
    config = {"architectures": ["Step3p7ForConditionalGeneration"], "model_type": "step3p7", "text_config": text}
    config |= {"vision_config": {"model_type": "step3p5_vision", "width": vh, "layers": 47}}
    return tensors + vision, config | {"quantization_config": quant}, extra


def mistral_large3_native() -> Layout:
    """Mistral-Large-3-675B-Instruct-2512 (FP8), Mistral-native only: consolidated-*.safetensors + params.json,
    no config.json, no HF shard; per-tensor `.qscale_weight` / `.qscale_act` (vLLM MistralLarge3ForCausalLM).
    DeepSeek-V3's geometry (I): dim 7168, 61 layers (3 dense of 18432), 128 experts of 4096 + 1 shared."""
    dim, layers, hidden, experts, expert_dim, heads, vocab = 7168, 61, 18432, 128, 4096, 128, 131072

    def q8(name: str, shape: tuple[int, int]) -> list[Tensor]:
        return per_tensor(name, shape, "qscale_weight", "qscale_act")

    tensors = bf16("tok_embeddings.weight", (vocab, dim))
    for layer in range(layers):
        p = f"layers.{layer}."
        tensors += bf16(p + "attention_norm.weight", (dim,)) + bf16(p + "ffn_norm.weight", (dim,))
        a = p + "attention."
        tensors += q8(a + "wq_a", (1536, dim)) + bf16(a + "q_a_norm.weight", (1536,))
        tensors += q8(a + "wq_b", (heads * 192, 1536)) + q8(a + "wkv_a_with_mqa", (576, dim))
        tensors += bf16(a + "kv_a_norm.weight", (512,)) + q8(a + "wkv_b", (heads * 256, 512))
        tensors += q8(a + "wo", (dim, heads * 128)) + f32(a + "kv_fake_quantizer.qscale_act", ())
        if layer < 3:
            for w, shape in (("w1", (hidden, dim)), ("w2", (dim, hidden)), ("w3", (hidden, dim))):
                tensors += q8(p + "feed_forward." + w, shape)
            continue
        tensors += bf16(p + "gate.weight", (experts, dim))
        for e in range(experts):
            for w, shape in (("w1", (expert_dim, dim)), ("w2", (dim, expert_dim)), ("w3", (expert_dim, dim))):
                tensors += q8(f"{p}experts.{e}.{w}", shape)
        for w, shape in (("w1", (expert_dim, dim)), ("w2", (dim, expert_dim)), ("w3", (expert_dim, dim))):
            tensors += q8(f"{p}shared_experts.{w}", shape)
    tensors += bf16("norm.weight", (dim,)) + bf16("output.weight", (vocab, dim))
    params = {
        "dim": dim,
        "n_layers": layers,
        "head_dim": 128,
        "hidden_dim": hidden,
        "n_heads": heads,
        "n_kv_heads": heads,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "vocab_size": vocab,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "moe": {
            "num_experts": experts,
            "num_experts_per_tok": 4,
            "expert_hidden_dim": expert_dim,
            "first_k_dense_replace": 3,
            "num_shared_experts": 1,
        },
        "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"},
    }
    return tensors, {"__mistral_native__": True}, {"params.json": params, "tekken.json": {"config": {}}}


def qwen_regex_ignore(count: int = 600) -> Layout:
    """Qwen3.5-397B-A17B-FP8 re-quantized by LLM-Compressor: its ignore list is `re:` entries, one per layer and
    module kind (`re:.*layers\\.7\\.linear_attn\\.in_proj_a$`), plus ModelOpt-style wildcards per layer."""
    tensors, config, extra = qwen3_5(QWEN_397B, moe=True, vision=True)
    kinds = (
        "linear_attn\\.in_proj_a",
        "linear_attn\\.in_proj_b",
        "linear_attn\\.conv1d",
        "mlp\\.gate",
        "mlp\\.shared_expert_gate",
    )
    regexes = [f"re:.*layers\\.{i}\\.{k}$" for i in range(60) for k in kinds]
    wildcards = [f"model.language_model.layers.{i}.*norm*" for i in range(60)]
    ignore = (regexes + wildcards + ["lm_head", "re:.*visual.*", "re:^mtp\\..*(gate|fc)$"])[:count]
    config["quantization_config"]["modules_to_not_convert"] = ignore
    return tensors, config, extra


# ---------------------------------------------------------------------------------------------------


LAYOUTS: dict[str, Callable[[], Layout]] = {
    "qwen3.5-397b-a17b-fp8": lambda: qwen3_5(QWEN_397B, moe=True, vision=True),
    "qwen3.6-35b-a3b-fp8": lambda: qwen3_5(QWEN_35B, moe=True, vision=True),
    "qwen3.6-27b-fp8": lambda: qwen3_5(QWEN_27B, moe=False, vision=True),
    "qwen3.8-2.4t-a95b-fp8": lambda: qwen3_5(QWEN_2T, moe=True, vision=False, text_only=True),
    "glm-5.2-fp8": glm52,
    "minimax-m3-mxfp8": minimax_m3,
    "nemotron-3-super-fp8": nemotron3_super,
    "nemotron-3-nano-30b-a3b-fp8": lambda: nemotron3_super(g=NEMOTRON_NANO),
    "step-3.5-flash-fp8": step3p5,
    "mimo-v2-flash": mimo_v2_flash,
    "mistral-small-4": mistral_small4,
    "hy3-fp8": hy3,
    "ling-3.0-flash-fp8": ling3_flash,
    "gemma-4-31b-fp8-dynamic": gemma4_31b,
    "deepseek-v4-flash-0731": deepseek_v4_flash,
    "kimi-k2.5": lambda: (*bench_layout("kimi-k2.5"), {}),
    "kimi-k2.5-full-config": kimi25,
    "ling-3.0-flash-mxfp4-experts": ling_mxfp4_experts,
    "qwen3.6-35b-quant-in-text-f32": qwen_quant_in_text,
    "glm-5.1-all-indexers": glm51_all_indexers,
    "mimo-v2.5-fused-qkv": mimo_v25_fused_qkv,
    "gemma-4-e4b-fp8-dynamic": gemma4_e4b,
    "nemotron-nano-9b-v2-fp8": nemotron_nano_dense,
    "step-3.5-flash-ct-block": step3p5_ct_block,
    "mistral-small-4-fp8-embedding": mistral4_fp8_embedding,
    "step-3.7-flash-fp8": step3p7_flash,
    "qwen3.5-397b-regex-ignore": qwen_regex_ignore,
    "mistral-large-3-native": mistral_large3_native,
    "gemma-4-26b-a4b-fp8-dynamic": lambda: gemma4_26b_a4b(fused=False),
    "gemma-4-26b-a4b-fp8-block-fused": lambda: gemma4_26b_a4b(fused=True),
}


def build(name: str, root: Path) -> int:
    tensors, config, extra = LAYOUTS[name]()
    write_header_only(root, tensors, config)
    if config.get("__mistral_native__"):  # consolidated-*.safetensors and params.json alone
        (root / "model.safetensors.index.json").unlink()
        (root / "config.json").unlink()
        for shard in sorted(root.glob("model-*.safetensors")):
            shard.rename(root / shard.name.replace("model-", "consolidated-"))
    for fname, doc in extra.items():
        (root / fname).write_text(json.dumps(doc, indent=1))
    return len(tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--build", nargs=2, metavar=("LAYOUT", "DIR"))
    args = parser.parse_args()
    if args.list:
        print("\n".join(LAYOUTS))
    elif args.build:
        print(f"{build(args.build[0], Path(args.build[1]))} tensors in {args.build[1]}")


if __name__ == "__main__":
    main()
