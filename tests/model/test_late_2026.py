"""The releases of late 2026 (tests/support/releases_late_2026.py) through every target: converted exactly
where an engine loads the result, refused by name where none does."""

from __future__ import annotations

import json
import re

import pytest
import torch

import fp8conv
from fp8conv.errors import PlanRefused
from tests.support.helpers import load_dir
from tests.support.readers_2026 import scaled_by_powers_of_two
from tests.support.reference import quantize_exact_reference, quantize_reference, same_bits
from tests.support.releases_late_2026 import INKLING_FP8, build_inkling_fp8

pytest.importorskip("scipy")  # transformers' Inkling vision tower plans its output scales with it


@pytest.fixture(scope="module")
def inkling(tmp_path_factory):
    path = tmp_path_factory.mktemp("inkling") / "Inkling-FP8-dynamic"
    return path, build_inkling_fp8(path)


def test_inkling_to_channel_is_the_release_s_own_format(inkling, tmp_path):
    src, truth = inkling
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="channel"))
    out = load_dir(tmp_path / "out")
    fused = [n for n in truth if n.endswith(INKLING_FP8) and truth[n].dim() == 3]
    assert any("experts.w13_weight" in n for n in fused) and any("shared_w13_weight" in n for n in fused)
    for name, value in truth.items():
        if not name.endswith(INKLING_FP8):
            assert same_bits(out[name], value), name
            continue
        q, scale = quantize_reference(value.reshape(-1, value.shape[-1]), None)
        assert same_bits(out[name], q.reshape(value.shape)), name  # rows stay interleaved, each with its scale
        assert torch.equal(out[name + "_scale"], scale.reshape(*value.shape[:-1], 1)), name
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert quant["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    # the bf16 LM head is a Linear: listed, or an engine would read it as FP8
    assert "model.llm.unembed" in quant["ignore"]
    assert "model.llm.layers.0.attn.wq_du" in quant["ignore"]
    assert fp8conv.verify(src, tmp_path / "out").ok


def test_inkling_to_bf16_loads_in_transformers(inkling, tmp_path):
    from transformers.models.inkling.modeling_inkling import InklingForConditionalGeneration

    src, truth = inkling
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    out = load_dir(tmp_path / "out")
    assert set(out) == {n for n in truth}
    for name, value in truth.items():
        assert same_bits(out[name], value.to(torch.bfloat16)), name
    model, info = InklingForConditionalGeneration.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # transformers de-interleaves w13 into [gate; up] halves as it loads: gate = even rows, up = odd rows
    w13 = truth["model.llm.layers.1.mlp.experts.w13_weight"].to(torch.bfloat16)
    loaded = model.model.language_model.layers[1].mlp.experts.gate_up_proj.data
    assert torch.equal(loaded, torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1))
    assert fp8conv.verify(src, tmp_path / "out").ok


@pytest.mark.parametrize("options", [{"to": "block"}, {"to": "block", "scale_fmt": "ue8m0"}, {"to": "mxfp8"}])
def test_inkling_block_targets_are_refused_by_name(inkling, tmp_path, options):
    src, _ = inkling
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(**options))
    message = "\n".join(str(p) for p in refused.value.problems)
    for name in ("layers.1.mlp.experts.w13_weight", "shared_experts.shared_w13_weight", "layers.0.mlp.w13_dn.weight"):
        assert re.search(rf"{re.escape(name)}.*interleaved.*no engine reads Inkling.*--to channel", message), name
    assert not (tmp_path / "out").exists()


def test_a_bf16_inkling_s_fused_experts_become_channel_fp8_as_the_release_s(inkling, tmp_path):
    src, truth = inkling
    fp8conv.convert(src, tmp_path / "bf16", fp8conv.ConvertOptions(to="bf16"))
    fp8conv.convert(tmp_path / "bf16", tmp_path / "out", fp8conv.ConvertOptions(to="channel"))
    out = load_dir(tmp_path / "out")
    for name in ("model.llm.layers.1.mlp.experts.w13_weight", "model.llm.layers.1.mlp.shared_experts.shared_w2_weight"):
        value = truth[name].to(torch.bfloat16).to(torch.float32)
        q, scale = quantize_reference(value.reshape(-1, value.shape[-1]), None)
        assert same_bits(out[name], q.reshape(value.shape)), name
        assert torch.equal(out[name + "_scale"], scale.reshape(*value.shape[:-1], 1)), name


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from tests.support.releases_late_2026 import build_v41

    path = tmp_path_factory.mktemp("v41") / "DeepSeek-V4.1-Flash"
    return path, build_v41(path)


ENGRAM = "layers.1.engram.embed"


def test_v41_reads_each_tensor_s_geometry(v41):
    src, _ = v41
    report = fp8conv.inspect(src)
    assert report.problems == []
    # dense 32x32 (declared); the Engram table one scale per row of 32 values: a grid only (1, 32) gives
    assert report.block_geometries == {"32x32": 11, "1x32": 1}


def test_v41_to_bf16_dequantizes_every_geometry(v41, tmp_path):
    src, truth = v41
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    out = load_dir(tmp_path / "out")
    for name, value in truth.items():
        assert same_bits(out[name], value.to(torch.bfloat16)), name
    assert not [n for n in out if n.endswith(".scale")]
    assert fp8conv.verify(src, tmp_path / "out").ok


@pytest.mark.parametrize("to", ["block", "channel", "mxfp8"])
def test_v41_fp8_targets_keep_the_engram_table_as_its_loaders_read_it(v41, tmp_path, to):
    """Every V4.1 loader hard-codes the Engram table's (1, 32) E8M0 geometry (model.geometry): an FP8 output
    keeps its bytes and its scale's, dtype included; the rest is converted as for DeepSeek-V4."""
    from safetensors.torch import load_file

    src, _ = v41
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to=to))
    table = load_file(src / "model-00003-of-00003.safetensors")
    out = load_file(tmp_path / "out" / "model-00003-of-00003.safetensors")  # alone in its shard still
    assert set(out) == set(table)
    for name in table:
        assert same_bits(out[name], table[name]), name
    assert out[ENGRAM + ".scale"].dtype == torch.float8_e8m0fnu
    assert fp8conv.verify(src, tmp_path / "out").ok


def test_v41_to_block_keeps_its_32x32_dense_blocks(v41, tmp_path):
    from safetensors.torch import load_file

    src, _ = v41
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="block"))
    out = load_dir(tmp_path / "out")
    stored = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(f).items()}
    assert same_bits(out["layers.0.attn.wq_a.weight"], stored["layers.0.attn.wq_a.weight"])
    assert out["layers.0.attn.wq_a.scale"].shape == (7, 5)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]


def test_v41_ue8m0_is_refused_by_name_for_its_32x32_blocks(v41, tmp_path):
    src, _ = v41
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="block", scale_fmt="ue8m0"))
    assert "32x32 blocks; --scale-fmt ue8m0 (DeepGEMM) takes 128x128 blocks only" in str(refused.value.problems[0])


def test_a_grid_of_one_scale_per_row_is_read_exactly_under_any_declared_block(tmp_path):
    """A family that states nothing about it: read exactly (the grid can mean nothing else), and an FP8
    output writes it in the declared geometry, which any loader reads from the config."""
    from tests.support.helpers import fp8, fp8_block_config, write_checkpoint
    from tests.support.reference import dequant_block_reference

    q = fp8((200, 256), 3)
    scale = torch.rand(200, 2, generator=torch.Generator().manual_seed(4)) + 0.01  # rows: one per row
    name = "model.layers.0.mlp.down_proj.weight"
    tensors = {name: q, name + "_scale_inv": scale, "model.norm.weight": torch.ones(256)}
    write_checkpoint(tmp_path / "in", tensors, config=fp8_block_config())
    assert fp8conv.inspect(tmp_path / "in").block_geometries == {}  # one geometry: nothing to list
    truth = dequant_block_reference(q, scale, (1, 128), torch.float32)
    fp8conv.convert(tmp_path / "in", tmp_path / "bf16", fp8conv.ConvertOptions(to="bf16"))
    assert same_bits(load_dir(tmp_path / "bf16")[name], truth.to(torch.bfloat16))
    fp8conv.convert(tmp_path / "in", tmp_path / "block", fp8conv.ConvertOptions(to="block"))
    out = load_dir(tmp_path / "block")
    want_q, want_s = quantize_reference(truth, (128, 128))
    assert same_bits(out[name], want_q) and torch.equal(out[name + "_scale_inv"], want_s)
    # a grid that fits no block on an axis is still refused by name
    tensors[name + "_scale_inv"] = torch.rand(150, 2) + 0.01
    write_checkpoint(tmp_path / "bad", tensors, config=fp8_block_config())
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(tmp_path / "bad", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert f"tensor '{name}'" in str(refused.value.problems[0]) and "[150, 2]" in str(refused.value.problems[0])


@pytest.fixture(scope="module")
def quark(tmp_path_factory):
    from tests.support.releases_late_2026 import build_quark

    path = tmp_path_factory.mktemp("quark") / "GLM-Quark-like"
    return path, build_quark(path)


def test_quark_reads_every_scheme_of_its_layers(quark):
    src, _ = quark
    report = fp8conv.inspect(src)
    assert report.problems == [] and report.quant_method == "quark"
    assert report.formats == {"block-fp8": 3, "channel-fp8": 2, "mxfp4": 3, "per-tensor-fp8": 2, "unquantized": 7}


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_quark_converts_exactly_to_every_target(quark, tmp_path, to):
    from safetensors.torch import load_file

    src, truth = quark
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to=to))
    out = load_dir(tmp_path / "out")
    stored = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(f).items()}
    for name, value in truth.items():
        if to == "bf16":
            assert same_bits(out[name], value.to(torch.bfloat16)), name
            continue
        kept = name.startswith("model.layers.0.") and not any(p in name for p in ("o_proj", "down_proj"))
        if to == "block" and kept:  # block FP8 in the input's own blocks: its bytes kept
            assert same_bits(out[name], stored[name]), name
            continue
        if to == "block" and scaled_by_powers_of_two(stored, name):  # MXFP8 / MXFP4 layers: power-of-two
            # blocks wherever one is exact
            q, scale, _ = quantize_exact_reference(value, (128, 128))
        else:
            q, scale = quantize_reference(value, None if to == "channel" else (128, 128))
        suffix = "_scale" if to == "channel" else "_scale_inv"
        assert same_bits(out[name], q), name
        assert torch.equal(out[name + suffix], scale.reshape(-1, 1) if to == "channel" else scale), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if to != "bf16":
        assert "quark" not in json.dumps(config["quantization_config"])
        listed = config["quantization_config"].get("ignore") or config["quantization_config"].get("ignored_layers")
        assert "lm_head" in listed
    assert fp8conv.verify(src, tmp_path / "out").ok


@pytest.mark.parametrize("options", [{"to": "block", "scale_fmt": "ue8m0"}, {"to": "mxfp8"}])
def test_quark_to_the_power_of_two_targets(quark, tmp_path, options):
    """Quark's mix to the E8M0 targets: every quantized weight requantized and reported, verify passes, and
    the MXFP4 layer (E2M1 under E8M0 per 1x32) comes back exactly as MXFP8 (its groups' own exponents)."""
    src, truth = quark
    result = fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(**options), run=fp8conv.RunOptions())
    reported = result.requantization["tensors"]
    assert set(reported) == set(truth)
    if options["to"] == "mxfp8":
        mxfp4 = [n for n in truth if n.startswith("model.layers.1.") and "o_proj" not in n and "down_proj" not in n]
        assert mxfp4 and all(reported[n]["relative_frobenius"] == 0 for n in mxfp4)
    assert fp8conv.verify(src, tmp_path / "out").ok


def test_quark_per_layer_block_sizes_and_the_nested_form(tmp_path):
    """A layer_quant_config entry with a block size of its own reads that layer's grid in it; the sections
    under `quant_config` (transformers' QuarkConfig written back) read the same."""
    from tests.support.helpers import fp8, write_checkpoint
    from tests.support.reference import dequant_block_reference
    from tests.support.releases_late_2026 import BLOCK_SPEC, quark_config, quark_spec

    q64, q128 = fp8((128, 256), 1), fp8((128, 256), 2)
    s64 = torch.rand(2, 4) * 0.01 + 1e-3
    s128 = torch.rand(1, 2) * 0.01 + 1e-3
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": q64,
        "model.layers.0.self_attn.q_proj.weight_scale": s64,
        "model.layers.0.self_attn.k_proj.weight": q128,
        "model.layers.0.self_attn.k_proj.weight_scale": s128,
        "model.norm.weight": torch.ones(256),
    }
    spec64 = quark_spec("fp8_e4m3", "per_block", block_size=[64, 64], scale_type="float32")
    layers = {"model.layers.0.self_attn.q_proj": {"weight": spec64}, "model.layers.0.*": {"weight": BLOCK_SPEC}}
    config = quark_config(layers)
    for form, cfg in (("top", config), ("nested", _nested(config))):
        write_checkpoint(tmp_path / form, tensors, cfg)
        fp8conv.convert(tmp_path / form, tmp_path / f"{form}-out", fp8conv.ConvertOptions(to="bf16"))
        out = load_dir(tmp_path / f"{form}-out")
        want64 = dequant_block_reference(q64, s64, (64, 64), torch.bfloat16)
        want128 = dequant_block_reference(q128, s128, (128, 128), torch.bfloat16)
        assert same_bits(out["model.layers.0.self_attn.q_proj.weight"], want64), form
        assert same_bits(out["model.layers.0.self_attn.k_proj.weight"], want128), form


def _nested(config: dict) -> dict:
    quant = config["quantization_config"]
    sections = {k: v for k, v in quant.items() if k not in ("quant_method", "export")}
    return config | {
        "quantization_config": {
            "quant_method": "quark",
            "quant_config": sections,
            "json_export_config": quant["export"],
        }
    }


@pytest.mark.parametrize(
    ("weight", "named"),
    [
        ({"dtype": "fp6_e3m2", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}, "MXFP6"),
        ({"dtype": "int8", "qscheme": "per_channel", "symmetric": True}, "INT8"),
        (
            [
                {"dtype": "fp4", "qscheme": "per_group", "group_size": 16},
                {"dtype": "fp8_e4m3", "qscheme": "per_tensor"},
            ],
            "two-stage",
        ),
        ({"dtype": "fp8_e4m3", "qscheme": "per_tensor", "symmetric": False}, "asymmetric"),
    ],
)
def test_quark_schemes_fp8conv_does_not_decode_are_refused_by_name(tmp_path, weight, named):
    from tests.support.releases_late_2026 import build_quark, quark_config, quark_layers

    config = quark_config({"*q_proj": {"weight": weight}, **quark_layers()})
    build_quark(tmp_path / "in", config)
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    message = str(refused.value.problems[0])
    assert "layer_quant_config['*q_proj'].weight" in message and named in message and "config.json" in message


def test_quark_kv_cache_group_is_declared_in_a_channel_output_with_its_scales(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.support.releases_late_2026 import build_quark, quark_config, quark_layers

    config = quark_config(quark_layers())
    config["quantization_config"]["export"]["kv_cache_group"] = ["*k_proj", "*v_proj"]
    build_quark(tmp_path / "in", config)
    shard = next((tmp_path / "in").glob("*.safetensors"))
    tensors = load_file(shard) | {"model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.02)}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((tmp_path / "in" / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.k_proj.output_scale"] = shard.name
    (tmp_path / "in" / "model.safetensors.index.json").write_text(json.dumps(index))
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="channel"))
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert quant["kv_cache_scheme"]["type"] == "float" and quant["kv_cache_scheme"]["strategy"] == "tensor"
    assert torch.equal(load_dir(tmp_path / "out")["model.layers.0.self_attn.k_proj.output_scale"], torch.tensor(0.02))


def test_the_engine_check_names_block_fp8_inkling_experts(inkling):
    """verify's independent check: an Inkling output whose fused experts are block FP8 (what no engine
    reads, whoever wrote it) is named; the channel layout is not."""
    from fp8conv.check.engine_layouts import engine_layout_problems

    src, _ = inkling
    config = json.loads((src / "config.json").read_text())
    w13 = "model.llm.layers.1.mlp.experts.w13_weight"
    block = {w13: ("F8_E4M3", (4, 384, 128)), w13 + "_scale_inv": ("F32", (4, 3, 1))}
    channel = {w13: ("F8_E4M3", (4, 384, 128)), w13 + "_scale": ("F32", (4, 384, 1))}
    found = engine_layout_problems(config, block, lambda n: None, lambda n: None)
    assert len(found) == 1 and w13 in found[0] and "vllm#48876" in found[0]
    assert engine_layout_problems(config, channel, lambda n: None, lambda n: None) == []


def test_v41_verify_reads_the_kept_engram_table_in_bands_and_catches_a_flipped_byte(v41, tmp_path):
    from safetensors.torch import load_file, save_file

    from fp8conv.options import Tuning

    src, _ = v41
    fp8conv.convert(src, tmp_path / "out", fp8conv.ConvertOptions(to="block"))
    small = Tuning(verify_band_elements=4096)  # the table's 300 x 64 values in bands of 64 rows
    assert fp8conv.verify(src, tmp_path / "out", tuning=small).ok
    shard = tmp_path / "out" / "model-00003-of-00003.safetensors"
    tensors = load_file(shard)
    flipped = tensors[ENGRAM + ".weight"].view(torch.uint8).clone()
    flipped[250, 7] ^= 1
    tensors[ENGRAM + ".weight"] = flipped.view(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    failures = fp8conv.verify(src, tmp_path / "out", tuning=small).failures
    assert any(ENGRAM + ".weight: not byte-identical to the input" in f for f in failures), failures
