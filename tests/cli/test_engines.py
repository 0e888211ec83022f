"""The outputs load in transformers (and transformers + compressed-tensors) and compute what the
reference-dequantized weights compute; the TP-padded model computes exactly what the unpadded one does."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from tests.support.helpers import load_dir
from tests.support.reductions import assert_same_function
from tests.support.reference import dequant_reference, same_bits
from tests.support.synthetic import TinyModelShape
from tests.support.transformers_reference import (
    reference_model_dir,
    transformers,
    transformers_logits,
)


def test_transformers_loads_bf16_output(tiny, tmp_path):
    out = tmp_path / "bf16"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    src = load_dir(tiny.path)
    reference = {
        n: (dequant_reference(src, n).to(torch.bfloat16) if n in tiny.fp8_weights else t)
        for n, t in src.items()
        if not n.endswith("_scale_inv")
    }
    ref_dir = reference_model_dir(tmp_path, tiny.path, reference)
    got, expected = transformers_logits(out), transformers_logits(ref_dir)
    assert got.abs().max() > 0 and same_bits(got, expected)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_with_compressed_tensors_loads_channel_output(tiny, tmp_path):
    pytest.importorskip("compressed_tensors")
    out = tmp_path / "channel"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="channel"))
    ref_dir = reference_model_dir(tmp_path, tiny.path, _row_scaled_decoded(load_dir(out)))
    # decompressed to bf16: the weights the reference computes, so the logits must be identical
    decompressed = transformers_logits(
        out, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    assert same_bits(decompressed, transformers_logits(ref_dir))
    # and as users load it by default (FP8 weights with dynamic per-token FP8 activations)
    compressed = transformers_logits(out)
    assert torch.isfinite(compressed).all()
    assert (compressed - decompressed).abs().max() < 0.25 * decompressed.abs().max()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_with_compressed_tensors_loads_int8_output(make_tiny, tmp_path):
    """A dense model (every layer dense, the MTP layer too): transformers 5.25 gathers the per-expert INT8
    Linears of a compressed-tensors MoE into its fused experts for none of its load paths (an error naming
    experts.gate_up_proj: loud, never garbage; vLLM loads them, tests_engine)."""
    pytest.importorskip("compressed_tensors")
    tiny = make_tiny(shape=TinyModelShape(first_k_dense_replace=3))
    out = tmp_path / "int8"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="int8"))
    got = load_dir(out)
    assert sum(t.dtype == torch.int8 for t in got.values()) == len(tiny.linear_weights)
    ref_dir = reference_model_dir(tmp_path, tiny.path, _row_scaled_decoded(got))
    # decompressed to bf16 by compressed-tensors' int-quantized decompressor: the weights the reference computes
    decompressed = transformers_logits(
        out, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    assert decompressed.abs().max() > 0 and same_bits(decompressed, transformers_logits(ref_dir))
    # against the exact values (the bf16 output): INT8 rows (steps of amax / 127, ~0.7% of these weights) hold
    # them closer than channel FP8 (3 mantissa bits, ~2.5%), so its logits are closer too
    fp8conv.convert(tiny.path, tmp_path / "bf16", ConvertOptions(to="bf16"))
    fp8conv.convert(tiny.path, tmp_path / "channel", ConvertOptions(to="channel"))
    exact = transformers_logits(tmp_path / "bf16")
    channel = transformers_logits(
        tmp_path / "channel", quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    assert 0 < (decompressed - exact).norm() < (channel - exact).norm()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_transformers_loads_the_int8_moe_output_right_or_refuses_it_loudly(tiny, tmp_path):
    """transformers 5.25 refuses it (its fused experts find none of the per-expert INT8 Linears); a later one
    that loads it must compute the decoded weights."""
    pytest.importorskip("compressed_tensors")
    out = tmp_path / "int8"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="int8"))
    decompressed = transformers.CompressedTensorsConfig(run_compressed=False)
    try:
        got = transformers_logits(out, quantization_config=decompressed)
    except RuntimeError as exc:
        assert "conversion of the weights" in str(exc)
        return
    reference = _row_scaled_decoded(load_dir(out))
    assert same_bits(got, transformers_logits(reference_model_dir(tmp_path, tiny.path, reference)))


def _row_scaled_decoded(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A channel FP8 or INT8 output as bf16 weights: each code times its row's scale in float32, rounded once."""
    return {
        n: (t.to(torch.float32) * tensors[n + "_scale"]).to(torch.bfloat16) if n + "_scale" in tensors else t
        for n, t in tensors.items()
        if not n.endswith("_scale")
    }


def test_padded_block_output_computes_the_same_function(tiny, tmp_path):
    fp8conv.convert(tiny.path, tmp_path / "block", ConvertOptions(to="block"))
    fp8conv.convert(tiny.path, tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=4))
    config = json.loads((tmp_path / "padded" / "config.json").read_text())
    assert config["intermediate_size"] == 512 and config["moe_intermediate_size"] == 512  # 448, 192 before
    assert fp8conv.inspect(tmp_path / "padded").tp_indivisible["4"] == []
    assert fp8conv.inspect(tmp_path / "block").tp_indivisible["4"] != []
    plain, padded = load_dir(tmp_path / "block"), load_dir(tmp_path / "padded")
    for name in (
        "model.layers.0.mlp.gate_proj",
        "model.layers.1.mlp.experts.3.up_proj",
        "model.layers.2.mlp.shared_experts.gate_proj",
    ):
        w, s = padded[name + ".weight"], padded[name + ".weight_scale_inv"]
        rows, grid_rows = plain[name + ".weight"].shape[0], plain[name + ".weight_scale_inv"].shape[0]
        assert w.shape[0] == 512 and s.shape[0] == 4
        assert same_bits(w[:rows], plain[name + ".weight"]) and (w[rows:].view(torch.uint8) == 0).all()
        assert same_bits(s[:grid_rows], plain[name + ".weight_scale_inv"]) and (s[grid_rows:] == 1).all()
    down = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert padded[down].shape == (320, 512) and (padded[down][:, 192:].view(torch.uint8) == 0).all()

    for name in ("block", "padded"):
        fp8conv.convert(tmp_path / name, tmp_path / f"{name}-bf16", ConvertOptions(to="bf16"))
    assert_same_function(
        transformers_logits(tmp_path / "padded-bf16"), transformers_logits(tmp_path / "block-bf16")
    )  # tests/support/reductions.py
    # float32: the matmuls reduce over 512 instead of 448 columns, in another order (about 1e-6 apart)
    padded32, plain32 = (
        transformers_logits(tmp_path / "padded-bf16", torch.float32),
        transformers_logits(tmp_path / "block-bf16", torch.float32),
    )
    torch.testing.assert_close(padded32, plain32, rtol=1e-5, atol=1e-5)


def test_padded_mlp_is_the_same_function_in_plain_torch(tiny, tmp_path):
    """silu(0) * 0 = 0 and zero down columns add nothing: the dense MLP, by hand, before and after."""
    fp8conv.convert(tiny.path, tmp_path / "plain", ConvertOptions(to="bf16"))
    fp8conv.convert(tiny.path, tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=8))
    fp8conv.convert(tmp_path / "padded", tmp_path / "padded-bf16", ConvertOptions(to="bf16"))
    a, b = load_dir(tmp_path / "plain"), load_dir(tmp_path / "padded-bf16")
    x = torch.randn(5, 320, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def mlp(t, prefix):
        g, u, d = (t[prefix + p + ".weight"].to(torch.float64) for p in ("gate_proj", "up_proj", "down_proj"))
        return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T

    assert b["model.layers.0.mlp.gate_proj.weight"].shape == (1024, 320)  # 448 -> 8 ranks x 128
    torch.testing.assert_close(mlp(a, "model.layers.0.mlp."), mlp(b, "model.layers.0.mlp."), rtol=1e-12, atol=0)


def test_padding_from_bf16_quantizes_the_padded_weight(make_tiny, tmp_path):
    ckpt = make_tiny(dialect="bf16")
    fp8conv.convert(ckpt.path, tmp_path / "block", ConvertOptions(to="block"))
    fp8conv.convert(ckpt.path, tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=2))
    plain, padded = load_dir(tmp_path / "block"), load_dir(tmp_path / "padded")
    name = "model.layers.0.mlp.down_proj.weight"
    assert padded[name].shape == (320, 512)
    assert same_bits(padded[name][:, :448], plain[name])  # zero padding does not change a block's amax


def test_padding_refuses_when_config_and_tensors_disagree(tiny, tmp_path):
    config_path = tiny.path / "config.json"
    config = json.loads(config_path.read_text())
    config["moe_intermediate_size"] = 256
    config_path.write_text(json.dumps(config))
    with pytest.raises(fp8conv.CheckpointError, match="moe_intermediate_size") as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4))
    assert "mlp.experts." in str(info.value) and not (tmp_path / "out").exists()


def _decoded_ue8m0(out) -> dict[str, torch.Tensor]:
    """The ue8m0 output decoded by the tests' own arithmetic: each float8_e8m0fnu byte b is the float32
    2^(b - 127) (from the bits), a float32 scale that power of two itself, times its 128x128 block of e4m3
    values, rounded once to bf16."""
    written = load_dir(out)
    decoded = {}
    for name, t in written.items():
        scale = written.get(name + "_scale_inv")
        if name.endswith("_scale_inv"):
            continue
        if scale is None:
            decoded[name] = t
            continue
        assert scale.dtype in (torch.float8_e8m0fnu, torch.float32), (name, scale.dtype)
        if scale.dtype == torch.float32:  # stored as the power of two itself (DeepSeek-V3.1's storage)
            assert bool((torch.frexp(scale)[0] == 0.5).all()), name
            powers = scale
        else:
            powers = (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        grid = powers.repeat_interleave(128, 0).repeat_interleave(128, 1)[: t.shape[0], : t.shape[1]]
        decoded[name] = (t.to(torch.float32) * grid).to(torch.bfloat16)
    return decoded


# Every Linear whole 128x128 blocks: transformers' FineGrainedFP8 dequantizer refuses a weight its scale
# grid does not divide ("Weight shape (192, 320) not divisible by scale grid (2, 3)"), as the default tiny is
ALIGNED = TinyModelShape(
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=128,
    num_attention_heads=4,
    kv_lora_rank=384,
    q_lora_rank=128,
    qk_rope_head_dim=128,
    qk_nope_head_dim=64,
    v_head_dim=64,
)


@pytest.mark.parametrize("scale_dtype", [None, "e8m0"])
def test_transformers_loads_ue8m0_output_as_its_decoded_weights(make_tiny, tmp_path, scale_dtype):
    """--to block --scale-fmt ue8m0 in transformers (FineGrainedFP8, scale_fmt ue8m0), float32 powers of two
    (the default) or E8M0 bytes: without a GPU it dequantizes to bf16 on load; every weight and the logits
    are those of the tests' own decode."""
    tiny = make_tiny(shape=ALIGNED)
    out = tmp_path / "ue8m0"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="block", scale_fmt="ue8m0", scale_dtype=scale_dtype))
    stored = load_dir(out)[tiny.fp8_weights[0] + "_scale_inv"].dtype
    assert stored == (torch.float32 if scale_dtype is None else torch.float8_e8m0fnu)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    decoded = _decoded_ue8m0(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    unfused = [n for n in tiny.fp8_weights if n in params]  # transformers 5 fuses the experts: logits check them
    assert len(unfused) >= 8, unfused
    for name in unfused:
        assert same_bits(params[name], decoded[name]), name
    ref_dir = reference_model_dir(tmp_path, out, decoded)
    got, expected = transformers_logits(out), transformers_logits(ref_dir)
    assert got.abs().max() > 0 and same_bits(got, expected)


def test_transformers_with_compressed_tensors_loads_the_mxfp8_output(tmp_path):
    """--to mxfp8's default spelling (compressed-tensors mxfp8-quantized), of a dense model transformers
    built: transformers decompresses it through compressed-tensors into exactly the tests' own decode (each
    uint8 E8M0 byte b as 2^(b - 127) times its 1x32 group of e4m3 values). (transformers 5.25 refuses the
    same spelling on fused MoE experts, loudly: its CompressedTensorsDequantize does not expand group
    scales over a 3-D weight.)"""
    pytest.importorskip("compressed_tensors")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "llama")
    out = tmp_path / "mxfp8"
    fp8conv.convert(tmp_path / "llama", out, ConvertOptions(to="mxfp8"))
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "mxfp8-quantized"
    got = load_dir(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, quantization_config=transformers.CompressedTensorsConfig(run_compressed=False)
    )
    params = dict(model.named_parameters())
    quantized = [n for n in got if n + "_scale" in got]
    assert len(quantized) == 14, quantized  # every Linear of the two layers
    for name in quantized:
        powers = (got[name + "_scale"].view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
        decoded = (got[name].to(torch.float32) * powers.repeat_interleave(32, dim=1)).to(torch.bfloat16)
        assert same_bits(params[name], decoded), name
