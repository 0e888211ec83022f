"""Packed 4-bit inputs: DeepSeek-V4 (MXFP4 experts + block FP8), gpt-oss MXFP4, compressed-tensors INT4
and NVFP4, ModelOpt NVFP4 -- classified, converted to bf16 / channel / block FP8, refused when broken.

Checkpoints are packed by the tests' own code (tests/support/packing.py) and checked against the format
definitions evaluated in float64, and against compressed-tensors' and transformers' own decoders."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.model.classify import Kind, classify
from fp8conv.options import Tuning
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import load_dir, write_checkpoint
from tests.support.packed_builders import (
    INT4_WEIGHTS,
    NVFP4_SHAPES,
    NVFP4_WEIGHTS,
    V4_LINEARS,
    build_int4,
    build_nvfp4,
    build_v4,
    packed_builders_ct_config,
    v4_config,
)
from tests.support.packing import (
    e2m1_value,
    e8m0_value,
    group_scaled,
    pack_int32,
    pack_nibbles,
    random_codes,
    random_e8m0,
)
from tests.support.reference import dequant_block_reference, quantize_exact_reference, quantize_reference, same_bits


def test_v4_tensors_are_classified_by_dtype_companion_and_config(tmp_path):
    build_v4(tmp_path / "c")
    ckpt = open_checkpoint(tmp_path / "c")
    cls = classify(ckpt.index, ckpt.config)
    assert cls.problems == []
    assert cls.weights["layers.0.ffn.experts.1.w2.weight"].kind is Kind.MXFP4
    assert cls.weights["layers.0.ffn.experts.1.w2.weight"].shape == (320, 96)
    assert cls.weights["layers.1.attn.wq_a.weight"].kind is Kind.BLOCK
    assert cls.weights["layers.1.attn.wq_a.weight"].scale == "layers.1.attn.wq_a.scale"
    counts = cls.kind_counts()
    assert counts["mxfp4"] == 12 and counts["block-fp8"] == 6
    report = fp8conv.inspect(tmp_path / "c")
    assert report.formats["mxfp4"] == 12
    expert_elements = 2 * 2 * (3 * 96 * 320)
    fp8_elements = 2 * sum(n * k for n, k in V4_LINEARS.values())
    plain = 2 * 64 * 320 * 2 + 320 * 2 + 2 * (320 * 2 + 4 * 320 * 4 + 2 * 4 + 2 * 320 * 2)
    assert report.estimated_output_bytes["bf16"] == 2 * (expert_elements + fp8_elements) + plain


def test_v4_to_bf16_dequantizes_every_expert_once_in_float32(tmp_path):
    src, truth = build_v4(tmp_path / "c")
    result = fp8conv.convert(
        tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(verify_after=True)
    )
    assert result.verified is not None and result.verified.ok, result.verified
    got = load_dir(tmp_path / "out")
    for name, value in truth.items():
        assert same_bits(got[name], value.to(torch.float32).to(torch.bfloat16)), name
    assert not [n for n in got if n.endswith(".scale")]
    for name in ("embed.weight", "layers.1.hc_attn_fn", "layers.0.attn.attn_sink", "layers.0.ffn.gate.weight"):
        assert same_bits(got[name], src[name]), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and "expert_dtype" not in config
    assert result.tensors_converted == len(truth)


@pytest.mark.parametrize("to", ["block", "channel"])
def test_v4_to_fp8_requantizes_experts_and_counts_exact_blocks(tmp_path, to):
    _, truth = build_v4(tmp_path / "c", scale_low=100)
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to), run=RunOptions(verify_after=True))
    assert result.verified is not None and result.verified.ok, result.verified
    lost = result.packed_blocks_exact < result.packed_blocks_total  # a warning says how many, only then
    said = any(f"{result.packed_blocks_exact} of {result.packed_blocks_total}" in w for w in result.warnings)
    assert said == lost
    got = load_dir(tmp_path / "out")
    suffix = ".scale" if to == "block" else ".weight_scale"  # V4 keeps its own scale name for block FP8
    exact = total = 0
    for name, value in truth.items():
        base = name.removesuffix(".weight")
        w32 = value.to(torch.float32)
        if ".ffn.experts." in name:
            if to == "block":  # E8M0 scales: power-of-two block scales wherever one holds every value
                q_ref, s_ref, _ = quantize_exact_reference(w32, (128, 128))
            else:
                q_ref, s_ref = quantize_reference(w32, None)
            assert same_bits(got[name], q_ref) and same_bits(
                got[base + suffix], s_ref.reshape(got[base + suffix].shape)
            ), name
            bn, bk = (128, 128) if to == "block" else (1, w32.shape[1])
            back = dequant_block_reference(got[name], got[base + suffix].reshape(s_ref.shape), (bn, bk), torch.float32)
            n, k = w32.shape
            for r in range(0, n, bn):
                for c in range(0, k, bk):
                    total += 1
                    exact += bool(torch.equal(back[r : r + bn, c : c + bk], w32[r : r + bn, c : c + bk]))
    assert (result.packed_blocks_exact, result.packed_blocks_total) == (exact, total)
    if to == "channel":  # amax / 448 row scales put most E2M1 values between FP8 steps: the all-zero rows
        assert 0 < exact < total
    else:  # every 128x128 block of these experts (group exponents within 12 of each other) under 2^e
        assert exact == total
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["expert_dtype"] == "fp8"
    if to == "block":
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
        # every output scale a power of two (the experts' exact blocks, the linears' kept E8M0): the input's
        # scale_fmt ue8m0 stays true, and stays
        assert config["quantization_config"]["scale_fmt"] == "ue8m0"
        # the FP8 linears keep their bytes; their e8m0 scales widen to float32 under the same name
        assert got["layers.0.attn.wq_a.scale"].dtype == torch.float32
        assert not [n for n in got if n.endswith("weight_scale_inv")]


def test_v4_without_expert_dtype_fp4_is_refused_not_guessed(tmp_path):
    config = v4_config()
    del config["expert_dtype"]
    build_v4(tmp_path / "c", config=config)
    with pytest.raises(fp8conv.CheckpointError, match="does not declare it") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "ffn.experts" in str(err.value) and "expert_dtype 'fp4'" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_v41_expert_dtype_inside_quantization_config_is_read(tmp_path):
    config = v4_config()
    config["quantization_config"]["expert_dtype"] = config.pop("expert_dtype")
    _, truth = build_v4(tmp_path / "c", config=config, layers=1, experts=1)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    name = "layers.0.ffn.experts.0.w2.weight"
    assert same_bits(got[name], truth[name].to(torch.float32).to(torch.bfloat16))


# --- the one-byte traps from the issue, each a test that catches it ---------------------------------


def test_trap_one_byte_tensors_are_not_fp8(tmp_path):
    """A tool that treats every one-byte tensor as FP8 reads the int8 experts as e4m3 bytes."""
    src, truth = build_v4(tmp_path / "c", layers=1, experts=1)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    name = "layers.0.ffn.experts.0.w1.weight"
    assert got[name].shape == (96, 320)  # two values per byte, not one
    as_fp8 = src[name].view(torch.float8_e4m3fn).to(torch.float32)
    assert not torch.equal(got[name][:, :160].float(), as_fp8.to(torch.bfloat16).float())
    assert same_bits(got[name], truth[name].to(torch.float32).to(torch.bfloat16))


def test_trap_e8m0_is_read_by_its_bits(tmp_path):
    """Byte 120 is 2^-7 (not 120.0, as copying the bytes into float32 gives) and byte 124 is 2^-3 (not 0,
    as a numeric cast of the e8m0 value into uint8 gives)."""
    from fp8conv.backends.scales import scale_to_float32

    b = torch.tensor([120, 124, 127, 130], dtype=torch.uint8)
    expected = torch.tensor([2.0**-7, 2.0**-3, 1.0, 8.0])
    assert torch.equal(scale_to_float32(b.view(torch.float8_e8m0fnu)), expected)
    assert torch.equal(scale_to_float32(b), expected)  # gpt-oss stores the same exponents as uint8
    codes = torch.full((4, 64), 2, dtype=torch.uint8)  # every value 1.0
    scale = torch.tensor([[120, 124]] * 4, dtype=torch.uint8)
    tensors = {"layers.0.ffn.experts.0.w1.weight": pack_nibbles(codes).view(torch.int8)}
    tensors["layers.0.ffn.experts.0.w1.scale"] = scale.view(torch.float8_e8m0fnu)
    write_checkpoint(tmp_path / "c", tensors, v4_config())
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")["layers.0.ffn.experts.0.w1.weight"].float()
    assert torch.equal(got[:, :32], torch.full((4, 32), 2.0**-7))
    assert torch.equal(got[:, 32:], torch.full((4, 32), 2.0**-3))


def test_nibble_order_is_low_first(tmp_path):
    """Byte 0x2C holds code 0xC (-2.0) in its low nibble: element 0; code 2 (1.0) in its high: element 1."""
    row = torch.tensor([[0x2C] * 16], dtype=torch.uint8)
    tensors = {"layers.0.ffn.experts.0.w1.weight": row.view(torch.int8)}
    tensors["layers.0.ffn.experts.0.w1.scale"] = torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    write_checkpoint(tmp_path / "c", tensors, v4_config())
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")["layers.0.ffn.experts.0.w1.weight"].float()
    assert got[0, :4].tolist() == [-2.0, 1.0, -2.0, 1.0]
    # compressed-tensors' INT4 words: element 8g+j in bits [4j, 4j+4)
    word = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert (pack_int32(torch.arange(8, dtype=torch.uint8)[None]) == word).all()


# --- refusals: named, before anything is written ------------------------------------------------------


def _v4_expert(tmp_path, codes_shape, scale: torch.Tensor):
    tensors = {"layers.0.ffn.experts.0.w1.weight": pack_nibbles(random_codes(codes_shape, 1)).view(torch.int8)}
    tensors["layers.0.ffn.experts.0.w1.scale"] = scale.view(torch.float8_e8m0fnu)
    write_checkpoint(tmp_path / "c", tensors, v4_config())


def test_nan_e8m0_scale_byte_is_refused_by_name(tmp_path):
    scale = torch.full((4, 2), 127, dtype=torch.uint8)
    scale[1, 1] = 255
    _v4_expert(tmp_path, (4, 64), scale)
    with pytest.raises(fp8conv.CheckpointError, match="NaN") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "layers.0.ffn.experts.0.w1.scale" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_scale_grid_disagreeing_with_k_is_refused(tmp_path):
    _v4_expert(tmp_path, (4, 64), torch.full((4, 3), 127, dtype=torch.uint8))  # K = 64 needs 2 per row
    with pytest.raises(fp8conv.CheckpointError, match=r"K = 64 in groups of 32 needs \[4, 2\]") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "layers.0.ffn.experts.0.w1.weight" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_k_not_a_multiple_of_the_group_is_refused(tmp_path):
    _v4_expert(tmp_path, (4, 48), torch.full((4, 2), 127, dtype=torch.uint8))  # K = 48
    with pytest.raises(fp8conv.CheckpointError, match="not a multiple of the group size 32"):
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert not (tmp_path / "out").exists()


# --- compressed-tensors INT4 and NVFP4, ModelOpt NVFP4: against compressed-tensors' own decoders --------


def test_int4_pack_quantized_matches_compressed_tensors(tmp_path):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    shapes = {"model.layers.1.mlp.experts.0.gate_proj": (40, 96), "model.layers.1.mlp.experts.0.down_proj": (96, 64)}
    src, truth = build_int4(tmp_path / "c", shapes)
    ckpt = open_checkpoint(tmp_path / "c")
    assert {w.kind for w in classify(ckpt.index, ckpt.config).weights.values()} == {Kind.INT4}
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**INT4_WEIGHTS))
    for base in shapes:
        state = {k.removeprefix(base + "."): v for k, v in src.items() if k.startswith(base + ".")}
        theirs = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        ours = got[base + ".weight"]
        assert same_bits(ours, truth[base + ".weight"].to(torch.float32).to(torch.bfloat16)), base
        assert same_bits(ours, theirs.to(torch.bfloat16)), base
        assert not [n for n in got if n.startswith(base + ".weight_")]
    assert json.loads((tmp_path / "out" / "config.json").read_text()).get("quantization_config") is None


def test_int4_weight_shape_that_disagrees_is_refused(tmp_path):
    """compressed-tensors pads K up to whole int32 words; fp8conv refuses what it would have to guess."""
    src, _ = build_int4(tmp_path / "c", {"model.layers.0.mlp.down_proj": (8, 64)})
    src["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([8, 61], dtype=torch.int32)
    write_checkpoint(tmp_path / "c", src, packed_builders_ct_config("pack-quantized", INT4_WEIGHTS))
    with pytest.raises(fp8conv.CheckpointError, match=r"unpacked weight is \[8, 61\]") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "model.layers.0.mlp.down_proj.weight_shape" in str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("global_scale", [2.0**-9, 1 / 2688.0])
def test_nvfp4_compressed_tensors(tmp_path, global_scale):
    """A power-of-two global scale: every path is exact and compressed-tensors agrees bit for bit. Any
    other: fp8conv rounds (e2m1 * scale) / global once in float32; compressed-tensors rounds
    scale / global first, so the two may differ by one float32 step before the bf16 rounding."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src, truth = build_nvfp4(tmp_path / "c", NVFP4_SHAPES, global_scale)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**NVFP4_WEIGHTS))
    for base in NVFP4_SHAPES:
        ours = got[base + ".weight"]
        assert same_bits(ours, truth[base + ".weight"].to(torch.float32).to(torch.bfloat16)), base
        state = {k.removeprefix(base + "."): v for k, v in src.items() if k.startswith(base + ".")}
        theirs = NVFP4PackedCompressor.decompress(state, scheme)["weight"].to(torch.float32)
        if global_scale == 2.0**-9:
            assert same_bits(ours, theirs.to(torch.bfloat16)), base
        else:
            assert torch.allclose(ours.float(), theirs, rtol=2**-7, atol=0), base
    assert sorted(got) == ["model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"]


def test_nvfp4_modelopt(tmp_path):
    _, truth = build_nvfp4(tmp_path / "c", NVFP4_SHAPES, 1 / 2688.0, modelopt=True)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    for name, value in truth.items():
        # e2m1 * e4m3 is exact, so one float32 rounding by weight_scale_2 is the float64 value rounded once
        assert same_bits(got[name], value.to(torch.float32).to(torch.bfloat16)), name
    fp8conv.convert(tmp_path / "c", tmp_path / "ch", ConvertOptions(to="channel"))
    out = load_dir(tmp_path / "ch")
    for name, value in truth.items():
        q_ref, s_ref = quantize_reference(value.to(torch.float32), None)
        assert same_bits(out[name], q_ref) and same_bits(out[name + "_scale"], s_ref), name


def test_int8_weight_with_float_scale_is_not_taken_for_nvfp4(tmp_path):
    tensors = {"x.weight": torch.zeros(4, 4, dtype=torch.uint8), "x.weight_scale": torch.ones(4, 1)}
    qc = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    write_checkpoint(tmp_path / "c", tensors, {"quantization_config": qc})
    with pytest.raises(fp8conv.CheckpointError, match="are int8, not FP8 or packed FP4"):
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))


# --- the CPU backend's table-driven decode is the reference's, bit for bit -------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scales", ["e8m0 bytes", "e8m0 values", "powers of two", "bf16 values", "float32 values"])
def test_cpu_table_decode_matches_reference_bit_for_bit(dtype, scales):
    from fp8conv.backends import get_backend
    from fp8conv.rewrite.unpack import code_values

    codes = torch.arange(256, dtype=torch.uint8).repeat(3, 2).reshape(3, 8, 64)  # every byte, three experts
    gen = torch.Generator().manual_seed(3)
    from fp8conv.backends.scales import scale_to_float32

    every_byte = torch.arange(255, dtype=torch.uint8)[torch.randperm(255, generator=gen)][:96].reshape(3, 8, 4)
    every_byte[0, 0, :2] = torch.tensor([0, 254])  # 2^-127 (a float32 subnormal) and 2^127 (6 x 2^127 is inf)
    scale = {
        "e8m0 bytes": every_byte,  # MXFP4 as unpack hands it over: the CPU's (scale, byte) table
        "e8m0 values": scale_to_float32(every_byte.view(torch.float8_e8m0fnu)),
        "powers of two": 2.0 ** torch.randint(-130, 120, (3, 8, 4), generator=gen).float(),
        "bf16 values": torch.rand(3, 8, 4, generator=gen).to(torch.bfloat16).float() * 2.0**-60,
        "float32 values": torch.rand(3, 8, 4, generator=gen) + 1e-3,
    }[scales]
    for kind in (Kind.MXFP4, Kind.INT4):
        outs = []
        for device in ("reference", "cpu"):
            out = torch.empty(3, 8, 128, dtype=dtype)
            get_backend(device).decode_4bit(codes, code_values(kind), scale, 32, out)
            outs.append(out)
        assert same_bits(outs[0], outs[1]), kind
    # low nibble first, against the tests' own definition: bytes 0..15 hold code b in the low nibble
    first = float(e8m0_value(scale[0, 0, 0])) if scale.dtype == torch.uint8 else float(scale[0, 0, 0])
    low = (e2m1_value(codes[0, 0, :16]) * first).to(torch.float32).to(dtype)
    out = torch.empty(3, 8, 128, dtype=dtype)
    get_backend("cpu").decode_4bit(codes, code_values(Kind.MXFP4), scale, 32, out)
    assert same_bits(out[0, 0, 0:32:2].contiguous(), low)


# --- gpt-oss: transformers' own MXFP4 decoder, and the bf16 output loads as transformers' gpt-oss --------

TOKENS = torch.tensor([[1, 7, 42, 3, 99, 250, 17, 5]])


@pytest.mark.parametrize("band_elements", [None, 3000])
def test_gpt_oss_mxfp4_to_bf16_loads_as_transformers_gpt_oss(tmp_path, monkeypatch, band_elements):
    """band_elements 3000: the experts are written in bands of slices of each expert's output rows."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = transformers.GptOssConfig(
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
    reference = {k: v.contiguous() for k, v in model.state_dict().items()}
    packed = dict(reference)
    seed = 100
    for i in range(cfg.num_hidden_layers):
        for proj, (rows, k) in {"gate_up_proj": (2 * 96, 64), "down_proj": (64, 96)}.items():
            seed += 1
            name = f"model.layers.{i}.mlp.experts.{proj}"
            codes = random_codes((4, rows, k), seed)  # [E, out, in], as gpt-oss stores them
            scales = random_e8m0((4, rows, k // 32), seed, 118, 126)
            del packed[name]
            packed[name + "_blocks"] = pack_nibbles(codes).reshape(4, rows, k // 32, 16)
            packed[name + "_scales"] = scales
            value = group_scaled(e2m1_value(codes), e8m0_value(scales), 32)
            reference[name] = value.transpose(1, 2).to(torch.float32).to(torch.bfloat16).contiguous()
    cfg.save_pretrained(tmp_path / "ref")
    save_file(reference, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    write_checkpoint(tmp_path / "c", packed, config, shards=2)
    ckpt = open_checkpoint(tmp_path / "c")
    assert classify(ckpt.index, ckpt.config).kind_counts()["mxfp4-gpt-oss"] == 4

    from fp8conv.rewrite.experts import ExpertBands

    streamed = []
    real_init = ExpertBands.__init__
    monkeypatch.setattr(ExpertBands, "__init__", lambda self, job, b: streamed.append(job) or real_init(self, job, b))
    run = RunOptions() if band_elements is None else RunOptions(tuning=Tuning(convert_band_elements=band_elements))
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"), run=run)
    assert len(streamed) == (0 if band_elements is None else 4)
    assert all(job.band_rows < job.spec.shape[1] for job in streamed)
    got = load_dir(tmp_path / "out")
    for i in range(cfg.num_hidden_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            theirs = convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"])
            assert same_bits(got[name], theirs) and same_bits(got[name], reference[name]), name
    assert not [n for n in got if n.endswith(("_blocks", "_scales"))]

    def logits(path):
        loaded, info = transformers.GptOssForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, output_loading_info=True
        )
        assert not any(info.values()), info
        with torch.no_grad():
            return loaded(TOKENS).logits.float()

    ours, expected = logits(tmp_path / "out"), logits(tmp_path / "ref")
    assert ours.abs().max() > 0 and same_bits(ours, expected)

    with pytest.raises(fp8conv.CheckpointError, match="gpt-oss MXFP4 experts have no FP8 layout"):
        fp8conv.convert(tmp_path / "c", tmp_path / "fp8", ConvertOptions(to="block"))
    assert not (tmp_path / "fp8").exists()


def test_kimi_style_int4_experts_to_bf16_load_in_transformers_deepseek_v3(make_tiny, tmp_path):
    """Kimi-K2-Thinking's layout: routed experts pack-quantized INT4, everything else bf16."""
    pytest.importorskip("transformers")
    from tests.support.transformers_reference import reference_model_dir, transformers_logits

    tiny = make_tiny(dialect="bf16")
    src = load_dir(tiny.path)
    packed, reference = {}, {}
    for i, (name, t) in enumerate(sorted(src.items())):
        if ".mlp.experts." not in name or "layers.2." in name:  # the MTP layer stays bf16 (transformers drops it)
            packed[name] = reference[name] = t
            continue
        base, (n, k) = name.removesuffix(".weight"), t.shape
        codes = random_codes((n, k), 500 + i)
        scale = (t.float().abs().reshape(n, k // 32, 32).amax(-1) / 8 + 1e-3).to(torch.bfloat16)
        packed[base + ".weight_packed"] = pack_int32(codes)
        packed[base + ".weight_scale"] = scale
        packed[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
        reference[name] = group_scaled(codes.to(torch.float64) - 8, scale.to(torch.float64), 32).to(torch.bfloat16)
    config = json.loads((tiny.path / "config.json").read_text())
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.gate$", "re:.*layers\\.0\\.mlp.*"]
    config["quantization_config"] = packed_builders_ct_config("pack-quantized", INT4_WEIGHTS)["quantization_config"] | {
        "ignore": ignore
    }
    write_checkpoint(tmp_path / "c", packed, config, shards=3)
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    assert sorted(got) == sorted(reference)
    assert all(same_bits(got[n], reference[n]) for n in reference)
    ours, expected = (
        transformers_logits(tmp_path / "out"),
        transformers_logits(reference_model_dir(tmp_path, tmp_path / "c", reference)),
    )
    assert ours.abs().max() > 0 and same_bits(ours, expected)


def test_cli_inspect_and_convert_name_the_packed_formats(tmp_path):
    from click.testing import CliRunner

    from fp8conv.cli.commands import main

    build_v4(tmp_path / "c", layers=1, experts=1)
    runner = CliRunner()
    result = runner.invoke(main, ["inspect", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "format:        mixed(block-fp8+mxfp4)" in result.stdout
    assert "block-fp8 3, mxfp4 3, unquantized" in result.stdout
    assert "--to bf16 ~" in result.stdout and "problems:      none" in result.stdout
    result = runner.invoke(main, ["convert", str(tmp_path / "c"), "--to", "block", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    # V4's experts hold every value under power-of-two block scales: no warning, the summary says so
    assert not result.stderr and "all 9 blocks requantized from 4-bit values or power-of-two scales exact" in (
        result.stdout
    )
    result = runner.invoke(
        main, ["convert", str(tmp_path / "c"), "--to", "block", "--pad-for-tp", "8", "-o", str(tmp_path / "tp")]
    )
    assert result.exit_code == 1 and "--pad-for-tp does not know" in result.stderr
    assert not (tmp_path / "tp").exists()
