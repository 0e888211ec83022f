"""A DeepSeek-V4 release, end to end: a tiny model in DeepSeek's own names and layout (block FP8 linears
with E8M0 128x128 scales, MXFP4 routed experts, bf16 / float32 rest, DeepSeek's config keys), converted
--to bf16, loaded by transformers' AutoModelForCausalLM and run, against a reference DeepseekV4ForCausalLM
that holds the weights decoded by the definitions (tests/support/packing.py), set by hand under transformers'
own parameter names -- so a tensor fp8conv writes under a name transformers maps elsewhere, or decodes
wrongly, changes the logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp8conv
from tests.support.helpers import fp8, load_dir, write_checkpoint
from tests.support.packed_builders import v4_config
from tests.support.packing import e2m1_value, e8m0_value, group_scaled, pack_nibbles, random_codes, random_e8m0
from tests.support.reference import dequant_block_reference, same_bits

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4 (added in 5.x)", allow_module_level=True)

HIDDEN, INTER, EXPERTS, VOCAB = 160, 32, 4, 256  # K = 160 and 32: neither a multiple of 128
# 136 tokens: the HCA layer (compress ratio 128) closes one window, the CSA layer (4) 34
TOKENS = torch.randint(0, VOCAB, (1, 136), generator=torch.Generator().manual_seed(7))

# transformers' name (after "model.layers.L.") -> DeepSeek's (after "layers.L."), from DeepSeek's
# inference code; transformers' conversion_mapping "deepseek_v4" reads the right-hand side back
LAYER_NAMES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
# A V4 release's FP8 linears (128x128 E8M0 scales); the routed experts are MXFP4; the rest bf16,
# except DeepSeek's float32 tensors (hc_*, attn_sink, ape, the router's bias) and tid2eid (int64)
FP8_LINEARS = (
    ".attn.wq_a.",
    ".attn.wq_b.",
    ".attn.wkv.",
    ".attn.wo_a.",
    ".attn.wo_b.",
    ".attn.indexer.wq_b.",
    ".shared_experts.",
)
FLOAT32 = ("hc_", "attn_sink", ".ape", "gate.bias")


def release_config() -> dict:
    """DeepSeek's spelling of the architecture (compress_ratios, num_hash_layers, qk_rope_head_dim, which
    transformers folds into its own fields), one layer of each attention type: sliding, CSA (with an
    indexer), HCA; the first layer hash-routed."""
    arch = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTER,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "q_lora_rank": 128,  # q_b_proj [256, 128]: whole 128-blocks, which transformers' own FP8 decoding reads right
        "num_experts_per_tok": 2,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": 1,
        "compress_ratios": [0, 4, 128],
        "num_hash_layers": 1,
        "qk_rope_head_dim": 8,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "max_position_embeddings": 256,
        "num_nextn_predict_layers": 1,
    }
    return v4_config(**arch)


def hf_to_native(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.L.<rest>
    return f"layers.{layer}.{LAYER_NAMES[rest]}"


def build_release(path) -> dict[str, torch.Tensor]:
    """Writes the release; returns the reference state dict under transformers' names: every quantized
    weight decoded by the definitions (exactly, then rounded once to bf16 as --to bf16 must), the rest as
    stored; the routed experts fused as transformers holds them (gate_up_proj[e] = w1 over w3)."""
    config = transformers.DeepseekV4Config(**{k: v for k, v in release_config().items() if k != "architectures"})
    shapes = {k: tuple(v.shape) for k, v in transformers.DeepseekV4ForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    native: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for seed, (hf, shape) in enumerate(shapes.items(), start=1):
        if hf.endswith(("experts.gate_up_proj", "experts.down_proj")):
            layer = hf.split(".")[2]
            parts = ("w1", "w3") if hf.endswith("gate_up_proj") else ("w2",)
            rows = shape[1] // len(parts)
            fused = []
            for e in range(EXPERTS):
                for w in parts:
                    name, k = f"layers.{layer}.ffn.experts.{e}.{w}", shape[2]
                    own_seed = 1000 * seed + 10 * e + int(w[1])  # w1 and w3 differ
                    codes = random_codes((rows, k), own_seed)
                    scale = random_e8m0((rows, k // 32), own_seed, 118, 124)
                    native[name + ".weight"] = pack_nibbles(codes).view(torch.int8)
                    native[name + ".scale"] = scale.view(torch.float8_e8m0fnu)
                    fused.append(group_scaled(e2m1_value(codes), e8m0_value(scale), 32))
            stacked = torch.stack([torch.cat(fused[i : i + len(parts)]) for i in range(0, len(fused), len(parts))])
            reference[hf] = stacked.to(torch.float32).to(torch.bfloat16)
            continue
        name = hf_to_native(hf)
        if any(f in name for f in FP8_LINEARS):
            native[name], native[name.removesuffix(".weight") + ".scale"], reference[hf] = fp8_linear(shape, seed)
        elif name.endswith("tid2eid"):
            native[name] = reference[hf] = torch.randint(0, EXPERTS, shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen) * 0.1 + (1.0 if "norm" in name else 0.0)
            native[name] = reference[hf] = value if any(f in name for f in FLOAT32) else value.to(torch.bfloat16)
    # DeepSeek ships its multi-token-prediction layer too: converted like the rest, ignored by transformers
    native["mtp.0.attn.wq_a.weight"], native["mtp.0.attn.wq_a.scale"], _ = fp8_linear((48, HIDDEN), 99)
    native["mtp.0.ffn.experts.0.w1.weight"] = pack_nibbles(random_codes((INTER, HIDDEN), 99)).view(torch.int8)
    native["mtp.0.ffn.experts.0.w1.scale"] = random_e8m0((INTER, HIDDEN // 32), 99).view(torch.float8_e8m0fnu)
    write_checkpoint(path, native, release_config(), shards=3)
    return reference


def fp8_linear(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 weight, its E8M0 128x128 scale, and its value (e4m3 x 2^(b-127), exact in float32) in bf16."""
    q = fp8(shape, seed)
    scale = random_e8m0((math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), seed, 112, 118)
    exact = dequant_block_reference(q, e8m0_value(scale).to(torch.float32), (128, 128), torch.float32)
    return q, scale.view(torch.float8_e8m0fnu), exact.to(torch.bfloat16)


def test_v4_release_to_bf16_runs_in_transformers_as_decoded_by_definition(tmp_path):
    reference = build_release(tmp_path / "c")
    fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))

    out = load_dir(tmp_path / "out")
    assert not [n for n in out if n.endswith(".scale")]
    assert out["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert out["mtp.0.ffn.experts.0.w1.weight"].shape == (INTER, HIDDEN)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    # everything else as DeepSeek wrote it (the reference below is built from this config too)
    assert written == {k: v for k, v in release_config().items() if k not in ("quantization_config", "expert_dtype")}
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert isinstance(config, transformers.DeepseekV4Config)
    assert getattr(config, "quantization_config", None) is None and getattr(config, "expert_dtype", None) is None
    assert config.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert isinstance(model, transformers.DeepseekV4ForCausalLM)
    assert not any(info.values()), info

    expected = transformers.DeepseekV4ForCausalLM(config).to(torch.float32)
    expected.load_state_dict(reference, strict=True)
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(reference)
    wrong = [n for n, t in expected.state_dict().items() if not same_bits(loaded[n], t)]
    assert not wrong, wrong

    with torch.no_grad():
        ours, theirs = model(TOKENS).logits, expected(TOKENS).logits
    assert torch.isfinite(ours).all() and ours.abs().max() > 0
    assert same_bits(ours, theirs)


def load_dequantized(path) -> torch.nn.Module:
    """transformers' own decoding of block FP8 (and V4's FP4 experts): FineGrainedFP8Config(dequantize=True)."""
    pytest.importorskip("accelerate")  # transformers' quantized loading needs it
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float32,
        output_loading_info=True,
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
    )
    assert not any(info.values()), info
    return model


def grid_guess_holds(shape: torch.Size) -> bool:
    """transformers' dequantize=True takes the block size from the scale grid (rows // grid rows), which
    is 128 only when both dims are whole 128-blocks; on ragged shapes it guesses wrong (160 rows under
    two grid rows read as 80-row blocks), the trap fp8conv exists to avoid, so only these are compared."""
    return shape[-1] % 128 == 0 and shape[-2] % 128 == 0


def test_v4_release_decoded_by_transformers_equals_fp8conv_bf16(tmp_path):
    """An independent decoder: transformers' MXFP4 expert unpacking (its own E2M1 table, nibble order and
    E8M0 scales) gives bit for bit the values of fp8conv's bf16 output."""
    build_release(tmp_path / "c")
    fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    theirs = load_dequantized(tmp_path / "c").state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).state_dict()
    assert sorted(theirs) == sorted(ours)
    experts = [n for n in ours if ".mlp.experts." in n]
    assert len(experts) == 2 * 3  # gate_up_proj and down_proj, three layers
    fp8_in_release = {n for n in ours if n not in experts and any(p in hf_to_native(n) for p in FP8_LINEARS)}
    compared = [n for n in ours if n not in fp8_in_release or grid_guess_holds(ours[n].shape)]
    assert len([n for n in compared if n in fp8_in_release]) == 3  # q_b_proj, three layers
    wrong = [n for n in compared if not same_bits(theirs[n], ours[n])]
    assert not wrong, wrong


def test_v4_block_output_loads_in_transformers_as_its_blocks_define(tmp_path):
    """--to block: MXFP4 experts requantized to 128x128 FP8. transformers loads it with no missing or
    unexpected keys, runs it, and decodes each whole-block tensor to the values the output's own bytes
    and scales define."""
    build_release(tmp_path / "c")
    fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="block"))
    model = load_dequantized(tmp_path / "out")
    loaded = model.state_dict()
    out = load_dir(tmp_path / "out")
    native = {hf_to_native(n): n for n in loaded if ".mlp.experts." not in n}
    checked = 0
    for name, tensor in out.items():
        scale = out.get(name.removesuffix(".weight") + ".scale")
        if scale is None or name not in native or not grid_guess_holds(tensor.shape):
            continue
        expected = dequant_block_reference(tensor, scale.to(torch.float32), (128, 128), torch.float32)
        assert same_bits(loaded[native[name]], expected), name
        checked += 1
    experts = loaded["model.layers.0.mlp.experts.down_proj"]  # [E, HIDDEN, INTER]: ragged, values not compared
    assert experts.shape == (EXPERTS, HIDDEN, INTER) and torch.isfinite(experts).all()
    with torch.no_grad():
        logits = model(TOKENS).logits
    assert torch.isfinite(logits).all() and logits.abs().max() > 0
    assert checked == 3  # wq_b, three layers
