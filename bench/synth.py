"""Synthetic DeepSeek-like block-FP8 checkpoints of a chosen size, streamed to disk tensor by tensor."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from fp8conv.storage.writer import ShardWriter, TensorSpec

# DeepSeek-V3 shapes (hidden 7168): dense MLP, routed experts, MLA projections; ragged ones included
RAGGED = [
    ("self_attn.kv_a_proj_with_mqa", (576, 7168)),  # 5-row grid, not divisible
    ("self_attn.q_a_proj", (1536, 7168)),
    ("self_attn.kv_b_proj", (32768, 512)),
    ("self_attn.o_proj", (7168, 16384)),
]
DENSE = [("mlp.gate_proj", (18432, 7168)), ("mlp.up_proj", (18432, 7168)), ("mlp.down_proj", (7168, 18432))]
EXPERT = [("gate_proj", (2048, 7168)), ("up_proj", (2048, 7168)), ("down_proj", (7168, 2048))]
# one shared expert, as config.json's n_shared_experts says: --pad-for-tp checks its width against
# moe_intermediate_size * n_shared_experts, so an odd width here would be (rightly) refused
SHARED = [(f"mlp.shared_experts.{n}", s) for n, s in EXPERT]


def layer_tensors(layer: int, ragged: bool) -> list[tuple[str, tuple[int, int]]]:
    p = f"model.layers.{layer}."
    out = [(p + n + ".weight", s) for n, s in DENSE]
    out += [(p + f"mlp.experts.{e}.{n}.weight", s) for e in range(8) for n, s in EXPERT]
    if ragged:
        out += [(p + n + ".weight", s) for n, s in RAGGED + SHARED]
    return out


def build(path: Path, size_gib: float, shards: int = 4, ragged: bool = True, seed: int = 0) -> Path:
    """FP8 weights with random finite codes, float32 128x128 scale grids, bf16 norms; about size_gib."""
    path.mkdir(parents=True, exist_ok=True)
    target = int(size_gib * 2**30)
    names: list[tuple[str, tuple[int, int]]] = []
    total, layer = 0, 0
    while total < target:
        for name, shape in layer_tensors(layer, ragged):
            if total >= target:
                break
            names.append((name, shape))
            total += math.prod(shape)
        layer += 1
    per_shard = math.ceil(len(names) / shards)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per_shard : (i + 1) * per_shard]
        specs = []
        for name, (n, k) in part:
            specs.append(TensorSpec(name, "F8_E4M3", (n, k)))
            specs.append(TensorSpec(name + "_scale_inv", "F32", (math.ceil(n / 128), math.ceil(k / 128))))
        norm = f"model.layers.{i}.input_layernorm.weight"
        specs.append(TensorSpec(norm, "BF16", (7168,)))
        writer = ShardWriter(path / fname, specs, {"format": "pt"})
        for name, (n, k) in part:
            codes = torch.randint(0, 0x7E, (n, k), generator=gen, dtype=torch.uint8)
            codes |= torch.randint(0, 2, (n, k), generator=gen, dtype=torch.uint8) << 7
            writer.write_tensor(name, codes)
            scale = torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=gen) * 1e-3 + 1e-4
            writer.write_tensor(name + "_scale_inv", scale)
        writer.write_tensor(norm, torch.ones(7168, dtype=torch.bfloat16))
        writer.commit()
        weight_map.update({s.name: fname for s in specs})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "deepseek_v3",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": layer,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


# DeepSeek-V4-Flash-like (hidden 4096): MXFP4 routed experts (int8 [out, in/2] + e8m0 [out, in/32]) and
# block FP8 for the rest (e4m3 + e8m0 `.scale` per 128x128 block), DeepSeek-V4's own names
V4_HIDDEN = 4096
V4_EXPERT = [("w1", (2048, V4_HIDDEN)), ("w2", (V4_HIDDEN, 2048)), ("w3", (2048, V4_HIDDEN))]
V4_FP8 = [
    ("attn.wq_a", (1024, V4_HIDDEN)),
    ("attn.wkv", (576, V4_HIDDEN)),  # ragged: a 5-row grid
    ("attn.wo_b", (V4_HIDDEN, 4096)),
    ("ffn.shared_experts.w1", (2048, V4_HIDDEN)),
    ("ffn.shared_experts.w2", (V4_HIDDEN, 2048)),
    ("ffn.shared_experts.w3", (2048, V4_HIDDEN)),
]
V4_EXPERTS_PER_LAYER = 16


def build_v4(path: Path, size_gib: float, shards: int = 4, seed: int = 0) -> Path:
    """About size_gib of a DeepSeek-V4-shaped checkpoint with random codes and scales."""
    path.mkdir(parents=True, exist_ok=True)
    target = int(size_gib * 2**30)
    names: list[tuple[str, tuple[int, int], bool]] = []  # (weight name, [out, in], is an MXFP4 expert)
    total, layer = 0, 0
    while total < target:
        p = f"layers.{layer}."
        layer_names = [(p + n + ".weight", s, False) for n, s in V4_FP8]
        layer_names += [
            (p + f"ffn.experts.{e}.{n}.weight", s, True) for e in range(V4_EXPERTS_PER_LAYER) for n, s in V4_EXPERT
        ]
        for name, shape, packed in layer_names:
            if total >= target:
                break
            names.append((name, shape, packed))
            total += math.prod(shape) // (2 if packed else 1)
        layer += 1
    per_shard = math.ceil(len(names) / shards)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per_shard : (i + 1) * per_shard]
        specs = []
        for name, (n, k), packed in part:
            scale = name.removesuffix(".weight") + ".scale"
            if packed:
                specs += [TensorSpec(name, "I8", (n, k // 2)), TensorSpec(scale, "F8_E8M0", (n, k // 32))]
            else:
                grid = (math.ceil(n / 128), math.ceil(k / 128))
                specs += [TensorSpec(name, "F8_E4M3", (n, k)), TensorSpec(scale, "F8_E8M0", grid)]
        norm = f"layers.{i}.attn_norm.weight"
        specs.append(TensorSpec(norm, "BF16", (V4_HIDDEN,)))
        writer = ShardWriter(path / fname, specs, {"format": "pt"})
        for spec in specs[:-1]:
            if spec.dtype == "F8_E8M0":  # exponents around 2^-10, never 255 (NaN)
                data = torch.randint(112, 122, spec.shape, generator=gen, dtype=torch.uint8)
            elif spec.dtype == "I8":
                data = torch.randint(0, 256, spec.shape, generator=gen, dtype=torch.uint8)
            else:  # finite e4m3 codes
                data = torch.randint(0, 0x7E, spec.shape, generator=gen, dtype=torch.uint8)
                data |= torch.randint(0, 2, spec.shape, generator=gen, dtype=torch.uint8) << 7
            writer.write_tensor(spec.name, data)
        writer.write_tensor(norm, torch.ones(V4_HIDDEN, dtype=torch.bfloat16))
        writer.commit()
        weight_map.update({s.name: fname for s in specs})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "num_hidden_layers": layer,
        "hidden_size": V4_HIDDEN,
        "moe_intermediate_size": 2048,
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    return path
