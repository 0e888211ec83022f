"""fp8conv: convert block-FP8 LLM checkpoints into what other hardware and engines can run."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .check.inspect_report import InspectReport, inspect
from .errors import CheckpointError, Fp8ConvError, OptionsError, OutputError, PlanRefused
from .model.classify import Kind
from .options import ConvertOptions, RunOptions
from .output.finish import FinalizeResult, finalize
from .version import __version__

if TYPE_CHECKING:
    from .check.audit.audit import AuditResult, audit
    from .check.verify import VerifyResult, verify
    from .run.convert import ConvertResult, convert

# convert and verify import torch; loaded on first use so that `import fp8conv`, inspect and --help do not.
_LAZY = {
    "AuditResult": "check.audit.audit",
    "audit": "check.audit.audit",
    "ConvertResult": "run.convert",
    "convert": "run.convert",
    "VerifyResult": "check.verify",
    "verify": "check.verify",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AuditResult",
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
    "audit",
    "convert",
    "finalize",
    "inspect",
    "verify",
]
