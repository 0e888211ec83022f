"""compressed-tensors' own converter with its FP8 block dequantizer, on one CPU worker.

python bench/ct_convert.py INPUT_DIR OUTPUT_DIR
"""

from __future__ import annotations

import sys

import torch
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    converter = FP8BlockDequantizer.from_pretrained(src, dtype=torch.bfloat16)
    convert_checkpoint(src, dst, converter, max_workers=1, device="cpu")


if __name__ == "__main__":
    main()
