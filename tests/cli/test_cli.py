"""The CLI: one-line errors with exit 1, usage errors exit 2, progress only on a terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from tests.support.helpers import load_dir


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_inspect_text(runner, tiny):
    result = runner.invoke(main, ["inspect", str(tiny.path)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "format:        block-fp8" in out
    assert "128x128 (from config.json)" in out
    assert "block-fp8 48, unquantized 25" in out
    assert "MTP layers:    2 (num_hidden_layers = 2)" in out
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight [576, 320] -> grid [5, 3]" in out
    assert "problems:      none" in out
    assert "... and 33 more (--json lists them all)" in out


def test_inspect_json(runner, tiny):
    result = runner.invoke(main, ["inspect", str(tiny.path), "--json"])
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["format"] == "block-fp8" and doc["block_size"] == [128, 128]
    assert doc["estimated_output_bytes"]["bf16"] > doc["total_bytes"]


def test_inspect_lists_problems_instead_of_failing(runner, make_tiny):
    ckpt = make_tiny(config_block=None)
    result = runner.invoke(main, ["inspect", str(ckpt.path), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 0 and doc["format"] == "unverified" and len(doc["problems"]) == 48


def test_convert_then_summary(runner, tiny, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(main, ["convert", str(tiny.path), "--to", "bf16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "48 tensor(s) converted, 25 copied" in result.stdout
    assert "converting" not in result.stderr  # not a terminal: no progress bar
    assert len(load_dir(out)) == 73


def test_a_file_left_out_is_named_on_stderr_by_the_run_and_by_its_dry_run(runner, tiny, tmp_path):
    (tiny.path / "pytorch_model.bin").write_bytes(b"not read")
    why = "weights in a pickle format fp8conv does not read"
    args = ["convert", str(tiny.path), "--to", "bf16", "-o", str(tmp_path / "out"), "-q"]
    planned = runner.invoke(main, [*args, "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert f"warning: pytorch_model.bin would not be copied: {why}" in planned.stderr
    done = runner.invoke(main, args)
    assert done.exit_code == 0, done.output
    assert f"warning: pytorch_model.bin was not copied: {why}" in done.stderr  # under -q too
    assert not (tmp_path / "out" / "pytorch_model.bin").exists()


def test_refusal_is_one_line_exit_1(runner, make_tiny, tmp_path):
    ckpt = make_tiny(config_block=None)
    result = runner.invoke(main, ["convert", str(ckpt.path), "--to", "bf16", "-o", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("error: tensor 'model.")
    assert "--block-size 128,128" in lines[0] and "Traceback" not in result.stderr
    assert lines[1] == "(set FP8CONV_DEBUG=1 for the full traceback)"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{tmp}/nowhere"],
        ["convert", "{tmp}/nowhere", "--to", "bf16", "-o", "{tmp}/o"],
        ["convert", "{ckpt}", "--to", "bf16", "-o", "{tmp}/full", "-j", "2"],
        ["verify", "{ckpt}", "{tmp}/nowhere"],
        ["finalize", "{tmp}/full"],
    ],
    ids=["inspect", "convert", "convert-j", "verify", "finalize"],
)
def test_every_command_refuses_in_one_line(runner, tiny, tmp_path, args):
    """Every command's Fp8ConvError ends the same way: one 'error:' line, the debug hint, exit 1."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "stray").write_text("x")
    argv = [a.format(tmp=tmp_path, ckpt=tiny.path) for a in args]
    result = runner.invoke(main, argv)
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and " — " in lines[0], result.stderr
    assert lines[1] == "(set FP8CONV_DEBUG=1 for the full traceback)"


def test_debug_env_shows_traceback(runner, make_tiny, tmp_path):
    ckpt = make_tiny(config_block=None)
    result = runner.invoke(
        main,
        ["convert", str(ckpt.path), "--to", "bf16", "-o", str(tmp_path / "o")],
        env={"FP8CONV_DEBUG": "1"},
    )
    assert result.exit_code == 1 and "Traceback" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["convert", "X", "-o", "Y"],  # --to missing
        ["convert", "X", "--to", "fp4", "-o", "Y"],
        ["convert", "X", "--to", "bf16", "-o", "Y", "--block-size", "128"],
        ["convert", "X", "--to", "bf16", "-o", "Y", "--block-size", "0,128"],
        ["frobnicate"],
    ],
)
def test_usage_errors_exit_2(runner, args):
    assert runner.invoke(main, args).exit_code == 2


def test_block_size_option_reaches_the_classifier(runner, make_tiny, tmp_path):
    ckpt = make_tiny(config_block=None)
    args = [
        "convert",
        str(ckpt.path),
        "--to",
        "bf16",
        "-o",
        str(tmp_path / "out"),
        "--block-size",
        "128x128",
        "-q",
    ]
    result = runner.invoke(main, args)
    assert result.exit_code == 0 and result.stdout == ""


def test_real_subprocess(tiny, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "fp8conv", "convert", str(tiny.path), "--to", "bf16", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (out / "config.json").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 1
    assert again.stderr.startswith("error: output directory") and "--overwrite" in again.stderr


def test_progress_bar_on_a_terminal(tiny, tmp_path):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real terminal's size
    cmd = [
        sys.executable,
        "-m",
        "fp8conv",
        "convert",
        str(tiny.path),
        "--to",
        "bf16",
        "-o",
        str(tmp_path / "o"),
    ]
    proc = subprocess.Popen(cmd, stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO once the child has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(leader)
    screen = b"".join(chunks).decode(errors="replace")
    assert "converting" in screen and "100%" in screen and "B/s" in screen


def test_library_progress_callback(tiny, tmp_path):
    seen = []
    result = fp8conv.convert(
        tiny.path,
        tmp_path / "o",
        ConvertOptions(to="bf16"),
        run=RunOptions(progress=lambda done, total: seen.append((done, total))),
    )
    assert seen[-1] == (result.bytes_written, result.bytes_written)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_python_api_example_runs(tiny, tmp_path):
    example = Path(__file__).parents[2] / "examples" / "convert_with_python.py"
    done = subprocess.run(
        [sys.executable, str(example), str(tiny.path), str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "block-fp8, block size [128, 128], 0 problem(s)" in done.stdout
    assert "48 tensors converted" in done.stdout and "verify: ok" in done.stdout


def test_gaudi2_target_and_conflicting_range(runner, tiny, tmp_path):
    out = tmp_path / "g2"
    result = runner.invoke(main, ["convert", str(tiny.path), "--to", "channel", "--target", "gaudi2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["fp8_dtype_flavor"] == "float8_e4m3fnuz"
    args = ["convert", str(tiny.path), "--to", "channel", "--target", "gaudi2", "--fp8-max", "448", "-o", "x"]
    conflict = runner.invoke(main, args)
    assert conflict.exit_code == 2 and "--target gaudi2 means --fp8-max 240" in conflict.stderr
    wrong_target = runner.invoke(main, ["convert", str(tiny.path), "--to", "block", "--fp8-max", "240", "-o", "y"])
    assert wrong_target.exit_code == 2 and "applies to --to channel only" in wrong_target.stderr


def test_pad_for_tp_from_the_cli(runner, tiny, tmp_path):
    out = tmp_path / "padded"
    args = ["convert", str(tiny.path), "--to", "block", "--pad-for-tp", "8", "-o", str(out)]
    assert runner.invoke(main, args).exit_code == 0
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == 1024
    shown = runner.invoke(main, ["inspect", str(tiny.path)]).stdout
    assert "TP=4   not divisible: dense intermediate_size 448 -> 112/rank" in shown
    assert "TP=8   ok" in runner.invoke(main, ["inspect", str(out)]).stdout


def test_pad_roles_from_the_cli(runner, tiny, tmp_path):
    out = tmp_path / "padded"
    args = ["convert", str(tiny.path), "--to", "block", "--pad-for-tp", "4", "-o", str(out), "-q"]
    dense = runner.invoke(main, [*args, "--pad-roles", "dense"])
    assert dense.exit_code == 0
    # the shared experts share moe_intermediate_size with the routed ones, left 48 rows per rank: said
    assert "--pad-roles dense leaves the shared MLP (moe_intermediate_size * n_shared_experts 192" in dense.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["intermediate_size"] == 512 and config["moe_intermediate_size"] == 192  # routed left alone
    unknown = runner.invoke(main, [*args, "--pad-roles", "dense,experts", "--overwrite"])
    assert unknown.exit_code == 2 and "--pad-roles experts is not a list of dense, shared, routed" in unknown.stderr
    alone = runner.invoke(main, ["convert", str(tiny.path), "--to", "block", "--pad-roles", "dense", "-o", "x"])
    assert alone.exit_code == 2 and "--pad-roles applies with --pad-for-tp only" in alone.stderr
    coupled = runner.invoke(main, [*args, "--pad-roles", "shared", "--overwrite"])
    assert coupled.exit_code == 1 and "add routed to --pad-roles" in coupled.stderr
    shown = runner.invoke(main, ["inspect", str(tiny.path)]).stdout
    assert "--pad-for-tp 4 --pad-roles dense,shared,routed: --to block ~" in shown
    assert "--pad-for-tp 4 --pad-roles dense: --to block ~" not in shown  # it leaves the shared experts so


def test_tuning_is_hidden_and_a_bad_one_is_a_usage_error(runner, tiny, tmp_path):
    """--tuning (how the work is cut, for tests) is not in --help; what it cannot use exits 2, nothing written."""
    assert "--tuning" not in runner.invoke(main, ["convert", "--help"]).stdout
    args = ["convert", str(tiny.path), "--to", "bf16", "-o", str(tmp_path / "out"), "-q", "--tuning"]
    for text, message in [
        ("{band", "--tuning is not JSON"),
        ("[1]", "--tuning is not a JSON object"),
        ('{"band": 1}', "unknown tuning value(s) band"),
        ('{"segment_bytes": 100}', "tuning segment_bytes 100 is not a positive multiple of 4096"),
    ]:
        refused = runner.invoke(main, [*args, text])
        assert refused.exit_code == 2 and message in refused.stderr, refused.stderr
    assert not (tmp_path / "out").exists()
