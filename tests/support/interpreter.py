"""Shared by several test modules (carried out of tests/run/test_startup.py)."""

from __future__ import annotations

import subprocess
import sys

NO_TORCH = "\nassert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"


def run_fresh_interpreter(code: str) -> None:
    """Run `code`, then the no-torch check, in a new interpreter; its failure output is the assertion's."""
    done = subprocess.run([sys.executable, "-c", "import sys\n" + code + NO_TORCH], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
