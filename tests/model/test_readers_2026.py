"""The quantization readers 2026's releases need: ModelOpt FP8 (per-tensor, in every form its config is
written in) and MIXED_PRECISION, MXFP8 (MiniMax-M3 `quant_method: mxfp8`, ModelOpt MXFP8,
compressed-tensors mxfp8-quantized), compressed-tensors mxfp4-pack-quantized, and MXFP4 experts declared
inside an fp8 config (Ling, MiMo). Each tiny layout (tests/support/readers_2026.py) is converted to every target
and checked against the format definitions; broken or undeclared layouts are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.backends import get_backend
from fp8conv.model.classify import Kind, WeightFormat
from fp8conv.rewrite.dequant import dequantize
from fp8conv.rewrite.quant import requantize
from tests.support.helpers import fp8, load_dir
from tests.support.packing import e8m0_value, group_scaled, random_e8m0
from tests.support.readers_2026 import (
    HIDDEN,
    INTER,
    LAYOUTS,
    LLAMA_PROJ,
    Release,
    ct_mxfp4_mixed,
    ct_mxfp8,
    expected_weight,
    fp8_with_mxfp4_experts,
    llama_config,
    minimax_m3_mxfp8,
    modelopt_fp8_llama,
    modelopt_mxfp8_llama,
    mxfp4,
    mxfp8,
    scaled_by_powers_of_two,
    write_release,
)
from tests.support.reference import quantize_reference, same_bits

TARGETS = ("bf16", "channel", "block", "int8")
COMPANIONS = (".weight_scale", ".weight_scale_inv", ".weight_scale_2", ".input_scale", ".weight_packed")


def expected_names(rel: Release, to: str) -> set[str]:
    """Every tensor the output must hold: the plain ones, each quantized weight (and its new scale), the
    KV-cache scales unless bf16; none of the input's own scales, packed codes or activation scales."""
    plain = {n for n in rel.tensors if not n.endswith(COMPANIONS) and n not in rel.truth and n not in rel.kv_scales}
    names = plain | set(rel.truth)
    if to != "bf16":
        names |= {n + ("_scale" if to in ("channel", "int8") else "_scale_inv") for n in rel.truth} | set(rel.kv_scales)
    return names


def kept_block(rel: Release, name: str, to: str) -> bool:
    """A 128x128 block-FP8 input weight converted --to block keeps its bytes and scales (KEEP_BLOCKS)."""
    scale = rel.tensors.get(name + "_scale_inv")
    return to == "block" and scale is not None and scale.dtype == torch.float32 and rel.tensors[name].dim() == 2


@pytest.mark.parametrize("to", TARGETS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_release_layout_converts_to_every_target_as_its_definition_says(tmp_path, layout, to):
    rel = LAYOUTS[layout]()
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to), run=RunOptions(verify_after=True))
    out = load_dir(tmp_path / "out")
    assert set(out) == expected_names(rel, to)
    for name, value in rel.truth.items():
        if kept_block(rel, name, to):
            assert same_bits(out[name], rel.tensors[name]) and same_bits(
                out[name + "_scale_inv"], rel.tensors[name + "_scale_inv"]
            )
        else:
            expected_weight(value, to, out, name, scaled_by_powers_of_two(rel.tensors, name))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    method = {"bf16": None, "channel": "compressed-tensors", "block": "fp8", "int8": "compressed-tensors"}[to]
    assert (config.get("quantization_config") or {}).get("quant_method") == method
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()  # config.json describes the output


def test_inspect_names_each_new_format(tmp_path):
    expected = {
        "minimax-m3 mxfp8": {"mxfp8": 10},
        "compressed-tensors mxfp4-pack-quantized + mxfp8": {"mxfp8": 2, "mxfp4-pack-quantized": 6},
        "ling fp8 + mxfp4 experts": {"block-fp8": 2, "mxfp4": 6},
        "modelopt mixed fp8+nvfp4": {"per-tensor-fp8": 8, "nvfp4-modelopt": 6},
        "nemotron-h modelopt-fp8": {"per-tensor-fp8": 8},
    }
    for layout, kinds in expected.items():
        write_release(tmp_path / layout, LAYOUTS[layout]())
        report = fp8conv.inspect(tmp_path / layout)
        assert {k: v for k, v in report.formats.items() if k != "unquantized"} == kinds, layout


@pytest.mark.parametrize(
    ("layout", "line"),
    [
        ("minimax-m3 mxfp8", "block size:    1x32 groups (MXFP8: one E8M0 scale per 32 values of a row)"),
        ("compressed-tensors mxfp8-quantized", "block size:    1x32 groups (MXFP8"),
        ("ling fp8 + mxfp4 experts", "block size:    128x128 (from config.json)\n"),
    ],
)
def test_inspect_states_mxfp8_group_layout(tmp_path, layout, line):
    """inspect's block-size line for MXFP8 inputs names the 1x32 scale groups (not "none", which reads as
    unquantized); a block-FP8 input's line is unchanged."""
    from click.testing import CliRunner

    from fp8conv.cli.commands import main

    write_release(tmp_path / "c", LAYOUTS[layout]())
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert line in result.stdout, result.stdout
    assert fp8conv.inspect(tmp_path / "c").mxfp8_groups == ([[1, 32]] if "mxfp8" in layout else [])


@pytest.mark.parametrize("build", [lambda: modelopt_fp8_llama("config.json flat"), modelopt_mxfp8_llama, ct_mxfp8])
def test_llama_layouts_pad_for_tp(tmp_path, build):
    """--to block --pad-for-tp 8: the MLP grows to 1024 (8 ranks x 128), the real rows and columns are the
    fresh block quantization of the decoded weight, the padding is zero."""
    rel = build()
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    out = load_dir(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["intermediate_size"] == 1024
    for name, value in rel.truth.items():
        n, k = value.shape
        q_ref, s_ref = quantize_reference(value.to(torch.float32), (128, 128))
        got = out[name]
        assert got.shape == (
            (1024, k) if "gate_proj" in name or "up_proj" in name else (n, 1024) if "down" in name else (n, k)
        )
        assert same_bits(got[:n, :k], q_ref), name
        assert int(got.view(torch.uint8).count_nonzero()) == int(got[:n, :k].view(torch.uint8).count_nonzero())
        assert same_bits(out[name + "_scale_inv"][: s_ref.shape[0], : s_ref.shape[1]], s_ref), name


@pytest.mark.parametrize("build", [ct_mxfp4_mixed, lambda: fp8_with_mxfp4_experts("ling")])
def test_packed_4bit_layouts_refuse_pad_for_tp_in_one_line(tmp_path, build):
    write_release(tmp_path / "c", build())
    with pytest.raises(fp8conv.OptionsError, match="--pad-for-tp does not know the MLP layout"):
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))


def test_modelopt_fp8_bf16_output_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    rel = modelopt_fp8_llama("hf_quant_config.json")
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    model, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = model.state_dict()
    for name, value in rel.truth.items():
        assert same_bits(state[name].to(torch.bfloat16), value.to(torch.float32).to(torch.bfloat16)), name


def test_compressed_tensors_decoders_agree_bit_for_bit(tmp_path):
    """compressed-tensors 0.20's own MXFP8 / MXFP4 decompressors give the bits fp8conv writes --to bf16
    (e4m3 or E2M1 times a power of two in range is exact in bf16, so their bf16 arithmetic is exact)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    rel = ct_mxfp4_mixed()
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    out = load_dir(tmp_path / "out")
    checked = 0
    for name in rel.truth:
        base = name.removesuffix(".weight")
        state = {k.removeprefix(base + "."): v for k, v in rel.tensors.items() if k.startswith(base + ".")}
        bits = 4 if "weight_packed" in state else 8
        args = QuantizationArgs(num_bits=bits, type="float", strategy="group", group_size=32, scale_dtype=torch.uint8)
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        compressor = MXFP4PackedCompressor if bits == 4 else MXFP8QuantizationCompressor
        theirs = compressor.decompress(state, scheme)["weight"]
        assert same_bits(out[name], theirs.to(torch.bfloat16)), name
        checked += 1
    assert checked == 8


def _refused(tmp_path, rel: Release, match: str, to: str = "bf16") -> str:
    write_release(tmp_path / "c", rel)
    with pytest.raises(fp8conv.CheckpointError, match=match) as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to))
    assert not (tmp_path / "out").exists()
    return str(err.value)


def test_mxfp8_k_not_a_multiple_of_32_is_refused_by_name(tmp_path):
    rel = modelopt_mxfp8_llama()
    rel.tensors["model.layers.0.mlp.down_proj.weight"] = fp8((64, 80), 1)
    rel.tensors["model.layers.0.mlp.down_proj.weight_scale"] = random_e8m0((64, 3), 1)
    message = _refused(tmp_path, rel, "K = 80 is not a multiple of the group size 32")
    assert "model.layers.0.mlp.down_proj.weight" in message


def test_mxfp8_scale_grid_that_does_not_fit_is_refused_by_name(tmp_path):
    rel = minimax_m3_mxfp8()
    name = "language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"
    rel.tensors[name] = random_e8m0((64, 4), 1)  # K = 64 needs [64, 2]
    _refused(tmp_path, rel, f"MXFP8 scale {name} has shape \\[64, 4\\]")


def test_mxfp8_nan_exponent_is_refused_by_the_scale_name(tmp_path):
    rel = ct_mxfp8()
    name = "model.layers.1.self_attn.o_proj.weight_scale"
    rel.tensors[name][3, 1] = 255  # E8M0 0xFF is NaN
    message = _refused(tmp_path, rel, "NaN/Inf")
    assert name in message


def test_mxfp8_tensors_under_a_plain_fp8_config_are_not_guessed(tmp_path):
    """uint8 [N, K/32] scales beside e4m3 weights, but config.json declares 128x128 block FP8: refused."""
    rel = modelopt_mxfp8_llama()
    rel.sidecar = None
    rel.config = llama_config(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128])
    _refused(tmp_path, rel, "blocks of \\[128, 128\\]")


def test_mxfp4_experts_in_an_fp8_config_that_does_not_declare_them_are_refused(tmp_path):
    rel = fp8_with_mxfp4_experts("ling")
    del rel.config["quantization_config"]["routed_experts_quant_method"]
    message = _refused(tmp_path, rel, "does not declare it")
    assert "routed_experts_quant_method" in message and "mlp.experts" in message


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("store_dtype", "nvfp4", "fp8conv reads MXFP4 routed experts only"),
        ("routed_experts_quant_method", "int4", "fp8conv reads MXFP4 routed experts only"),
        ("routed_experts_group_size", 64, "MXFP4 experts in groups of 64"),
    ],
)
def test_unreadable_expert_declarations_in_an_fp8_config_are_refused(tmp_path, key, value, match):
    rel = fp8_with_mxfp4_experts("ling")
    rel.config["quantization_config"][key] = value
    message = _refused(tmp_path, rel, match)
    assert message.startswith("in config.json: ")


def test_mxfp4_pack_quantized_scale_of_the_wrong_shape_is_refused(tmp_path):
    rel = ct_mxfp4_mixed()
    name = "model.layers.1.mlp.experts.0.down_proj.weight_scale"
    rel.tensors[name] = random_e8m0((64, 2), 1)  # K = 96 needs [64, 3]
    _refused(tmp_path, rel, f"scale {name} has shape \\[64, 2\\]")


def test_compressed_tensors_mxfp8_group_of_another_size_is_refused(tmp_path):
    rel = ct_mxfp8()
    rel.config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16
    _refused(tmp_path, rel, "mxfp8-quantized float8 with strategy 'group', group_size 16")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_decode_is_bit_identical_on_cpu_and_reference(out_dtype):
    """Every e4m3 code and the extreme exponents (2^-127 subnormal, 2^127 past the CPU shift path's limit),
    dequantized and requantized per row by both backends and by the definition."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 255, (40, 256), generator=gen, dtype=torch.int16)
    q = torch.where(codes == 0x7F, 0, codes).to(torch.uint8).view(torch.float8_e4m3fn)
    e = random_e8m0((40, 8), 6, low=100, high=150)
    e[0, 0], e[1, 1], e[2, 2], e[3, 3] = 0, 1, 254, 127
    fmt = WeightFormat("w", Kind.MXFP8, "s", block=(1, 32))
    truth = group_scaled(q.to(torch.float64), e8m0_value(e), 32).to(torch.float32)
    outs = {}
    for device in ("cpu", "reference"):
        backend = get_backend(device)
        deq = dequantize(q, e, fmt, out_dtype, backend)
        assert same_bits(deq, truth.to(out_dtype)), device
        outs[device] = requantize(q[4:], e[4:], fmt, None, 448.0, backend)  # rows without the overflows
    assert all(same_bits(a, b) for a, b in zip(outs["cpu"], outs["reference"], strict=True))
    q_ref, s_ref = quantize_reference(truth[4:], None)
    assert same_bits(outs["cpu"][0], q_ref) and same_bits(outs["cpu"][1], s_ref)


def test_fused_3d_mxfp8_experts_convert(tmp_path):
    """transformers-5 style fused experts `experts.gate_up_proj` [E, 2I, H] with a uint8 scale [E, 2I, H/32]."""
    rel = Release({})
    mxfp8(rel, "model.layers.0.mlp.experts.gate_up_proj", (2, 2 * INTER, HIDDEN), 3)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    rel.tensors[name + "_scale_inv"] = rel.tensors.pop(name + ".weight_scale")
    rel.tensors[name] = rel.tensors.pop(name + ".weight")
    value = rel.truth.pop(name + ".weight")
    rel.config = {"model_type": "minimax_m3_vl", "quantization_config": {"quant_method": "mxfp8"}}
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "bf16", ConvertOptions(to="bf16"))
    assert same_bits(load_dir(tmp_path / "bf16")[name], value.to(torch.float32).to(torch.bfloat16))
    fp8conv.convert(tmp_path / "c", tmp_path / "block", ConvertOptions(to="block"))
    out = load_dir(tmp_path / "block")
    for e in range(2):
        q_ref, s_ref = quantize_reference(value[e].to(torch.float32), (128, 128))
        assert same_bits(out[name][e], q_ref) and same_bits(out[name + "_scale_inv"][e], s_ref), e


def test_modelopt_fp8_per_channel_per_token_is_channel_fp8(tmp_path):
    """FP8_PER_CHANNEL_PER_TOKEN: weight_scale [N] per output channel, no input_scale (vLLM's
    ModelOptFp8PcPtLinearMethod)."""
    rel = Release({})
    for i, (proj, shape) in enumerate(LLAMA_PROJ.items()):
        base, q = f"model.layers.0.{proj}", fp8(shape, i)
        s = torch.rand(shape[0], generator=torch.Generator().manual_seed(i)) * 0.01 + 0.001
        rel.tensors[base + ".weight"], rel.tensors[base + ".weight_scale"] = q, s
        rel.truth[base + ".weight"] = q.to(torch.float64) * s.to(torch.float64)[:, None]
    rel.config = llama_config(quant_method="modelopt", quant_algo="FP8_PER_CHANNEL_PER_TOKEN")
    write_release(tmp_path / "c", rel)
    assert fp8conv.inspect(tmp_path / "c").formats == {"channel-fp8": 7, "unquantized": 0}
    for to in TARGETS:
        fp8conv.convert(tmp_path / "c", tmp_path / to, ConvertOptions(to=to))
        out = load_dir(tmp_path / to)
        for name, value in rel.truth.items():
            expected_weight(value, to, out, name)


def test_mxfp8_tag_with_another_block_size_is_refused(tmp_path):
    rel = minimax_m3_mxfp8()
    rel.config["quantization_config"]["weight_block_size"] = [128, 128]
    _refused(tmp_path, rel, "quant_method 'mxfp8' with weight_block_size \\[128, 128\\]")


def test_mxfp4_in_an_fp8_config_outside_the_routed_experts_is_refused(tmp_path):
    """vLLM's Fp8Config gives store_dtype mxfp4 to RoutedExperts only: a packed shared expert is refused."""
    rel = fp8_with_mxfp4_experts("mimo")
    mxfp4(rel, "model.layers.1.mlp.shared_experts.up_proj", (INTER, HIDDEN), 40, "weight", "weight_scale")
    message = _refused(tmp_path, rel, "covers routed experts \\(.experts.E.\\) only")
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in message


def test_minimax_mxfp8_kv_cache_declaration_is_kept_for_channel(tmp_path):
    """vLLM reads a MiniMax mxfp8 tag's kv_cache_quant_algo as ModelOpt's: --to channel declares it."""
    rel = minimax_m3_mxfp8()
    rel.config["quantization_config"]["kv_cache_quant_algo"] = "FP8"
    for kv in ("k_scale", "v_scale"):
        rel.tensors[f"language_model.model.layers.0.self_attn.{kv}"] = torch.tensor(0.125, dtype=torch.float32)
    write_release(tmp_path / "c", rel)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="channel"))
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert quant["kv_cache_scheme"]["num_bits"] == 8 and quant["kv_cache_scheme"]["type"] == "float"
    assert "language_model.model.layers.0.self_attn.k_scale" in load_dir(tmp_path / "out")
