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
