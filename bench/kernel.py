"""Kernel throughput of every backend present, in process, on DeepSeek-V3 shapes: dequantize to bf16
and requantize to channel FP8, in the 4M-element row bands the converter streams. For a device
backend the time includes moving the band to the device and the result back, as a conversion pays it.
Also checks every backend's bytes against the reference backend's on the same bands.

    python bench/kernel.py [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fp8conv.backends import available_devices, get_backend

SHAPES = [(18432, 7168), (7168, 18432), (2048, 7168), (576, 7168), (32768, 512)]
BAND_ELEMENTS = 1 << 22
REPEATS = 5


def bands(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One band of whole 128-row blocks per shape: random finite e4m3 codes, float32 block scales."""
    out = []
    for n, k in SHAPES:
        rows = min(n, max(128, BAND_ELEMENTS // k // 128 * 128))
        codes = torch.randint(0, 0x7E, (1, rows, k), generator=gen, dtype=torch.uint8)
        codes |= torch.randint(0, 2, (1, rows, k), generator=gen, dtype=torch.uint8) << 7
        scale = torch.rand(1, math.ceil(rows / 128), math.ceil(k / 128), generator=gen) * 1e-3 + 1e-4
        out.append((codes.view(torch.float8_e4m3fn), scale))
    return out


def run(device: str, work: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, object]:
    backend = get_backend(device)
    results: dict[str, object] = {}
    outputs: dict[str, list[torch.Tensor]] = {"bf16": [], "channel": []}
    for target in ("bf16", "channel"):
        elements, seconds = 0, 0.0
        for rep in range(REPEATS + 1):  # the first pass warms buffers (and the device) and is not timed
            start = time.perf_counter()
            for w, s in work:
                _, rows, k = w.shape
                if target == "bf16":
                    out = torch.empty(1, rows, k, dtype=torch.bfloat16)
                    backend.dequantize_blocks(w, s, (128, 128), out)
                    result = [out]
                else:
                    q = torch.empty(1, rows, k, dtype=torch.float8_e4m3fn)
                    qs = torch.empty(1, rows, 1)
                    backend.requantize_blocks(w, s, (128, 128), (1, k), 448.0, q, qs)
                    result = [q, qs]
                if rep == 0:
                    outputs[target].append(torch.cat([t.reshape(-1).view(torch.uint8) for t in result]))
            if device == "cuda":
                torch.cuda.synchronize()
            if rep:
                seconds += time.perf_counter() - start
                elements += sum(w.numel() for w, _ in work)
        results[f"{target}_g_elements_per_s"] = round(elements / seconds / 1e9, 3)
    results["outputs"] = outputs
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CLI uses cores - 1)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = bands(torch.Generator().manual_seed(0))
    report: dict[str, dict[str, object]] = {}
    reference = run("reference", work)
    for device in available_devices():
        r = reference if device == "reference" else run(device, work)
        same = all(
            torch.equal(a, b)
            for target in ("bf16", "channel")
            for a, b in zip(r["outputs"][target], reference["outputs"][target], strict=True)  # type: ignore[index]
        )
        report[device] = {k: v for k, v in r.items() if k != "outputs"} | {"bit_identical_to_reference": same}
        print(f"{device:10s} {report[device]}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "backends": report}, indent=2) + "\n")


if __name__ == "__main__":
    main()
