"""NVFP4 decode, every code byte under every e4m3 scale byte, with and without a global scale: the CPU
backend's (scale byte, code byte) tables give the reference backend's bits and the definition's.

The definition, computed here in float64: E2M1 value * e4m3 scale (exact), then / weight_global_scale
(compressed-tensors) or * weight_scale_2 (ModelOpt) rounded once to float32 (a float64 quotient or product
of two float32 values rounded to float32 is the correctly rounded float32 result), then once to the
output dtype."""

from __future__ import annotations

import pytest
import torch

from fp8conv.backends import available_devices, get_backend
from fp8conv.model.classify import Kind
from fp8conv.rewrite.unpack import code_values
from tests.support.packing import e2m1_value, group_scaled
from tests.support.reference import same_bits

# (global scale, divided?): compressed-tensors' typical 448 * 6 / amax, ModelOpt's reciprocal, a
# non-power-of-two, one that pushes values into float32 subnormals, one that overflows to inf
GLOBALS = [None, (2688.0, True), (1 / 2688.0, False), (3.0, True), (2.0**-120, False), (2.0**100, False)]
E4M3_NAN_BYTES = (0x7F, 0xFF)
DEVICES = [
    pytest.param(d, marks=pytest.mark.skipif(d not in available_devices(), reason=f"no {d} device here"))
    for d in ("cpu", "cuda", "hpu")
]


def every_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """codes [1, 256, 256]: row s holds all 256 code bytes; scale [1, 256, 32]: row s all scale byte s."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1).reshape(1, 256, 256)
    scale = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 32).contiguous()
    return codes, scale.view(torch.float8_e4m3fn)


def definition(codes: torch.Tensor, scale: torch.Tensor, g: tuple[float, bool] | None, dtype) -> torch.Tensor:
    nibbles = torch.stack((codes & 0xF, codes >> 4), dim=-1).reshape(*codes.shape[:-1], -1)
    value = group_scaled(e2m1_value(nibbles), scale.to(torch.float64), 16)
    if g is not None:
        g64 = float(torch.tensor(g[0], dtype=torch.float32))
        value = value / g64 if g[1] else value * g64
    return value.to(torch.float32).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_nvfp4_decode_is_the_reference_and_the_definition_for_every_scale_byte(device, dtype):
    codes, scale = every_pair()
    tested, reference = get_backend(device), get_backend("reference")
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(E4M3_NAN_BYTES)] = False
    # one backend for all: the CPU's tables are kept per global scale (and evicted), never mixed up
    for g in [*GLOBALS, *GLOBALS[:2]]:
        g_tensor = None if g is None else torch.tensor(g[0], dtype=torch.float32)
        divide = g is not None and g[1]
        outs = []
        for backend in (tested, reference):
            out = torch.empty(1, 256, 512, dtype=dtype)
            backend.decode_4bit(codes, code_values(Kind.NVFP4), scale, 16, out, g_tensor, divide)
            outs.append(out)
        assert same_bits(outs[0], outs[1]), g  # NaN scale bytes included
        expected = definition(codes, scale, g, dtype)
        assert same_bits(outs[0][0, finite], expected[0, finite]), g
        assert outs[0][0, ~finite].isnan().all()


def test_tables_are_kept_for_a_few_global_scales_only():
    """An NVFP4 tensor has its own global scale: the CPU backend keeps a bounded number of tables."""
    from fp8conv.backends.cpu import TABLES_KEPT

    codes, scale = every_pair()
    finite = torch.ones(256, dtype=torch.bool)
    finite[list(E4M3_NAN_BYTES)] = False
    cpu = get_backend("cpu")
    out = torch.empty(1, 256, 512, dtype=torch.bfloat16)
    for i in range(TABLES_KEPT + 5):
        g = 1000.0 + i
        cpu.decode_4bit(codes, code_values(Kind.NVFP4), scale, 16, out, torch.tensor(g), True)
        assert same_bits(out[0, finite], definition(codes, scale, (g, True), torch.bfloat16)[0, finite]), g
    assert len(cpu._tables) == TABLES_KEPT
