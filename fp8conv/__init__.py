"""fp8conv: convert block-FP8 LLM checkpoints into what other hardware and engines can run."""

from .errors import CheckpointError, Fp8ConvError, OptionsError, OutputError, PlanRefused
from .formats import Kind
from .parts import FinalizeResult, finalize
from .pipeline import ConvertResult, convert
from .plan import ConvertOptions
from .report import InspectReport, inspect
from .verify import VerifyResult, verify
from .version import __version__

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
    "VerifyResult",
    "__version__",
    "convert",
    "finalize",
    "inspect",
    "verify",
]
