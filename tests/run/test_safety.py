"""Damaged scales, a full disk and a file-size limit: refused or failed cleanly, nothing complete-looking."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import CheckpointError, OutputError
from fp8conv.options import Tuning
from fp8conv.storage.out_dir import TEMP_SUFFIX
from tests.support.helpers import load_dir


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


@pytest.mark.parametrize("block_option", [[], ["--block-size", "128,128"]])
def test_the_command_a_scale_refusal_names_lists_every_problem(make_tiny, tmp_path, block_option):
    """Convert refuses the first bad scale and names a command that lists them all; running that command
    on the checkpoint lists every one, while plain inspect (headers only) says it has not read them. A
    config without weight_block_size needs convert's --block-size: the command named carries it too."""
    tiny = make_tiny(config_block=None) if block_option else make_tiny()
    bad = {
        "model.layers.0.self_attn.o_proj.weight_scale_inv": 0.0,
        "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv": -0.5,
        "model.layers.1.mlp.shared_experts.up_proj.weight_scale_inv": float("nan"),
    }
    for name, value in bad.items():
        _set_scale_value(tiny, name, value)
    runner = CliRunner()
    convert = ["convert", str(tiny.path), "--to", "bf16", "-o", str(tmp_path / "out"), *block_option]
    refused = runner.invoke(main, convert)
    assert refused.exit_code == 1 and not (tmp_path / "out").exists()
    first = refused.stderr.splitlines()[0]
    advice = re.search(r"\(and 2 more problem\(s\); `(fp8conv [^`]+)` lists them all\)", first)
    assert advice, first
    listed = runner.invoke(main, [*shlex.split(advice.group(1))[1:], str(tiny.path)])
    assert listed.exit_code == 0, listed.output
    assert "problems:      3\n" in listed.stdout
    for name in bad:
        assert sum(f"tensor '{name}'" in line for line in listed.stdout.splitlines()) == 1, listed.stdout
    plain = runner.invoke(main, ["inspect", str(tiny.path), *block_option])
    assert "problems:      none (from the headers; --scales reads the scale tensors too)" in plain.stdout
    as_json = json.loads(runner.invoke(main, ["inspect", "--scales", "--json", str(tiny.path), *block_option]).stdout)
    assert as_json["scales_read"] and len(as_json["problems"]) == 3


def test_a_plan_refusal_lists_every_problem_where_its_message_says(tiny, tmp_path):
    """A plan's problems depend on convert's options, so no inspect lists them: the one-line refusal says
    FP8CONV_DEBUG=1 lists them, and with it the CLI prints every one."""
    config = json.loads((tiny.path / "config.json").read_text())
    config["intermediate_size"] += 128  # the dense MLP's three weights now disagree with config.json
    (tiny.path / "config.json").write_text(json.dumps(config))
    convert = ["convert", str(tiny.path), "--to", "bf16", "-o", str(tmp_path / "out")]
    refused = CliRunner().invoke(main, convert)
    lines = refused.stderr.strip().splitlines()
    assert refused.exit_code == 1 and len(lines) == 2, refused.stderr  # the refusal, the debug hint
    advice = re.search(r"\(and 2 more problem\(s\); set (\w+)=(\w+) to list them all\)", lines[0])
    assert advice, lines[0]
    listed = CliRunner().invoke(main, convert, env={advice[1]: advice[2]})
    errors = [line for line in listed.stderr.splitlines() if line.startswith("error: ")]
    assert listed.exit_code == 1 and len(errors) == 3 and errors[0] == lines[0], listed.stderr
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert sum(f"model.layers.0.mlp.{proj}.weight" in e for e in errors) == 1, errors
    assert not (tmp_path / "out").exists()


def test_not_enough_space_is_refused_with_both_numbers(tiny, tmp_path, monkeypatch):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OutputError, match=r"needs \d+ bytes .* has 1000 bytes") as info:
        fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert "--no-space-check" in str(info.value) and not (tmp_path / "out").exists()
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(space_check=False))


FSIZE_LIMITED = """
import json, resource, signal, sys
from fp8conv.cli.commands import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
# small bands: the tiny weights stream in bands, writes in flight
tuning = json.dumps({"convert_band_elements": int(sys.argv[4])})
sys.argv = ["fp8conv", "convert", sys.argv[1], "--to", sys.argv[3], "-o", sys.argv[2], "--tuning", tuning]
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


@pytest.mark.parametrize("band_elements", [1 << 22, 3000])
def test_an_error_in_the_arithmetic_cancels_the_run_cleanly(tiny, tmp_path, monkeypatch, band_elements):
    """A failure on a compute thread (banded) or the main one (whole) mid-shard: it is what convert()
    raises, the reads and writes in flight are drained, and no partial shard or index is left."""
    from fp8conv.backends.cpu import CpuBackend

    bands = fp8conv.RunOptions(tuning=Tuning(convert_band_elements=band_elements))
    real = CpuBackend.dequantize_blocks
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("arithmetic failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuBackend, "dequantize_blocks", failing)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="arithmetic failed"):
        fp8conv.convert(tiny.path, out, fp8conv.ConvertOptions(to="bf16"), run=bands)
    assert len(calls) >= 5
    assert not list(out.glob(f".*{TEMP_SUFFIX}")) and not (out / "model.safetensors.index.json").exists()
    monkeypatch.setattr(CpuBackend, "dequantize_blocks", real)
    # nothing left running holds the output
    fp8conv.convert(tiny.path, out, fp8conv.ConvertOptions(to="bf16"), run=replace(bands, overwrite=True))
