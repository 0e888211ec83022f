"""Tiny synthetic DeepSeek-V3-like FP8 checkpoints, for tests, examples and demos.

Written with safetensors' own save_file (so it needs numpy, a test/dev dependency), never with
fp8conv's writer, so the reader is tested against files the rest of the world writes. The shapes are
the awkward ones real checkpoints have: kv_a_proj_with_mqa 576 rows under a 5-row grid, a dense MLP of
448 rows under a 4-row grid, 192 rows under 2, hidden size 320 (not a multiple of 128), an MTP layer,
and a scale stored in a different shard from its weight.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FP8_MAX = 448.0


@dataclass
class TinyModelShape:
    vocab_size: int = 256
    hidden_size: int = 320
    intermediate_size: int = 448
    moe_intermediate_size: int = 192
    num_hidden_layers: int = 2  # layer 0 dense, the rest MoE; plus one MTP layer
    num_attention_heads: int = 2
    n_routed_experts: int = 4
    n_shared_experts: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int = 192
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    first_k_dense_replace: int = 1
    num_nextn_predict_layers: int = 1


@dataclass
class TinyCheckpoint:
    path: Path
    shards: list[str]
    config: dict[str, Any] | None
    fp8_weights: list[str] = field(default_factory=list)
    moved_scale: str | None = None  # a scale written to another shard than its weight
    dialect: str = "block"
    linear_weights: list[str] = field(default_factory=list)  # quantized in every dialect but bf16


def quantize_block_fp8(
    w: torch.Tensor,
    block: tuple[int, int],
    scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's recipe: zero-pad to whole blocks, scale = block amax / 448, crop the padding.

    `scale_fn` adjusts the scales before quantizing (e.g. round them to bf16 or up to a power of two).
    """
    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_fn is not None:
        scale = scale_fn(scale)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale.contiguous()


def _pow2_at_least(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(scale)))


def _e8m0_bytes(pow2_scale: torch.Tensor) -> torch.Tensor:
    return (torch.log2(pow2_scale).round().to(torch.int32) + 127).to(torch.uint8)


# The input dialects the factory writes: how each FP8 linear and its companions are stored.
DIALECTS = (
    "block",  # DeepSeek-V3/R1, Qwen3-FP8: weight_scale_inv float32 grid
    "block-bf16-scales",  # some Qwen3 dense: the same grid stored as bf16
    "ue8m0",  # DeepSeek-V3.1: scale_fmt ue8m0, float32 scales (o_proj scales not powers of two)
    "ue8m0-e8m0",  # UE8M0 scales stored as float8_e8m0fnu
    "ue8m0-u8",  # UE8M0 scales stored as uint8 exponents
    "per-tensor",  # AutoFP8 / vLLM: weight_scale 0-D, input_scale
    "per-tensor-mistral",  # transformers / Mistral: weight_scale_inv 0-D, activation_scale
    "channel",  # weight_scale [N]
    "ct-tensor",  # compressed-tensors, strategy tensor: weight_scale [1], input_scale [1]
    "ct-channel",  # compressed-tensors, strategy channel: weight_scale [N, 1]
    "ct-block",  # compressed-tensors, strategy block: weight_scale grid
    "bf16",  # unquantized (e.g. after fine-tuning)
)


def _quantized_tensors(dialect: str, name: str, w: torch.Tensor, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    base = name.removesuffix(".weight")
    n, k = w.shape
    if dialect == "bf16":
        return {name: w.to(torch.bfloat16)}
    if dialect in ("block", "ct-block"):
        q, s = quantize_block_fp8(w, block)
        return {name: q, name + ("_scale_inv" if dialect == "block" else "_scale"): s}
    if dialect == "block-bf16-scales":
        q, s = quantize_block_fp8(w, block, lambda x: x.to(torch.bfloat16).float())
        return {name: q, name + "_scale_inv": s.to(torch.bfloat16)}
    if dialect.startswith("ue8m0"):
        exact_pow2 = dialect != "ue8m0" or not name.endswith("o_proj.weight")
        q, s = quantize_block_fp8(w, block, _pow2_at_least if exact_pow2 else None)
        if dialect == "ue8m0-e8m0":
            return {name: q, name + "_scale_inv": _e8m0_bytes(s).view(torch.float8_e8m0fnu)}
        if dialect == "ue8m0-u8":
            return {name: q, name + "_scale_inv": _e8m0_bytes(s)}
        return {name: q, name + "_scale_inv": s}
    if dialect in ("per-tensor", "per-tensor-mistral", "ct-tensor"):
        q, s = quantize_block_fp8(w, (n, k))
        act = torch.tensor(0.05)
        if dialect == "per-tensor":
            return {name: q, name + "_scale": s.reshape(()), base + ".input_scale": act}
        if dialect == "per-tensor-mistral":
            return {name: q, name + "_scale_inv": s.reshape(()), base + ".activation_scale": act}
        return {name: q, name + "_scale": s.reshape(1), base + ".input_scale": act.reshape(1)}
    if dialect in ("channel", "ct-channel"):
        q, s = quantize_block_fp8(w, (1, k))
        return {name: q, name + "_scale": s.reshape(n) if dialect == "channel" else s}
    raise ValueError(f"unknown dialect {dialect!r}; one of {', '.join(DIALECTS)}")


_CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*eh_proj$", "re:.*shared_head\\.head$"]


def dialect_quantization_config(dialect: str, block: tuple[int, int] | None) -> dict[str, Any] | None:
    """The quantization_config each dialect ships with (None: no quantization_config at all)."""
    if dialect == "bf16":
        return None
    if dialect.startswith("ct-"):
        strategy = dialect[3:]
        weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
        if strategy == "block":
            weights["block_structure"] = list(block or (128, 128))
        acts = {"num_bits": 8, "type": "float", "strategy": "tensor" if strategy == "tensor" else "token"}
        acts["dynamic"] = strategy != "tensor"
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": _CT_IGNORE,
        }
    if dialect == "per-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    if dialect == "per-tensor-mistral":
        return {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "weight_block_size": None,
            "modules_to_not_convert": ["lm_head"],
        }
    if dialect == "channel":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    config: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        config["weight_block_size"] = list(block)
    if dialect.startswith("ue8m0"):
        config["scale_fmt"] = "ue8m0"
    return config


def tiny_config(shape: TinyModelShape) -> dict[str, Any]:
    s = shape
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_nextn_predict_layers": s.num_nextn_predict_layers,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_attention_heads,
        "n_shared_experts": s.n_shared_experts,
        "n_routed_experts": s.n_routed_experts,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 2.5,
        "n_group": 2,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "kv_lora_rank": s.kv_lora_rank,
        "q_lora_rank": s.q_lora_rank,
        "qk_rope_head_dim": s.qk_rope_head_dim,
        "qk_nope_head_dim": s.qk_nope_head_dim,
        "v_head_dim": s.v_head_dim,
        "first_k_dense_replace": s.first_k_dense_replace,
        "hidden_act": "silu",
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return config


def _layer_tensors(s: TinyModelShape, i: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, kind) for one decoder layer; kind is 'fp8', 'norm', 'bf16' or 'f32'."""
    p = f"model.layers.{i}."
    h, heads = s.hidden_size, s.num_attention_heads
    t: dict[str, tuple[tuple[int, ...], str]] = {
        p + "input_layernorm.weight": ((h,), "norm"),
        p + "post_attention_layernorm.weight": ((h,), "norm"),
        p + "self_attn.q_a_proj.weight": ((s.q_lora_rank, h), "fp8"),
        p + "self_attn.q_a_layernorm.weight": ((s.q_lora_rank,), "norm"),
        p + "self_attn.q_b_proj.weight": (
            (heads * (s.qk_nope_head_dim + s.qk_rope_head_dim), s.q_lora_rank),
            "fp8",
        ),
        p + "self_attn.kv_a_proj_with_mqa.weight": ((s.kv_lora_rank + s.qk_rope_head_dim, h), "fp8"),
        p + "self_attn.kv_a_layernorm.weight": ((s.kv_lora_rank,), "norm"),
        p + "self_attn.kv_b_proj.weight": (
            (heads * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
            "fp8",
        ),
        p + "self_attn.o_proj.weight": ((h, heads * s.v_head_dim), "fp8"),
    }

    def mlp(prefix: str, width: int) -> None:
        t[prefix + "gate_proj.weight"] = ((width, h), "fp8")
        t[prefix + "up_proj.weight"] = ((width, h), "fp8")
        t[prefix + "down_proj.weight"] = ((h, width), "fp8")

    if i < s.first_k_dense_replace:
        mlp(p + "mlp.", s.intermediate_size)
    else:
        t[p + "mlp.gate.weight"] = ((s.n_routed_experts, h), "bf16")
        t[p + "mlp.gate.e_score_correction_bias"] = ((s.n_routed_experts,), "f32")
        for e in range(s.n_routed_experts):
            mlp(p + f"mlp.experts.{e}.", s.moe_intermediate_size)
        mlp(p + "mlp.shared_experts.", s.moe_intermediate_size * s.n_shared_experts)
    if i >= s.num_hidden_layers:  # DeepSeek's multi-token-prediction layer
        t[p + "enorm.weight"] = ((h,), "norm")
        t[p + "hnorm.weight"] = ((h,), "norm")
        t[p + "eh_proj.weight"] = ((h, 2 * h), "bf16")
        t[p + "shared_head.norm.weight"] = ((h,), "norm")
        t[p + "shared_head.head.weight"] = ((s.vocab_size, h), "bf16")
        t[p + "embed_tokens.weight"] = ((s.vocab_size, h), "bf16")
    return t


SIDE_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}\n',
    "tokenizer_config.json": '{"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 256}\n',
    "special_tokens_map.json": '{"bos_token": "<s>", "eos_token": "</s>"}\n',
    "generation_config.json": '{"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.6}\n',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}\n",
    "modeling_deepseek.py": "# custom modeling code shipped for trust_remote_code\n",
    "configuration_deepseek.py": "# custom configuration code shipped for trust_remote_code\n",
    "tiktoken.model": "IQ== 0\nIg== 1\n",
    "README.md": "# tiny synthetic DeepSeek-like FP8 checkpoint\n",
    "LICENSE": "MIT\n",
    "figures/note.txt": "a file in a subfolder\n",
}


def build_tiny_deepseek(
    path: str | Path,
    *,
    block: tuple[int, int] = (128, 128),
    config_block: tuple[int, int] | str | None = "same",
    shape: TinyModelShape | None = None,
    num_shards: int = 3,
    with_index: bool = True,
    with_config: bool = True,
    move_a_scale: bool = True,
    seed: int = 0,
    dialect: str = "block",
) -> TinyCheckpoint:
    """Write a tiny DeepSeek-V3-like FP8 checkpoint (block FP8 unless `dialect` says otherwise) into `path`.

    `config_block` is what config.json claims: "same" as `block`, None for no weight_block_size, or a
    different block to make the grids disagree with the config.
    """
    from safetensors.torch import save_file  # needs numpy: a test/dev dependency

    s = shape or TinyModelShape()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    specs: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((s.vocab_size, s.hidden_size), "bf16"),
    }
    for i in range(s.num_hidden_layers + s.num_nextn_predict_layers):
        specs.update(_layer_tensors(s, i))
    specs["model.norm.weight"] = ((s.hidden_size,), "norm")
    specs["lm_head.weight"] = ((s.vocab_size, s.hidden_size), "bf16")

    tensors: dict[str, torch.Tensor] = {}
    linear_weights = []
    for name, (tshape, kind) in specs.items():
        if kind == "norm":
            tensors[name] = (1 + 0.1 * torch.randn(tshape, generator=gen)).to(torch.bfloat16)
        elif kind == "f32":
            tensors[name] = 0.01 * torch.randn(tshape, generator=gen)
        elif kind == "bf16":
            tensors[name] = (0.02 * torch.randn(tshape, generator=gen)).to(torch.bfloat16)
        else:
            # rows of very different magnitude, so a scale applied to the wrong rows shows
            row_gain = torch.exp(torch.randn(tshape[0], 1, generator=gen))
            w = 0.02 * torch.randn(tshape, generator=gen) * row_gain
            tensors.update(_quantized_tensors(dialect, name, w, block))
            linear_weights.append(name)

    shard_of = _assign_shards(list(tensors), num_shards)
    moved = None
    moved_weight = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    scales = [n for n in tensors if n.startswith(moved_weight + "_scale")]
    if move_a_scale and num_shards > 1 and scales:
        moved = scales[0]
        shard_of[moved] = (shard_of[moved] + 1) % num_shards
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    if num_shards == 1 and not with_index:
        names = ["model.safetensors"]
    for i, fname in enumerate(names):
        part = {n: t for n, t in tensors.items() if shard_of[n] == i}
        save_file(part, str(out / fname), metadata={"format": "pt"})
    if with_index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: names[shard_of[n]] for n in sorted(tensors)},
        }
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    claimed = block if config_block == "same" else config_block
    config = tiny_config(s) if with_config else None
    if config is not None:
        quant = dialect_quantization_config(dialect, claimed if not isinstance(claimed, str) else None)
        if quant is not None:
            config["quantization_config"] = quant
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for rel, text in SIDE_FILES.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)
    fp8_weights = [] if dialect == "bf16" else linear_weights
    return TinyCheckpoint(out, names, config, fp8_weights, moved, dialect, linear_weights)


def _assign_shards(names: list[str], num_shards: int) -> dict[str, int]:
    """Layer i goes to shard i % num_shards; embeddings first, final norm and lm_head last."""
    shard_of = {}
    for name in names:
        parts = name.split(".")
        if len(parts) > 2 and parts[1] == "layers":
            shard_of[name] = int(parts[2]) % num_shards
        else:
            shard_of[name] = 0 if "embed_tokens" in name else num_shards - 1
    return shard_of
