"""Tiny checkpoints in the layouts of the FP8 releases of 2026 (names, dtypes, config keys, layouts; not
sizes), built by hand here, independently of fp8conv (shared/RELEASES-2026.md; names confirmed in
transformers 5.24's modeling files and conversion_mapping.py, vLLM 0.33's model files).

API (for other test files):

    build_release(name, folder) -> Release
    RELEASES: every name
    release.path, release.config
    release.fp8_weights   names of the FP8 weights (block 128x128 unless release.layout says "tensor"); in a
                          bf16 master, the Linears a conversion to FP8 quantizes
    release.bf16_linears  modules that stay bf16 and that a loader must be told not to quantize
    release.layout        "block" | "tensor" | "bf16" (an unquantized master)
    release.hf_class      the transformers class that loads the bf16 output's text model (config.json's
                          text section), or None

Widths are not multiples of 128 (padding has something to do); experts 3, layers 2-4.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.support.reference import quantize_reference

H = 96  # hidden size
E = 3  # routed experts
BLOCK = [128, 128]


@dataclass
class Release:
    name: str
    path: Path
    config: dict[str, Any]
    fp8_weights: list[str]
    bf16_linears: list[str]
    layout: str
    hf_class: str | None = None
    notes: list[str] = field(default_factory=list)


class _Builder:
    """Tensors by name; FP8 ones quantized here (block 128x128, the scale stored as `scale_dtype`)."""

    def __init__(self, layout: str, scale_dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        self.layout, self.scale_dtype = layout, scale_dtype
        self.tensors: dict[str, torch.Tensor] = {}
        self.fp8: list[str] = []
        self.bf16_linears: list[str] = []
        self.gen = torch.Generator().manual_seed(seed)

    def _random(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * 0.05

    def linear(self, name: str, shape: tuple[int, ...], quantized: bool = True) -> None:
        """`name` without `.weight`; 2-D, or 3-D stacked / fused experts (quantized expert by expert)."""
        w = self._random(shape)
        if not quantized or self.layout == "bf16":
            self.tensors[name + ".weight"] = w.to(torch.bfloat16)
            if not quantized:
                self.bf16_linears.append(name)
            else:  # a bf16 master: a conversion to FP8 quantizes it
                self.fp8.append(name + ".weight")
            return
        self.quantized(name + ".weight", name + ".weight_scale" + ("" if self.layout == "tensor" else "_inv"), w)

    def quantized(self, weight: str, scale: str, w: torch.Tensor) -> None:
        if self.layout == "tensor":
            s = (w.abs().amax() / 448.0).to(torch.float32)
            self.tensors[weight] = torch.clamp(w / s, -448, 448).to(torch.float8_e4m3fn)
            self.tensors[scale] = s.reshape(())
        else:
            pairs = [quantize_reference(m, (128, 128)) for m in (w if w.dim() == 3 else [w])]
            q = torch.stack([p[0] for p in pairs]) if w.dim() == 3 else pairs[0][0]
            s = torch.stack([p[1] for p in pairs]) if w.dim() == 3 else pairs[0][1]
            self.tensors[weight], self.tensors[scale] = q, s.to(self.scale_dtype)
        self.fp8.append(weight)

    def fused(self, name: str, shape: tuple[int, ...]) -> None:
        """A bare fused 3-D expert parameter (transformers 5: experts.gate_up_proj), always bf16 here."""
        self.tensors[name] = self._random(shape).to(torch.bfloat16)

    def plain(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
        self.tensors[name] = (1 + self._random(shape)).to(dtype)

    def write(self, folder: Path, config: dict[str, Any], shards: int = 2) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        names = list(self.tensors)
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {}
        for i, fname in enumerate(files):
            part = {n: self.tensors[n].contiguous() for n in names[i::shards]}
            save_file(part, str(folder / fname))
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        (folder / "config.json").write_text(json.dumps(config, indent=2))


def _fp8_config(layout: str, **extra: Any) -> dict[str, Any] | None:
    if layout == "bf16":
        return None
    q: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if layout == "block":
        q["weight_block_size"] = BLOCK
    return {**q, **extra}


def _with_quant(config: dict[str, Any], layout: str, **extra: Any) -> dict[str, Any]:
    q = _fp8_config(layout, **extra)
    return {**config, "torch_dtype": "bfloat16", **({"quantization_config": q} if q else {})}


def _attention(b: _Builder, p: str, heads: int = 4, kv: int = 2, head_dim: int = 32, gate: bool = False) -> None:
    b.linear(p + "q_proj", (heads * head_dim * (2 if gate else 1), H))
    b.linear(p + "k_proj", (kv * head_dim, H))
    b.linear(p + "v_proj", (kv * head_dim, H))
    b.linear(p + "o_proj", (H, heads * head_dim))


def _gated_mlp(b: _Builder, p: str, width: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
    b.linear(p + names[0], (width, H))
    b.linear(p + names[1], (width, H))
    b.linear(p + names[2], (H, width))


def _experts(b: _Builder, p: str, width: int, fused: bool) -> None:
    """Per-expert 2-D (the FP8 releases) or fused 3-D [E, 2I, H] / [E, H, I] (the bf16 masters)."""
    if fused:
        b.fused(p + "experts.gate_up_proj", (E, 2 * width, H))
        b.fused(p + "experts.down_proj", (E, H, width))
    else:
        for e in range(E):
            _gated_mlp(b, f"{p}experts.{e}.", width)


# ---------------------------------------------------------------------------------------------------
# Qwen3.5 / 3.6 / 3.8: text under model.language_model, vision model.visual (bf16), MTP at mtp.*


def _qwen3_5_text_layer(b: _Builder, p: str, linear: bool, moe: bool, fused: bool, inter: int, moe_inter: int):
    b.plain(p + "input_layernorm.weight", (H,))
    b.plain(p + "post_attention_layernorm.weight", (H,))
    if linear:  # gated delta net: key heads 2 x 16, value heads 4 x 16, conv kernel 4
        key_dim, value_dim, v_heads = 32, 64, 4
        b.linear(p + "linear_attn.in_proj_qkv", (2 * key_dim + value_dim, H))
        b.linear(p + "linear_attn.in_proj_z", (value_dim, H))
        b.linear(p + "linear_attn.in_proj_b", (v_heads, H), quantized=False)
        b.linear(p + "linear_attn.in_proj_a", (v_heads, H), quantized=False)
        b.plain(p + "linear_attn.conv1d.weight", (2 * key_dim + value_dim, 1, 4))
        b.plain(p + "linear_attn.dt_bias", (v_heads,))
        b.plain(p + "linear_attn.A_log", (v_heads,), torch.float32)
        b.plain(p + "linear_attn.norm.weight", (16,))
        b.linear(p + "linear_attn.out_proj", (H, value_dim))
    else:
        _attention(b, p + "self_attn.", gate=True)
        b.plain(p + "self_attn.q_norm.weight", (32,))
        b.plain(p + "self_attn.k_norm.weight", (32,))
    if not moe:
        _gated_mlp(b, p + "mlp.", inter)
        return
    b.plain(p + "mlp.gate.weight", (E, H))
    b.plain(p + "mlp.shared_expert_gate.weight", (1, H))
    _gated_mlp(b, p + "mlp.shared_expert.", moe_inter)
    _experts(b, p + "mlp.", moe_inter, fused)


def _qwen3_5(folder: Path, layout: str, moe: bool) -> Release:
    b = _Builder(layout, torch.bfloat16)  # the releases store bf16 scales
    fused = layout == "bf16" and moe  # the bf16 master keeps its experts pre-stacked
    inter, moe_inter = 330, 136
    lm = "model.language_model."
    b.plain(lm + "embed_tokens.weight", (300, H))
    for i, linear in enumerate((True, False)):
        _qwen3_5_text_layer(b, f"{lm}layers.{i}.", linear, moe, fused, inter, moe_inter)
    b.plain(lm + "norm.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    b.linear("mtp.fc", (H, 2 * H), quantized=False)  # never quantized (vLLM qwen3_5_mtp.py builds it as given)
    for norm in ("mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.norm"):
        b.plain(norm + ".weight", (H,))
    _qwen3_5_text_layer(b, "mtp.layers.0.", False, moe, fused, inter, moe_inter)
    b.plain("model.visual.patch_embed.proj.weight", (64, 3, 2, 4, 4))
    b.linear("model.visual.blocks.0.attn.qkv", (192, 64), quantized=False)
    b.linear("model.visual.merger.linear_fc1", (256, 256), quantized=False)
    kind = "qwen3_5_moe" if moe else "qwen3_5"
    text: dict[str, Any] = {
        "model_type": kind + "_text",
        "hidden_size": H,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attn_output_gate": True,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1,
        "vocab_size": 300,
        "rms_norm_eps": 1e-6,
    }
    if moe:
        text |= {"moe_intermediate_size": moe_inter, "shared_expert_intermediate_size": moe_inter}
        text |= {"num_experts": E, "num_experts_per_tok": 2}
    else:
        text["intermediate_size"] = inter
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    skip = ["lm_head", "mtp.fc", "model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1"]
    config = {"architectures": [arch], "model_type": kind, "text_config": text}
    config = _with_quant(config, layout, modules_to_not_convert=skip)
    b.write(folder, config)
    hf_class = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    return Release(kind, folder, config, b.fp8, b.bf16_linears, layout, hf_class)


# ---------------------------------------------------------------------------------------------------
# GLM-5 / 5.1 / 5.2 (glm_moe_dsa): DeepSeek-V3.2's layout; indexer only on some layers; MTP at layer L


def _mla(b: _Builder, p: str, indexer: bool) -> None:
    b.linear(p + "q_a_proj", (64, H))
    b.plain(p + "q_a_layernorm.weight", (64,))
    b.linear(p + "q_b_proj", (4 * 48, 64))
    b.linear(p + "kv_a_proj_with_mqa", (32 + 16, H))
    b.plain(p + "kv_a_layernorm.weight", (32,))
    b.linear(p + "kv_b_proj", (4 * (32 + 32), 32))
    b.linear(p + "o_proj", (H, 4 * 32))
    if indexer:
        b.linear(p + "indexer.wq_b", (2 * 32, 64))
        b.linear(p + "indexer.wk", (32, H))
        b.linear(p + "indexer.weights_proj", (2, H), quantized=False)
        b.plain(p + "indexer.k_norm.weight", (32,))
        b.plain(p + "indexer.k_norm.bias", (32,))


def _deepseek_moe(b: _Builder, p: str, width: int, shared_names: str = "shared_experts") -> None:
    b.plain(p + "gate.weight", (E, H))
    b.plain(p + "gate.e_score_correction_bias", (E,), torch.float32)
    _experts(b, p, width, fused=False)
    _gated_mlp(b, f"{p}{shared_names}.", width)


def _glm5(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    b.plain("model.embed_tokens.weight", (300, H))
    for i, (moe, indexer) in enumerate(((False, True), (True, True), (True, False), (True, True))):
        p = f"model.layers.{i}."
        b.plain(p + "input_layernorm.weight", (H,))
        b.plain(p + "post_attention_layernorm.weight", (H,))
        _mla(b, p + "self_attn.", indexer)
        if moe:
            _deepseek_moe(b, p + "mlp.", 136)
        else:
            _gated_mlp(b, p + "mlp.", 330)
    mtp = "model.layers.3."  # = num_hidden_layers: the MTP layer, no embed_tokens, no shared_head.head
    b.linear(mtp + "eh_proj", (H, 2 * H), quantized=False)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        b.plain(mtp + norm + ".weight", (H,))
    b.plain("model.norm.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    config = {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "hidden_size": H,
        "intermediate_size": 330,
        "moe_intermediate_size": 136,
        "n_shared_experts": 1,
        "n_routed_experts": E,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 3,
        "num_nextn_predict_layers": 1,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "num_attention_heads": 4,
        "index_n_heads": 2,
        "indexer_types": ["full", "full", "shared"],  # GLM-5.2: indexers on "full" layers only
        "index_head_dim": 32,
        "vocab_size": 300,
    }
    # the release's list names self_attn.indexers_proj, a module that does not exist
    skip = ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.self_attn.indexers_proj" for i in range(4)]
    config = _with_quant(config, layout, modules_to_not_convert=skip)
    b.write(folder, config)
    return Release("glm_moe_dsa", folder, config, b.fp8, b.bf16_linears, layout, "GlmMoeDsaForCausalLM")


# ---------------------------------------------------------------------------------------------------
# Nemotron-H (nemotron_h): backbone.layers.{L}.mixer.*; Mamba, attention, latent MoE and MLP mixers


def _nemotron_h(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    latent, inter, moe_inter, shared_inter = 64, 330, 136, 200
    b.plain("backbone.embeddings.weight", (300, H))
    pattern = "M*E-"
    for i, kind in enumerate(pattern):
        p = f"backbone.layers.{i}."
        b.plain(p + "norm.weight", (H,))
        if kind == "M":  # Mamba-2: in_proj FP8 in the release, with an input_scale
            b.linear(p + "mixer.in_proj", (2 * 128 + 2 * 16 + 4, H))
            b.plain(p + "mixer.conv1d.weight", (128 + 2 * 16, 1, 4))
            b.plain(p + "mixer.conv1d.bias", (128 + 2 * 16,))
            for small in ("A_log", "D", "dt_bias"):
                b.plain(p + "mixer." + small, (4,), torch.float32)
            b.plain(p + "mixer.norm.weight", (128,))
            b.linear(p + "mixer.out_proj", (H, 128))
        elif kind == "*":
            _attention(b, p + "mixer.")
        elif kind == "E":  # non-gated experts in the latent space, shared experts in the hidden one
            b.plain(p + "mixer.gate.weight", (E, H), torch.float32)
            b.plain(p + "mixer.gate.e_score_correction_bias", (E,), torch.float32)
            for e in range(E):
                b.linear(f"{p}mixer.experts.{e}.up_proj", (moe_inter, latent))
                b.linear(f"{p}mixer.experts.{e}.down_proj", (latent, moe_inter))
            b.linear(p + "mixer.shared_experts.up_proj", (shared_inter, H))
            b.linear(p + "mixer.shared_experts.down_proj", (H, shared_inter))
            b.linear(p + "mixer.fc1_latent_proj", (latent, H))
            b.linear(p + "mixer.fc2_latent_proj", (H, latent))
        else:
            b.linear(p + "mixer.up_proj", (inter, H))
            b.linear(p + "mixer.down_proj", (H, inter))
    b.plain("backbone.norm_f.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    b.plain("mtp.layers.0.norm.weight", (H,))
    _attention(b, "mtp.layers.0.mixer.")
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": H,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_inter,
        "moe_shared_expert_intermediate_size": shared_inter,
        "moe_latent_size": latent,
        "n_routed_experts": E,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_num_heads": 4,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "num_nextn_predict_layers": 1,
        "vocab_size": 300,
    }
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("nemotron_h", folder, config, b.fp8, b.bf16_linears, layout, "NemotronHForCausalLM")


# ---------------------------------------------------------------------------------------------------
# Step-3.5 / 3.7-Flash (step3p5): experts stacked 3-D as moe.{gate,up,down}_proj.weight, share_expert


def _step3p5(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    inter, moe_inter, share = 330, 136, 136  # share_expert_dim equals moe_intermediate_size, as in the release
    b.plain("model.embed_tokens.weight", (300, H))
    for i in range(2):
        p = f"model.layers.{i}."
        b.plain(p + "input_layernorm.weight", (H,))
        b.plain(p + "post_attention_layernorm.weight", (H,))
        _attention(b, p + "self_attn.")
        if i == 0:
            _gated_mlp(b, p + "mlp.", inter)
            continue
        b.plain(p + "moe.gate.weight", (E, H), torch.float32)
        b.plain(p + "moe.router_bias", (E,), torch.float32)
        b.linear(p + "moe.gate_proj", (E, moe_inter, H))
        b.linear(p + "moe.up_proj", (E, moe_inter, H))
        b.linear(p + "moe.down_proj", (E, H, moe_inter))
        _gated_mlp(b, p + "share_expert.", share)
    b.plain("model.norm.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    config = {
        "architectures": ["Step3p5ForCausalLM"],
        "model_type": "step3p5",
        "hidden_size": H,
        "intermediate_size": inter,
        "moe_intermediate_size": moe_inter,
        "share_expert_dim": share,
        "moe_num_experts": E,
        "moe_top_k": 2,
        "moe_layers_enum": "1",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_attention_groups": 2,
        "head_dim": 32,
        "vocab_size": 300,
    }
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("step3p5", folder, config, b.fp8, b.bf16_linears, layout)


# ---------------------------------------------------------------------------------------------------
# Hy3 (hy_v3), Ling / Ring (bailing_moe_v2), MiniMax-M3 text, Gemma-4, DeepSeek-V4-Flash-0731's DSpark


def _hy_v3(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    b.plain("model.embed_tokens.weight", (300, H))
    for i in range(2):
        p = f"model.layers.{i}."
        b.plain(p + "input_layernorm.weight", (H,))
        b.plain(p + "post_attention_layernorm.weight", (H,))
        _attention(b, p + "self_attn.")
        b.plain(p + "self_attn.q_norm.weight", (32,))
        b.plain(p + "self_attn.k_norm.weight", (32,))
        if i == 0:
            _gated_mlp(b, p + "mlp.", 330)
            continue
        b.plain(p + "mlp.router.gate.weight", (E, H), torch.float32)
        b.plain(p + "mlp.expert_bias", (E,), torch.float32)
        _experts(b, p + "mlp.", 136, fused=False)
        _gated_mlp(b, p + "mlp.shared_mlp.", 136)
    b.plain("model.norm.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    config = {
        "architectures": ["HYV3ForCausalLM"],
        "model_type": "hy_v3",
        "hidden_size": H,
        "intermediate_size": 330,
        "moe_intermediate_size": 136,
        "num_experts": E,
        "num_shared_experts": 1,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 300,
    }
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("hy_v3", folder, config, b.fp8, b.bf16_linears, layout, "HYV3ForCausalLM")


def _bailing(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    b.plain("model.word_embeddings.weight", (300, H))
    for i in range(2):
        p = f"model.layers.{i}."
        b.plain(p + "input_layernorm.weight", (H,))
        b.linear(p + "attention.query_key_value", ((4 + 2 * 2) * 32, H))
        b.linear(p + "attention.dense", (H, 4 * 32))
        if i == 0:
            _gated_mlp(b, p + "mlp.", 330)
            continue
        b.plain(p + "mlp.gate.weight", (E, H), torch.float32)
        b.plain(p + "mlp.gate.expert_bias", (E,), torch.float32)
        _experts(b, p + "mlp.", 136, fused=False)
        _gated_mlp(b, p + "mlp.shared_experts.", 2 * 136)
    b.plain("model.norm.weight", (H,))
    b.linear("lm_head", (300, H), quantized=False)
    config = {
        "architectures": ["BailingMoeV2ForCausalLM"],
        "model_type": "bailing_moe_v2",
        "hidden_size": H,
        "intermediate_size": 330,
        "moe_intermediate_size": 136,
        "num_shared_experts": 2,
        "num_experts": E,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
    }
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("bailing_moe_v2", folder, config, b.fp8, b.bf16_linears, layout)


def _minimax_m3(folder: Path, layout: str) -> Release:
    b = _Builder(layout)
    lm = "language_model.model."
    b.plain(lm + "embed_tokens.weight", (300, H))
    p = lm + "layers.0."
    _attention(b, p + "self_attn.")
    b.plain(p + "block_sparse_moe.gate.weight", (E, H), torch.float32)
    b.plain(p + "block_sparse_moe.e_score_correction_bias", (E,), torch.float32)
    for e in range(E):
        _gated_mlp(b, f"{p}block_sparse_moe.experts.{e}.", 136, ("w1", "w3", "w2"))
    b.linear("language_model.lm_head", (300, H), quantized=False)
    b.linear("vision_tower.vision_model.encoder.layers.0.mlp.fc1", (128, 64), quantized=False)
    b.linear("patch_merge_mlp.linear_1", (256, 256), quantized=False)
    b.linear("patch_merge_mlp.linear_2", (H, 256), quantized=False)
    b.linear("multi_modal_projector.linear_1", (H, H), quantized=False)
    text = {"hidden_size": H, "intermediate_size": 136, "num_hidden_layers": 1, "num_local_experts": E}
    config = {"architectures": ["MiniMaxM3VLForConditionalGeneration"], "model_type": "minimax_m3_vl"}
    config = _with_quant(config | {"text_config": text}, layout)
    b.write(folder, config)
    return Release("minimax_m3_vl", folder, config, b.fp8, b.bf16_linears, layout)


def _gemma4(folder: Path, layout: str) -> Release:
    """The three bf16 Linears whose names hold `embed` must end up in the FP8 outputs' ignore lists."""
    b = _Builder(layout)
    lm = "model.language_model."
    b.plain(lm + "embed_tokens.weight", (300, H))
    p = lm + "layers.0."
    _attention(b, p + "self_attn.")
    _gated_mlp(b, p + "mlp.", 330)
    b.plain(p + "input_layernorm.weight", (H,))
    b.linear("model.vision_tower.patch_embedder.input_proj", (64, 48), quantized=False)
    b.linear("model.vision_tower.encoder.layers.0.mlp.gate_proj.linear", (128, 64), quantized=False)
    b.linear("model.audio_tower.layers.0.feed_forward1.ffw_layer_1.linear", (128, 64), quantized=False)
    b.linear("model.embed_vision.embedding_projection", (H, 64), quantized=False)
    b.linear("model.embed_audio.embedding_projection", (H, 64), quantized=False)
    text = {"model_type": "gemma4_text", "hidden_size": H, "intermediate_size": 330, "num_hidden_layers": 1}
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("gemma4", folder, config, b.fp8, b.bf16_linears, layout)


def _gemma4_e(folder: Path, layout: str) -> Release:
    """Gemma-4 E2B / E4B: the last num_kv_shared_layers layers reuse an earlier layer's KV and, with
    use_double_wide_mlp, have MLPs twice intermediate_size wide (transformers 5.24 modeling_gemma4.py
    Gemma4TextMLP: intermediate_size * 2 where kv_sharing_modes[layer] == "reuse"); no per-layer key."""
    b = _Builder(layout)
    lm = "model.language_model."
    b.plain(lm + "embed_tokens.weight", (300, H))
    for layer, width in enumerate((330, 330, 660)):
        p = f"{lm}layers.{layer}."
        _attention(b, p + "self_attn.")
        _gated_mlp(b, p + "mlp.", width)
        b.plain(p + "input_layernorm.weight", (H,))
    text = {"model_type": "gemma4_text", "hidden_size": H, "intermediate_size": 330, "num_hidden_layers": 3}
    text |= {"num_kv_shared_layers": 1, "use_double_wide_mlp": True, "layer_types": ["full_attention"] * 3}
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    config = _with_quant(config, layout)
    b.write(folder, config)
    return Release("gemma4", folder, config, b.fp8, b.bf16_linears, layout)


def _dspark(folder: Path, layout: str) -> Release:
    """DeepSeek-V4-Flash-0731's draft at mtp.{i}.*, beside a decoder in bf16 (the V4 layouts are elsewhere).
    main_proj is one of the Linears a bf16 -> FP8 run quantizes: vLLM's DSpark draft for DeepSeek-V4 builds
    it as ReplicatedLinear(quant_config=vllm_config.quant_config), SGLang's DSpark layer likewise, and the
    release ships it FP8 with a `.scale` (loaders read mtp.0.main_proj.weight + .scale)."""
    b = _Builder(layout)
    b.plain("embed.weight", (300, H))
    _attention(b, "layers.0.attn.")
    for i in range(2):
        b.linear(f"mtp.{i}.main_proj", (H, 2 * H))
        b.plain(f"mtp.{i}.main_norm.weight", (H,))
    config = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4_dspark_test"}
    config |= {"hidden_size": H, "num_hidden_layers": 1}
    b.write(folder, config, shards=1)
    return Release("dspark", folder, config, b.fp8, b.bf16_linears, layout)


_BUILDERS: dict[str, Callable[[Path], Release]] = {
    "qwen3.6-35b-a3b-fp8": lambda f: _qwen3_5(f, "block", moe=True),
    "qwen3.6-27b-fp8": lambda f: _qwen3_5(f, "block", moe=False),
    "qwen3.6-35b-a3b-bf16": lambda f: _qwen3_5(f, "bf16", moe=True),
    "glm-5.2-fp8": lambda f: _glm5(f, "block"),
    "glm-5.2-bf16": lambda f: _glm5(f, "bf16"),
    "nemotron-3-bf16": lambda f: _nemotron_h(f, "bf16"),
    "nemotron-3-fp8-tensor": lambda f: _nemotron_h(f, "tensor"),
    "step-3.5-flash-fp8": lambda f: _step3p5(f, "block"),
    "hy3-fp8": lambda f: _hy_v3(f, "block"),
    "hy3-bf16": lambda f: _hy_v3(f, "bf16"),
    "ling-fp8": lambda f: _bailing(f, "block"),
    "minimax-m3-bf16": lambda f: _minimax_m3(f, "bf16"),
    "gemma-4-fp8": lambda f: _gemma4(f, "block"),
    "gemma-4-e4b-fp8": lambda f: _gemma4_e(f, "block"),
    "dspark-bf16": lambda f: _dspark(f, "bf16"),
}
RELEASES = tuple(_BUILDERS)


def build_release(name: str, folder: Path) -> Release:
    release = _BUILDERS[name](folder)
    release.name = name
    return release
