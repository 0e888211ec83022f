"""fp8conv: convert block-FP8 LLM checkpoints into what other hardware and engines can run."""

from .errors import CheckpointError, Fp8ConvError, OptionsError, OutputError, PlanRefused
from .formats import Kind
from .pipeline import ConvertResult, convert
from .report import InspectReport, inspect

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConvertResult",
    "Fp8ConvError",
    "InspectReport",
    "Kind",
    "OptionsError",
    "OutputError",
    "PlanRefused",
    "__version__",
    "convert",
    "inspect",
]
