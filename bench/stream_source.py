"""`make bench` with --stream-rate: --stream against download-then-convert, with a throttled local
source standing in for the network (no Hub access here). Each mode is one process, like every variant.

  stream:    fp8conv.convert(..., run=RunOptions(stream=source, evict_input=True)): shards fetched
             one ahead, converted as they arrive, each evicted once written
  then:      every shard fetched first through the same source, then the same conversion (what
             snapshot_download followed by convert does)
  download:  the throttled fetch alone: the floor both modes pay
"""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.support's stand-in

import fp8conv  # every mode pays the same start-up (torch's import) first: the rows differ by overlap only
from fp8conv import ConvertOptions, RunOptions
from tests.support.local_shards import LocalShardSource


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("staging", type=Path)
    parser.add_argument("--rate-mb", type=float, required=True, help="throttle, MB/s (10^6 bytes)")
    parser.add_argument("--mode", choices=("stream", "then", "download"), required=True)
    args = parser.parse_args()
    shutil.rmtree(args.staging, ignore_errors=True)
    source = LocalShardSource(args.src, args.staging, bytes_per_s=args.rate_mb * 1e6)
    shards = sorted(p.name for p in args.src.glob("*.safetensors"))
    if args.mode in ("then", "download"):
        for name in shards:
            source.fetch(name, threading.Event())
    if args.mode != "download":
        fp8conv.convert(
            args.src,
            args.out,
            ConvertOptions(to="bf16"),
            run=RunOptions(stream=source, evict_input=True, overwrite=True),
        )
    shutil.rmtree(args.staging, ignore_errors=True)


if __name__ == "__main__":
    main()
