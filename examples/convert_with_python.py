"""The library API: inspect, then convert, without the CLI. The library never prints or exits.

python examples/convert_with_python.py CHECKPOINT OUT_DIR
"""

from __future__ import annotations

import sys

import fp8conv
from fp8conv import ConvertOptions


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit("usage: convert_with_python.py CHECKPOINT OUT_DIR")
    source, output = sys.argv[1], sys.argv[2]
    report = fp8conv.inspect(source)
    print(f"{source}: {report.format}, block size {report.block_size}, {len(report.problems)} problem(s)")
    try:
        result = fp8conv.convert(source, output, ConvertOptions(to="bf16"))
    except fp8conv.Fp8ConvError as exc:
        sys.exit(f"refused: {exc}")
    print(f"{result.tensors_converted} tensors converted into {result.output} in {result.seconds:.2f} s")
    checked = fp8conv.verify(source, output, sample=0.5)
    print(f"verify: {'ok' if checked.ok else checked.failures}")


if __name__ == "__main__":
    main()
