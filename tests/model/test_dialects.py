"""Every input dialect converts to every target, checked against independent references."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.options import Tuning
from tests.support.helpers import load_dir
from tests.support.reference import dequant_reference, quantize_reference, same_bits, scale_values, within_fp8_bound
from tests.support.synthetic import DIALECTS


@pytest.fixture(params=["whole", "bands"])
def execution(request) -> RunOptions:
    """Each test twice: whole tensors, and streamed in bands of rows small enough to split every weight."""
    return RunOptions(tuning=Tuning(convert_band_elements=3000)) if request.param == "bands" else RunOptions()


KEEPS_BLOCKS = {"block", "block-bf16-scales", "ue8m0", "ue8m0-e8m0", "ue8m0-u8", "ct-block"}
UNQUANTIZED_LINEARS = {
    "lm_head",
    "model.layers.1.mlp.gate",
    "model.layers.2.mlp.gate",
    "model.layers.2.eh_proj",
}


def _truth(src: dict[str, torch.Tensor], name: str, dialect: str) -> torch.Tensor:
    return src[name].to(torch.float32) if dialect == "bf16" else dequant_reference(src, name)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_to_bf16(make_tiny, tmp_path, dialect, execution):
    ckpt = make_tiny(dialect=dialect)
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16"), run=execution)
    got = load_dir(tmp_path / "out")
    for name in ckpt.linear_weights:
        assert same_bits(got[name], _truth(src, name, dialect).to(torch.bfloat16)), name
    assert not [n for n in got if n.endswith(("_scale", "_scale_inv", "input_scale", "activation_scale"))]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config


@pytest.mark.parametrize("dialect", DIALECTS)
def test_to_channel(make_tiny, tmp_path, dialect, execution):
    ckpt = make_tiny(dialect=dialect)
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="channel"), run=execution)
    got = load_dir(tmp_path / "out")
    for name in ckpt.linear_weights:
        ref = _truth(src, name, dialect)
        q, scale = got[name], got[name + "_scale"]
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == (ref.shape[0], 1), name  # vLLM asserts [N, 1]; [N] is refused
        expected_q, expected_scale = quantize_reference(ref, None)
        assert same_bits(q, expected_q) and same_bits(scale, expected_scale), name
        amax_row = ref.abs().amax(dim=1, keepdim=True)
        assert within_fp8_bound(q.to(torch.float32) * scale, ref, amax_row), name
    assert not [n for n in got if n.endswith(("_scale_inv", "input_scale", "activation_scale"))]
    modules = {n.removesuffix(".weight") for n in ckpt.linear_weights}
    plain = [n for n in src if n.rsplit(".", 1)[0] not in modules]
    assert "model.layers.1.mlp.gate.weight" in plain and "lm_head.weight" in plain
    for name in plain:  # everything that is not a linear weight or its companion is untouched
        assert same_bits(got[name], src[name]), name
    text = (tmp_path / "out" / "config.json").read_text()
    assert "weight_block_size" not in text  # a stale block size crashes MLA kv_b_proj loading on HPU
    qc = json.loads(text)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["quantization_status"] == "compressed"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    assert group["weights"] == {
        "num_bits": 8,
        "type": "float",
        "strategy": "channel",
        "symmetric": True,
        "dynamic": False,
    }
    assert group["input_activations"] == {
        "num_bits": 8,
        "type": "float",
        "strategy": "token",
        "symmetric": True,
        "dynamic": True,
    }
    assert set(qc["ignore"]) >= UNQUANTIZED_LINEARS
    assert "fp8_dtype_flavor" not in qc


@pytest.mark.parametrize("dialect", DIALECTS)
def test_to_block(make_tiny, tmp_path, dialect, execution):
    ckpt = make_tiny(dialect=dialect)
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="block"), run=execution)
    got = load_dir(tmp_path / "out")
    for name in ckpt.linear_weights:
        ref = _truth(src, name, dialect)
        q, scale = got[name], got[name + "_scale_inv"]
        assert scale.dtype == torch.float32 and scale.shape == (
            -(-ref.shape[0] // 128),
            -(-ref.shape[1] // 128),
        )
        if dialect in KEEPS_BLOCKS:  # nothing changes: the FP8 bytes pass through, scales widen exactly
            assert same_bits(q, src[name]), name
            stored = src.get(name + "_scale_inv", src.get(name + "_scale"))
            assert same_bits(scale, scale_values(stored)), name
        else:
            expected_q, expected_scale = quantize_reference(ref, (128, 128))
            assert same_bits(q, expected_q) and same_bits(scale, expected_scale), name
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["activation_scheme"] == "dynamic"
    assert qc["weight_block_size"] == [128, 128]
    assert (
        set(qc["modules_to_not_convert"]) >= UNQUANTIZED_LINEARS
        and qc["ignored_layers"] == qc["modules_to_not_convert"]
    )
    # scale_fmt ue8m0 only where every scale really is a power of two (V3.1's o_proj scales are not)
    assert ("scale_fmt" in qc) == (dialect in ("ue8m0-e8m0", "ue8m0-u8"))


def test_block_passthrough_is_bit_identical(make_tiny, tmp_path, execution):
    ckpt = make_tiny()
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="block"), run=execution)
    got = load_dir(tmp_path / "out")
    assert set(got) == set(src)
    assert all(same_bits(got[n], src[n]) for n in src)


def test_per_tensor_is_never_read_as_blocks(make_tiny, tmp_path, execution):
    """Read as 128x128 blocks, a per-tensor checkpoint would load unscaled: hundreds of times too large."""
    ckpt = make_tiny(dialect="per-tensor")
    report = fp8conv.inspect(ckpt.path)
    assert report.format == "per-tensor-fp8" and report.block_size is None
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16"), run=execution)
    got = load_dir(tmp_path / "out")
    name = "model.layers.0.mlp.down_proj.weight"
    assert got[name].abs().max() < 10  # the raw FP8 values reach 448


def test_gaudi2_range(make_tiny, tmp_path, execution):
    ckpt = make_tiny()
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="channel", fp8_max=240.0), run=execution)
    got = load_dir(tmp_path / "out")
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    ref = dequant_reference(src, name)
    expected_q, expected_scale = quantize_reference(ref, None, fp8_max=240.0)
    assert same_bits(got[name], expected_q) and same_bits(got[name + "_scale"], expected_scale)
    assert got[name].to(torch.float32).abs().max() == 240
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["fp8_dtype_flavor"] == "float8_e4m3fnuz"


def test_zero_rows_stay_zero_with_finite_scales(tmp_path, execution):
    from tests.support.helpers import write_checkpoint

    w = torch.zeros(256, 128, dtype=torch.bfloat16)
    w[5] = 0.5
    path = write_checkpoint(tmp_path / "c", {"x.weight": w}, None)
    for target in ("channel", "block"):
        fp8conv.convert(path, tmp_path / target, ConvertOptions(to=target), run=execution)
        got = load_dir(tmp_path / target)
        scale = got["x.weight_scale" if target == "channel" else "x.weight_scale_inv"]
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert (got["x.weight"].to(torch.float32)[6:] == 0).all()


@pytest.mark.parametrize(
    ("scale", "layout"),
    [
        (torch.rand(3, 2, 3) + 0.1, "block"),  # [E, gn, gk]
        (torch.rand(3, 200, 1) + 0.1, "channel"),  # [E, N, 1]
        (torch.rand(3) + 0.1, "per-expert"),  # [E]
    ],
)
def test_fused_3d_experts(tmp_path, scale, layout, execution):
    from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

    q = fp8((3, 200, 300), seed=4)
    config = fp8_block_config() if layout == "block" else {"quantization_config": {"quant_method": "fp8"}}
    path = write_checkpoint(
        tmp_path / "c",
        {
            "model.layers.1.mlp.experts.w13.weight": q,
            "model.layers.1.mlp.experts.w13.weight_scale_inv": scale,
        },
        config,
    )
    per_expert = {f"e{e}": q[e] for e in range(3)}
    refs = []
    for e in range(3):
        s = scale[e] if layout != "per-expert" else scale[e].reshape(())
        refs.append(dequant_reference({"w": per_expert[f"e{e}"], "w_scale_inv": s}, "w"))
    ref = torch.stack(refs)
    for target in ("bf16", "channel", "block"):
        fp8conv.convert(path, tmp_path / target, ConvertOptions(to=target), run=execution)
        got = load_dir(tmp_path / target)
        name = "model.layers.1.mlp.experts.w13.weight"
        if target == "bf16":
            assert same_bits(got[name], ref.to(torch.bfloat16))
        elif target == "channel":
            assert got[name + "_scale"].shape == (3, 200, 1)
            for e in range(3):
                eq, es = quantize_reference(ref[e], None)
                assert same_bits(got[name][e], eq) and same_bits(got[name + "_scale"][e], es)
        else:
            assert got[name + "_scale_inv"].shape == (3, 2, 3)
            if layout == "block":
                assert same_bits(got[name], q)
            else:
                for e in range(3):
                    eq, es = quantize_reference(ref[e], (128, 128))
                    assert same_bits(got[name][e], eq) and same_bits(got[name + "_scale_inv"][e], es)


def test_fused_modules_share_one_scheme(make_tiny, tmp_path, execution):
    """A bf16 gate_proj beside an FP8 up_proj cannot be loaded as one fused layer: refused by name."""
    from safetensors.torch import load_file, save_file

    ckpt = make_tiny()
    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.gate_proj.weight"
    shard = ckpt.path / index["weight_map"][name]
    tensors = load_file(shard)
    src = load_dir(ckpt.path)
    tensors[name] = dequant_reference(src, name).to(torch.bfloat16)
    scale_shard = ckpt.path / index["weight_map"].pop(name + "_scale_inv")
    save_file(
        tensors if scale_shard != shard else {k: v for k, v in tensors.items() if k != name + "_scale_inv"},
        str(shard),
    )
    if scale_shard != shard:
        rest = {k: v for k, v in load_file(scale_shard).items() if k != name + "_scale_inv"}
        save_file(rest, str(scale_shard))
    (ckpt.path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(fp8conv.CheckpointError, match="engines fuse them") as info:
        fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="channel"), run=execution)
    assert "model.layers.0.mlp.up_proj.weight" in str(info.value)
    fp8conv.convert(
        ckpt.path, tmp_path / "bf16", ConvertOptions(to="bf16"), run=execution
    )  # dequantizing everything is fine


def test_modules_listed_as_not_converted_stay_unquantized_and_listed(make_tiny, tmp_path, execution):
    from safetensors.torch import load_file, save_file

    ckpt = make_tiny(num_shards=1, with_index=False, dialect="per-tensor")
    shard = ckpt.path / "model.safetensors"
    tensors = load_file(shard)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = dequant_reference(tensors, name).to(torch.bfloat16)
    for companion in (name + "_scale", "model.layers.1.self_attn.o_proj.input_scale"):
        del tensors[companion]
    save_file(tensors, str(shard))
    config = json.loads((ckpt.path / "config.json").read_text())
    config["quantization_config"]["ignored_layers"] = ["lm_head", "model.layers.1.self_attn.o_proj"]
    (ckpt.path / "config.json").write_text(json.dumps(config))
    for target, key in (("channel", "ignore"), ("block", "modules_to_not_convert")):
        fp8conv.convert(ckpt.path, tmp_path / target, ConvertOptions(to=target), run=execution)
        got = load_dir(tmp_path / target)
        assert same_bits(got[name], tensors[name]) and name + "_scale" not in got
        qc = json.loads((tmp_path / target / "config.json").read_text())["quantization_config"]
        assert "model.layers.1.self_attn.o_proj" in qc[key] and "lm_head" in qc[key]
