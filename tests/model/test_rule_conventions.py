"""Families the table does not name, found by rule: the naming conventions of model types transformers 5.24
has that no test elsewhere builds (ERNIE-4.5-MoE, Cohere2-MoE, Hunyuan-MoE, Hy-V4, GLM-4, Granite-4 hybrid, Apertus,
Kimi-Linear, LongCat-Flash, LFM2). Each is a real transformers model saved in its original layout (save_pretrained
writes the checkpoint's own names: per-expert tensors, routers, activation parameters), block-quantized by the
plain definitions of tests/support/reference.py, then converted with --pad-for-tp 4 and checked the way an engine
reads it: transformers builds the model from the output's config.json and its dequantized tensors, finds every
parameter at the shape config.json gives it, and computes what the unpadded input computes
(tests/support/reductions.py's tolerance).

Each was refused by --pad-for-tp before its rule existed (a tensor inside an MLP with no role, or a width key
the rules did not know). The other tests check what a bf16 -> FP8 run leaves unquantized and lists (Hunyuan's
router mlp.gate.wg, projectors by other names, Step's attention gate g_proj) or quantizes with its fused partner
(Hy-V4's linear_gate), LFM2's derived width and a connector's own MLP: each failed before its fix.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from tests.support.reductions import assert_same_function
from tests.support.reference import dequant_block_reference, quantize_reference

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TOKENS = torch.tensor([[2, 9, 41, 5, 88, 201, 13, 4, 60]])
BASE = dict(
    hidden_size=200,
    num_hidden_layers=2,
    vocab_size=256,
    intermediate_size=330,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
MLA = dict(num_key_value_heads=4, head_dim=16, kv_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
MOE = dict(num_experts_per_tok=2)

# model_type -> (config, {config key: the width it has in the input}); every key listed is padded to whole
# 128-blocks per rank at TP 4 (a multiple of 512) and must be the width of the tensors of its role
MODELS: dict[str, tuple[dict, dict[str, int]]] = {
    # shared experts sized moe_intermediate_size * moe_num_shared_experts; router stats under moe_statics
    "ernie4_5_moe": (
        BASE | dict(moe_intermediate_size=136, moe_num_experts=4, moe_k=2, moe_num_shared_experts=2, use_bias=False),
        {"moe_intermediate_size": 136, "intermediate_size": 330},
    ),
    # two shared experts sized intermediate_size * num_shared_experts (as the routed ones: intermediate_size)
    "cohere2_moe": (
        BASE | dict(intermediate_size=136, num_experts=4, num_shared_experts=2, **MOE),
        {"intermediate_size": 136},
    ),
    # its gate projections are named linear_gate (dense MLP and shared experts; transformers renames them
    # gate_proj), its routed experts fused 3-D
    "hy_v4": (
        BASE | dict(moe_intermediate_size=136, n_routed_experts=4, num_experts=4, n_shared_experts=1, **MOE),
        {"intermediate_size": 330, "moe_intermediate_size": 136},
    ),
    # the router is mlp.gate.wg; its shared_mlp has intermediate_size (336: transformers' grouped_mm wants
    # 16-byte strides)
    "hunyuan_v1_moe": (BASE | dict(intermediate_size=336, num_experts=4, moe_topk=2), {"intermediate_size": 336}),
    # one fused 2-D [gate; up] Linear, mlp.gate_up_proj [2I, H] (halves of whole blocks: kept as they are)
    "glm4": (BASE | dict(intermediate_size=256), {"intermediate_size": 256}),
    # block_sparse_moe.input_linear [E, 2I, H] / output_linear, shared_mlp.input_linear [2I, H], router.layer
    "granitemoehybrid": (
        BASE
        | dict(
            intermediate_size=136,
            num_local_experts=4,
            shared_intermediate_size=256,
            layer_types=["attention", "attention"],
            mamba_n_heads=4,
            mamba_d_head=100,
            **MOE,
        ),
        {"intermediate_size": 136, "shared_intermediate_size": 256},
    ),
    # xIELU's parameters inside the MLP (mlp.act_fn.alpha_p ...), up/down only
    "apertus": (BASE, {"intermediate_size": 330}),
    # the dense first layer is a block_sparse_moe of gate/up/down_proj; experts w1/w2/w3
    "kimi_linear": (
        BASE
        | MLA
        | dict(
            layer_types=["full_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            moe_intermediate_size=136,
            num_experts=4,
            num_shared_experts=1,
            num_experts_per_token=2,
        ),
        {"intermediate_size": 330, "moe_intermediate_size": 136},
    ),
    # two dense MLPs per layer (mlps.0, mlps.1) of ffn_hidden_size, experts of expert_ffn_hidden_size
    "longcat_flash": (
        BASE
        | MLA
        | dict(
            ffn_hidden_size=330,
            expert_ffn_hidden_size=136,
            n_routed_experts=4,
            zero_expert_num=2,
            moe_topk=2,
            num_layers=2,
            q_lora_rank=64,
        ),
        {"ffn_hidden_size": 330, "expert_ffn_hidden_size": 136},
    ),
}
# Left in their float dtype, as FP8 releases ship them: embeddings, norms, the head, routers
_FLOAT = re.compile(r"embed|norm|lm_head|router|\.gate\.weight$|\.gate\.wg\.|classifier")


def _save_model(model_type: str, settings: dict, folder: Path) -> dict:
    config = transformers.AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def _read(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _block_fp8(model_type: str, settings: dict, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model as a block-FP8 release (two shards and an index), and what it computes: every quantized
    weight as float32(q) * float32(scale) in bf16."""
    staging = folder.with_name(folder.name + "-bf16")
    config = _save_model(model_type, settings, staging)
    stored, reference = {}, {}
    for name, t in _read(staging).items():
        if name.endswith(".weight") and t.dim() == 2 and not _FLOAT.search(name):
            q, s = quantize_reference(t.float(), (128, 128))
            stored[name], stored[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            reference[name] = dequant_block_reference(q, s, (128, 128))
        else:
            stored[name] = reference[name] = t
    folder.mkdir()
    names = sorted(stored)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: stored[n].contiguous() for n in part}, str(folder / shard), {"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder, reference


def _logits(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """What transformers computes with `tensors` under `config` (its quantization_config dropped); every
    parameter must be found at the shape config.json gives it."""
    folder.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def _dequantized(folder: Path) -> dict[str, torch.Tensor]:
    got = _read(folder)
    out = {}
    for name, t in got.items():
        if name.endswith("_scale_inv"):
            continue
        scale = got.get(name + "_scale_inv")
        out[name] = dequant_block_reference(t, scale, (128, 128)) if t.dtype == torch.float8_e4m3fn else t
    return out


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_padded_for_tp4_computes_what_the_input_does(tmp_path, model_type):
    source, reference = _block_fp8(model_type, MODELS[model_type][0], tmp_path / "in")
    out = tmp_path / "out"
    fp8conv.convert(source, out, ConvertOptions(to="block", pad_for_tp=4))
    config = json.loads((out / "config.json").read_text())
    for key, before in MODELS[model_type][1].items():
        assert config[key] == math.ceil(before / 512) * 512, (key, config[key])
    padded = _logits(tmp_path / "padded", _dequantized(out), config)
    plain = _logits(tmp_path / "plain", reference, json.loads((source / "config.json").read_text()))
    assert_same_function(padded, plain)


@pytest.mark.parametrize("to", ["channel", "block"])
def test_hunyuan_router_stays_unquantized(tmp_path, to):
    """vLLM's hunyuan_v1.py builds mlp.gate (the checkpoint's mlp.gate.wg) with quant_config=None: a bf16 ->
    FP8 run keeps it in its float dtype and lists it as not converted."""
    source = tmp_path / "in"
    _save_model("hunyuan_v1_moe", MODELS["hunyuan_v1_moe"][0], source)
    out = tmp_path / "out"
    fp8conv.convert(source, out, ConvertOptions(to=to))
    got = _read(out)
    routers = [n for n in got if n.endswith("mlp.gate.wg.weight")]
    assert routers and all(got[n].dtype != torch.float8_e4m3fn for n in routers)
    assert got["model.layers.0.mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    listed = qc["ignore"] if to == "channel" else qc["modules_to_not_convert"]
    for name in routers:
        module = name.removesuffix(".weight")
        assert any(module == m or module.endswith("." + m) or re.fullmatch(m[3:], module) for m in listed), module


def test_lfm2_derived_width_converts_and_pad_is_refused(tmp_path):
    """LFM2's MLP is not intermediate_size wide: its code derives the width (2/3 of it, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of: 330 -> 256 here, 12288 -> 8192 in LFM2-1.2B).
    Converted as it is (no key disagrees: none states the width); --pad-for-tp, which could write no key
    giving a padded width, is refused saying why."""
    source, reference = _block_fp8("lfm2", BASE | dict(layer_types=["full_attention", "conv"]), tmp_path / "in")
    assert reference["model.layers.0.feed_forward.w1.weight"].shape == (256, 200)
    out = tmp_path / "out"
    fp8conv.convert(source, out, ConvertOptions(to="bf16"))
    config = json.loads((source / "config.json").read_text())
    got = _logits(tmp_path / "got", _read(out), config)
    assert torch.equal(got, _logits(tmp_path / "plain", reference, config))
    with pytest.raises(fp8conv.Fp8ConvError, match="derives it from intermediate_size while block_auto_adjust"):
        fp8conv.convert(source, tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=4))


def _linear(rows: int, cols: int) -> torch.Tensor:
    return (torch.randn(rows, cols) * 0.05).bfloat16()


@pytest.mark.parametrize("to", ["channel", "block"])
def test_outside_the_layers_and_attention_gates_stay_unquantized(tmp_path, to):
    """A bf16 -> FP8 run of a model the table does not know quantizes the decoder layers' Linears only:
    Step-3.7's vit_large_projector and MiniCPM-V's merger (multimodal projectors by other names, outside every
    layer) and Step's head-wise attention gate self_attn.g_proj (bf16 in the Step-3.5 FP8 release, listed as
    not converted) keep their dtype and are listed; Idefics3's connector, DeepSeek-VL's aligner, VideoLLaMA3's
    projector and Video-LLaVA's image_tower too, around a Llama text model of the table."""
    from tests.support.helpers import load_dir, write_checkpoint

    for model_type, extra in (
        ("step3p5", ["vit_large_projector", "model.layers.0.self_attn.g_proj"]),
        ("qwen3_5_text", ["model.merger.mlp.0.linear_1"]),
        (
            "llama",
            [
                "model.connector.modality_projection.proj",
                "model.aligner.linear1",
                "model.projector.readout.0",
                "image_tower.encoder.layers.0.mlp.fc1",
            ],
        ),
    ):
        tensors = {f"model.layers.0.self_attn.{p}.weight": _linear(128, 256) for p in ("q_proj", "o_proj")}
        tensors |= {name + ".weight": _linear(8 if "g_proj" in name else 256, 256) for name in extra}
        config = {"model_type": model_type, "hidden_size": 256, "num_hidden_layers": 1}
        source = write_checkpoint(tmp_path / model_type, tensors, config)
        out = tmp_path / f"{model_type}-{to}"
        fp8conv.convert(source, out, ConvertOptions(to=to))
        got = load_dir(out)
        assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        listed = qc["ignore"] if to == "channel" else qc["modules_to_not_convert"]
        for name in extra:
            assert got[name + ".weight"].dtype == torch.bfloat16, name
            assert any(name == m or name.endswith("." + m) or re.fullmatch(m[3:], name) for m in listed), name


def test_hy_v4_gate_projection_is_quantized_with_its_up_projection(tmp_path):
    """Hy-V4's mlp.linear_gate is its gate projection (transformers' conversion_mapping renames it gate_proj),
    not a router: a bf16 -> FP8 run quantizes it with its up_proj, one scheme for the [gate; up] an engine
    fuses."""
    source = tmp_path / "in"
    _save_model("hy_v4", MODELS["hy_v4"][0], source)
    out = tmp_path / "out"
    fp8conv.convert(source, out, ConvertOptions(to="channel"))
    got = _read(out)
    for home in ("model.layers.0.mlp.", "model.layers.1.mlp.shared_experts."):
        assert got[home + "linear_gate.weight"].dtype == torch.float8_e4m3fn, home
        assert got[home + "up_proj.weight"].dtype == torch.float8_e4m3fn, home


def test_a_connectors_own_mlp_is_not_the_language_models(tmp_path):
    """Idefics2's connector holds a perceiver resampler with layers and MLPs of its own width: not the text
    model's dense MLP, so not held to its intermediate_size (every target refused the checkpoint before)."""
    from tests.support.helpers import write_checkpoint

    tensors = {}
    for home, width in (
        ("model.text_model.layers.0.mlp.", 330),
        ("model.connector.perceiver_resampler.layers.0.mlp.", 96),
    ):
        tensors |= {home + p + ".weight": _linear(width, 200) for p in ("gate_proj", "up_proj")}
        tensors[home + "down_proj.weight"] = _linear(200, width)
    config = {"model_type": "mistral", "hidden_size": 200, "intermediate_size": 330, "num_hidden_layers": 1}
    source = write_checkpoint(tmp_path / "in", tensors, config)
    fp8conv.convert(source, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=2))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["intermediate_size"] == 512
    got = _read(tmp_path / "out")
    assert got["model.text_model.layers.0.mlp.down_proj.weight"].shape == (200, 512)
    assert got["model.connector.perceiver_resampler.layers.0.mlp.down_proj.weight"].shape == (200, 96)
