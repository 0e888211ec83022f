"""bench/plan_scale.py loaded as a module: its release layouts and header-only writer build the tests'
checkpoints too (bench/ is no package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench" / "plan_scale.py"


def plan_scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plan_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
