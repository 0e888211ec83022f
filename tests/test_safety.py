"""Damaged scales, a full disk and a file-size limit: refused or failed cleanly, nothing complete-looking."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.errors import CheckpointError, OutputError
from fp8conv.writer import TEMP_SUFFIX

from .helpers import load_dir


def _set_scale_value(ckpt, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt.path / "model.safetensors.index.json").read_text())
    shard = ckpt.path / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    tensors[name][1, 0] = value
    save_file(tensors, str(shard))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_scale_is_refused_by_name_unless_allowed(tiny, tmp_path, value):
    name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    _set_scale_value(tiny, name, value)
    with pytest.raises(CheckpointError, match="NaN/Inf") as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert name in str(info.value) and "--allow-nonfinite" in str(info.value)
    assert not (tmp_path / "out").exists()
    result = fp8conv.convert(
        tiny.path, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(allow_nonfinite=True)
    )
    assert any(name in w for w in result.warnings)
    weight = load_dir(tmp_path / "out")[name.removesuffix("_scale_inv")]
    assert not torch.isfinite(weight[128:256, :128].float()).all()


@pytest.mark.parametrize("value", [0.0, -0.5])
def test_zero_or_negative_scale_is_refused(tiny, tmp_path, value):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _set_scale_value(tiny, name, value)
    with pytest.raises(CheckpointError, match="zero or negative") as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="channel"), run=RunOptions(allow_nonfinite=True))
    assert name in str(info.value) and not (tmp_path / "out").exists()


def test_not_enough_space_is_refused_with_both_numbers(tiny, tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OutputError, match=r"needs \d+ bytes .* has 1000 bytes") as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert "--no-space-check" in str(info.value) and not (tmp_path / "out").exists()
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(space_check=False))


FSIZE_LIMITED = """
import resource, signal, sys
import fp8conv.stream
from fp8conv.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
fp8conv.stream.BAND_ELEMENTS = int(sys.argv[4])  # small: the tiny weights stream in bands, writes in flight
sys.argv = ["fp8conv", "convert", sys.argv[1], "--to", sys.argv[3], "-o", sys.argv[2]]
main()
"""


@pytest.mark.parametrize("to", ["bf16", "channel"])
@pytest.mark.parametrize("band_elements", [1 << 22, 4096])
def test_a_failing_write_ends_cleanly(tiny, tmp_path, to, band_elements):
    """The first shard outgrows a 1 MiB file-size limit: one clear line, exit 1, no partial file, no index;
    also when the failing write is a band still in flight behind the arithmetic."""
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_LIMITED, str(tiny.path), str(out), to, str(band_elements)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith("error: ") and "writing failed: File too large" in first and "Traceback" not in done.stderr
    assert not list(out.glob(f"*{TEMP_SUFFIX}")) and not list(out.glob(f".*{TEMP_SUFFIX}"))
    assert not (out / "model.safetensors.index.json").exists() and not (out / "config.json").exists()
