"""Power-of-two (UE8M0) scales, measured side by side on the same tensors: fp8conv's --to block
--scale-fmt ue8m0 against vLLM's load-time requantization, and the throughput of both E8M0 targets.

vLLM's path (fp8_utils.requant_weight_ue8m0_inplace: dequantize in float32, then DeepGEMM's
per_block_cast_to_fp8(use_ue8m0=True)) is re-implemented here from its definition, in plain torch:
per 128x128 block, sf = 2^ceil(log2(max(amax, 1e-4) / 448)) and q = (x * (1 / sf)) cast to e4m3.
Inputs: DeepSeek-like shapes, heavy-tailed bf16 "masters", and their block FP8 made DeepSeek's way
(float32 scale = block amax / 448). Errors are relative Frobenius distances from the input's own values:
from the FP8 checkpoint's dequantized float32 values, and from the bf16 master. Standalone it writes
bench/ue8m0.json and bench/ue8m0.md; bench.py adds its table to results.md.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from fp8conv.backends import get_backend
from fp8conv.rewrite.pow2 import quantize_pow2, tensor_error

HERE = Path(__file__).resolve().parent
BLOCK = (128, 128)
# (name, N, K): DeepSeek-V3's shapes with K (and the larger N) cut to fit a small machine's bench
SHAPES = [
    ("q_a_proj", 1536, 1792),
    ("kv_a_proj_with_mqa", 576, 1792),
    ("o_proj", 1792, 1024),
    ("gate_proj (dense)", 2304, 896),
    ("down_proj (expert)", 896, 512),
]


def master(n: int, k: int, seed: int) -> torch.Tensor:
    """A bf16 weight with what real ones have: rows of different scales and heavy tails (Student-t, 4 dof)."""
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, k, generator=gen)
    chi = torch.randn(n, k, 4, generator=gen).square().mean(dim=2)
    row_scale = torch.exp(torch.randn(n, 1, generator=gen) * 0.5) * 0.02
    return (normal / chi.sqrt() * row_scale).to(torch.bfloat16)


def _blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    n, k = x.shape
    gn, gk = math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1])
    padded = torch.zeros(gn * BLOCK[0], gk * BLOCK[1], dtype=torch.float32)
    padded[:n, :k] = x
    return padded.view(gn, BLOCK[0], gk, BLOCK[1]), n, k


def deepseek_block_fp8(w: torch.Tensor) -> torch.Tensor:
    """The FP8 checkpoint's values: block amax / 448 float32 scales, then dequantized in float32."""
    blocks, n, k = _blocks(w.float())
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * scale).view(blocks.shape[0] * BLOCK[0], -1)[:n, :k].contiguous()


def vllm_ue8m0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """per_block_cast_to_fp8(x, use_ue8m0=True) as vLLM runs it at load: (values in float32, exponents)."""
    blocks, n, k = _blocks(x)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    sf = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    q = (blocks * (1.0 / sf)).to(torch.float8_e4m3fn)
    values = (q.float() * sf).view(blocks.shape[0] * BLOCK[0], -1)[:n, :k].contiguous()
    return values, torch.log2(sf).reshape(blocks.shape[0], blocks.shape[2]).to(torch.int32)


def relative(approx: torch.Tensor, truth: torch.Tensor) -> float:
    d = (approx.double() - truth.double()).norm()
    return float(d / truth.double().norm())


def fp8conv_values(x: torch.Tensor, search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q, exps = quantize_pow2(x, BLOCK, search, get_backend("cpu"))
    scale = torch.pow(2.0, exps.double() - 127).float()
    full = scale.repeat_interleave(BLOCK[0], 0)[: x.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : x.shape[1]]
    return q.float() * full, exps.to(torch.int32) - 127


def error_table() -> list[dict]:
    rows = []
    for i, (name, n, k) in enumerate(SHAPES):
        w = master(n, k, seed=i)
        x = deepseek_block_fp8(w)
        master32 = w.float()
        (vllm, vllm_e), (ours, ours_e) = vllm_ue8m0(x), fp8conv_values(x, search=True)
        rows.append(
            {
                "tensor": name,
                "shape": [n, k],
                "from_fp8_vllm": relative(vllm, x),
                "from_fp8_fp8conv": relative(ours, x),
                "blocks_other_exponent": int((vllm_e != ours_e).sum()),
                "blocks": vllm_e.numel(),
                "from_bf16_two_roundings": relative(vllm, master32),
                "from_bf16_fp8conv": relative(fp8conv_values(master32, search=False)[0], master32),
            }
        )
    return rows


def throughput(n: int = 1024, k: int = 3584) -> dict[str, float]:
    """M elements/s on the CPU backend, one thread as bench.py's processes use: the arithmetic and the
    error report of one requantized FP8 weight, per target."""
    x = deepseek_block_fp8(master(n, k, seed=99))
    out = {}
    for target, block in (("block --scale-fmt ue8m0", BLOCK), ("mxfp8", (1, 32))):
        started = time.perf_counter()
        backend = get_backend("cpu")
        q, exps = quantize_pow2(x, block, True, backend)
        tensor_error(x, q, exps, block, backend)
        out[target] = x.numel() / (time.perf_counter() - started) / 1e6
    return out


def measure() -> dict:
    rows = error_table()
    total = sum(r["shape"][0] * r["shape"][1] for r in rows)

    def mean(key: str) -> float:
        return sum(r[key] * r["shape"][0] * r["shape"][1] for r in rows) / total

    return {
        "rows": rows,
        "mean": {key: mean(key) for key in rows[0] if key.startswith("from_")},
        "aggregate_lower": mean("from_fp8_fp8conv") < mean("from_fp8_vllm"),
        "never_worse": all(r["from_fp8_fp8conv"] <= r["from_fp8_vllm"] for r in rows),
        "throughput_melem_s": throughput(),
    }


def markdown(doc: dict | None) -> str:
    if not doc:
        return ""
    lines = [
        "## Power-of-two (UE8M0) scales: fp8conv against vLLM's load-time requantization",
        "",
        "Relative Frobenius error. From FP8: against the block FP8 checkpoint's own values (vLLM requantizes at",
        "every load with the ceiling exponent; fp8conv once, each block's exponent of least squared error). From",
        "bf16: against the master weights (block FP8 then vLLM's requantization: two roundings; fp8conv: one).",
        "",
        "| tensor | shape | from FP8: vLLM | from FP8: fp8conv | blocks given another exponent "
        "| from bf16: FP8 + vLLM | from bf16: fp8conv |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['tensor']} | {r['shape'][0]}x{r['shape'][1]} | {r['from_fp8_vllm']:.6%} | "
            f"{r['from_fp8_fp8conv']:.6%} | {r['blocks_other_exponent']} of {r['blocks']} | "
            f"{r['from_bf16_two_roundings']:.4%} | {r['from_bf16_fp8conv']:.4%} |"
        )
    m = doc["mean"]
    lines.append(
        f"| mean (by elements) | | {m['from_fp8_vllm']:.6%} | {m['from_fp8_fp8conv']:.6%} | | "
        f"{m['from_bf16_two_roundings']:.4%} | {m['from_bf16_fp8conv']:.4%} |"
    )
    lines += [
        "",
        f"fp8conv never worse than vLLM on any tensor: {'yes' if doc['never_worse'] else 'NO'}. With power-of-two",
        "scales e4m3's rounding is the same relative rounding at every exponent: the exponent only decides which",
        "values saturate and which fall below e4m3's normal range, so from FP8 the two differ only in the few",
        "blocks where trading a saturated value for finer small ones lowers the squared error.",
        "",
    ]
    lines.append(
        "Throughput (CPU backend, one thread, requantizing FP8 with the exponent search and the error report): "
        + ", ".join(f"--to {t}: {v:.1f} M elements/s" for t, v in doc["throughput_melem_s"].items())
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    doc = measure()
    (HERE / "ue8m0.json").write_text(json.dumps(doc, indent=2) + "\n")
    (HERE / "ue8m0.md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
