"""Build a tiny DeepSeek-V3-like block-FP8 checkpoint (the same factory the tests use, tests/synthetic.py;
it needs the test extras: pip install -e '.[test]').

python examples/make_tiny_checkpoint.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for tests.support.synthetic

from tests.support.synthetic import build_tiny_deepseek


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: make_tiny_checkpoint.py OUT_DIR")
    ckpt = build_tiny_deepseek(sys.argv[1])
    print(f"wrote {ckpt.path}: {len(ckpt.shards)} shards, {len(ckpt.fp8_weights)} block-FP8 weights")


if __name__ == "__main__":
    main()
