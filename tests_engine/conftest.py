"""The engine tests: fp8conv's outputs served by vLLM's CPU build, run by `make engine-test` (not by
`make test`: the main suite's testpaths is tests/). vLLM lives in its own venv (.venv-engine) and runs in
one subprocess per model, driven by vllm_worker.py; fp8conv and transformers run here, in .venv."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from .models import KINDS, build_fp8

ROOT = Path(__file__).resolve().parent.parent
ENGINE_PYTHON = Path(os.environ.get("FP8CONV_ENGINE_PYTHON", ROOT / ".venv-engine" / "bin" / "python"))
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
WORKER_TIMEOUT_S = 1200  # the load worker builds 7 models x 3 ranks: over 600 s on a busy 2-core host

TIMINGS: list[tuple[str, float]] = []
VERDICTS: list[str] = []  # what each test saw, shown after the run (what was computed, what only loaded)


@dataclass
class Converted:
    fp8: Path  # the published block FP8 layout, built by models.py
    bf16: Path
    channel: Path
    block: Path  # --to block, unpadded
    block_tp2: Path  # --to block --pad-for-tp 2
    int8: Path  # --to int8 (compressed-tensors W8A8)


def fp8conv_cli(*args: str) -> None:
    """The CLI as users run it."""
    proc = subprocess.run([sys.executable, "-m", "fp8conv", *args, "-q"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> dict[str, Converted]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for kind in KINDS:
        fp8 = build_fp8(kind, root)
        c = Converted(fp8, *(root / f"{kind}-{t}" for t in ("bf16", "channel", "block", "block-tp2", "int8")))
        fp8conv_cli("convert", str(fp8), "--to", "bf16", "-o", str(c.bf16))
        fp8conv_cli("convert", str(fp8), "--to", "channel", "-o", str(c.channel))
        fp8conv_cli("convert", str(fp8), "--to", "block", "-o", str(c.block))
        fp8conv_cli("convert", str(fp8), "--to", "block", "--pad-for-tp", "2", "-o", str(c.block_tp2))
        fp8conv_cli("convert", str(fp8), "--to", "int8", "-o", str(c.int8))
        out[kind] = c
    return out


def run_worker(label: str, *args: str) -> subprocess.CompletedProcess:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} missing: `make engine-test` creates .venv-engine with vLLM's CPU build")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(ENGINE_PYTHON), str(WORKER), *args], capture_output=True, text=True, timeout=WORKER_TIMEOUT_S
    )
    TIMINGS.append((label, time.perf_counter() - t0))
    return proc


def worker_json(label: str, *args: str, out: Path) -> dict:
    proc = run_worker(label, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


def pytest_terminal_summary(terminalreporter):
    if VERDICTS:
        terminalreporter.section("vLLM on fp8conv's outputs")
        for line in VERDICTS:
            terminalreporter.write_line(line)
    if TIMINGS:
        terminalreporter.section("vLLM processes (wall seconds, import included)")
        for label, seconds in TIMINGS:
            terminalreporter.write_line(f"{seconds:7.1f} s  {label}")
