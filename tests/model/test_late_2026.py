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
from tests.support.reference import quantize_reference, same_bits
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
