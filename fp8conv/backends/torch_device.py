"""The plain-torch backend: the definition of the numbers, on any torch device.

On "cpu" it is the reference every other backend must match bit for bit; the same code serves CUDA
and HPU (float32 product, one rounding; amax and division in float32; clamp, then cast).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .pow2 import Buffers, Decode, ReportSums, fresh_buffers, quantize_pow2_rows
from .row_report import int8_row_sums_
from .scales import apply_global_scale, scale_to_float32

ROWS_PER_CHUNK = 256  # rounded to whole blocks: keeps the float32 temporaries small


def round_for_codes_(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled, clamped float32 values made ready for one cast to `dtype`: an FP8 cast rounds to nearest even
    itself; a cast to INT8 truncates, so INT8 codes are rounded first, half to even (torch.round, every
    device), and the cast is then exact."""
    return values.round_() if dtype == torch.int8 else values


class TorchDeviceBackend:
    def __init__(self, device: str = "cpu", name: str = "reference") -> None:
        self.device = torch.device(device)
        self.name = name

    def _chunks(self, n: int, bn: int) -> range:
        return range(0, n, max(bn, (ROWS_PER_CHUNK // bn) * bn))

    def dequantize_blocks(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor
    ) -> None:
        bn, bk = block
        m_count, n, k = weight.shape
        full_k = (k // bk) * bk  # columns covered by whole blocks; the rest share the last grid column
        step = self._chunks(n, bn).step
        scale = scale.to(self.device, torch.float32)
        for m in range(m_count):
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                rows = r1 - r0
                # each row's scales: grid rows repeated bn times, cropped to the chunk (partial last block)
                s = scale[m, r0 // bn : (r1 + bn - 1) // bn].repeat_interleave(bn, dim=0)[:rows]
                prod = weight[m, r0:r1].to(self.device).to(torch.float32)
                if full_k:
                    prod[:, :full_k].view(rows, full_k // bk, bk).mul_(s[:, : full_k // bk, None])
                if full_k < k:
                    prod[:, full_k:].mul_(s[:, -1:])
                out[m, r0:r1].copy_(prod.to(out.dtype))

    def requantize_blocks(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        in_block: tuple[int, int],
        out_block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        # float32 stays on the device: only FP8 goes over the bus, in and out
        w32 = torch.empty(weight.shape, dtype=torch.float32, device=self.device)
        self.dequantize_blocks(weight, scale, in_block, w32)
        self.quantize_blocks(w32, out_block, fp8_max, q_out, scale_out, row_sums)

    def quantize_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
        row_sums: torch.Tensor | None = None,
    ) -> None:
        for m, r0, r1, g0, g1, blocks in self._padded_block_chunks(weight, block):
            amax = blocks.abs().amax(dim=(1, 3))
            scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
            y = (blocks / scale[:, None, :, None]).clamp_(-fp8_max, fp8_max)
            if row_sums is None:
                q = round_for_codes_(y, q_out.dtype).to(q_out.dtype)
            else:  # INT8 rows (block (1, K): one row per block, no padding) and their report
                assert block == (1, weight.shape[2]) and q_out.dtype == torch.int8, "row sums are INT8 rows'"
                rows = y.view(r1 - r0, -1)
                planes = torch.stack([rows, torch.round(rows)])
                q = planes[1].to(q_out.dtype).view(y.shape)  # before the report overwrites the planes
                sums = torch.empty(r1 - r0, row_sums.shape[-1], dtype=torch.float64, device=self.device)
                int8_row_sums_(planes, scale.view(-1), sums)
                row_sums[m, r0:r1] = sums.cpu()
            q_out[m, r0:r1] = q.reshape(-1, q.shape[2] * q.shape[3])[: r1 - r0, : weight.shape[2]].cpu()
            scale_out[m, g0:g1] = scale.cpu()

    def _padded_block_chunks(
        self, weight: torch.Tensor, block: tuple[int, int]
    ) -> Iterator[tuple[int, int, int, int, int, torch.Tensor]]:
        """(m, rows r0:r1, grid rows g0:g1, the chunk zero-padded to whole blocks viewed [gn, bn, gk, bk])."""
        bn, bk = block
        m_count, n, k = weight.shape
        gk = -(-k // bk)
        step = self._chunks(n, bn).step
        for m in range(m_count):
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                g0, g1 = r0 // bn, -(-r1 // bn)
                padded = torch.zeros((g1 - g0) * bn, gk * bk, dtype=torch.float32, device=self.device)
                padded[: r1 - r0, :k] = weight[m, r0:r1].to(self.device)
                yield m, r0, r1, g0, g1, padded.view(g1 - g0, bn, gk, bk)

    def quantize_pow2_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        search: bool,
        q_out: torch.Tensor,
        exponents_out: torch.Tensor,
        report_rows: int,
    ) -> list[ReportSums]:
        bn = block[0]
        m_count, n, _ = weight.shape
        sums = []
        for m in range(m_count):
            for r0 in range(0, n, report_rows):
                r1 = min(n, r0 + report_rows)
                x = weight[m, r0:r1].to(self.device, torch.float32)
                q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=self.device)
                exponents, chunk = quantize_pow2_rows(x, block, search, q, self._decode_e4m3, self._pow2_buffers())
                q_out[m, r0:r1] = q.cpu()
                exponents_out[m, r0 // bn : -(-r1 // bn)] = exponents.cpu()
                sums.append(chunk)
        return sums

    def _pow2_buffers(self) -> Buffers:
        """quantize_pow2_rows' temporaries: fresh on this device (the CPU backend reuses its own)."""
        return fresh_buffers(self.device)

    # e4m3 -> float32 for quantize_pow2_rows: torch's own cast (the definition; the CPU backend's is faster)
    _decode_e4m3: Decode = None

    def decode_4bit(
        self,
        codes: torch.Tensor,
        values: torch.Tensor,
        scale: torch.Tensor,
        group: int,
        out: torch.Tensor,
        global_scale: torch.Tensor | None = None,
        divide_global: bool = False,
    ) -> None:
        # the plain definition: each nibble indexes the 16 values, low nibble first, then the group scale,
        # then (NVFP4) the global scale, all in float32
        m_count, n, half = codes.shape
        step = max(1, (ROWS_PER_CHUNK * 64) // max(half, 1))
        values = values.to(self.device)
        # on the device, never a CPU scalar: CUDA divides by a CPU scalar as a multiply by its reciprocal
        g = None if global_scale is None else global_scale.to(self.device, torch.float32).reshape(())
        for m in range(m_count):
            for r0 in range(0, n, step):
                r1 = min(n, r0 + step)
                c = codes[m, r0:r1].to(self.device).to(torch.int64)
                w = torch.stack((values[c & 0xF], values[c >> 4]), dim=-1).reshape(r1 - r0, 2 * half)
                s = scale_to_float32(scale[m, r0:r1]).to(self.device)
                w.view(r1 - r0, -1, group).mul_(s[:, :, None])
                apply_global_scale(w, g, divide_global)
                out[m, r0:r1].copy_(w)  # one rounding to out's dtype
