"""fp8conv: convert block-FP8 LLM checkpoints into what other hardware and engines can run."""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import CheckpointError, Fp8ConvError, OptionsError, OutputError, PlanRefused
from .formats import Kind
from .options import ConvertOptions, RunOptions
from .parts import FinalizeResult, finalize
from .report import InspectReport, inspect
from .version import __version__

if TYPE_CHECKING:
    from .pipeline import ConvertResult, convert
    from .verify import VerifyResult, verify

# convert and verify import torch; loaded on first use so that `import fp8conv`, inspect and --help do not.
_LAZY = {"ConvertResult": "pipeline", "convert": "pipeline", "VerifyResult": "verify", "verify": "verify"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # Importing the submodule fp8conv.verify binds it on the package; the name stays the function.
        if name == "verify" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "CheckpointError",
    "ConvertOptions",
    "ConvertResult",
    "FinalizeResult",
    "Fp8ConvError",
    "InspectReport",
    "Kind",
    "OptionsError",
    "OutputError",
    "PlanRefused",
    "RunOptions",
    "VerifyResult",
    "__version__",
    "convert",
    "finalize",
    "inspect",
    "verify",
]
