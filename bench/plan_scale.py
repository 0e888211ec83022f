"""Planning at release scale: `fp8conv inspect` and `convert --dry-run` on header-only checkpoints.

A header-only checkpoint has real safetensors headers (names, dtypes, shapes, offsets as a release's)
and a data region that is a hole: each shard is extended with truncate, so a 750 GB release costs a few
MB of headers on disk. inspect and --dry-run read headers only, so they plan it as they would the real
one. Layouts (real tensor counts, real shapes):

- `scale-200k`: Qwen3.5-MoE-shaped block FP8, 64 layers x 512 experts, ~200k tensors, a 2,000-entry
  modules_to_not_convert (plain names, some naming no tensor, a few `re:` and wildcard entries);
- `qwen3.5-397b`: Qwen3.5-397B-A17B-FP8's layout (189,042 tensors; about 512 ignore entries);
- `glm5.2`: GLM-5.2-FP8's (118,629 tensors; its list names `self_attn.indexers_proj`, no tensor's);
- `kimi-k2.5`: Kimi-K2.5's (compressed-tensors INT4 routed experts, 69,120 weight_packed; 208,550 tensors).

`python bench/plan_scale.py` builds each, times inspect and dry-run in fresh processes (wall time and
peak RSS from getrusage of the child) and writes bench/plan-scale.json and bench/plan-scale.md;
`bench/bench.py` runs it too (`make bench`). `--build LAYOUT DIR` only builds one. `--against TREE`
times another source tree (a worktree of an earlier commit) alternately with this one, run for run, and
reports the CPU ratio: this machine's speed drifts by a third from hour to hour, a ratio far less.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ELEMENT_BYTES = {"F8_E4M3": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "I8": 1, "F8_E8M0": 1}
TENSORS_PER_SHARD = 1500
# issue 24: at 200k tensors and a 2,000-entry ignore list, within this
TARGET_S, TARGET_RSS_MB = 3.0, 400

Tensor = tuple[str, str, tuple[int, ...]]  # name, dtype, shape


def fp8(name: str, shape: tuple[int, int], scale_dtype: str = "F32") -> list[Tensor]:
    """A block-FP8 weight and its 128x128 scale grid."""
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    return [(name + ".weight", "F8_E4M3", shape), (name + ".weight_scale_inv", scale_dtype, grid)]


def bf16(name: str, shape: tuple[int, ...]) -> list[Tensor]:
    return [(name, "BF16", shape)]


# -- Qwen3.5-MoE (qwen3_5_moe): hidden 4096, 512 experts of width 1024, 3 linear-attention : 1 full layer
QWEN_H, QWEN_I, QWEN_VOCAB = 4096, 1024, 248320


def _qwen_layer(p: str, full: bool, experts: int) -> Iterator[Tensor]:
    h, i = QWEN_H, QWEN_I
    yield from bf16(p + "input_layernorm.weight", (h,))
    yield from bf16(p + "post_attention_layernorm.weight", (h,))
    if full:
        yield from fp8(p + "self_attn.q_proj", (16384, h), "BF16")
        yield from fp8(p + "self_attn.k_proj", (512, h), "BF16")
        yield from fp8(p + "self_attn.v_proj", (512, h), "BF16")
        yield from fp8(p + "self_attn.o_proj", (h, 8192), "BF16")
        yield from bf16(p + "self_attn.q_norm.weight", (256,))
        yield from bf16(p + "self_attn.k_norm.weight", (256,))
    else:
        a = p + "linear_attn."
        yield from fp8(a + "in_proj_qkv", (12288, h), "BF16")
        yield from fp8(a + "in_proj_z", (8192, h), "BF16")
        yield from bf16(a + "in_proj_b.weight", (64, h))
        yield from bf16(a + "in_proj_a.weight", (64, h))
        yield from bf16(a + "conv1d.weight", (12288, 1, 4))
        yield from fp8(a + "out_proj", (h, 8192), "BF16")
        yield from bf16(a + "A_log", (64,))
        yield from bf16(a + "dt_bias", (64,))
        yield from bf16(a + "norm.weight", (128,))
    yield from bf16(p + "mlp.gate.weight", (experts, h))
    for e in range(experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            yield from fp8(f"{p}mlp.experts.{e}.{proj}", shape, "BF16")
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        yield from fp8(f"{p}mlp.shared_expert.{proj}", shape, "BF16")
    yield from bf16(p + "mlp.shared_expert_gate.weight", (1, h))


def qwen35_tensors(layers: int, experts: int) -> list[Tensor]:
    out: list[Tensor] = []
    out += bf16("model.language_model.embed_tokens.weight", (QWEN_VOCAB, QWEN_H))
    for layer in range(layers):
        out += _qwen_layer(f"model.language_model.layers.{layer}.", layer % 4 == 3, experts)
    out += bf16("model.language_model.norm.weight", (QWEN_H,))
    out += bf16("lm_head.weight", (QWEN_VOCAB, QWEN_H))
    out += _qwen_layer("mtp.layers.0.", True, experts)
    out += bf16("mtp.fc.weight", (QWEN_H, 2 * QWEN_H))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out += bf16(f"mtp.{norm}.weight", (QWEN_H,))
    for b in range(27):  # the vision tower, bf16: 27 blocks of 12 tensors + 9
        v = f"model.visual.blocks.{b}."
        for name in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            out += bf16(v + name + ".weight", (1152, 1152))
            out += bf16(v + name + ".bias", (1152,))
        for norm in ("norm1", "norm2"):
            out += bf16(v + norm + ".weight", (1152,)) + bf16(v + norm + ".bias", (1152,))
    for n in range(9):
        out += bf16(f"model.visual.merger.part{n}.weight", (1152,))
    return out


def qwen35_config(layers: int, experts: int, ignore: list[str]) -> dict:
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": QWEN_H,
        "num_hidden_layers": layers,
        "moe_intermediate_size": QWEN_I,
        "shared_expert_intermediate_size": QWEN_I,
        "num_experts": experts,
        "mtp_num_hidden_layers": 1,
    }
    quant = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ignore,
    }
    return {"model_type": "qwen3_5_moe", "text_config": text, "quantization_config": quant}


def qwen35_ignore(tensors: list[Tensor], size: int) -> list[str]:
    """What Qwen's releases list: every module left in bf16 (norms included), then names of modules the
    checkpoint does not have, a few `re:` and ModelOpt-style wildcard entries, up to `size` entries."""
    bf16_tensors = [n for n, dtype, _ in tensors if dtype == "BF16" and not n.endswith("_scale_inv")]
    modules = sorted(
        {n.rsplit(".", 1)[0] for n in bf16_tensors if n.endswith((".weight", ".bias")) and "experts" not in n}
    )
    stale = [f"model.language_model.layers.{i}.linear_attn.in_proj_ba" for i in range(size)]
    patterns = [r"re:.*visual\.merger\..*", "re:^mtp\\.fc$", "model.visual.blocks.*.attn*", "lm_head*"]
    return (patterns + modules + stale)[:size]


# -- GLM-5.2 (glm_moe_dsa): DeepSeek-V3.2's layout; indexers on 22 of 79 layers
GLM_H, GLM_VOCAB, GLM_EXPERTS = 6144, 154880, 256


def _glm_attention(p: str, indexer: bool) -> Iterator[Tensor]:
    h = GLM_H
    a = p + "self_attn."
    yield from fp8(a + "q_a_proj", (2048, h))
    yield from bf16(a + "q_a_layernorm.weight", (2048,))
    yield from fp8(a + "q_b_proj", (64 * 256, 2048))
    yield from fp8(a + "kv_a_proj_with_mqa", (576, h))
    yield from bf16(a + "kv_a_layernorm.weight", (512,))
    yield from fp8(a + "kv_b_proj", (64 * 448, 512))
    yield from fp8(a + "o_proj", (h, 64 * 256))
    if indexer:
        x = a + "indexer."
        yield from fp8(x + "wq_b", (4096, 2048))
        yield from fp8(x + "wk", (128, h))
        yield from bf16(x + "weights_proj.weight", (32, h))
        yield from bf16(x + "k_norm.weight", (128,))
        yield from bf16(x + "k_norm.bias", (128,))


def _glm_layer(layer: int) -> Iterator[Tensor]:
    p, h = f"model.layers.{layer}.", GLM_H
    moe = layer >= 3
    indexer = not moe or layer == 78 or (layer >= 6 and layer % 4 == 2)
    yield from bf16(p + "input_layernorm.weight", (h,))
    yield from bf16(p + "post_attention_layernorm.weight", (h,))
    yield from _glm_attention(p, indexer)
    if not moe:
        for proj, shape in (("gate_proj", (12288, h)), ("up_proj", (12288, h)), ("down_proj", (h, 12288))):
            yield from fp8(p + "mlp." + proj, shape)
        return
    yield from [
        (p + "mlp.gate.weight", "F32", (GLM_EXPERTS, h)),
        (p + "mlp.gate.e_score_correction_bias", "F32", (GLM_EXPERTS,)),
    ]
    for e in range(GLM_EXPERTS):
        for proj, shape in (("gate_proj", (2048, h)), ("up_proj", (2048, h)), ("down_proj", (h, 2048))):
            yield from fp8(f"{p}mlp.experts.{e}.{proj}", shape)
    for proj, shape in (("gate_proj", (2048, h)), ("up_proj", (2048, h)), ("down_proj", (h, 2048))):
        yield from fp8(f"{p}mlp.shared_experts.{proj}", shape)
    if layer == 78:  # the MTP layer
        yield from bf16(p + "eh_proj.weight", (h, 2 * h))
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield from bf16(f"{p}{norm}.weight", (h,))


def glm52_tensors() -> list[Tensor]:
    out = bf16("model.embed_tokens.weight", (GLM_VOCAB, GLM_H))
    for layer in range(79):
        out += _glm_layer(layer)
    return out + bf16("model.norm.weight", (GLM_H,)) + bf16("lm_head.weight", (GLM_VOCAB, GLM_H))


def glm52_config() -> dict:
    ignore = ["model.embed_tokens", "lm_head"]
    ignore += [f"model.layers.{layer}.self_attn.indexers_proj" for layer in range(79)]
    ignore += [f"model.layers.{layer}.mlp.gate" for layer in range(3, 79)]
    quant = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ignore,
    }
    return {
        "model_type": "glm_moe_dsa",
        "hidden_size": GLM_H,
        "num_hidden_layers": 78,
        "first_k_dense_replace": 3,
        "intermediate_size": 12288,
        "moe_intermediate_size": 2048,
        "n_routed_experts": GLM_EXPERTS,
        "n_shared_experts": 1,
        "quantization_config": quant,
    }


# -- Kimi-K2.5 (kimi_k25, text kimi_k2): compressed-tensors INT4 g32 routed experts, the rest bf16
KIMI_H, KIMI_I, KIMI_EXPERTS, KIMI_VOCAB = 7168, 2048, 384, 163840


def _kimi_layer(layer: int) -> Iterator[Tensor]:
    p, h = f"language_model.model.layers.{layer}.", KIMI_H
    yield from bf16(p + "input_layernorm.weight", (h,))
    yield from bf16(p + "post_attention_layernorm.weight", (h,))
    a = p + "self_attn."
    for name, shape in (
        ("q_a_proj", (1536, h)),
        ("q_b_proj", (64 * 192, 1536)),
        ("kv_a_proj_with_mqa", (576, h)),
        ("kv_b_proj", (64 * 256, 512)),
        ("o_proj", (h, 64 * 128)),
    ):
        yield from bf16(a + name + ".weight", shape)
    yield from bf16(a + "q_a_layernorm.weight", (1536,))
    yield from bf16(a + "kv_a_layernorm.weight", (512,))
    if layer == 0:
        for proj, shape in (("gate_proj", (18432, h)), ("up_proj", (18432, h)), ("down_proj", (h, 18432))):
            yield from bf16(p + "mlp." + proj + ".weight", shape)
        return
    yield from [
        (p + "mlp.gate.weight", "BF16", (KIMI_EXPERTS, h)),
        (p + "mlp.gate.e_score_correction_bias", "F32", (KIMI_EXPERTS,)),
    ]
    for e in range(KIMI_EXPERTS):
        for proj, (n, k) in (("gate_proj", (KIMI_I, h)), ("up_proj", (KIMI_I, h)), ("down_proj", (h, KIMI_I))):
            x = f"{p}mlp.experts.{e}.{proj}."
            yield (x + "weight_packed", "I32", (n, k // 8))
            yield (x + "weight_scale", "BF16", (n, k // 32))
            yield (x + "weight_shape", "I64", (2,))
    for proj, shape in (("gate_proj", (KIMI_I, h)), ("up_proj", (KIMI_I, h)), ("down_proj", (h, KIMI_I))):
        yield from bf16(f"{p}mlp.shared_experts.{proj}.weight", shape)


def kimi25_tensors() -> list[Tensor]:
    out = bf16("language_model.model.embed_tokens.weight", (KIMI_VOCAB, KIMI_H))
    for layer in range(61):
        out += _kimi_layer(layer)
    out += bf16("language_model.model.norm.weight", (KIMI_H,)) + bf16(
        "language_model.lm_head.weight", (KIMI_VOCAB, KIMI_H)
    )
    for b in range(27):
        v = f"vision_tower.encoder.blocks.{b}."
        for name in ("wqkv", "wo", "mlp.fc0", "mlp.fc1"):
            out += bf16(v + name + ".weight", (1152, 1152)) + bf16(v + name + ".bias", (1152,))
        for norm in ("norm0", "norm1"):
            out += bf16(v + norm + ".weight", (1152,)) + bf16(v + norm + ".bias", (1152,))
    for n in (0, 2):
        out += bf16(f"mm_projector.proj.{n}.weight", (KIMI_H, 4608)) + bf16(f"mm_projector.proj.{n}.bias", (KIMI_H,))
    return out


def kimi25_config(tensors: list[Tensor]) -> dict:
    linears = [n for n, d, s in tensors if d == "BF16" and len(s) == 2 and n.endswith(".weight")]
    ignore = sorted({n.rsplit(".", 1)[0] for n in linears if "embed" not in n})
    ignore = [m for m in ignore if not m.endswith("mlp.gate")] + ["re:.*vision_tower.*", "re:.*mm_projector.*"]
    group = {
        "targets": ["Linear"],
        "format": "pack-quantized",
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
    }
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    quant["ignore"] = ignore
    text = {
        "model_type": "kimi_k2",
        "hidden_size": KIMI_H,
        "num_hidden_layers": 61,
        "moe_intermediate_size": KIMI_I,
        "n_routed_experts": KIMI_EXPERTS,
        "quantization_config": quant,
    }
    return {"model_type": "kimi_k25", "text_config": text}


# -- DeepSeek-V4.1-Flash (deepseek_v41): ../shared/RELEASES-LATE-2026.md; dense FP8 in 32x32 E8M0 blocks, MXFP4
# experts (1x32), two Engram tables in (1, 32) blocks under the declared [32, 32], each alone in a shard
V41_H, V41_I, V41_E, V41_VOCAB, V41_LAYERS = 5120, 2304, 384, 129280, 40
V41_ENGRAM_ROWS = {1: 384006168, 14: 384016682}
V41_TENSORS = 96085


def _fp8_32(name: str, shape: tuple[int, int]) -> list[Tensor]:
    grid = (math.ceil(shape[0] / 32), math.ceil(shape[1] / 32))
    return [(name + ".weight", "F8_E4M3", shape), (name + ".scale", "F8_E8M0", grid)]


def _fp4(name: str, shape: tuple[int, int]) -> list[Tensor]:
    return [
        (name + ".weight", "I8", (shape[0], shape[1] // 2)),
        (name + ".scale", "F8_E8M0", (shape[0], shape[1] // 32)),
    ]


def _v41_layer(p: str) -> list[Tensor]:
    h, i = V41_H, V41_I
    out = bf16(p + "attn_norm.weight", (h,)) + bf16(p + "ffn_norm.weight", (h,))
    for name, shape in (
        ("attn.wq_a", (1280, h)),
        ("attn.wq_b", (16384, 1280)),
        ("attn.wkv", (512, h)),
        ("attn.wo_a", (4096, 4096)),
        ("attn.wo_b", (h, 4096)),
    ):
        out += _fp8_32(p + name, shape)
    out += bf16(p + "attn.q_norm.weight", (1280,)) + bf16(p + "attn.kv_norm.weight", (512,))
    out += [(p + "attn.attn_sink", "F32", (64,))]
    out += [(p + f"hc_{k}_{x}", "F32", (4, h)) for k in ("attn", "ffn") for x in ("fn", "base", "scale")]
    out += [*bf16(p + "ffn.gate.weight", (V41_E, h)), (p + "ffn.gate.bias_vl", "F32", (V41_E,))]
    for w, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
        out += _fp8_32(p + "ffn.shared_experts." + w, shape)
    for e in range(V41_E):
        for w, shape in (("w1", (i, h)), ("w2", (h, i)), ("w3", (i, h))):
            out += _fp4(f"{p}ffn.experts.{e}.{w}", shape)
    return out


def v41_shards() -> list[list[Tensor]]:
    """48 shards as the release has them: one backbone layer each (Engram's projections with their
    layer), the MTP layer over three, each Engram table alone, then the embeddings, the head, vision."""
    shards = []
    for layer in range(V41_LAYERS):
        tensors = _v41_layer(f"layers.{layer}.")
        if layer in V41_ENGRAM_ROWS:
            e = f"layers.{layer}.engram."
            tensors += (
                _fp8_32(e + "wkv", (25600, 6144)) + bf16(e + "q_weight", (4, V41_H)) + bf16(e + "k_weight", (4, V41_H))
            )
        shards.append(tensors)
    mtp = _v41_layer("mtp.0.") + _fp8_32("mtp.0.e_proj", (V41_H, V41_H)) + _fp8_32("mtp.0.h_proj", (V41_H, V41_H))
    mtp += bf16("mtp.0.enorm.weight", (V41_H,)) + bf16("mtp.0.hnorm.weight", (V41_H,))
    third = math.ceil(len(mtp) / 3)
    shards += [mtp[k * third : (k + 1) * third] for k in range(3)]
    for layer, rows in V41_ENGRAM_ROWS.items():
        e = f"layers.{layer}.engram.embed"
        shards.append([(e + ".weight", "F8_E4M3", (rows, 256)), (e + ".scale", "F8_E8M0", (rows, 8))])
    shards.append(bf16("embed.weight", (V41_VOCAB, V41_H)))
    shards.append(bf16("head.weight", (V41_VOCAB, V41_H)) + bf16("norm.weight", (V41_H,)))
    vision: list[Tensor] = []
    while sum(map(len, shards)) + len(vision) < V41_TENSORS - 2:
        b = f"vision.blocks.{len(vision) // 4}."
        vision += bf16(b + "attn.qkv.weight", (3456, 1152)) + bf16(b + "attn.proj.weight", (1152, 1152))
        vision += bf16(b + "norm1.weight", (1152,)) + bf16(b + "norm2.weight", (1152,))
    vision = vision[: V41_TENSORS - 2 - sum(map(len, shards))]
    vision += bf16("aligner.fc.weight", (V41_H, 1152)) + bf16("aligner.fc.bias", (V41_H,))
    shards.append(vision)
    return shards


def v41_config() -> dict:
    text = {
        "model_type": "deepseek_v41_text",
        "hidden_size": V41_H,
        "num_hidden_layers": V41_LAYERS,
        "num_nextn_predict_layers": 1,
        "moe_intermediate_size": V41_I,
        "n_routed_experts": V41_E,
        "n_shared_experts": 1,
        "num_experts_per_tok": 6,
        "engram_layer_ids": sorted(V41_ENGRAM_ROWS),
        "vocab_size": V41_VOCAB,
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
        "text_config": text,
        "quantization_config": quant,
    }


def layout(name: str) -> tuple[list[Tensor], dict]:
    """(tensors, config.json) of a named layout."""
    if name == "scale-200k":
        tensors = qwen35_tensors(64, 512)
        return tensors, qwen35_config(64, 512, qwen35_ignore(tensors, 2000))
    if name == "qwen3.5-397b":
        tensors = qwen35_tensors(60, 512)
        return tensors, qwen35_config(60, 512, qwen35_ignore(tensors, 512))
    if name == "glm5.2":
        return glm52_tensors(), glm52_config()
    if name == "kimi-k2.5":
        tensors = kimi25_tensors()
        return tensors, kimi25_config(tensors)
    if name == "deepseek-v4.1-flash":
        return [t for shard in v41_shards() for t in shard], v41_config()
    raise SystemExit(f"unknown layout {name!r}")


def shards_of(name: str) -> list[list[Tensor]] | None:
    """The layout's own shards where the release's shard layout matters (each Engram table alone)."""
    return v41_shards() if name == "deepseek-v4.1-flash" else None


def write_header_only(
    root: Path,
    tensors: list[Tensor],
    config: dict,
    per_shard: int = TENSORS_PER_SHARD,
    shards: list[list[Tensor]] | None = None,
) -> int:
    """Write `tensors` as shards (of `per_shard` tensors, or as `shards` gives them) whose headers are real
    and whose data is a hole; returns their bytes."""
    root.mkdir(parents=True, exist_ok=True)
    if shards is None:
        shards = [tensors[i : i + per_shard] for i in range(0, len(tensors), per_shard)]
    count = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(count):
        fname = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, dtype, shape in shards[i]:
            nbytes = math.prod(shape) * ELEMENT_BYTES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(root / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)  # the data region: a hole, no disk blocks
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "config.json").write_text(json.dumps(config, indent=1))
    return total


def timed(cmd: list[str], log: Path) -> dict:
    """Wall time, peak RSS (the child's own, from wait4) and the exit status of one fresh process."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    lines = log.read_text().strip().splitlines()
    return {
        "seconds": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),  # a loaded machine stretches the wall time
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "rc": rc,
        "error": lines[-1] if rc and lines else "",
    }


# Runs `python -m fp8conv` from another source tree (argv[1]), the installed one's editable finder dropped
BASELINE_BOOT = (
    "import runpy, sys; tree = sys.argv.pop(1); "
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
    "sys.path.insert(0, tree); import fp8conv; "
    "assert fp8conv.__file__.startswith(tree), fp8conv.__file__; "
    "runpy.run_module('fp8conv', run_name='__main__', alter_sys=True)"
)


def measure(name: str, work: Path, reps: int = 1, against: Path | None = None) -> dict:
    """Build the layout under `work`, then time inspect and --dry-run on it (best of `reps`). `against`:
    another source tree (an earlier commit's worktree), timed alternately with this one, run for run, so
    the ratio holds on a shared machine whose speed drifts."""
    root = work / name
    shutil.rmtree(root, ignore_errors=True)
    tensors, config = layout(name)
    nbytes = write_header_only(root, tensors, config, shards=shards_of(name))
    on_disk = sum(f.stat().st_blocks * 512 for f in root.iterdir())
    fp8conv = [sys.executable, "-m", "fp8conv"]
    out = str(work / "out")
    commands = {
        "inspect": [*fp8conv, "inspect", str(root)],
        # --no-space-check: the output of a 750 GB release would not fit here, and the plan is what is timed
        "dry-run --to block": [
            *fp8conv,
            "convert",
            str(root),
            "--to",
            "block",
            "-o",
            out,
            "--dry-run",
            "--no-space-check",
        ],
        # as a user runs it: the plan, then the output's size against the free space, which a release's
        # 400-750 GB do not fit here, so it ends refused (rc 1) once everything is counted
        "dry-run --to block, space checked": [*fp8conv, "convert", str(root), "--to", "block", "-o", out, "--dry-run"],
    }
    result: dict = {
        "tensors": len(tensors),
        "ignore_entries": len(_ignore_of(config)),
        "checkpoint_bytes": nbytes,
        "bytes_on_disk": on_disk,
        "commands": {},
    }
    for label, cmd in commands.items():
        log = work / f"{name}-{label.split()[0]}{'-space' if 'space' in label else ''}.log"
        runs, baseline = [], []
        for _ in range(reps):
            runs.append(timed(cmd, log))
            if against is not None:
                baseline.append(timed([sys.executable, "-c", BASELINE_BOOT, str(against), *cmd[3:]], log))
        result["commands"][label] = min(runs, key=lambda r: r["cpu_s"])
        if baseline:
            result["commands"][label]["baseline"] = min(baseline, key=lambda r: r["cpu_s"])
    shutil.rmtree(root, ignore_errors=True)
    return result


def _ignore_of(config: dict) -> list[str]:
    quant = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config", {})
    return quant.get("modules_to_not_convert") or quant.get("ignore") or []


def markdown(doc: dict) -> str:
    against = doc.get("against")
    lines = [
        "# Planning at release scale (header-only checkpoints)",
        "",
        f"{doc['machine']}. Target (issue 24): inspect and --dry-run at 200k tensors with a 2,000-entry "
        f"ignore list within {TARGET_S:g} s and {TARGET_RSS_MB} MB. Best of {doc.get('reps', 1)} by CPU time"
        + (f"; the baseline is {against}, run alternately with this tree." if against else "."),
        "",
        "A space-checked dry run ends refused here (rc 1): the releases' outputs (hundreds of GB) do not fit"
        " this machine's disk; it is timed all the same, its plan made and its output counted in full.",
        "",
        "| layout | tensors | ignore entries | command | wall s | CPU s | peak RSS MB | rc |"
        + (" baseline CPU s | baseline RSS MB | CPU ratio |" if against else ""),
        "|---|---:|---:|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if against else ""),
    ]
    for name, r in doc["layouts"].items():
        for label, c in r["commands"].items():
            row = (
                f"| {name} | {r['tensors']} | {r['ignore_entries']} | {label} | {c['seconds']} | {c['cpu_s']} | "
                f"{c['peak_rss_mb']} | {c['rc']} |"
            )
            if against and "baseline" in c:
                b = c["baseline"]
                row += f" {b['cpu_s']} | {b['peak_rss_mb']} | {c['cpu_s'] / b['cpu_s']:.2f} |"
            lines.append(row)
    return "\n".join(lines)


def run(work: Path, layouts: list[str], reps: int = 1, against: Path | None = None, label: str | None = None) -> dict:
    import platform

    doc = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "reps": reps,
        "against": label or (str(against) if against else None),
        "layouts": {name: measure(name, work, reps, against) for name in layouts},
    }
    (HERE / "plan-scale.json").write_text(json.dumps(doc, indent=2) + "\n")
    (HERE / "plan-scale.md").write_text(markdown(doc) + "\n")
    return doc


LAYOUTS = ["scale-200k", "qwen3.5-397b", "glm5.2", "kimi-k2.5", "deepseek-v4.1-flash"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="build/plan-scale")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--build", nargs=2, metavar=("LAYOUT", "DIR"), help="only build one layout into DIR")
    parser.add_argument("--against", type=Path, help="another fp8conv source tree to time alternately (a worktree)")
    parser.add_argument("--against-label", help="how the report names it (a commit)")
    args = parser.parse_args()
    if args.build:
        tensors, config = layout(args.build[0])
        write_header_only(Path(args.build[1]), tensors, config, shards=shards_of(args.build[0]))
        print(f"{len(tensors)} tensors in {args.build[1]}")
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(markdown(run(work, args.layouts.split(","), args.reps, args.against, args.against_label)))


if __name__ == "__main__":
    main()
