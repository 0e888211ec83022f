"""Helpers shared by the tests: read outputs with safetensors itself, write broken files on purpose."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every top-level shard, read with safetensors itself."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            assert name not in tensors, name
            tensors[name] = t
    return tensors


# A conversion in a process of its own, which prints its peak RSS. VmHWM, not ru_maxrss: Linux carries
# ru_maxrss over from the parent across exec (here, pytest's own peak after building the input), while
# VmHWM belongs to the new process image alone.
_PEAK_RSS_SCRIPT = """
import json, sys
import fp8conv
from fp8conv.options import Tuning
args = json.loads(sys.argv[1])
tuning = Tuning() if args["band_elements"] is None else Tuning(convert_band_elements=args["band_elements"])
run = fp8conv.RunOptions(max_memory=args["max_memory"], tuning=tuning)
fp8conv.convert(args["src"], args["out"], fp8conv.ConvertOptions(to=args["to"]), run=run)
status = open("/proc/self/status").read()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""


def peak_rss_kib(src: Path, out: Path, to: str, max_memory: int | None = None, band_elements: int | None = None) -> int:
    """Convert `src` into `out` in a fresh process (`--max-memory`, and bands of `band_elements` when given):
    its peak RSS in KiB. The mmap threshold is fixed: glibc's dynamic one (up to 32 MiB) keeps freed
    16 MiB buffers in the heap now and then, which measures the allocator's mood rather than what fp8conv
    holds on to."""
    args = {"src": str(src), "out": str(out), "to": to, "max_memory": max_memory, "band_elements": band_elements}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_SCRIPT, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)},
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def write_raw_safetensors(path: Path, header: dict, data: bytes, header_len: int | None = None) -> None:
    """Write a safetensors file byte by byte, to make broken ones on purpose."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def dir_snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None, shards: int = 1) -> Path:
    """A small hand-made checkpoint: tensors dealt round-robin over `shards` files, with an index."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {n: names[i % shards] for i, n in enumerate(tensors)}
    for fname in names:
        save_file({n: t for n, t in tensors.items() if weight_map[n] == fname}, str(path / fname))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def fp8(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)


def fp8_block_config(block: list[int] | None = (128, 128)) -> dict:
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = list(block)
    return {"model_type": "deepseek_v3", "torch_dtype": "bfloat16", "quantization_config": qc}


def direct_io_works(folder) -> bool:
    """Whether this filesystem takes O_DIRECT, probed independently of fp8conv."""
    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()
