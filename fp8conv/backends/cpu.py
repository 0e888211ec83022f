"""The CPU backend: row chunks of whole blocks, so memory stays a few MB above the tensor itself."""

from __future__ import annotations

import torch

# Rows per chunk (rounded up to whole blocks): keeps the float32 temporary small and cache-friendly.
CHUNK_ROWS = 256


class CpuBackend:
    name = "cpu"

    def dequantize_blocks(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out: torch.Tensor
    ) -> None:
        bn, bk = block
        m_count, n, k = weight.shape
        full_k = (k // bk) * bk  # columns covered by whole blocks; the rest share the last grid column
        rows_per_chunk = max(bn, (CHUNK_ROWS // bn) * bn)
        scale = scale.to(torch.float32)
        for m in range(m_count):
            for r0 in range(0, n, rows_per_chunk):
                r1 = min(n, r0 + rows_per_chunk)
                rows = r1 - r0
                # each row's scales: grid rows repeated bn times, cropped to the chunk (partial last block)
                s = scale[m, r0 // bn : (r1 + bn - 1) // bn].repeat_interleave(bn, dim=0)[:rows]
                prod = weight[m, r0:r1].to(torch.float32)
                if full_k:
                    prod[:, :full_k].view(rows, full_k // bk, bk).mul_(s[:, : full_k // bk, None])
                if full_k < k:
                    prod[:, full_k:].mul_(s[:, -1:])
                out[m, r0:r1].copy_(prod)

    def quantize_blocks(
        self,
        weight: torch.Tensor,
        block: tuple[int, int],
        fp8_max: float,
        q_out: torch.Tensor,
        scale_out: torch.Tensor,
    ) -> None:
        bn, bk = block
        m_count, n, k = weight.shape
        gk = -(-k // bk)
        rows_per_chunk = max(bn, (CHUNK_ROWS // bn) * bn)
        for m in range(m_count):
            for r0 in range(0, n, rows_per_chunk):
                r1 = min(n, r0 + rows_per_chunk)
                g0, g1 = r0 // bn, -(-r1 // bn)
                padded = torch.zeros((g1 - g0) * bn, gk * bk, dtype=torch.float32)
                padded[: r1 - r0, :k] = weight[m, r0:r1]
                blocks = padded.view(g1 - g0, bn, gk, bk)
                amax = blocks.abs().amax(dim=(1, 3))
                scale = torch.where(amax > 0, amax / fp8_max, torch.ones_like(amax))
                q = (blocks / scale[:, None, :, None]).clamp_(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
                q_out[m, r0:r1] = q.view((g1 - g0) * bn, gk * bk)[: r1 - r0, :k]
                scale_out[m, g0:g1] = scale
