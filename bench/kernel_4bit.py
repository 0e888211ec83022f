"""Single-thread throughput of the CPU backend's packed 4-bit decode, in ns per output value, on one band
(4M values, DeepSeek-V4 expert rows: K = 4096) written into a reused buffer, as the band workers do.
CPU time of this thread (time.thread_time), best of several passes: other processes on the machine move
it less than wall time. Also checks the bytes against the reference backend's.

    python bench/kernel_4bit.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fp8conv.backends import get_backend
from fp8conv.model.classify import Kind
from fp8conv.rewrite.unpack import code_values

ROWS, K = 1024, 4096
PASSES, REPEATS = 7, 5


# name -> (kind, global scale, divided by it?): NVFP4 as compressed-tensors (/ weight_global_scale) and
# ModelOpt (* weight_scale_2) store it, and without one
CASES = {
    "mxfp4": (Kind.MXFP4, None, False),
    "nvfp4": (Kind.NVFP4, None, False),
    "nvfp4 / weight_global_scale": (Kind.NVFP4, 2688.0, True),
    "nvfp4 * weight_scale_2": (Kind.NVFP4_MODELOPT, 1 / 2688.0, False),
    "int4-pack-quantized": (Kind.INT4, None, False),
}


def inputs(kind: Kind, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """codes [1, ROWS, K/2], scale as unpack hands it over, group."""
    codes = torch.randint(0, 256, (1, ROWS, K // 2), generator=gen, dtype=torch.uint8)
    if kind is Kind.MXFP4:  # E8M0 bytes around 2^-10, as real experts
        return codes, torch.randint(112, 122, (1, ROWS, K // 32), generator=gen, dtype=torch.uint8), 32
    if kind in (Kind.NVFP4, Kind.NVFP4_MODELOPT):  # e4m3 group scales, as stored
        return codes, (torch.rand(1, ROWS, K // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn), 16
    return codes, (torch.rand(1, ROWS, K // 32, generator=gen) * 1e-2).to(torch.bfloat16).to(torch.float32), 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu, reference = get_backend("cpu"), get_backend("reference")
    report: dict[str, dict[str, object]] = {}
    for name, (kind, global_value, divide) in CASES.items():
        codes, scale, group = inputs(kind, torch.Generator().manual_seed(0))
        values = code_values(kind)
        g = None if global_value is None else torch.tensor(global_value, dtype=torch.float32)
        out = torch.empty(1, ROWS, K, dtype=torch.bfloat16)
        cpu.decode_4bit(codes, values, scale, group, out, g, divide)  # warms the tables and scratch buffers
        best = float("inf")
        for _ in range(PASSES):
            start = time.thread_time()
            for _ in range(REPEATS):
                cpu.decode_4bit(codes, values, scale, group, out, g, divide)
            best = min(best, (time.thread_time() - start) / REPEATS)
        ref = torch.empty_like(out)
        reference.decode_4bit(codes, values, scale, group, ref, g, divide)
        same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
        report[name] = {"ns_per_value": round(best / out.numel() * 1e9, 3), "bit_identical_to_reference": same}
        print(f"{name:28s} -> bf16 {report[name]}")
    if args.json:
        args.json.write_text(json.dumps({"rows": ROWS, "k": K, "results": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
