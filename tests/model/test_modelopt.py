"""ModelOpt NVFP4 in every form its quantization is declared in (the forms vLLM's ModelOptQuantConfigBase
reads): config.json's flat quantization_config, the same with hf_quant_config.json's nested
{"quantization": {...}} inside it, hf_quant_config.json alone (ModelOpt before 0.31), lowercase quant_algo,
W4A16_NVFP4. A tiny Llama packed by the tests' own code, converted --to bf16, loaded by transformers with
no missing or unexpected key (so no input_scale is left over) and run against a reference holding the
weights decoded by definition; hf_quant_config.json never reaches an output."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv.source.config import READ_FROM_KEY
from tests.support.helpers import dir_snapshot, load_dir
from tests.support.modelopt_builders import (
    EXCLUDED,
    PRODUCER,
    build_modelopt,
    modelopt_logits,
    tiny_llama,
)
from tests.support.reference import same_bits

FLAT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": EXCLUDED}
NESTED = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDED, "kv_cache_quant_algo": None}
# name -> (config.json's quantization_config or None, hf_quant_config.json or None)
FORMS = {
    "config.json flat": (FLAT, None),
    "config.json nested": ({"quant_method": "modelopt", "producer": PRODUCER, "quantization": NESTED}, None),
    "hf_quant_config.json only": (None, {"producer": PRODUCER, "quantization": NESTED}),
    "lowercase quant_algo": (FLAT | {"quant_algo": "nvfp4"}, None),
    "W4A16_NVFP4": (FLAT | {"quant_algo": "W4A16_NVFP4"}, None),
    "quant_method modelopt_fp4": (FLAT | {"quant_method": "modelopt_fp4"}, None),
    # vLLM reads hf_quant_config.json only when config.json has no quantization_config: config.json wins
    "config.json beside a stale hf_quant_config.json": (FLAT, {"producer": PRODUCER, "quantization": {}}),
}


@pytest.mark.parametrize("form", FORMS)
def test_modelopt_nvfp4_forms_to_bf16_load_in_transformers(tmp_path, form):
    from safetensors.torch import save_file

    qconfig, sidecar = FORMS[form]
    reference = build_modelopt(tmp_path / "c", qconfig, sidecar)
    report = fp8conv.inspect(tmp_path / "c")
    # the MLP widths are checked against the unpacked [N, K], not the uint8 container's [N, K/2]
    assert report.problems == [] and report.formats == {"nvfp4-modelopt": 14, "unquantized": 7}, report
    before = dir_snapshot(tmp_path / "c")
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert dir_snapshot(tmp_path / "c") == before
    assert result.tensors_converted == 14  # 7 Linears x 2 layers

    got = load_dir(tmp_path / "out")
    assert sorted(got) == sorted(reference)  # no weight_scale, weight_scale_2 or input_scale left
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(reference)
    wrong = [n for n, t in reference.items() if not same_bits(got[n], t)]
    assert not wrong, wrong

    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in written and READ_FROM_KEY not in json.dumps(written)
    # vLLM applies hf_quant_config.json to a config.json without quantization_config: it must not be there
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    if sidecar is not None:
        assert [f for f, _ in result.files_skipped] == ["hf_quant_config.json"]

    (tmp_path / "ref").mkdir()
    save_file(reference, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    tiny_llama().save_pretrained(tmp_path / "ref")
    ours, expected = modelopt_logits(tmp_path / "out"), modelopt_logits(tmp_path / "ref")
    assert ours.abs().max() > 0 and same_bits(ours, expected)


def test_modelopt_nvfp4_to_channel_drops_input_scales(tmp_path):
    """FP8_DYNAMIC quantizes activations per token: ModelOpt's static input_scale has no place there."""
    reference = build_modelopt(tmp_path / "c", None, {"producer": PRODUCER, "quantization": NESTED})
    fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="channel"))
    got = load_dir(tmp_path / "out")
    assert not [n for n in got if n.endswith((".input_scale", ".weight_scale_2"))]
    assert got["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert got["model.layers.0.mlp.down_proj.weight_scale"].shape == (64, 1)
    assert got["lm_head.weight"].dtype == torch.bfloat16
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == "compressed-tensors" and "lm_head" in written["ignore"]
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    assert sorted(got) == sorted(
        [n for n in reference if not n.endswith("_proj.weight") or n == "lm_head.weight"]
        + [n for n in reference if n.endswith("_proj.weight")]
        + [n + "_scale" for n in reference if n.endswith("_proj.weight")]
    )


@pytest.mark.parametrize(
    ("qconfig", "sidecar", "file", "message"),
    [
        # FP8 and MIXED_PRECISION are read (tests/model/test_readers_2026.py); FP8_PB_WO's 4-D block scales are not
        (FLAT | {"quant_algo": "FP8_PB_WO"}, None, "config.json", "ModelOpt quant_algo 'FP8_PB_WO' with group_size 16"),
        (FLAT | {"quant_algo": "MIXED_PRECISION"}, None, "config.json", "MIXED_PRECISION has no quantized_layers"),
        (FLAT | {"group_size": 32}, None, "config.json", "quant_algo 'NVFP4' with group_size 32"),
        (
            None,
            {"producer": PRODUCER, "quantization": NESTED | {"quant_algo": "INT4_AWQ"}},
            "hf_quant_config.json",
            "'INT4_AWQ'",
        ),
        (None, {"producer": PRODUCER}, "hf_quant_config.json", "quant_algo None"),
    ],
)
def test_modelopt_forms_fp8conv_does_not_read_are_refused_naming_the_file(tmp_path, qconfig, sidecar, file, message):
    build_modelopt(tmp_path / "c", qconfig, sidecar)
    with pytest.raises(fp8conv.CheckpointError, match=message) as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert str(err.value).startswith(f"in {file}: "), err.value
    assert not (tmp_path / "out").exists()


def test_modelopt_weights_without_any_quantization_description_are_refused_not_read_as_bf16(tmp_path):
    build_modelopt(tmp_path / "c", None, None)
    with pytest.raises(fp8conv.CheckpointError, match="does not declare it") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert "_proj.weight" in str(err.value) and "hf_quant_config.json" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_unreadable_hf_quant_config_json_is_refused_by_name(tmp_path):
    build_modelopt(tmp_path / "c", None, None)
    (tmp_path / "c" / "hf_quant_config.json").write_text('{"quantization": ')
    with pytest.raises(fp8conv.CheckpointError, match=r"^in hf_quant_config.json: is not valid JSON") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert str(err.value).endswith("fix or re-download hf_quant_config.json")
    assert not (tmp_path / "out").exists()
