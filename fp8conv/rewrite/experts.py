"""gpt-oss's fused MXFP4 experts (uint8 *_blocks [E, N, K/32, 16], E8M0 *_scales [E, N, K/32]) dequantized
band by band of their transposed output [E, K, N], seen as rows [E * K, N] (fp8conv.plan.bands.bands places
each band and its read): whole experts per band, or a slice of one expert's output rows k, which are
columns of its decoded [N, K]. The bits dequantized_output gives: one value depends on its code and its
group's scale only, rounded once to the output dtype."""

from __future__ import annotations

import torch

from ..backends import Backend
from ..backends.scratch import scratch
from ..dtypes import ELEMENT_BYTES, torch_dtype
from ..plan.conversion import Job
from .unpack import code_values


class ExpertBands:
    """The arithmetic of a BANDED gpt-oss job, for the scheduler (the same face as BandedJob)."""

    def __init__(self, job: Job, backend: Backend) -> None:
        assert job.fmt is not None and job.fmt.group is not None
        self.job, self.backend, self.group = job, backend, job.fmt.group
        _, self.k, self.n = job.spec.shape
        self.row_elements = self.n  # elements per output row
        self.out_dtype = torch_dtype(job.spec.dtype)
        self.out_size = ELEMENT_BYTES[job.spec.dtype]
        self.values = code_values(job.fmt.kind)
        self.new_scale: torch.Tensor | None = None  # dequantized: no scale written

    def compute(self, read: tuple[torch.Tensor, torch.Tensor], r0: int, band: torch.Tensor) -> None:
        """Output rows [r0, r0 + rows) into `band` (rows x N elements) from `read`: the blocks and the
        scales' bytes of the experts from r0's on (whole experts, or the one r0 is in)."""
        k, n, group = self.k, self.n, self.group
        out = band.view(-1, n)
        codes = read[0].view(-1, n, k // 2)
        exponents = read[1].view(-1, n, k // group)  # E8M0 bytes: by bits, never a numeric cast
        if out.shape[0] >= k:  # whole experts
            for i in range(out.shape[0] // k):
                self._decode(codes[i], exponents[i], 0, k, out[i * k : (i + 1) * k])
        else:
            k0 = r0 % k
            self._decode(codes[0], exponents[0], k0, k0 + out.shape[0], out)

    def _decode(self, codes: torch.Tensor, exponents: torch.Tensor, k0: int, k1: int, out: torch.Tensor) -> None:
        """Columns [k0, k1) (whole groups) of one expert's decoded [N, K], written transposed into out."""
        group = self.group
        decoded = scratch("expert decoded", (1, self.n, k1 - k0), self.out_dtype)  # before its transpose
        part = codes[None, :, k0 // 2 : k1 // 2]
        self.backend.decode_4bit(part, self.values, exponents[None, :, k0 // group : k1 // group], group, decoded)
        out.copy_(decoded[0].T)

    def add_exactness(self, exactness: list[int]) -> None:
        """Dequantized: no FP8 blocks to count."""
