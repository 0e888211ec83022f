"""Tiny checkpoints in the special layouts of 2026's releases (issue 24), with their own plain decode:
written here from the layouts' definitions (sglang-jax dequant_fused_kv, vLLM _shard_fp8_qkv_proj,
transformers FP8Experts), never with fp8conv's code.

- MiMo-V2-Flash: K and V of each KV head quantized as one unit (head_dim 192 + v_head_dim 128 = 320 rows,
  3 row blocks: k_proj keeps 2 scale rows per head, v_proj 1); full and sliding-window layers differ in
  their KV heads; one layer quantized the usual way (K and V apart).
- MiMo-V2.5: qkv_proj fused, [Q_g | K_g | V_g] per KV head, each group quantized alone.
- Mistral-Small-4 / transformers-5 FineGrainedFP8 (per-tensor): fused experts with a scale per gate/up
  half ([E, 2, 1]), down_proj [E, 1, 1] or [E], activation scales [E], an FP8 embedding with `weight_scale` [1].
"""

from __future__ import annotations

import math

import torch

from tests.support.helpers import write_checkpoint

FP8_MAX = 448.0
BLOCK = 128
HIDDEN = 200  # two column blocks, the second partial
HEAD_DIM, V_HEAD_DIM = 192, 128


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def quantize_block_plain(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks over zero padding: scale = amax / 448, q = w / scale."""
    n, k = w.shape
    gn, gk = math.ceil(n / BLOCK), math.ceil(k / BLOCK)
    padded = torch.zeros(gn * BLOCK, gk * BLOCK)
    padded[:n, :k] = w
    blocks = padded.view(gn, BLOCK, gk, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * BLOCK, gk * BLOCK)[:n, :k].contiguous(), scale


def decode_block_plain(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32(q) * float32(scale) of its 128x128 block (the naive grid when the grid is not that)."""
    n, k = q.shape
    rows = torch.arange(n) // BLOCK
    cols = torch.arange(k) // BLOCK
    return q.to(torch.float32) * scale.to(torch.float32)[rows][:, cols]


# ------------------------------------------------------------------ MiMo-V2-Flash, per-head fused K/V


def quantize_kv_per_head(k: torch.Tensor, v: torch.Tensor, kv: int):
    """Each head's [K_h; V_h] quantized as one unit; k_proj gets the unit's first 2 scale rows, v_proj the last."""
    qk, qv, sk, sv = [], [], [], []
    for h in range(kv):
        unit = torch.cat([k[h * HEAD_DIM : (h + 1) * HEAD_DIM], v[h * V_HEAD_DIM : (h + 1) * V_HEAD_DIM]])
        q, s = quantize_block_plain(unit)  # 320 rows -> 3 row blocks
        qk.append(q[:HEAD_DIM])
        qv.append(q[HEAD_DIM:])
        sk.append(s[:2])
        sv.append(s[2:])
    return torch.cat(qk), torch.cat(sk), torch.cat(qv), torch.cat(sv)


def decode_kv_per_head(qk, sk, qv, sv, kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact decode: each head's unit put back together and decoded on its own 3 blocks."""
    ks, vs = [], []
    for h in range(kv):
        unit = torch.cat([qk[h * HEAD_DIM : (h + 1) * HEAD_DIM], qv[h * V_HEAD_DIM : (h + 1) * V_HEAD_DIM]])
        scale = torch.cat([sk[2 * h : 2 * h + 2], sv[h : h + 1]])
        w = decode_block_plain(unit, scale)
        ks.append(w[:HEAD_DIM])
        vs.append(w[HEAD_DIM:])
    return torch.cat(ks), torch.cat(vs)


def mimo_flash_config() -> dict:
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "hidden_size": HIDDEN,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "v_head_dim": V_HEAD_DIM,
        "swa_num_attention_heads": 8,
        "swa_num_key_value_heads": 4,
        "swa_head_dim": HEAD_DIM,
        "swa_v_head_dim": V_HEAD_DIM,
        "hybrid_layer_pattern": [0, 1, 0],
        "vocab_size": 64,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }


# layer prefix -> (KV heads, per-head fused?): full, sliding-window, one quantized the usual way, MTP
MIMO_LAYERS = {
    "model.layers.0.self_attn.": (2, True),
    "model.layers.1.self_attn.": (4, True),
    "model.layers.2.self_attn.": (2, False),
    "model.mtp.layers.0.self_attn.": (2, True),
}


def build_mimo_flash(path, shards: int = 2) -> dict[str, torch.Tensor]:
    """The checkpoint, and the exact float32 decode of every FP8 weight by name."""
    tensors: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    for i, (prefix, (kv, fused)) in enumerate(MIMO_LAYERS.items()):
        k = torch.randn(kv * HEAD_DIM, HIDDEN, generator=_gen(i)) * 0.05
        v = torch.randn(kv * V_HEAD_DIM, HIDDEN, generator=_gen(100 + i)) * 0.05
        v[: V_HEAD_DIM // 2] *= 40  # V rows unlike K's, so a scale taken from the wrong unit shows
        if fused:
            qk, sk, qv, sv = quantize_kv_per_head(k, v, kv)
            truth[prefix + "k_proj.weight"], truth[prefix + "v_proj.weight"] = decode_kv_per_head(qk, sk, qv, sv, kv)
        else:
            (qk, sk), (qv, sv) = quantize_block_plain(k), quantize_block_plain(v)
            truth[prefix + "k_proj.weight"], truth[prefix + "v_proj.weight"] = (
                decode_block_plain(qk, sk),
                decode_block_plain(qv, sv),
            )
        tensors |= {prefix + "k_proj.weight": qk, prefix + "k_proj.weight_scale_inv": sk}
        tensors |= {prefix + "v_proj.weight": qv, prefix + "v_proj.weight_scale_inv": sv}
        heads = 8 if kv == 4 else 4
        o = torch.randn(HIDDEN, heads * V_HEAD_DIM, generator=_gen(200 + i)) * 0.05
        qo, so = quantize_block_plain(o)
        tensors |= {prefix + "o_proj.weight": qo, prefix + "o_proj.weight_scale_inv": so}
        truth[prefix + "o_proj.weight"] = decode_block_plain(qo, so)
    tensors["model.embed_tokens.weight"] = torch.randn(64, HIDDEN, generator=_gen(7)).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(64, HIDDEN, generator=_gen(8)).to(torch.bfloat16)
    write_checkpoint(path, tensors, mimo_flash_config(), shards=shards)
    return truth


# ------------------------------------------------------------------ MiMo-V2.5, qkv_proj per KV head


def mimo_fused_qkv_config() -> dict:
    config = mimo_flash_config() | {"model_type": "mimo_v2", "architectures": ["MiMoV2ForCausalLM"]}
    return config | {"attention_projection_layout": "fused_qkv", "num_hidden_layers": 2, "hybrid_layer_pattern": [0, 1]}


# layer prefix -> (query heads, KV heads): full attention, sliding-window, and the MTP layer (sliding-window)
MIMO_FUSED_LAYERS = {
    "model.layers.0.self_attn.": (4, 2),
    "model.layers.1.self_attn.": (8, 4),
    "model.mtp.layers.0.self_attn.": (8, 4),
}
MIMO_CKPT_TP = 2  # config num_key_value_heads: the chunks of every layer's qkv_proj


def mimo_chunk_rows(heads: int, kv: int) -> tuple[int, int, int]:
    """(q, k, v) rows of one chunk: heads / ckpt_tp query heads, max(1, kv / ckpt_tp) key and value heads
    (sglang _get_ckpt_qkv_shard_sizes, vLLM after vllm#57508)."""
    kv_per_chunk = max(1, kv // MIMO_CKPT_TP)
    return heads // MIMO_CKPT_TP * HEAD_DIM, kv_per_chunk * HEAD_DIM, kv_per_chunk * V_HEAD_DIM


def build_mimo_fused_qkv(path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """qkv_proj stored in ckpt_tp chunks of [Q_c; K_c; V_c], each chunk quantized alone: the full layer's
    chunks are 704 rows (5.5 blocks: 12 scale rows, where a plain grid has 11), the sliding-window and MTP
    layers' 1408 (11 blocks: 22 either way). Returns the exact decode by name in the stored order, and in
    the plain [Q; K; V] order engines read unquantized."""
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for n, (prefix, (heads, kv)) in enumerate(MIMO_FUSED_LAYERS.items()):
        q, k, v = (
            torch.randn(rows, HIDDEN, generator=_gen(300 + 10 * n + i)) * 0.05
            for i, rows in enumerate((heads * HEAD_DIM, kv * HEAD_DIM, kv * V_HEAD_DIM))
        )
        rq, rk, rv = mimo_chunk_rows(heads, kv)
        chunks = [
            torch.cat([q[c * rq : (c + 1) * rq], k[c * rk : (c + 1) * rk], v[c * rv : (c + 1) * rv]])
            for c in range(MIMO_CKPT_TP)
        ]
        quantized = [quantize_block_plain(w) for w in chunks]
        name = prefix + "qkv_proj.weight"
        tensors[name] = torch.cat([qc for qc, _ in quantized])
        tensors[name + "_scale_inv"] = torch.cat([sc for _, sc in quantized])
        decoded = [decode_block_plain(qc, sc) for qc, sc in quantized]
        stored[name] = torch.cat(decoded)
        plain[name] = torch.cat([d[a:b] for a, b in ((0, rq), (rq, rq + rk), (rq + rk, rq + rk + rv)) for d in decoded])
    tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    write_checkpoint(path, tensors, mimo_fused_qkv_config())
    return stored, plain


# ------------------------------------------------------------------ transformers-5 FineGrainedFP8, per-tensor

EXPERTS, INTER = 4, 48


def mistral4_config() -> dict:
    return {
        "architectures": ["Mistral4ForCausalLM"],
        "model_type": "mistral4",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "moe_intermediate_size": INTER,
        "n_routed_experts": EXPERTS,
        "vocab_size": 40,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "weight_block_size": None,
            "modules_to_not_convert": ["lm_head"],
        },
    }


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax() / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def build_mistral4(path) -> dict[str, torch.Tensor]:
    """Layer 0: down_proj_scale_inv [E, 1, 1]; layer 1: [E]. gate_up_proj [E, 2I, H] with a scale per
    half [E, 2, 1] (gate first); an FP8 embedding with weight_scale [1]; the exact decode by name."""
    tensors: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}."
        gate_up = torch.randn(EXPERTS, 2 * INTER, 64, generator=_gen(400 + layer))
        gate_up[:, INTER:] *= 9  # the up half far larger than the gate half: a scale for both would show
        down = torch.randn(EXPERTS, 64, INTER, generator=_gen(410 + layer))
        halves = [[_per_tensor(gate_up[e, h * INTER : (h + 1) * INTER]) for h in range(2)] for e in range(EXPERTS)]
        q_gu = torch.stack([torch.cat([q for q, _ in halves[e]]) for e in range(EXPERTS)])
        s_gu = torch.stack([torch.stack([s for _, s in halves[e]]) for e in range(EXPERTS)]).reshape(EXPERTS, 2, 1)
        per_down = [_per_tensor(down[e]) for e in range(EXPERTS)]
        q_d = torch.stack([q for q, _ in per_down])
        s_d = torch.stack([s for _, s in per_down])
        s_d = s_d.reshape(EXPERTS, 1, 1) if layer == 0 else s_d.reshape(EXPERTS)
        tensors |= {p + "mlp.experts.gate_up_proj": q_gu, p + "mlp.experts.gate_up_proj_scale_inv": s_gu}
        tensors |= {p + "mlp.experts.down_proj": q_d, p + "mlp.experts.down_proj_scale_inv": s_d}
        tensors[p + "mlp.experts.gate_up_proj_activation_scale"] = torch.rand(EXPERTS, generator=_gen(5)) + 0.5
        tensors[p + "mlp.experts.down_proj_activation_scale"] = torch.rand(EXPERTS, generator=_gen(6)) + 0.5
        rows = torch.arange(2 * INTER) // INTER  # which half a row is in
        truth[p + "mlp.experts.gate_up_proj"] = q_gu.to(torch.float32) * s_gu[:, rows, :]
        truth[p + "mlp.experts.down_proj"] = q_d.to(torch.float32) * s_d.reshape(EXPERTS, 1, 1)
        q, s = _per_tensor(torch.randn(64, 64, generator=_gen(420 + layer)))
        tensors |= {p + "self_attn.q_proj.weight": q, p + "self_attn.q_proj.weight_scale_inv": s}
        tensors[p + "self_attn.q_proj.activation_scale"] = torch.tensor(0.7)
        truth[p + "self_attn.q_proj.weight"] = q.to(torch.float32) * s
    q, s = _per_tensor(torch.randn(40, 64, generator=_gen(9)))
    tensors |= {"model.embed_tokens.weight": q, "model.embed_tokens.weight_scale": s.reshape(1)}
    truth["model.embed_tokens.weight"] = q.to(torch.float32) * s
    tensors["lm_head.weight"] = torch.randn(40, 64, generator=_gen(10)).to(torch.bfloat16)
    write_checkpoint(path, tensors, mistral4_config(), shards=2)
    return truth


# ------------------------------------------------------------------ Mistral-native only (Mistral-Large-3)

MISTRAL_NATIVE_FP8 = [
    "layers.0.attention.wq_a",
    "layers.0.attention.wq_b",
    "layers.0.attention.wkv_a_with_mqa",
    "layers.0.attention.wkv_b",
    "layers.0.attention.wo",
    "layers.0.feed_forward.w1",
    "layers.0.feed_forward.w2",
    "layers.0.feed_forward.w3",
    "layers.1.experts.0.w1",
    "layers.1.experts.0.w2",
    "layers.1.experts.1.w3",
    "layers.1.shared_experts.w1",
]


def mistral_large3_params() -> dict:
    return {
        "dim": 64,
        "n_layers": 2,
        "head_dim": 32,
        "hidden_dim": 96,
        "n_heads": 2,
        "n_kv_heads": 2,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 32,
        "vocab_size": 40,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "moe": {
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "expert_hidden_dim": 48,
            "first_k_dense_replace": 1,
            "num_shared_experts": 1,  # what makes vLLM build MistralLarge3ForCausalLM (deepseek_v3)
        },
        "llama_4_scaling": {"original_max_position_embeddings": 8192, "beta": 0.1},
        "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"},
    }


def build_mistral_native(path) -> dict[str, torch.Tensor]:
    """consolidated-0000{1,2}-of-00002.safetensors + params.json + tekken.json, no config.json, no HF
    shard: per-tensor `qscale_weight` (0-D and [1]) and `qscale_act`, a KV fake-quantizer scale, bf16
    norms, router, embeddings and output. The exact decode of every FP8 weight by name."""
    import json

    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    for i, module in enumerate(MISTRAL_NATIVE_FP8):
        q, s = _per_tensor(torch.randn(48 + 8 * (i % 3), 64, generator=_gen(500 + i)))
        s = s.reshape(1) if i % 2 else s
        tensors |= {module + ".weight": q, module + ".qscale_weight": s, module + ".qscale_act": torch.tensor(0.25)}
        truth[module + ".weight"] = q.to(torch.float32) * s.reshape(())
    for name, shape in [
        ("tok_embeddings.weight", (40, 64)),
        ("output.weight", (40, 64)),
        ("layers.1.gate.weight", (2, 64)),
    ]:
        tensors[name] = torch.randn(shape, generator=_gen(9)).to(torch.bfloat16)
    for name in ["norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"]:
        tensors[name] = torch.ones(64, dtype=torch.bfloat16)
    tensors["layers.0.attention.kv_fake_quantizer.qscale_act"] = torch.tensor(0.5)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    for part in range(2):
        shard = {n: tensors[n].contiguous() for n in names[part::2]}
        save_file(shard, str(path / f"consolidated-{part + 1:05d}-of-00002.safetensors"), metadata={"format": "pt"})
    (path / "params.json").write_text(json.dumps(mistral_large3_params(), indent=2))
    (path / "tekken.json").write_text('{"config": {}}')
    return truth


def build_mimo_transformers(path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny transformers MiMoV2FlashForCausalLM (one full, one sliding layer: 2 and 4 KV heads), every
    Linear but lm_head block FP8, k/v_proj quantized per KV head. (config, the exact decode as a bf16
    state dict, the state dict decoding v_proj on its naive grid)."""
    import transformers

    config = transformers.MiMoV2FlashConfig(
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["full_attention", "sliding_attention"],
        mlp_layer_types=["dense", "dense"],
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = transformers.MiMoV2FlashForCausalLM(config).to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors, exact, naive = dict(state), dict(state), dict(state)
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        k, v = state[p + "k_proj.weight"].float(), state[p + "v_proj.weight"].float()
        v[: V_HEAD_DIM // 2] *= 40  # V rows unlike K's (the same weights in every model compared)
        qk, sk, qv, sv = quantize_kv_per_head(k, v, k.shape[0] // HEAD_DIM)
        tensors |= {p + "k_proj.weight": qk, p + "k_proj.weight_scale_inv": sk}
        tensors |= {p + "v_proj.weight": qv, p + "v_proj.weight_scale_inv": sv}
        dk, dv = decode_kv_per_head(qk, sk, qv, sv, k.shape[0] // HEAD_DIM)
        exact[p + "k_proj.weight"], exact[p + "v_proj.weight"] = dk.bfloat16(), dv.bfloat16()
        naive[p + "k_proj.weight"], naive[p + "v_proj.weight"] = dk.bfloat16(), decode_block_plain(qv, sv).bfloat16()
    plain_linears = ("q_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")
    for name, w in state.items():
        if name.endswith(plain_linears):
            q, s = quantize_block_plain(w.float())
            tensors |= {name: q, name[: -len("weight")] + "weight_scale_inv": s}
            exact[name] = naive[name] = decode_block_plain(q, s).bfloat16()
    raw = config.to_dict() | {
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    }
    write_checkpoint(path, tensors, raw, shards=2)
    return raw, exact, naive
