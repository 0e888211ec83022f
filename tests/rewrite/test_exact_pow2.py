"""--to block from values a power of two can hold (rewrite/exact_pow2.py): each block whose values the ceiling
power of two gives back exactly takes that scale, the rest keep amax / 448; against the tests' own float64
definition (tests/support/reference.quantize_exact_reference), on blocks built on each side of the rule."""

from __future__ import annotations

import pytest
import torch

from fp8conv.backends import available_devices, get_backend
from fp8conv.rewrite.exact_pow2 import prefer_exact_pow2, scales_are_powers_of_two
from fp8conv.rewrite.quant import quantize
from tests.support.reference import quantize_exact_reference, same_bits

DEVICES = [
    pytest.param(d, marks=pytest.mark.skipif(d not in available_devices(), reason=f"no {d} device here"))
    for d in ("cpu", "reference", "cuda")
]
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4_like(rows: int, cols: int, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """E2M1 values times a power of two per 1x32 group, the groups' exponents in [low, high)."""
    signs = 1 - 2 * torch.randint(0, 2, (rows, cols), generator=gen)
    codes = E2M1[torch.randint(0, 8, (rows, cols), generator=gen)] * signs
    exponents = torch.randint(low, high, (rows, -(-cols // 32)), generator=gen).repeat_interleave(32, dim=1)[:, :cols]
    return codes * torch.pow(2.0, exponents.float())


def crafted(n: int, k: int) -> torch.Tensor:
    """2 x 3 blocks of 128 (the last ones ragged when n, k are): one of each kind."""
    gen = torch.Generator().manual_seed(5)
    w = torch.zeros(n, k)
    w[:128, :128] = mxfp4_like(128, 128, -12, -2, gen)  # exponents within 10: exact under 2^e
    w[:128, 128:256] = mxfp4_like(128, 128, -30, -2, gen)  # within 28: the smallest fall off e4m3's grid
    # [:128, 256:] stays zero: amax / 448's 1.0 is a power of two already
    codes = (torch.randn(n - 128, 128, generator=gen) * 60).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    codes[0, 0] = 448.0
    w[128:, :128] = codes * 2.0**-8  # amax / 448 = 2^-8: exact both ways, kept
    w[128:, 128:256] = torch.randn(n - 128, 128, generator=gen) * 0.01  # bf16-like: exact neither way
    third = codes[:, : k - 256] * 3 * 2.0**-10  # amax / 448 = 3 x 2^-10 gives these back, no power of two does
    third[0, 0] = 448.0 * 3 * 2.0**-10
    w[128:, 256:] = third
    return w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(256, 384), (250, 300)])
def test_blocks_a_power_of_two_holds_take_it_and_the_rest_keep_amax_over_448(device, shape):
    w = crafted(*shape)
    backend = get_backend(device)
    q, scale = quantize(w, (128, 128), 448.0, backend)
    exact, total = prefer_exact_pow2(w, q, scale, (128, 128), backend)
    want_q, want_s, want_exact = quantize_exact_reference(w, (128, 128))
    assert same_bits(q, want_q) and same_bits(scale, want_s)
    assert (exact, total) == (want_exact, 6)
    # each kind as built: pow2 / amax over 448 / kept 1.0 / kept 2^-8 / neither / amax over 448 exact
    assert exact == 4
    assert float(scale[0, 0]) == 2.0 ** round(float(torch.log2(scale[0, 0]))) and float(scale[0, 2]) == 1.0
    assert float(scale[1, 0]) == 2.0**-8 and float(scale[1, 2]) == 3 * 2.0**-10


def test_power_of_two_scales_are_told_by_dtype_or_bits():
    assert scales_are_powers_of_two(torch.tensor([120, 3], dtype=torch.uint8))
    assert scales_are_powers_of_two(torch.tensor([0.25, 2.0**-20, 1.0]), torch.tensor(0.5))
    assert not scales_are_powers_of_two(torch.tensor([0.25, 0.3]))
    assert not scales_are_powers_of_two(torch.tensor([0.25]), torch.tensor(1 / 2688))


def _with_pow2_scales(path) -> dict[str, torch.Tensor]:
    """A per-tensor FP8 checkpoint's 0-D weight scales rounded to powers of two, in place (the codes stay):
    the weights' float32 values under the new scales."""
    from safetensors.torch import load_file, save_file

    shards = {shard: load_file(shard) for shard in sorted(path.glob("*.safetensors"))}  # (a scale may be
    everything = {name: t for tensors in shards.values() for name, t in tensors.items()}  # in another shard)
    values = {}
    for shard, tensors in shards.items():
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            scale = torch.exp2(torch.log2(tensors[name].float()).round())
            tensors[name] = scale.to(tensors[name].dtype)
            weight = name.removesuffix("_scale")
            values[weight] = everything[weight].float() * scale
        save_file(tensors, shard, metadata={"format": "pt"})
    return values


def test_per_tensor_fp8_under_a_power_of_two_goes_into_blocks_exactly(make_tiny, tmp_path):
    """--to block from per-tensor FP8 whose scale is a power of two: every 128x128 block holds its values
    under its ceiling power of two (each block's largest code scaled up to at most 448, exactly): the
    definition's bytes, every block counted exact, verify passes. A float scale keeps amax / 448, uncounted."""
    import fp8conv
    from tests.support.helpers import load_dir

    plain = make_tiny(dialect="per-tensor")
    result = fp8conv.convert(plain.path, tmp_path / "plain", fp8conv.ConvertOptions(to="block"))
    assert result.packed_blocks_total == 0
    tiny = make_tiny(dialect="per-tensor")
    values = _with_pow2_scales(tiny.path)
    result = fp8conv.convert(tiny.path, tmp_path / "out", fp8conv.ConvertOptions(to="block"))
    out = load_dir(tmp_path / "out")
    blocks = 0
    for name, w in values.items():
        want_q, want_s, exact = quantize_exact_reference(w, (128, 128))
        assert exact == want_s.numel(), name
        assert same_bits(out[name], want_q) and same_bits(out[name + "_scale_inv"], want_s), name
        blocks += exact
    assert result.packed_blocks_exact == result.packed_blocks_total == blocks > 0
    assert fp8conv.verify(tiny.path, tmp_path / "out").ok
    # in bands of 128 rows (the FP8 band path): the same files and count
    from fp8conv.options import RunOptions, Tuning
    from tests.support.helpers import dir_snapshot

    small = RunOptions(tuning=Tuning(convert_band_elements=3000))
    banded = fp8conv.convert(tiny.path, tmp_path / "bands", fp8conv.ConvertOptions(to="block"), run=small)
    assert dir_snapshot(tmp_path / "bands") == dir_snapshot(tmp_path / "out")
    assert (banded.packed_blocks_exact, banded.packed_blocks_total) == (blocks, blocks)
