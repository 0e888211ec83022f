"""An independent, deliberately plain reference: pad to whole blocks, multiply in float32, crop."""

from __future__ import annotations

import math
import re

import torch


def dequant_block_reference(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    n, k = q.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    assert tuple(scale.shape) == (gn, gk), (scale.shape, (gn, gk))
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = q.to(torch.float32)
    product = padded.view(gn, bn, gk, bk) * scale.to(torch.float32)[:, None, :, None]
    return product.reshape(gn * bn, gk * bk)[:n, :k].to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN-safe, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Stored scale -> float32 values; UE8M0 bytes b mean 2^(b-127), computed here in float64."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        exponent = scale.view(torch.uint8).to(torch.float64)
        return torch.pow(2.0, exponent - 127).to(torch.float32)
    return scale.to(torch.float32)


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """A power-of-two scale as its E8M0 byte b (2^(b - 127)), whether stored as the byte or as float32."""
    if scale.dtype == torch.float32:
        mantissa, exponent = torch.frexp(scale)
        assert bool((mantissa == 0.5).all()), "a float32 scale that is not a power of two"
        return (exponent - 1 + 127).to(torch.uint8)
    return scale.view(torch.uint8)


def dequant_reference(tensors: dict[str, torch.Tensor], weight: str) -> torch.Tensor:
    """The float32 product float32(q) * float32(scale) for any dialect, chosen by the scale's shape."""
    q = tensors[weight]
    scale = tensors.get(weight + "_scale_inv", tensors.get(weight + "_scale"))
    s = scale_values(scale)
    n = q.shape[-2]
    if s.numel() == 1:
        return q.to(torch.float32) * s.reshape(())
    if tuple(s.shape) in ((n,), (n, 1)):
        return q.to(torch.float32) * s.reshape(n, 1)
    return dequant_block_reference(q, s, (128, 128), torch.float32)  # the factory's block size


def quantize_reference(
    w: torch.Tensor, block: tuple[int, int] | None, fp8_max: float = 448.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to whole blocks, scale = amax / fp8_max (1 for all-zero), clamp, cast; block None = per row."""
    n, k = w.shape
    bn, bk = block or (1, k)
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32)
    padded[:n, :k] = w
    blocks = padded.view(gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
    q = torch.clamp(blocks / scale[:, None, :, None], -fp8_max, fp8_max).to(torch.float8_e4m3fn)
    return q.reshape(gn * bn, gk * bk)[:n, :k], scale


def quantize_exact_reference(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """--to block from values a power of two may hold: per block, quantize_reference's amax / 448 block,
    unless the ceiling power of two (plain_exponent) gives back every value (float64 arithmetic) and the
    amax / 448 block is not already exact under a power-of-two scale; then that one. (q, scale, exact
    blocks)."""
    q, scale = quantize_reference(w, block)
    n, k = w.shape
    bn, bk = block
    q, scale = q.clone(), scale.clone()
    exact = 0
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * bn, min(n, (i + 1) * bn)), slice(j * bk, min(k, (j + 1) * bk))
            x = w[rows, cols].double()
            s = float(scale[i, j])
            amax_exact = bool((q[rows, cols].double() * s == x).all())
            e = plain_exponent(float(x.abs().max()))
            qp = (x / 2.0**e).float().to(torch.float8_e4m3fn)
            pow2_exact = bool((qp.double() * 2.0**e == x).all())
            if pow2_exact and not (amax_exact and math.frexp(s)[0] == 0.5):
                q[rows, cols], scale[i, j] = qp, 2.0**e
            exact += pow2_exact or amax_exact
    return q, scale, exact


def within_fp8_bound(deq: torch.Tensor, ref: torch.Tensor, amax: torch.Tensor) -> bool:
    """|dequant(out) - ref| <= 2^-4 |ref| + amax * 2^-9 (amax broadcast per row or per element)."""
    return bool(((deq - ref).abs() <= ref.abs() * 2**-4 + amax * 2**-9).all())


MLP_PROJ = re.compile(r"\.mlp\.(?:experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj\.weight$")


def pad_axis(t: torch.Tensor, axis: int, size: int, value: float) -> torch.Tensor:
    """`t` grown along `axis` to `size`, the new entries `value`."""
    shape = list(t.shape)
    shape[axis] = size - t.shape[axis]
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype)], dim=axis)


def expected_output(
    src: dict[str, torch.Tensor],
    fp8_weights: list[str],
    to: str,
    dtype: torch.dtype = torch.bfloat16,
    fp8_max: float = 448.0,
    pad_for_tp: int | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor a conversion of a block-FP8 (128x128, `_scale_inv`) checkpoint must write, from the
    definitions: bf16 is one rounding of float32(q) * float32(scale); channel is a fresh per-row
    quantization of that product; block keeps the FP8 bytes and float32 scales, and with pad_for_tp the
    MLP widths grow to whole 128-blocks per rank (zero weights, scale 1). Everything else is copied."""
    out = {n: t for n, t in src.items() if not n.endswith("_scale_inv")}
    for name in fp8_weights:
        q, scale = src[name], src[name + "_scale_inv"]
        if to == "bf16":
            out[name] = dequant_block_reference(q, scale, (128, 128), dtype)
        elif to == "channel":
            out[name], out[name + "_scale"] = quantize_reference(
                dequant_block_reference(q, scale, (128, 128), torch.float32), None, fp8_max
            )
        else:
            out[name], out[name + "_scale_inv"] = q, scale.to(torch.float32)
            m = MLP_PROJ.search(name)
            if pad_for_tp and m:
                axis = 1 if m.group(1) == "down" else 0
                width = math.ceil(q.shape[axis] / (128 * pad_for_tp)) * 128 * pad_for_tp
                q8 = q.view(torch.uint8)  # FP8 has no cat on every torch; its zero is the byte 0
                out[name] = pad_axis(q8, axis, width, 0).view(torch.float8_e4m3fn)
                out[name + "_scale_inv"] = pad_axis(out[name + "_scale_inv"], axis, width // 128, 1.0)
    return out


def plain_exponent(amax: float) -> int:
    """The least e with 448 * 2^e >= max(amax, 1e-4 as float32), by float64 arithmetic."""
    a = max(amax, float(torch.tensor(1e-4, dtype=torch.float32)))
    e = math.ceil(math.log2(a / 448.0))
    while 448.0 * 2.0**e < a:
        e += 1
    while 448.0 * 2.0 ** (e - 1) >= a:
        e -= 1
    return e


def plain_pow2(w: torch.Tensor, block: tuple[int, int], search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, E8M0 bytes) by the definition: per block the ceiling exponent, or (search) of it and the three
    below the one of least float64 squared error, the larger on a tie."""
    n, k = w.shape
    bn, bk = block
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float64)
    padded[:n, :k] = w.double()
    blocks = padded.view(gn, bn, gk, bk)
    exps = torch.empty(gn, gk, dtype=torch.int64)
    for i in range(gn):
        for j in range(gk):
            x = blocks[i, :, j, :]
            ceiling = plain_exponent(float(x.abs().max()))
            best, best_err = ceiling, None
            for e in range(ceiling, ceiling - (4 if search else 1), -1):
                q = (x / 2.0**e).clamp(-448, 448).float().to(torch.float8_e4m3fn)
                err = float(((q.double() * 2.0**e - x) ** 2).sum())
                if best_err is None or err < best_err:
                    best, best_err = e, err
            exps[i, j] = best
    scale = torch.pow(2.0, exps.double())[:, None, :, None]
    q = (blocks / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), (exps + 127).to(torch.uint8)


def quantize_int8_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--to int8, plainly, per row of [N, K]: scale = float32(amax / 127) (1 for an all-zero row), then the
    integer nearest each float32 quotient w / scale (Python's round: ties to even), clamped to +-127.
    Returns (q int8 [N, K], scale float32 [N, 1])."""
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    quotients = (w / scale).tolist()  # float32 quotients, exact as Python floats
    codes = [[max(-127, min(127, round(v))) for v in row] for row in quotients]
    return torch.tensor(codes, dtype=torch.int8).reshape(w.shape), scale
