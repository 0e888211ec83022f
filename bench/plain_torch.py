"""The plain way people write this conversion: safe_open each shard, dequantize with float32
temporaries and repeat_interleave'd scales, save_file. The baseline fp8conv must beat by 5x.

    python bench/plain_torch.py INPUT_DIR OUTPUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    dst.mkdir(parents=True, exist_ok=True)
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(shard, "pt") as f:
            names = list(f.keys())
            for name in names:
                if name.endswith("_scale_inv"):
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    s = f.get_tensor(name + "_scale_inv")
                    n, k = t.shape
                    full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
                    out[name] = (t.float() * full).to(torch.bfloat16)
                else:
                    out[name] = t
        save_file(out, str(dst / shard.name), metadata={"format": "pt"})


if __name__ == "__main__":
    main()
