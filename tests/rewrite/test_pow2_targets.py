"""--to block --scale-fmt ue8m0 and --to mxfp8: power-of-two (E8M0) scales, against the tests' own plain
definition (float64 exponent arithmetic, torch's float64 sums), every input kind, exactness where the input
scales already are powers of two, the refusals, --pad-for-tp, verify and the error report."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.backends import available_devices, get_backend
from fp8conv.cli.commands import main
from fp8conv.errors import OptionsError, PlanRefused
from fp8conv.rewrite.pow2 import quantize_pow2, quantize_pow2_reported
from tests.support.helpers import load_dir, write_checkpoint
from tests.support.reference import (
    dequant_reference,
    e8m0_bytes,
    plain_exponent,
    plain_pow2,
    same_bits,
    scale_values,
)

UE8M0 = ConvertOptions(to="block", scale_fmt="ue8m0")
UE8M0_E8M0 = ConvertOptions(to="block", scale_fmt="ue8m0", scale_dtype="e8m0")
MXFP8 = ConvertOptions(to="mxfp8")
MXFP8_MODELOPT = ConvertOptions(to="mxfp8", mxfp8_format="modelopt")


DEVICES = [
    pytest.param(d, marks=pytest.mark.skipif(d not in available_devices(), reason=f"no {d} device here"))
    for d in ("cpu", "reference", "cuda")
]


def plain_expected(src: dict[str, torch.Tensor], name: str, dialect: str, block: tuple[int, int]):
    """What the output of `name` must be: plain_pow2 of the input's float32 values, except that an output
    block inside one input block whose scale is a power of two keeps the input's bytes and exponent."""
    if dialect == "bf16":
        return plain_pow2(src[name].float(), block, search=False)
    q, exps = plain_pow2(dequant_reference(src, name), block, search=True)
    n, k = src[name].shape
    stored = src.get(name + "_scale_inv", src.get(name + "_scale"))
    in_block = {"per-tensor": (n, k), "ct-channel": (1, k), "channel": (1, k)}.get(dialect, (128, 128))
    grid = scale_values(stored).reshape(math.ceil(n / in_block[0]), math.ceil(k / in_block[1]))
    q, exps = q.clone(), exps.clone()
    for i in range(exps.shape[0]):
        for j in range(exps.shape[1]):
            r0, r1 = i * block[0], min(n, (i + 1) * block[0])
            c0, c1 = j * block[1], min(k, (j + 1) * block[1])
            inside = r0 // in_block[0] == (r1 - 1) // in_block[0] and c0 // in_block[1] == (c1 - 1) // in_block[1]
            e = math.log2(float(grid[r0 // in_block[0], c0 // in_block[1]]))
            if inside and e == int(e):
                exps[i, j] = int(e) + 127
                q[r0:r1, c0:c1] = src[name][r0:r1, c0:c1]
    return q, exps


def fp8_values(shape: tuple[int, int], block: tuple[int, int], seed: int) -> torch.Tensor:
    """Dequantized block FP8 (float32 scales over many binades), an outlier and an all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    s = torch.exp2(torch.randint(-12, 2, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    w = q.float() * s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]
    w[0, 0] *= 40.0  # one outlier: the ceiling exponent costs the rest of its block precision
    w[-min(shape[0], block[0]) :, -min(shape[1], block[1]) :] = 0.0
    return w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(300, 257), (128, 128), (1, 1), (200, 96)])
@pytest.mark.parametrize("block", [(128, 128), (1, 32)])
@pytest.mark.parametrize("search", [False, True])
def test_backends_match_the_plain_definition(device, shape, block, search):
    w = fp8_values(shape, (128, 128), seed=shape[0] + shape[1])
    q, exps = quantize_pow2(w, block, search, get_backend(device))
    want_q, want_e = plain_pow2(w, block, search)
    assert same_bits(exps, want_e) and same_bits(q, want_q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [(128, 128), (1, 32)])
def test_the_report_sums_are_the_plain_ones(device, block):
    """The report's parts (backends.pow2.chunk_report) against the plain float64 definition from the written
    bytes: squared errors and values, values over 448 at their block's exponent, nonzero inputs written as
    +-0 (values put far under the smallest subnormal of their block: they flush; NaN-free)."""
    w = fp8_values((300, 257), (128, 128), seed=5)
    w[3, 1:80:2] = float(w.abs().max()) * 2.0**-30  # flushed at any exponent their blocks (or groups) can take
    q, exps, parts = quantize_pow2_reported(w, block, True, get_backend(device))
    scale = scale_values(exps).repeat_interleave(block[0], 0)[:300].repeat_interleave(block[1], 1)[:, :257]
    written = q.double() * scale.double()
    y = w.double() / scale.double()
    assert sum(p.flushed for p in parts) == int(((w != 0) & (q.float() == 0)).sum()) >= 40
    assert sum(p.saturated for p in parts) == int((y.abs() > 448).sum())
    err2, norm2 = sum(p.err2 for p in parts), sum(p.norm2 for p in parts)
    assert err2 == pytest.approx(float(((written - w.double()) ** 2).sum()), rel=1e-6)
    assert norm2 == pytest.approx(float((w.double() ** 2).sum()), rel=1e-6)


def test_the_search_beats_the_ceiling_where_an_outlier_dominates():
    # one value just above 224: at the ceiling exponent (2^0) it rounds to 224 anyway, and one exponent
    # lower it saturates to 224 while every small value gets a finer grid
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(128, 128, generator=gen) * 0.004 + 0.001
    w[0, 0] = 224.5
    ceiling, _ = quantize_pow2(w, (128, 128), False, get_backend("cpu"))
    searched, exps = quantize_pow2(w, (128, 128), True, get_backend("cpu"))
    e0, s = plain_exponent(float(w.abs().max())), float(scale_values(exps).reshape(()))

    def sse(q: torch.Tensor, scale: float) -> float:
        return float(((q.double() * scale - w.double()) ** 2).sum())

    assert s < 2.0**e0 and sse(searched, s) < sse(ceiling, 2.0**e0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [(128, 128), (1, 32), (16, 16)])
def test_the_search_skipped_where_the_ceiling_must_win_changes_no_block(device, block):
    """The search is skipped where the largest value alone proves the ceiling wins (pow2.ceiling_wins);
    the blocks are built to sit on both sides of that test: largest values just above 224 x 2^e (the
    search may move them) and far above it, small values down in e4m3's subnormal range (the only ones a
    lower exponent can help), saturating neighbours. Every block's answer is the full search's (the tests'
    float64 definition)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 8 * block[0], 8 * block[1]
    w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-14, 0, (n, k), generator=gen)
    tops = 224 * (
        1
        + torch.rand(n // block[0], k // block[1], generator=gen)
        * torch.tensor([0.004, 0.03, 0.9])[torch.randint(0, 3, (n // block[0], k // block[1]), generator=gen)]
    )
    blocks = w.view(n // block[0], block[0], k // block[1], block[1])
    blocks[:, 0, :, 0] = tops  # each block's largest
    # under AMAX_FLOOR (1e-4) the floor sets the ceiling: the largest value lies below 224 x 2^e, nothing
    # clamps one exponent lower, and values subnormal at e make the lower exponent win
    blocks[0, :, 0] = torch.randn(block[0], block[1], generator=gen) * 2.0**-30
    blocks[0, 0, 0, 0] = 1e-5
    blocks[1, :, 1] = 0.0  # an all-zero block: every exponent exact, the ceiling by the tie rule
    q, exps = quantize_pow2(w, block, True, get_backend(device))
    want_q, want_e = plain_pow2(w, block, True)
    assert same_bits(exps, want_e) and same_bits(q, want_q)
    ceiling = plain_pow2(w, block, False)[1]
    assert bool((want_e != ceiling).any())  # some blocks moved by the search
    assert int(want_e[0, 0]) < int(ceiling[0, 0]) - 1  # the floored block among them, two or more lower


def _converted(src, out, options):
    result = fp8conv.convert(src, out, options)
    return result, load_dir(out), json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("dialect", ["block", "block-bf16-scales", "per-tensor", "ct-channel", "bf16"])
def test_every_input_kind_to_both_targets(make_tiny, tmp_path, dialect):
    tiny = make_tiny(dialect=dialect)
    src = load_dir(tiny.path)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 576 x 320: ragged under 128x128 blocks
    for n, (options, scale_name, scale_dtype, block) in enumerate(
        (
            (UE8M0, name + "_scale_inv", torch.float32, (128, 128)),  # DeepSeek-V3.1's storage, by default
            (UE8M0_E8M0, name + "_scale_inv", torch.float8_e8m0fnu, (128, 128)),
            (MXFP8, name + "_scale", torch.uint8, (1, 32)),
            (MXFP8_MODELOPT, name + "_scale", torch.uint8, (1, 32)),
        )
    ):
        out = tmp_path / f"{dialect}-{n}"
        result, tensors, config = _converted(tiny.path, out, options)
        want_q, want_e = plain_expected(src, name, dialect, block)
        assert tensors[scale_name].dtype == scale_dtype
        assert same_bits(e8m0_bytes(tensors[scale_name]), want_e) and same_bits(tensors[name], want_q)
        qc = config["quantization_config"]
        if options.to == "mxfp8" and options.mxfp8_format == "modelopt":
            assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "MXFP8") and "lm_head" in qc["ignore"]
        elif options.to == "mxfp8":  # compressed-tensors' MXFP8 preset, as vLLM's CompressedTensorsW8A8Mxfp8 reads
            group = qc["config_groups"]["group_0"]
            assert (qc["quant_method"], qc["format"], group["format"]) == ("compressed-tensors",) + (
                "mxfp8-quantized",
            ) * 2
            assert group["weights"]["group_size"] == 32 and group["weights"]["scale_dtype"] == "torch.uint8"
            assert "lm_head" in qc["ignore"]
        else:
            assert qc["scale_fmt"] == "ue8m0" and qc["weight_block_size"] == [128, 128]
        record = json.loads((out / ".fp8conv" / "manifest.json").read_text())["requantization"]
        assert record == result.requantization and name in record["tensors"]
        assert 0 < record["tensors"][name]["relative_frobenius"] < 0.05
        verified = fp8conv.verify(tiny.path, out)
        assert verified.ok, verified.failures


@pytest.mark.parametrize("dialect", ["ue8m0-e8m0", "ue8m0-u8"])
def test_power_of_two_inputs_keep_their_bytes(make_tiny, tmp_path, dialect):
    tiny = make_tiny(dialect=dialect)
    src = load_dir(tiny.path)
    for options in (UE8M0, MXFP8):
        result, tensors, _ = _converted(tiny.path, tmp_path / f"{dialect}-{options.to}", options)
        assert result.requantization["summary"]["exact"] == result.requantization["summary"]["tensors"]
        for name in tiny.fp8_weights:
            assert same_bits(tensors[name], src[name])
            stored = src[name + "_scale_inv"].view(torch.uint8)
            if options.to == "block":
                assert same_bits(e8m0_bytes(tensors[name + "_scale_inv"]), stored)
            else:  # each 1x32 group takes its 128x128 block's exponent
                k = src[name].shape[-1]
                want = stored.repeat_interleave(128, 0)[: src[name].shape[0]].repeat_interleave(4, 1)[:, : k // 32]
                assert same_bits(tensors[name + "_scale"], want.contiguous())


def test_deepseek_v31_keeps_what_is_exact_and_requantizes_o_proj(make_tiny, tmp_path):
    tiny = make_tiny(dialect="ue8m0")  # float32 scales, powers of two except o_proj's
    src = load_dir(tiny.path)
    result, tensors, _ = _converted(tiny.path, tmp_path / "out", UE8M0)
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    assert not result.requantization["tensors"][o_proj]["exact"]
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    assert result.requantization["tensors"][q_a]["exact"] and same_bits(tensors[q_a], src[q_a])
    want_q, want_e = plain_pow2(dequant_reference(src, o_proj), (128, 128), search=True)
    assert same_bits(tensors[o_proj], want_q) and same_bits(e8m0_bytes(tensors[o_proj + "_scale_inv"]), want_e)


def test_ue8m0_refuses_other_block_sizes_naming_a_tensor(make_tiny, tmp_path):
    tiny = make_tiny(block=(64, 64))
    with pytest.raises(PlanRefused) as err:
        fp8conv.convert(tiny.path, tmp_path / "out", UE8M0)
    message = err.value.problems[0].one_line()
    assert "128x128 blocks only" in message and "model." in message and "--block-size 128,128" in message
    assert not (tmp_path / "out" / "config.json").exists()


def test_mxfp8_refuses_k_not_a_multiple_of_32_naming_the_tensor(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.down_proj.weight": (torch.randn(64, 300, generator=gen) * 0.02).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": (torch.randn(300, 64, generator=gen) * 0.02).to(torch.bfloat16),
    }
    src = write_checkpoint(tmp_path / "src", tensors, {"model_type": "llama", "torch_dtype": "bfloat16"})
    with pytest.raises(PlanRefused) as err:
        fp8conv.convert(src, tmp_path / "out", MXFP8)
    (problem,) = err.value.problems
    assert "model.layers.0.mlp.down_proj.weight" in problem.one_line() and "K = 300" in problem.one_line()


def test_scale_fmt_applies_to_block_only():
    with pytest.raises(OptionsError, match="applies to --to block only"):
        ConvertOptions(to="channel", scale_fmt="ue8m0")
    assert "scale_fmt" not in ConvertOptions(to="block").to_dict()  # older manifests stay as they were


@pytest.mark.parametrize(("options", "tp"), [(UE8M0, 2), (MXFP8, 4)])
def test_pad_for_tp_with_both_targets(make_tiny, tmp_path, options, tp):
    tiny = make_tiny()
    padded = ConvertOptions(to=options.to, scale_fmt=options.scale_fmt, pad_for_tp=tp)
    _, tensors, config = _converted(tiny.path, tmp_path / "out", padded)
    multiple = tp * (128 if options.to == "block" else 32)
    assert config["intermediate_size"] % multiple == 0 and config["intermediate_size"] > 448
    down = tensors["model.layers.0.mlp.down_proj.weight"]
    assert down.shape[-1] == config["intermediate_size"] and not down[:, 448:].float().any()
    verified = fp8conv.verify(tiny.path, tmp_path / "out")
    assert verified.ok, verified.failures


def test_cli_prints_the_error_summary_and_json(make_tiny, tmp_path):
    tiny = make_tiny(dialect="block", num_shards=1)
    runner = CliRunner()
    run = runner.invoke(main, ["convert", str(tiny.path), "--to", "mxfp8", "-o", str(tmp_path / "a")])
    assert run.exit_code == 0, run.output
    assert "requantized" in run.output and "saturated" in run.output and "flushed to zero" in run.output
    args = ["convert", str(tiny.path), "--to", "block", "--scale-fmt", "ue8m0", "-o", str(tmp_path / "b"), "--json"]
    run = runner.invoke(main, args)
    assert run.exit_code == 0, run.output
    doc = json.loads(run.output)
    assert doc["requantization"]["summary"]["tensors"] == len(tiny.fp8_weights)


def test_inspect_says_whether_deepgemm_can_take_the_scales(make_tiny, tmp_path):
    runner = CliRunner()
    ready = runner.invoke(main, ["inspect", str(make_tiny(dialect="ue8m0-u8").path), "--scales"])
    not_ready = runner.invoke(main, ["inspect", str(make_tiny(dialect="ue8m0").path), "--scales"])
    assert "DeepGEMM-ready: yes" in ready.output, ready.output
    assert "DeepGEMM-ready: no" in not_ready.output and "o_proj" in not_ready.output, not_ready.output


def test_mxfp4_experts_go_into_mxfp8_exactly(tmp_path):
    """DeepSeek-V4: MXFP4 experts (e2m1 x E8M0 per 1x32) are MXFP8 values already: the search finds an
    exponent that holds every one; its block FP8 Linears (E8M0 scales) keep their bytes."""
    from tests.support.packed_builders import build_v4

    src = tmp_path / "v4"
    build_v4(src)
    result = fp8conv.convert(src, tmp_path / "out", MXFP8)
    tensors = result.requantization["tensors"]
    experts = [n for n in tensors if ".experts." in n]
    assert experts and all(tensors[n]["relative_frobenius"] == 0 and not tensors[n]["saturated"] for n in experts)
    assert all(tensors[n]["exact"] for n in tensors if n not in experts)
    verified = fp8conv.verify(src, tmp_path / "out")
    assert verified.ok, verified.failures


@pytest.mark.parametrize(("scale_dtype", "stored"), [(None, torch.float8_e8m0fnu), ("float32", torch.float32)])
def test_ue8m0_keeps_e8m0_storage_where_the_input_stores_it_so(tmp_path, scale_dtype, stored):
    """DeepSeek-V4's `.scale` is float8_e8m0fnu, and its output keeps that storage (and name) by default;
    --scale-dtype float32 asks otherwise."""
    from tests.support.packed_builders import build_v4

    tensors, _ = build_v4(tmp_path / "v4")
    options = ConvertOptions(to="block", scale_fmt="ue8m0", scale_dtype=scale_dtype)
    fp8conv.convert(tmp_path / "v4", tmp_path / "out", options)
    out = load_dir(tmp_path / "out")
    name = "layers.0.attn.wq_a"
    assert out[name + ".scale"].dtype == stored
    # kept bytes and exponents: the input's scales already are powers of two
    assert same_bits(e8m0_bytes(out[name + ".scale"]), tensors[name + ".scale"].view(torch.uint8))


def test_scale_dtype_and_mxfp8_format_apply_where_they_mean_something():
    with pytest.raises(OptionsError, match="--scale-dtype e8m0 applies with --scale-fmt ue8m0 only"):
        ConvertOptions(to="block", scale_dtype="e8m0")
    with pytest.raises(OptionsError, match="--mxfp8-format modelopt applies to --to mxfp8 only"):
        ConvertOptions(to="block", mxfp8_format="modelopt")
    assert "scale_dtype" not in UE8M0.to_dict() and UE8M0_E8M0.to_dict()["scale_dtype"] == "e8m0"


@pytest.mark.parametrize("options", [UE8M0, MXFP8], ids=["ue8m0", "mxfp8"])
@pytest.mark.parametrize("source", ["fp8", "v4-mxfp4", "half-power-of-two"])
def test_pow2_targets_stream_in_bands_to_the_same_bytes_and_report(make_tiny, tmp_path, options, source):
    """In bands (as every large weight streams) or whole: the same bytes, and the same error report to
    the last digit (its sums run over fixed 128-row chunks whatever the band size), a weight whose blocks
    are kept in some bands and requantized in others included."""
    from fp8conv.options import RunOptions, Tuning

    if source == "fp8":
        src = make_tiny().path
    elif source == "half-power-of-two":  # the first two block rows' scales powers of two, the rest not
        from tests.support.helpers import fp8, fp8_block_config

        scale = torch.rand(4, 3, generator=torch.Generator().manual_seed(2)) * 0.01 + 1e-3
        scale[:2] = 2.0 ** torch.randint(-12, -6, (2, 3)).to(torch.float32)
        tensors = {"model.layers.0.mlp.down_proj.weight": fp8((512, 384), 7)} | {
            "model.layers.0.mlp.down_proj.weight_scale_inv": scale
        }
        src = write_checkpoint(tmp_path / "half", tensors, fp8_block_config())
    else:
        from tests.support.packed_builders import build_v4

        build_v4(tmp_path / "v4")
        src = tmp_path / "v4"
    from tests.support.helpers import dir_snapshot

    whole = fp8conv.convert(src, tmp_path / "whole", options)
    # bands of one 128-row chunk, and of several (each computed chunk by chunk, some bands mixing kept and
    # requantized chunks)
    for band_elements in (3000, 125_000):
        out = tmp_path / f"banded-{band_elements}"
        banded = fp8conv.convert(src, out, options, run=RunOptions(tuning=Tuning(convert_band_elements=band_elements)))
        assert dir_snapshot(tmp_path / "whole") == dir_snapshot(out), band_elements
        assert whole.requantization == banded.requantization and banded.requantization["tensors"]
        assert fp8conv.verify(src, out).ok
