"""backends.pow2_codes: power-of-two requantization of block FP8 from its codes by tables, against the tests'
own plain definition (tests.support.reference.plain_pow2 on the dequantized values, blocks whose input scale
is a power of two keeping their bytes), its report against the float64 definition from the written bytes,
its refusals, and that conversions take it."""

from __future__ import annotations

import math

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.backends.pow2_codes import requantize_codes_pow2
from fp8conv.backends.torch_device import TorchDeviceBackend
from tests.support.helpers import fp8_block_config, write_checkpoint
from tests.support.reference import plain_pow2, same_bits, scale_values

IN_BLOCK = (128, 128)


def block_fp8(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and float32 128x128 scales over many binades: some scales powers of two (their blocks keep
    their bytes), one block whose largest value sits just above 224 x 2^e over values subnormal there (the
    search moves it), one all-zero block, one block so small it flushes."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=gen) * 2.0 ** torch.randint(-6, 7, shape, generator=gen)
    codes = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    scale = torch.exp2(torch.randint(-14, 3, grid, generator=gen).float()) * (1 + torch.rand(grid, generator=gen))
    scale.view(-1)[::3] = torch.exp2(torch.randint(-14, 3, scale.view(-1)[::3].shape, generator=gen).float())
    block = codes[: min(128, shape[0]), : min(128, shape[1])].view(torch.uint8)
    block.copy_(torch.randint(1, 12, block.shape, generator=gen, dtype=torch.uint8))  # subnormal codes
    block[0, 0] = 0x73  # e4m3 176 under the scale 1.3 x 2^-3: the block's largest value 228.8 x 2^-3, and
    scale[0, 0] = 2.0**-3 * 1.3  # its small values off e4m3's subnormal grid at 2^-3, finer one exponent lower
    if grid[0] * grid[1] > 2:  # a block under 1e-4 (AMAX_FLOOR sets its exponent): its values flush to zero
        scale.view(-1)[1] = 1.3 * 2.0**-40
    if grid[0] * grid[1] > 1:
        codes[-min(128, shape[0]) :, -min(128, shape[1]) :] = 0.0
    return codes, scale


def expected(codes: torch.Tensor, scale: torch.Tensor, out_block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """plain_pow2 of the dequantized values (searched), except output blocks whose input scale is a power of
    two: the input's bytes and that exponent."""
    n, k = codes.shape
    full = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    q, exps = plain_pow2(codes.float() * full, out_block, search=True)
    q, exps = q.clone(), exps.clone()
    for i in range(exps.shape[0]):
        for j in range(exps.shape[1]):
            rows, columns = (
                slice(i * out_block[0], (i + 1) * out_block[0]),
                slice(j * out_block[1], (j + 1) * out_block[1]),
            )
            e = math.log2(float(scale[rows.start // 128, columns.start // 128]))
            if e == int(e):
                exps[i, j] = int(e) + 127
                q[rows, columns] = codes[rows, columns]
    return q, exps


@pytest.mark.parametrize("shape", [(300, 257), (128, 128), (1, 1), (200, 96)])
@pytest.mark.parametrize("out_block", [(128, 128), (1, 32), (32, 64)])
def test_codes_give_the_definitions_bytes(shape, out_block):
    codes, scale = block_fp8(shape, seed=shape[0] * 7 + shape[1])
    q = torch.empty(shape, dtype=torch.float8_e4m3fn)
    done = requantize_codes_pow2(codes, scale, IN_BLOCK, out_block, 128, q)
    assert done is not None
    exps, _, _ = done
    want_q, want_e = expected(codes, scale, out_block)
    assert same_bits(exps, want_e) and same_bits(q, want_q)


def test_the_search_moved_a_block_and_kept_blocks_stayed():
    """The fixture is not vacuous: some block searched below its ceiling, some kept its bytes."""
    codes, scale = block_fp8((300, 257), seed=1)
    q = torch.empty(codes.shape, dtype=torch.float8_e4m3fn)
    exps = requantize_codes_pow2(codes, scale, IN_BLOCK, IN_BLOCK, 128, q)[0].to(torch.int32) - 127
    amax = codes.float().abs()[:128, :128].max() * scale[0, 0]
    assert int(exps[0, 0]) < math.ceil(math.log2(float(amax) / 448))
    kept = torch.log2(scale) == torch.log2(scale).round()
    assert bool(kept.any()) and bool((exps[kept] == torch.log2(scale)[kept].int()).all())


@pytest.mark.parametrize("out_block", [(128, 128), (1, 32)])
def test_the_report_is_the_plain_float64_one(out_block):
    codes, scale = block_fp8((300, 257), seed=5)
    q = torch.empty(codes.shape, dtype=torch.float8_e4m3fn)
    exps, parts, kept_all = requantize_codes_pow2(codes, scale, IN_BLOCK, out_block, 128, q)
    assert len(parts) == 3 and not kept_all
    n, k = codes.shape
    # the input's values: float32 products, as dequantizing them gives
    w = (codes.float() * scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).double()
    s = scale_values(exps).double().repeat_interleave(out_block[0], 0)[:n].repeat_interleave(out_block[1], 1)[:, :k]
    written = q.double() * s
    assert sum(p[0] for p in parts) == pytest.approx(float(((written - w) ** 2).sum()), rel=1e-12)
    assert sum(p[1] for p in parts) == pytest.approx(float((w**2).sum()), rel=1e-12)
    assert sum(p[2] for p in parts) == int(((w / s).abs() > 448).sum())
    flushed = int(((w != 0) & (q.float() == 0)).sum())
    assert sum(p[3] for p in parts) == flushed > 0


def test_nan_codes_are_left_to_the_definition():
    codes, scale = block_fp8((256, 256), seed=2)
    codes.view(torch.uint8)[200, 3] = 0xFF
    q = torch.zeros(codes.shape, dtype=torch.float8_e4m3fn)
    assert requantize_codes_pow2(codes, scale, IN_BLOCK, (1, 32), 128, q) is None
    assert not bool(q.view(torch.uint8).any())  # nothing written


def test_block_fp8_conversions_never_dequantize(tmp_path, monkeypatch):
    """DeepSeek-style block FP8 into ue8m0 blocks and MXFP8 goes through the codes (the float32 definition's
    quantize_pow2_blocks is never called), whole and in bands, to the definition's bytes."""

    def refuse(*args, **kwargs):
        raise AssertionError("dequantized and requantized in float32")

    codes, scale = block_fp8((640, 384), seed=3)
    tensors = {"model.layers.0.mlp.down_proj.weight": codes, "model.layers.0.mlp.down_proj.weight_scale_inv": scale}
    src = write_checkpoint(tmp_path / "src", tensors, fp8_block_config())
    monkeypatch.setattr(TorchDeviceBackend, "quantize_pow2_blocks", refuse)
    from fp8conv.options import RunOptions, Tuning

    targets = ((ConvertOptions(to="block", scale_fmt="ue8m0"), (128, 128)), (ConvertOptions(to="mxfp8"), (1, 32)))
    for options, block in targets:
        for band_elements in (None, 60_000):
            out = tmp_path / f"out-{options.to}-{band_elements}"
            run = None if band_elements is None else RunOptions(tuning=Tuning(convert_band_elements=band_elements))
            fp8conv.convert(src, out, options) if run is None else fp8conv.convert(src, out, options, run=run)
            from tests.support.helpers import load_dir

            got = load_dir(out)["model.layers.0.mlp.down_proj.weight"]
            assert same_bits(got, expected(codes, scale, block)[0]), (options.to, band_elements)


@pytest.mark.parametrize("out_block", [(128, 128), (1, 32)])
def test_every_search_left_to_the_definitions_sums_gives_the_same_bytes(out_block, monkeypatch):
    """With no margin wide enough to decide from counts (or gains), every open block is searched by the
    definition's own sums (choose_exponents on its values, or the tables' squares in pairwise order): the
    same bytes, so those fallbacks are right wherever the margin sends a block to them."""
    import fp8conv.backends.pow2_tables as pow2_tables

    codes, scale = block_fp8((300, 257), seed=9)
    want = requantize_codes_pow2(codes, scale, IN_BLOCK, out_block, 128, torch.empty(codes.shape, dtype=codes.dtype))
    monkeypatch.setattr(pow2_tables, "DECISION_MARGIN", float("inf"))
    q = torch.empty(codes.shape, dtype=torch.float8_e4m3fn)
    exps = requantize_codes_pow2(codes, scale, IN_BLOCK, out_block, 128, q)[0]
    want_q, want_e = expected(codes, scale, out_block)
    assert same_bits(exps, want_e) and same_bits(q, want_q) and same_bits(exps, want[0])


@pytest.mark.parametrize("in_block", [(256, 128), (64, 64), (96, 128)])
def test_other_input_blocks_give_the_definitions_bytes_and_report(in_block):
    """Input blocks other than 128x128 (report chunks of 128 rows share one input block, span two, or straddle
    them): MXFP8 from the codes is the definition's (plain_pow2 of the dequantized values), and each chunk's
    report sums to the float64 one over its rows."""
    n, k = 320, 256
    gen = torch.Generator().manual_seed(in_block[0])
    values = torch.randn((n, k), generator=gen) * 2.0 ** torch.randint(-6, 7, (n, k), generator=gen)
    codes = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (math.ceil(n / in_block[0]), math.ceil(k / in_block[1]))
    mantissa = 1.1 + 0.8 * torch.rand(grid, generator=gen)  # never a power of two: every block requantized
    scale = torch.exp2(torch.randint(-14, 3, grid, generator=gen).float()) * mantissa
    full = scale.repeat_interleave(in_block[0], 0)[:n].repeat_interleave(in_block[1], 1)[:, :k]
    w = codes.float() * full
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    exps, parts, _ = requantize_codes_pow2(codes, scale, in_block, (1, 32), 128, q)
    want_q, want_e = plain_pow2(w, (1, 32), search=True)
    assert same_bits(exps, want_e) and same_bits(q, want_q)
    s = scale_values(exps).double().repeat_interleave(32, 1)[:, :k]
    err2 = ((q.double() * s - w.double()) ** 2).sum(dim=1)
    assert len(parts) == 3
    for i, part in enumerate(parts):
        assert part[0] == pytest.approx(float(err2[i * 128 : (i + 1) * 128].sum()), rel=1e-12)
        assert part[1] == pytest.approx(float((w.double()[i * 128 : (i + 1) * 128] ** 2).sum()), rel=1e-12)
