"""--to int8: symmetric INT8 weights, one float32 scale per output row (absmax / 127, round half to even,
clamp), compressed-tensors W8A8 int-quantized; checked against a plain definition written here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.cli.commands import main
from fp8conv.errors import Fp8ConvError, OptionsError
from fp8conv.options import RunOptions, Tuning
from tests.support.helpers import load_dir, write_checkpoint
from tests.support.packed_builders import build_int4
from tests.support.reference import dequant_reference, quantize_int8_reference, same_bits
from tests.support.synthetic import DIALECTS

W8A8_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True},
    "output_activations": None,
    "format": "int-quantized",
}


@pytest.mark.parametrize("dialect", ["block", "per-tensor", "channel", "bf16"])
@pytest.mark.parametrize("bands", [False, True])
def test_every_linear_is_the_plain_int8_definition_of_the_input(make_tiny, tmp_path, dialect, bands):
    assert dialect in DIALECTS
    tiny = make_tiny(dialect=dialect)
    out = tmp_path / "int8"
    run = RunOptions(tuning=Tuning(convert_band_elements=3000)) if bands else RunOptions()
    fp8conv.convert(tiny.path, out, ConvertOptions(to="int8"), run=run)
    src, got = load_dir(tiny.path), load_dir(out)
    quantized = [n for n in got if got[n].dtype == torch.int8]
    assert sorted(quantized) == sorted(tiny.linear_weights)
    for name in quantized:
        w = dequant_reference(src, name) if src[name].dtype == torch.float8_e4m3fn else src[name].float()
        q, scale = quantize_int8_reference(w)
        assert same_bits(got[name], q), name
        assert same_bits(got[name + "_scale"], scale), name
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "int-quantized" and quant["config_groups"] == {"group_0": W8A8_GROUP}
    assert "lm_head" in quant["ignore"] and got["lm_head.weight"].dtype == torch.bfloat16


def test_ties_round_to_even_and_the_largest_value_is_127(tmp_path):
    """amax 127 makes the scale 1: x.5 values show the rounding (half to even, not away from zero)."""
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -126.5] + [0.0] * 23)
    w = torch.stack([row, -row, torch.zeros(32)]).to(torch.bfloat16)
    write_checkpoint(tmp_path / "c", {"model.layers.0.mlp.down_proj.weight": w}, {"model_type": "llama"})
    fp8conv.convert(tmp_path / "c", tmp_path / "o", ConvertOptions(to="int8"))
    got = load_dir(tmp_path / "o")
    q, scale = got["model.layers.0.mlp.down_proj.weight"], got["model.layers.0.mlp.down_proj.weight_scale"]
    assert q[0, :9].tolist() == [127, 0, 2, 2, 0, -2, -2, 3, -126]
    assert q[1, :9].tolist() == [-127, 0, -2, -2, 0, 2, 2, -3, 126]
    assert scale[:, 0].tolist() == [1.0, 1.0, 1.0] and not q[2].any()  # an all-zero row: scale 1, zeros


def test_reference_and_cpu_backends_write_the_same_bytes(make_tiny, tmp_path):
    tiny = make_tiny()
    for device in ("cpu", "reference"):
        fp8conv.convert(tiny.path, tmp_path / device, ConvertOptions(to="int8"), run=RunOptions(device=device))
    ours, theirs = load_dir(tmp_path / "cpu"), load_dir(tmp_path / "reference")
    assert ours.keys() == theirs.keys() and all(same_bits(ours[n], theirs[n]) for n in ours)


def test_packed_int4_experts_become_int8_rows(tmp_path):
    _, truth = build_int4(tmp_path / "c", {"model.layers.0.mlp.experts.0.down_proj": (64, 96)})
    fp8conv.convert(tmp_path / "c", tmp_path / "o", ConvertOptions(to="int8"))
    got = load_dir(tmp_path / "o")
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    q, scale = quantize_int8_reference(truth[name].to(torch.float32))
    assert same_bits(got[name], q) and same_bits(got[name + "_scale"], scale)


def test_verify_passes_the_output_and_names_a_changed_code(make_tiny, tmp_path):
    tiny = make_tiny()
    out = tmp_path / "int8"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="int8"))
    assert fp8conv.verify(tiny.path, out).ok
    name = tiny.linear_weights[0]
    shard = out / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_dir(out)
    q = tensors[name].clone()
    q[0, 0] = q[0, 0] + (1 if q[0, 0] < 127 else -1)  # one code one step away
    from safetensors.torch import load_file, save_file

    shard_tensors = load_file(shard)
    shard_tensors[name] = q
    save_file(shard_tensors, shard, metadata={"format": "pt"})
    result = fp8conv.verify(tiny.path, out)
    assert not result.ok and any(name in p and "differs from the reference" in p for p in result.failures)


def test_cli_converts_and_describes_int8(make_tiny, tmp_path):
    tiny = make_tiny()
    r = CliRunner().invoke(main, ["convert", str(tiny.path), "--to", "int8", "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    card = (tmp_path / "o" / "README.md").read_text()
    assert "INT8 W8A8" in card
    r = CliRunner().invoke(main, ["inspect", str(tiny.path)])
    assert "--to int8 ~" in r.output


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fp8_max": 240.0}, "--fp8-max 240 / --target gaudi2 applies to --to channel only"),
        ({"pad_for_tp": 2}, "--pad-for-tp N (N >= 1) applies to --to block only, or --to mxfp8"),
        ({"scale_fmt": "ue8m0"}, "--scale-fmt ue8m0 applies to --to block only"),
    ],
)
def test_options_int8_does_not_take(options, message):
    with pytest.raises(OptionsError) as exc:
        ConvertOptions(to="int8", **options)
    assert message in str(exc.value)


def test_deepseek_v4_is_refused_by_name(tmp_path):
    from tests.support.packed_builders import build_v4

    build_v4(tmp_path / "v4")
    with pytest.raises(Fp8ConvError) as exc:
        fp8conv.convert(tmp_path / "v4", tmp_path / "o", ConvertOptions(to="int8"))
    assert "none reads INT8 experts" in str(exc.value) and "--to channel" in str(exc.value)
    assert not (tmp_path / "o" / "config.json").exists()


def test_int8_output_is_as_large_as_channel_fp8_and_inspect_says_so(make_tiny, tmp_path):
    tiny = make_tiny()
    written = {}
    for to in ("channel", "int8"):
        fp8conv.convert(tiny.path, tmp_path / to, ConvertOptions(to=to))
        index = json.loads((tmp_path / to / "model.safetensors.index.json").read_text())
        written[to] = index["metadata"]["total_size"]
    assert written["int8"] == written["channel"] == fp8conv.inspect(tiny.path).estimated_output_bytes["int8"]


def plain_int8_report(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> float:
    """In float64 from the written bytes: each row's values over its scale (float32's quotient, as written),
    their distance from the codes, times the scale."""
    y = (x.to(torch.float32) / scale).to(torch.float64)
    s2 = scale.to(torch.float64) ** 2
    err2 = float((((q.to(torch.float64) - y) ** 2) * s2).sum())
    norm2 = float(((y**2) * s2).sum())
    return math.sqrt(err2 / norm2)


@pytest.mark.parametrize("bands", [False, True])
def test_the_error_report_is_the_plain_one_and_the_same_whole_in_bands_and_on_the_reference(make_tiny, tmp_path, bands):
    tiny = make_tiny()
    run = RunOptions(tuning=Tuning(convert_band_elements=3000)) if bands else RunOptions()
    result = fp8conv.convert(tiny.path, tmp_path / "o", ConvertOptions(to="int8"), run=run)
    reference = fp8conv.convert(
        tiny.path, tmp_path / "r", ConvertOptions(to="int8"), run=RunOptions(device="reference")
    )
    assert result.requantization == reference.requantization  # every digit
    tensors = result.requantization["tensors"]
    src, got = load_dir(tiny.path), load_dir(tmp_path / "o")
    assert sorted(tensors) == sorted(tiny.linear_weights)
    for name, report in tensors.items():
        relative = plain_int8_report(dequant_reference(src, name), got[name], got[name + "_scale"])
        assert report["relative_frobenius"] == pytest.approx(relative, rel=1e-6), name  # float32 row sums
        # values written as 0 are not counted for INT8 (backends.row_report says why): None, never a made-up 0
        assert (report["flushed"], report["saturated"], report["exact"]) == (None, 0, False), name
        assert report["elements"] == got[name].numel()
    assert 0.003 < result.requantization["summary"]["mean_relative_frobenius"] < 0.02


def test_the_summary_names_the_tensor_an_outlier_row_makes_coarse(tmp_path):
    torch.manual_seed(0)
    weights = {f"model.layers.0.mlp.{p}_proj.weight": torch.randn(64, 96) for p in ("gate", "up", "down")}
    weights["model.layers.0.mlp.up_proj.weight"][5, 7] = 200.0  # one outlier: row 5's step is 200 / 127
    write_checkpoint(tmp_path / "c", {n: w.to(torch.bfloat16) for n, w in weights.items()}, {"model_type": "llama"})
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "c"), "--to", "int8", "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("quantized 3 tensor(s) to INT8 rows"))
    assert line.split("coarsest (outlier rows): ")[1].startswith("model.layers.0.mlp.up_proj.weight ")
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "c"), "--to", "int8", "-o", str(tmp_path / "j"), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)["requantization"]
    assert report["summary"]["worst_tensor"] == "model.layers.0.mlp.up_proj.weight"
