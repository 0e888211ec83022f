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


# ------------------------------------------------------------------ DeepSeek-V4.1-Flash: two geometries

V41_HIDDEN, V41_INTER, V41_EXPERTS, V41_ROWS = 160, 96, 2, 300  # ROWS: the Engram table's, not 32-aligned


def v41_config() -> dict:
    """A composite config as V4.1 ships it: quantization_config at the top with expert_dtype inside it,
    the text model's geometry in text_config."""
    text = {
        "model_type": "deepseek_v41_text",
        "hidden_size": V41_HIDDEN,
        "num_hidden_layers": 2,
        "moe_intermediate_size": V41_INTER,
        "n_routed_experts": V41_EXPERTS,
        "n_shared_experts": 1,
        "engram_layer_ids": [1],
        "vocab_size": 64,
    }
    quant = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "torch_dtype": "bfloat16",
        "text_config": text,
        "quantization_config": quant,
    }


def _e8m0_block(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, its E8M0 scale on `block`'s grid, the exact float32 decode)."""
    from tests.support.helpers import fp8
    from tests.support.packing import e8m0_value, random_e8m0
    from tests.support.reference import dequant_block_reference

    q = fp8((n, k), seed)
    scale = random_e8m0((-(-n // block[0]), -(-k // block[1])), seed, 112, 124)
    return (
        q,
        scale.view(torch.float8_e8m0fnu),
        dequant_block_reference(q, e8m0_value(scale).to(torch.float32), block, torch.float32),
    )


def build_v41(path: Path) -> dict[str, torch.Tensor]:
    """DeepSeek-native names: dense FP8 in 32x32 E8M0 blocks (`.scale`), MXFP4 routed experts (1x32), the
    Engram table in (1, 32) blocks under the declared [32, 32] alone in the last shard, Engram's wkv
    in 32x32, bf16 q/k weights. Returns each quantized weight's exact float32 decode."""
    from tests.support.helpers import write_checkpoint
    from tests.support.packing import e2m1_value, e8m0_value, group_scaled, pack_nibbles, random_codes, random_e8m0

    tensors: dict[str, torch.Tensor] = {
        "embed.weight": torch.randn(64, V41_HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
        "head.weight": torch.randn(64, V41_HIDDEN, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16),
        "norm.weight": torch.ones(V41_HIDDEN, dtype=torch.bfloat16),
    }
    truth: dict[str, torch.Tensor] = {}
    seed = 10
    dense = {
        "attn.wq_a": (200, V41_HIDDEN),
        "attn.wo_a": (V41_HIDDEN, 96),
        "ffn.shared_experts.w1": (V41_INTER, V41_HIDDEN),
    }
    dense |= {"ffn.shared_experts.w3": (V41_INTER, V41_HIDDEN), "ffn.shared_experts.w2": (V41_HIDDEN, V41_INTER)}
    for layer in range(2):
        p = f"layers.{layer}."
        tensors[p + "ffn.gate.weight"] = torch.randn(V41_EXPERTS, V41_HIDDEN).to(torch.bfloat16)
        for name, (n, k) in dense.items():
            seed += 1
            q, scale, value = _e8m0_block(n, k, (32, 32), seed)
            tensors[p + name + ".weight"], tensors[p + name + ".scale"], truth[p + name + ".weight"] = q, scale, value
        for e in range(V41_EXPERTS):
            for w, (n, k) in {
                "w1": (V41_INTER, V41_HIDDEN),
                "w2": (V41_HIDDEN, V41_INTER),
                "w3": (V41_INTER, V41_HIDDEN),
            }.items():
                seed += 1
                codes, scale = random_codes((n, k), seed), random_e8m0((n, k // 32), seed, 118, 126)
                name = f"{p}ffn.experts.{e}.{w}"
                tensors[name + ".weight"] = pack_nibbles(codes).view(torch.int8)
                tensors[name + ".scale"] = scale.view(torch.float8_e8m0fnu)
                truth[name + ".weight"] = group_scaled(e2m1_value(codes), e8m0_value(scale), 32).to(torch.float32)
    e = "layers.1.engram."
    q, scale, truth[e + "wkv.weight"] = _e8m0_block(96, V41_HIDDEN, (32, 32), 90)
    tensors[e + "wkv.weight"], tensors[e + "wkv.scale"] = q, scale
    tensors[e + "q_weight"] = torch.randn(4, V41_HIDDEN).to(torch.bfloat16)
    tensors[e + "k_weight"] = torch.randn(4, V41_HIDDEN).to(torch.bfloat16)
    write_checkpoint(path, tensors, v41_config(), shards=2)
    # the Engram table alone in a shard of its own, as the release has it
    from safetensors.torch import save_file

    q, scale, truth[e + "embed.weight"] = _e8m0_block(V41_ROWS, 64, (1, 32), 91)
    table = "model-00003-of-00003.safetensors"
    save_file({e + "embed.weight": q, e + "embed.scale": scale}, str(path / table), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    renamed = {}
    for old in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        new = old.replace("of-00002", "of-00003")
        (path / old).rename(path / new)
        renamed[old] = new
    index["weight_map"] = {n: renamed[f] for n, f in index["weight_map"].items()}
    index["weight_map"] |= {e + "embed.weight": table, e + "embed.scale": table}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return truth


# ------------------------------------------------------------------ AMD Quark exports

QUARK_HIDDEN, QUARK_INTER = 256, 192


def quark_spec(dtype: str, qscheme: str, **extra) -> dict:
    """One Quark QTensorConfig as QConfig.to_dict() writes it."""
    return {"dtype": dtype, "qscheme": qscheme, "is_dynamic": False, "symmetric": True, "ch_axis": None} | extra


MXFP4_SPEC = quark_spec("fp4", "per_group", group_size=32, scale_format="e8m0", scale_type="float", ch_axis=-1)
BLOCK_SPEC = quark_spec("fp8_e4m3", "per_block", block_size=[128, 128], scale_type="float32")
DYNAMIC_INPUT = quark_spec("fp8_e4m3", "per_token", is_dynamic=True)


def quark_layers() -> dict:
    """build_quark's layer_quant_config: the first key matching a module gives its scheme."""
    per_tensor = quark_spec("fp8_e4m3", "per_tensor")
    return {
        "model.layers.0.*": {"weight": BLOCK_SPEC, "input_tensors": DYNAMIC_INPUT, "output_tensors": None},
        "*o_proj": {"weight": per_tensor, "input_tensors": per_tensor},
        "*down_proj": {"weight": quark_spec("fp8_e4m3", "per_channel", ch_axis=0), "input_tensors": DYNAMIC_INPUT},
    }


def quark_config(layer_quant_config: dict | None = None, exclude: list | None = None, **sections) -> dict:
    """A Quark export's config.json: a DeepSeek-V3-shaped text model, `quantization_config` as Quark writes it."""
    quant = {
        "quant_method": "quark",
        "global_quant_config": {"weight": MXFP4_SPEC, "input_tensors": None, "output_tensors": None, "bias": None},
        "layer_quant_config": layer_quant_config or {},
        "layer_type_quant_config": {},
        "exclude": exclude if exclude is not None else ["lm_head", "model.layers.*.mlp.gate"],
        "export": {
            "kv_cache_group": [],
            "pack_method": "reorder",
            "weight_format": "real_quantized",
            "min_kv_scale": 0.0,
        },
        "quant_mode": "eager_mode",
        "version": "0.11",
    } | sections
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": QUARK_HIDDEN,
        "intermediate_size": QUARK_INTER,
        "moe_intermediate_size": QUARK_INTER,
        "num_hidden_layers": 2,
        "n_routed_experts": 2,
        "vocab_size": 64,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }


def build_quark(path: Path, config: dict | None = None) -> dict[str, torch.Tensor]:
    """GLM-5.3-Flash-Quark's mix, small: layer 0 block FP8 128x128 with float32 `.weight_scale` (a
    multiplier) through layer_quant_config, layer 1 MXFP4 (uint8 `.weight` [N, K/2] low nibble first, E8M0
    uint8 `.weight_scale` [N, K/32]) by the global config, o_proj FP8 per tensor (0-D weight_scale, static
    input_scale), a per-channel down_proj ([N] scale), the router and lm_head excluded (bf16). Returns each
    quantized weight's exact float32 decode."""
    from tests.support.helpers import fp8, write_checkpoint
    from tests.support.packing import e2m1_value, e8m0_value, group_scaled, pack_nibbles, random_codes, random_e8m0
    from tests.support.reference import dequant_block_reference

    h, i = QUARK_HIDDEN, QUARK_INTER
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(64, h).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, h).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    truth: dict[str, torch.Tensor] = {}
    shapes = {"self_attn.q_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h)}
    seed = 40
    for layer in range(2):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "mlp.gate.weight"] = torch.randn(2, h).to(torch.bfloat16)
        for module, (n, k) in shapes.items():
            seed += 1
            name = p + module + ".weight"
            if layer == 0:  # block FP8
                q = fp8((n, k), seed)
                scale = (
                    torch.rand(-(-n // 128), -(-k // 128), generator=torch.Generator().manual_seed(seed)) * 0.01 + 1e-3
                )
                tensors[name], tensors[p + module + ".weight_scale"] = q, scale
                truth[name] = dequant_block_reference(q, scale, (128, 128), torch.float32)
            else:  # MXFP4
                codes, scale = random_codes((n, k), seed), random_e8m0((n, k // 32), seed, 118, 126)
                tensors[name] = pack_nibbles(codes)
                tensors[p + module + ".weight_scale"] = scale
                truth[name] = group_scaled(e2m1_value(codes), e8m0_value(scale), 32).to(torch.float32)
        o = p + "self_attn.o_proj"
        q = fp8((h, h), seed + 100)
        tensors[o + ".weight"], tensors[o + ".weight_scale"] = q, torch.tensor(0.0123)
        tensors[o + ".input_scale"] = torch.tensor(0.05)
        truth[o + ".weight"] = q.to(torch.float32) * torch.tensor(0.0123)
        d = p + "mlp.down_proj"
        q = fp8((h, i), seed + 200)
        per_row = torch.rand(h, generator=torch.Generator().manual_seed(seed)) * 0.01 + 1e-3
        tensors[d + ".weight"], tensors[d + ".weight_scale"] = q, per_row
        truth[d + ".weight"] = q.to(torch.float32) * per_row[:, None]
    config = config or quark_config(quark_layers())
    write_checkpoint(path, tensors, config, shards=2)
    return truth
