"""The CPU backend against the independent reference, bit for bit, on awkward shapes and blocks."""

from __future__ import annotations

import math

import pytest
import torch

from fp8conv.backends import available_devices, get_backend
from fp8conv.errors import OptionsError
from fp8conv.model.classify import Kind, WeightFormat
from fp8conv.rewrite.dequant import dequantize
from fp8conv.rewrite.quant import quantize, requantize
from tests.support.reference import dequant_block_reference, quantize_int8_reference, quantize_reference, same_bits

BLOCK_128 = WeightFormat("w", Kind.BLOCK, "s", block=(128, 128))
SHAPES_AND_BLOCKS = [
    ((448, 320), (128, 128)),  # 4-row grid with a partial last block: not 112-row blocks
    ((576, 320), (128, 128)),  # kv_a_proj_with_mqa: 576 / 5 is not even divisible
    ((192, 7), (128, 128)),  # K far below one block
    ((1, 1), (128, 128)),
    ((300, 257), (64, 32)),  # non-square block, ragged both ways
    ((256, 256), (128, 128)),  # aligned
    ((130, 600), (128, 128)),  # a chunk boundary inside the second grid row
    ((1000, 40), (3, 7)),  # tiny odd blocks: many chunks, partial in both dims
    ((300, 2100), (128, 128)),  # wide rows: the CPU table gathers a piece of one grid row at a time
    ((70, 4500), (1, 4500)),  # one scale per row, 4500 wide: CPU tables over several grid rows at once
]


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every finite e4m3fn code (NaN codes 0x7f/0xff excluded) at random."""
    codes = torch.randint(0, 255, shape, generator=gen, dtype=torch.int16)
    codes = torch.where(codes == 0x7F, torch.zeros_like(codes), codes)
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


DEVICES = [
    pytest.param(d, marks=pytest.mark.skipif(d not in available_devices(), reason=f"no {d} device here"))
    for d in ("cpu", "reference", "cuda", "hpu")
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_matches_reference_bit_for_bit(device, shape, block, dtype):
    gen = torch.Generator().manual_seed(hash((shape, block)) % 2**31)
    q = random_fp8(shape, gen)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    # scales spanning many binades, so a scale applied to the wrong block changes the bits
    scale = torch.exp2(torch.randint(-20, 4, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    fmt = WeightFormat("w", Kind.BLOCK, "s", block=block)
    got = dequantize(q, scale, fmt, dtype, get_backend(device))
    assert same_bits(got, dequant_block_reference(q, scale, block, dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "block"), [*SHAPES_AND_BLOCKS, ((300, 257), None), ((1, 5), None)])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
def test_quantize_matches_reference_bit_for_bit(device, shape, block, fp8_max):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen) * 4)
    w[0] = 0  # an all-zero row: scale 1, stays zero
    q, scale = quantize(w, block, fp8_max, get_backend(device))
    expected_q, expected_scale = quantize_reference(w, block, fp8_max)
    assert same_bits(q, expected_q) and same_bits(scale, expected_scale)


# a block's scale: normal; 2^121 (the CPU path's x256 would overflow: it steps aside); 2^-140 (the channel
# scale goes subnormal and |w / s| passes fp8_max: the clamp matters); 2^119.5 (products overflow to inf)
EXTREME_SCALES = {"normal": None, "huge": 2.0**121, "tiny": 2.0**-140, "overflowing": 2.0**119.5}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
@pytest.mark.parametrize("out_block", [None, (128, 128)])
@pytest.mark.parametrize("fp8_max", [448.0, 240.0])
@pytest.mark.parametrize("scale_case", list(EXTREME_SCALES))
@pytest.mark.parametrize("nan_codes", [True, False])
def test_requantize_matches_dequantize_then_quantize(device, shape, block, out_block, fp8_max, scale_case, nan_codes):
    """FP8 straight to FP8 (the fused CPU path for channel output) = the reference dequantize, then quantize;
    with and without NaN codes (the CPU path patches them only when present)."""
    gen = torch.Generator().manual_seed(hash((shape, block)) % 2**31)
    codes = random_fp8(shape, gen).view(torch.uint8)
    specials = torch.tensor([0x80, 0x7F, 0xFF] if nan_codes else [0x80], dtype=torch.uint8)  # -0, both NaNs
    codes.view(-1)[: min(len(specials), shape[1])] = specials[: shape[1]]
    codes[-1] = 0  # an all-zero row (or block): scale 1, stays zero
    q8 = codes.view(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    scale = torch.exp2(torch.randint(-20, 4, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    if EXTREME_SCALES[scale_case] is not None:
        scale.view(-1)[0] = EXTREME_SCALES[scale_case]
    fmt = WeightFormat("w", Kind.BLOCK, "s", block=block)
    q, new_scale = requantize(q8, scale, fmt, out_block, fp8_max, get_backend(device))
    expected_q, expected_scale = quantize_reference(
        dequant_block_reference(q8, scale, block, torch.float32), out_block, fp8_max
    )
    assert same_bits(q, expected_q) and same_bits(new_scale, expected_scale)


def test_requantize_fused_experts_match_per_expert():
    gen = torch.Generator().manual_seed(11)
    q8 = random_fp8((3, 300, 257), gen)
    scale = torch.exp2(torch.randint(-30, 30, (3, 3, 3), generator=gen).float())
    fmt = WeightFormat("w", Kind.BLOCK, "s", block=(128, 128))
    q, new_scale = requantize(q8, scale, fmt, None, 448.0, get_backend("cpu"))
    for e in range(3):
        expected_q, expected_scale = quantize_reference(
            dequant_block_reference(q8[e], scale[e], (128, 128), torch.float32), None, 448.0
        )
        assert same_bits(q[e], expected_q) and same_bits(new_scale[e], expected_scale)


@pytest.mark.parametrize("device", DEVICES)
def test_every_e4m3_code_dequantizes_exactly(device):
    """All 256 codes (NaNs, both zeros, subnormals, 448) against torch's own cast, with odd scales."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(3, 1).view(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0], [2.0**-130], [3.0e5]])  # a float32 subnormal scale too
    got = dequantize(
        codes, scale, WeightFormat("w", Kind.BLOCK, "s", block=(1, 256)), torch.float32, get_backend(device)
    )
    assert same_bits(got, codes.to(torch.float32) * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("shape", "block"), [((256, 512), (128, 128)), ((300, 2100), (128, 128))])
def test_every_code_under_extreme_scales_matches_reference(device, dtype, shape, block):
    """Into bf16/f16 the CPU backend gathers from per-block tables: every code (NaNs, -0, subnormals) in
    every block, under scales whose products overflow, go subnormal or would overflow a x256 shift."""
    codes = torch.arange(shape[0] * shape[1], dtype=torch.int64).remainder(256).to(torch.uint8).view(shape)
    q8 = codes.view(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    gen = torch.Generator().manual_seed(5)
    scale = torch.exp2(torch.randint(-20, 4, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    scale.view(-1)[: len(EXTREME_SCALES) - 1] = torch.tensor([v for v in EXTREME_SCALES.values() if v])
    fmt = WeightFormat("w", Kind.BLOCK, "s", block=block)
    got = dequantize(q8, scale, fmt, dtype, get_backend(device))
    assert same_bits(got, dequant_block_reference(q8, scale, block, dtype))


def test_remainder_columns_take_the_grids_last_column_as_the_reference_does():
    """A grid one column short of the ragged width (the remainder shares the last block's scale): the
    backends agree with the reference's rule instead of reading past the grid."""
    gen = torch.Generator().manual_seed(9)
    q8 = random_fp8((1, 256, 2100), gen)
    scale = torch.exp2(torch.randint(-20, 4, (1, 2, 2100 // 128), generator=gen).float())
    want = torch.empty(1, 256, 2100, dtype=torch.bfloat16)
    get_backend("reference").dequantize_blocks(q8, scale, (128, 128), want)
    got = torch.empty_like(want)
    get_backend("cpu").dequantize_blocks(q8, scale, (128, 128), got)
    assert same_bits(got, want)


def test_guessing_block_from_grid_would_differ():
    """Guard that the test data can catch the classic bug: 448 rows / 4 grid rows read as 112-row blocks."""
    gen = torch.Generator().manual_seed(1)
    q = random_fp8((448, 128), gen)
    scale = torch.tensor([[1.0], [2.0], [4.0], [8.0]])
    right = dequant_block_reference(q, scale, (128, 128))
    wrong = (q.float().view(4, 112, 128) * scale[:, :, None]).view(448, 128).to(torch.bfloat16)
    assert not same_bits(right, wrong)
    assert same_bits(dequantize(q, scale, BLOCK_128, torch.bfloat16, get_backend("cpu")), right)


def test_channel_and_per_tensor_are_block_math():
    gen = torch.Generator().manual_seed(2)
    q = random_fp8((200, 33), gen)
    row_scale = torch.rand(200, 1, generator=gen) + 0.5
    got = dequantize(q, row_scale, WeightFormat("w", Kind.CHANNEL, "s"), torch.bfloat16, get_backend("cpu"))
    assert same_bits(got, (q.float() * row_scale).to(torch.bfloat16))
    one = torch.tensor(0.37)
    got = dequantize(q, one, WeightFormat("w", Kind.PER_TENSOR, "s"), torch.bfloat16, get_backend("cpu"))
    assert same_bits(got, (q.float() * one).to(torch.bfloat16))


def test_fused_expert_tensor_dequantizes_per_expert():
    gen = torch.Generator().manual_seed(3)
    q = random_fp8((3, 200, 130), gen)
    scale = torch.rand(3, 2, 2, generator=gen) + 0.1
    got = dequantize(q, scale, WeightFormat("w", Kind.BLOCK, "s", block=(128, 128)), torch.bfloat16, get_backend("cpu"))
    for e in range(3):
        assert same_bits(got[e], dequant_block_reference(q[e], scale[e], (128, 128)))


def test_nan_codes_stay_nan():
    q = torch.tensor([[0x7F, 0xFF, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = dequantize(
        q,
        torch.ones(1, 1),
        WeightFormat("w", Kind.BLOCK, "s", block=(128, 128)),
        torch.bfloat16,
        get_backend("cpu"),
    )
    assert torch.isnan(out[0, :2]).all() and not torch.isnan(out[0, 2])


def test_unknown_or_absent_device_is_refused_plainly():
    with pytest.raises(OptionsError, match="device 'tpu' is not available"):
        get_backend("tpu")
    for device in ("cuda", "hpu"):
        if device not in available_devices():
            with pytest.raises(OptionsError, match=f"--device {device}: no"):
                get_backend(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("shape", "block"), SHAPES_AND_BLOCKS)
@pytest.mark.parametrize("from_fp8", [True, False])
def test_int8_rows_and_their_report_sums_match_the_reference_bit_for_bit(device, shape, block, from_fp8):
    """--to int8 from FP8 (the fused CPU path) and from float32: the plain definition's codes and scales, and
    the report's row sums the reference backend takes, to the bit; those sums are the plain float64 ones."""
    from fp8conv.rewrite.int8_report import row_sums_for

    gen = torch.Generator().manual_seed(hash((shape, block)) % 2**31)
    q8 = random_fp8(shape, gen)
    q8.view(torch.uint8)[-1] = 0  # an all-zero row: scale 1, stays zero
    grid = (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    scale = torch.exp2(torch.randint(-20, 4, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    fmt = WeightFormat("w", Kind.BLOCK, "s", block=block)
    w32 = dequant_block_reference(q8, scale, block, torch.float32)
    results = {}
    for name in dict.fromkeys(["reference", device]):
        sums = row_sums_for(shape, torch.int8)
        backend = get_backend(name)
        if from_fp8:
            q, s = requantize(q8, scale, fmt, None, 127.0, backend, torch.int8, sums)
        else:
            q, s = quantize(w32, None, 127.0, backend, torch.int8, sums)
        results[name] = (q, s, sums)
    q, s, sums = results[device]
    expected_q, expected_scale = quantize_int8_reference(w32)
    assert same_bits(q, expected_q) and same_bits(s, expected_scale)
    assert same_bits(sums, results["reference"][2])
    y = (w32 / expected_scale).to(torch.float64)
    s2 = expected_scale.to(torch.float64) ** 2
    assert torch.allclose(sums[0, :, 0], (((q.to(torch.float64) - y) ** 2) * s2).sum(1), rtol=1e-5, atol=0)
    assert torch.allclose(sums[0, :, 1], ((y**2) * s2).sum(1), rtol=1e-5, atol=0)
