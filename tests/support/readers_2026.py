"""Tiny checkpoints in the quantization layouts of 2026's releases, built by the tests' own code.

Each builder writes a checkpoint with the release's tensor names, dtypes, scale layouts and config keys
(not its sizes) and returns a Release whose `truth` holds every quantized weight's value by the format's
definition, in float64: FP8 per-tensor q * s; MXFP8 q * 2^(e - 127) per 1x32 group along K; MXFP4 E2M1
code * 2^(e - 127) per 32; NVFP4 (ModelOpt) code * e4m3 scale * weight_scale_2; block FP8 q * s per
128x128 block. Nothing here calls fp8conv.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.support.helpers import fp8, write_checkpoint
from tests.support.packing import (
    e2m1_value,
    e8m0_value,
    group_scaled,
    pack_nibbles,
    random_codes,
    random_e4m3_scales,
    random_e8m0,
)
from tests.support.reference import quantize_exact_reference, quantize_int8_reference, quantize_reference, same_bits

MX_GROUP = 32
HIDDEN, INTER = 64, 96  # K and N of every projection: whole 32-groups, not whole 128-blocks
PRODUCER = {"name": "modelopt", "version": "0.39.0"}


@dataclass
class Release:
    tensors: dict[str, torch.Tensor]  # as written
    truth: dict[str, torch.Tensor] = field(default_factory=dict)  # output weight name -> float64 value
    config: dict = field(default_factory=dict)
    sidecar: dict | None = None  # hf_quant_config.json
    kv_scales: tuple[str, ...] = ()


def per_tensor_fp8(rel: Release, base: str, shape: tuple[int, int], seed: int, input_scale: bool = True) -> None:
    q, s = fp8(shape, seed), torch.tensor(0.5 ** (4 + seed % 5) * 1.25, dtype=torch.float32)
    rel.tensors[base + ".weight"], rel.tensors[base + ".weight_scale"] = q, s
    if input_scale:
        rel.tensors[base + ".input_scale"] = torch.tensor(0.0625, dtype=torch.float32)
    rel.truth[base + ".weight"] = q.to(torch.float64) * float(s)


def mxfp8(rel: Release, base: str, shape: tuple[int, ...], seed: int, scale_name: str = "weight_scale") -> None:
    """e4m3 weight, uint8 E8M0 exponents [..., N, K/32] (exponents around 2^-8 .. 2^3)."""
    q = fp8(shape, seed)
    e = random_e8m0((*shape[:-1], shape[-1] // MX_GROUP), seed, low=119, high=131)
    rel.tensors[base + ".weight"], rel.tensors[f"{base}.{scale_name}"] = q, e
    rel.truth[base + ".weight"] = group_scaled(q.to(torch.float64), e8m0_value(e), MX_GROUP)


def mxfp4(rel: Release, base: str, shape: tuple[int, int], seed: int, weight: str, scale: str) -> None:
    """Two E2M1 codes per uint8 (low nibble first) [N, K/2], uint8 E8M0 [N, K/32]."""
    codes = random_codes(shape, seed)
    e = random_e8m0((shape[0], shape[1] // MX_GROUP), seed)
    rel.tensors[f"{base}.{weight}"], rel.tensors[f"{base}.{scale}"] = pack_nibbles(codes), e
    rel.truth[base + ".weight"] = group_scaled(e2m1_value(codes), e8m0_value(e), MX_GROUP)


def nvfp4_modelopt(rel: Release, base: str, shape: tuple[int, int], seed: int) -> None:
    codes, scale = random_codes(shape, seed), random_e4m3_scales((shape[0], shape[1] // 16), seed)
    g = float(torch.tensor(2.0**-9, dtype=torch.float32))
    rel.tensors[base + ".weight"], rel.tensors[base + ".weight_scale"] = pack_nibbles(codes), scale
    rel.tensors[base + ".weight_scale_2"], rel.tensors[base + ".input_scale"] = torch.tensor(g), torch.tensor(1.0)
    rel.truth[base + ".weight"] = group_scaled(e2m1_value(codes), scale.to(torch.float64), 16) * g


def block_fp8(rel: Release, base: str, shape: tuple[int, int], seed: int) -> None:
    q = fp8(shape, seed)
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    s = torch.rand(grid, generator=torch.Generator().manual_seed(seed)) * 0.01 + 0.001
    rel.tensors[base + ".weight"], rel.tensors[base + ".weight_scale_inv"] = q, s
    full = s.to(torch.float64).repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    rel.truth[base + ".weight"] = q.to(torch.float64) * full


def bf16(rel: Release, name: str, shape: tuple[int, ...], seed: int) -> None:
    rel.tensors[name] = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


LLAMA_PROJ = {
    "self_attn.q_proj": (HIDDEN, HIDDEN),
    "self_attn.k_proj": (32, HIDDEN),
    "self_attn.v_proj": (32, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (INTER, HIDDEN),
    "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}


def llama_config(**quant) -> dict:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return config | ({"quantization_config": quant} if quant else {})


def llama_skeleton(rel: Release, quantize: Callable[[Release, str, tuple[int, int], int], None]) -> Release:
    """Llama's names; every projection quantized by `quantize`, embeddings / norms / lm_head bf16."""
    bf16(rel, "model.embed_tokens.weight", (128, HIDDEN), 1)
    bf16(rel, "lm_head.weight", (128, HIDDEN), 2)
    rel.tensors["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    for layer in range(2):
        pre = f"model.layers.{layer}."
        rel.tensors[pre + "input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        rel.tensors[pre + "post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for i, (proj, shape) in enumerate(LLAMA_PROJ.items()):
            quantize(rel, pre + proj, shape, 10 * layer + i)
    return rel


def modelopt_fp8_llama(form: str) -> Release:
    """nvidia Llama-3.x FP8: per-tensor weight_scale / input_scale 0-D, KV scales on k_proj / v_proj."""
    rel = llama_skeleton(Release({}), per_tensor_fp8)
    for layer in range(2):
        for proj, kv in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            name = f"model.layers.{layer}.self_attn.{proj}.{kv}"
            rel.tensors[name] = torch.tensor(0.03125, dtype=torch.float32)
            rel.kv_scales += (name,)
    nested = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    if form == "hf_quant_config.json":
        rel.config, rel.sidecar = llama_config(), {"producer": PRODUCER, "quantization": nested}
    elif form == "config.json nested":
        rel.config = llama_config(quant_method="modelopt", producer=PRODUCER, quantization=nested)
    else:  # config.json flat, as ModelOpt >= 0.31 writes it (quant_algo in any case)
        rel.config = llama_config(quant_method="modelopt", quant_algo="fp8", ignore=["lm_head"])
    return rel


def nemotron_h_fp8() -> Release:
    """Nemotron-3 (nemotron_h): backbone.layers.*.mixer.*, FP8 Mamba in_proj/out_proj with input_scale,
    non-gated experts (up/down only), a shared expert; embeddings, router, lm_head bf16."""
    rel = Release({})
    bf16(rel, "backbone.embeddings.weight", (128, HIDDEN), 1)
    bf16(rel, "lm_head.weight", (128, HIDDEN), 2)
    per_tensor_fp8(rel, "backbone.layers.0.mixer.in_proj", (160, HIDDEN), 3)
    per_tensor_fp8(rel, "backbone.layers.0.mixer.out_proj", (HIDDEN, 64), 4)
    bf16(rel, "backbone.layers.0.mixer.conv1d.weight", (96, 1, 4), 5)
    bf16(rel, "backbone.layers.1.mixer.gate.weight", (4, HIDDEN), 6)
    for e in range(2):
        per_tensor_fp8(rel, f"backbone.layers.1.mixer.experts.{e}.up_proj", (INTER, HIDDEN), 7 + e)
        per_tensor_fp8(rel, f"backbone.layers.1.mixer.experts.{e}.down_proj", (HIDDEN, INTER), 9 + e)
    per_tensor_fp8(rel, "backbone.layers.1.mixer.shared_experts.up_proj", (INTER, HIDDEN), 11)
    per_tensor_fp8(rel, "backbone.layers.1.mixer.shared_experts.down_proj", (HIDDEN, INTER), 12)
    rel.config = {"model_type": "nemotron_h", "hidden_size": HIDDEN, "torch_dtype": "bfloat16"}
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head", "*.mixer.gate"]}
    rel.sidecar = {"producer": PRODUCER, "quantization": quant}
    return rel


def modelopt_mixed() -> Release:
    """ModelOpt MIXED_PRECISION: attention FP8 per-tensor, MLP NVFP4, each named in quantized_layers."""
    layers: dict[str, dict] = {}

    def quantize(rel: Release, base: str, shape: tuple[int, int], seed: int) -> None:
        if ".mlp." in base:
            nvfp4_modelopt(rel, base, shape, seed)
            layers[base] = {"quant_algo": "NVFP4", "group_size": 16}
        else:
            per_tensor_fp8(rel, base, shape, seed)
            layers[base] = {"quant_algo": "FP8"}

    rel = llama_skeleton(Release({}), quantize)
    quant = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers, "exclude_modules": ["lm_head"]}
    rel.config = llama_config(quant_method="modelopt", producer=PRODUCER, quantization=quant)
    return rel


def modelopt_mxfp8_llama() -> Release:
    rel = llama_skeleton(Release({}), mxfp8)
    quant = {"quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    rel.config, rel.sidecar = llama_config(), {"producer": PRODUCER, "quantization": quant}
    return rel


def minimax_m3_mxfp8() -> Release:
    """MiniMax-M3-MXFP8: quant_method mxfp8 + ignored_layers, scales named weight_scale_inv (uint8)."""
    rel = Release({})
    pre = "language_model.model.layers.0."
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        mxfp8(rel, pre + "self_attn." + proj, (HIDDEN, HIDDEN), i, "weight_scale_inv")
    for e in range(2):
        for j, (w, shape) in enumerate((("w1", (INTER, HIDDEN)), ("w2", (HIDDEN, INTER)), ("w3", (INTER, HIDDEN)))):
            mxfp8(rel, f"{pre}block_sparse_moe.experts.{e}.{w}", shape, 10 + 3 * e + j, "weight_scale_inv")
    bf16(rel, pre + "block_sparse_moe.gate.weight", (2, HIDDEN), 20)
    rel.tensors[pre + "block_sparse_moe.e_score_correction_bias"] = torch.zeros(2, dtype=torch.float32)
    bf16(rel, "language_model.lm_head.weight", (128, HIDDEN), 21)
    bf16(rel, "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", (INTER, HIDDEN), 22)
    ignored = ["language_model.lm_head", "vision_tower", "language_model.model.layers.0.block_sparse_moe.gate"]
    quant = {"quant_method": "mxfp8", "ignored_layers": ignored}
    rel.config = {"model_type": "minimax_m3_vl", "text_config": {"hidden_size": HIDDEN}, "quantization_config": quant}
    return rel


def ct_group(fmt: str, num_bits: int, targets: list[str]) -> dict:
    weights = {"num_bits": num_bits, "type": "float", "strategy": "group", "group_size": MX_GROUP}
    weights |= {"symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"}
    return {"targets": targets, "format": fmt, "weights": weights, "input_activations": None}


def ct_mxfp8() -> Release:
    """compressed-tensors mxfp8-quantized: e4m3 weight + uint8 weight_scale [N, K/32]."""
    rel = llama_skeleton(Release({}), mxfp8)
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp8-quantized",
        "config_groups": {"group_0": ct_group("mxfp8-quantized", 8, ["Linear"])},
        "ignore": ["lm_head"],
    }
    rel.config = llama_config(**quant)
    return rel


def ct_mxfp4_mixed() -> Release:
    """Kimi-K3 / GLM-5.2 MXFP4 builds: routed experts mxfp4-pack-quantized (weight_packed + weight_scale
    uint8), attention mxfp8-quantized, the rest bf16 and ignored."""
    rel = Release({})
    pre = "model.layers.1."
    for i, proj in enumerate(("q_proj", "o_proj")):
        mxfp8(rel, pre + "self_attn." + proj, (HIDDEN, HIDDEN), i)
    for e in range(2):
        for j, (proj, shape) in enumerate(
            (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
        ):
            mxfp4(rel, f"{pre}mlp.experts.{e}.{proj}", shape, 10 + 3 * e + j, "weight_packed", "weight_scale")
    bf16(rel, pre + "mlp.gate.weight", (2, HIDDEN), 30)
    bf16(rel, "lm_head.weight", (128, HIDDEN), 31)
    groups = {
        "group_0": ct_group("mxfp4-pack-quantized", 4, ["re:.*mlp\\.experts.*"]),
        "group_1": ct_group("mxfp8-quantized", 8, ["re:.*self_attn.*"]),
    }
    quant = {"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": groups}
    quant["ignore"] = ["lm_head", "re:.*mlp\\.gate$"]
    rel.config = {"model_type": "kimi_k3", "torch_dtype": "bfloat16", "quantization_config": quant}
    return rel


def fp8_with_mxfp4_experts(style: str) -> Release:
    """Block FP8 attention and MXFP4 routed experts declared inside the fp8 config: Ling
    (`routed_experts_quant_method`, scales `weight_scale_inv`) or MiMo (`store_dtype`, `weight_scale`)."""
    rel = Release({})
    pre = "model.layers.1."
    block_fp8(rel, pre + "self_attn.q_proj", (HIDDEN, 160), 1)
    block_fp8(rel, pre + "self_attn.o_proj", (160, HIDDEN), 2)
    scale = "weight_scale_inv" if style == "ling" else "weight_scale"
    for e in range(2):
        for j, (proj, shape) in enumerate(
            (("gate_proj", (INTER, HIDDEN)), ("up_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
        ):
            mxfp4(rel, f"{pre}mlp.experts.{e}.{proj}", shape, 10 + 3 * e + j, "weight", scale)
    bf16(rel, pre + "mlp.gate.weight", (2, HIDDEN), 30)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if style == "ling":
        quant |= {"scale_fmt": "ue8m0", "routed_experts_quant_method": "mxfp4", "routed_experts_group_size": 32}
        model_type = "bailing_moe_v3"
    else:
        quant |= {"store_dtype": "mxfp4"}
        model_type = "mimo_v2"
    rel.config = {"model_type": model_type, "torch_dtype": "bfloat16", "quantization_config": quant}
    return rel


LAYOUTS: dict[str, Callable[[], Release]] = {
    "modelopt-fp8 hf_quant_config.json": lambda: modelopt_fp8_llama("hf_quant_config.json"),
    "modelopt-fp8 config.json nested": lambda: modelopt_fp8_llama("config.json nested"),
    "modelopt-fp8 config.json flat": lambda: modelopt_fp8_llama("config.json flat"),
    "nemotron-h modelopt-fp8": nemotron_h_fp8,
    "modelopt mixed fp8+nvfp4": modelopt_mixed,
    "modelopt-mxfp8": modelopt_mxfp8_llama,
    "minimax-m3 mxfp8": minimax_m3_mxfp8,
    "compressed-tensors mxfp8-quantized": ct_mxfp8,
    "compressed-tensors mxfp4-pack-quantized + mxfp8": ct_mxfp4_mixed,
    "ling fp8 + mxfp4 experts": lambda: fp8_with_mxfp4_experts("ling"),
    "mimo fp8 + store_dtype mxfp4": lambda: fp8_with_mxfp4_experts("mimo"),
}


def write_release(path: Path, rel: Release, shards: int = 2) -> Path:
    write_checkpoint(path, rel.tensors, rel.config, shards=shards)
    if rel.sidecar is not None:
        (path / "hf_quant_config.json").write_text(json.dumps(rel.sidecar))
    return path


def scaled_by_powers_of_two(tensors: dict[str, torch.Tensor], name: str) -> bool:
    """Whether every stored scale of weight `name` (E8M0 bytes, or floats) is a power of two."""
    base = name.removesuffix("weight")
    scales = [t for n, t in tensors.items() if n.startswith(base) and n != name and "scale" in n and "input" not in n]
    return bool(scales) and all(
        t.dtype in (torch.uint8, torch.float8_e8m0fnu) or bool((torch.frexp(t.float().abs())[0] == 0.5).all())
        for t in scales
    )


def expected_weight(
    value: torch.Tensor, to: str, out: dict[str, torch.Tensor], name: str, pow2_scaled: bool = False
) -> None:
    """Assert `out` holds weight `name` as `to` must write it, from its float64 value: bf16 one rounding of
    the float32 product; channel / block / int8 a fresh quantization of that product (tests/support/reference.py),
    block from power-of-two scales (pow2_scaled) with a power of two wherever one gives every value back."""
    w32 = value.to(torch.float32)
    if to == "bf16":
        assert same_bits(out[name], w32.to(torch.bfloat16)), name
        return
    block, suffix = (None, "_scale") if to in ("channel", "int8") else ((128, 128), "_scale_inv")
    flat = w32.reshape(-1, *w32.shape[-2:])
    if to == "int8":
        pairs = [quantize_int8_reference(m) for m in flat]
    elif block and pow2_scaled:
        pairs = [quantize_exact_reference(m, block)[:2] for m in flat]
    else:
        pairs = [quantize_reference(m, block) for m in flat]
    q = torch.stack([p[0] for p in pairs]).reshape(w32.shape)
    s = torch.stack([p[1] for p in pairs])
    s = s.reshape(*w32.shape[:-2], *s.shape[-2:])
    assert same_bits(out[name], q), name
    assert same_bits(out[name + suffix], s), name + suffix
