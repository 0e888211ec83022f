"""An input's quantization config as one neutral description (QuantSettings), filled by the reader of its
dialect (fp8conv.model.dialects): what the classifier, the plans and inspect read, whatever the dialect."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..source.config import CONFIG_NAME
from .ignore_list import IgnoreList

FLOAT_QUANTIZED_FORMATS = ("float-quantized", "naive-quantized")
# How configs spell the one FP8 type fp8conv reads: DeepSeek "e4m3", MiniMax-M2 torch's "float8_e4m3fn",
# safetensors' "F8_E4M3", Mistral's "fp8_e4m3". Compared lowercased.
E4M3_SPELLINGS = frozenset({"e4m3", "e4m3fn", "float8_e4m3fn", "float8_e4m3", "f8_e4m3", "fp8_e4m3", "fp8_e4m3fn"})
# Methods that are plain FP8 under another name: Meta's Llama-3.1 FP8 release (channel weight_scale [N, 1]).
FP8_ALIASES = ("fbgemm_fp8",)
# Packed 4-bit formats a config can declare -> elements per scale along K (see formats.Kind)
MXFP4_GROUP = 32
NVFP4_GROUP = 16
# ModelOpt quant_algo values whose weights are NVFP4 (W4A16: the same weights, activations left in bf16)
MODELOPT_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
# ModelOpt FP8 algos whose tensors are fp8conv's per-tensor / channel FP8 (vLLM's ModelOptFp8Config)
MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
MODELOPT_MXFP8_ALGO = "MXFP8"
MODELOPT_MIXED_ALGO = "MIXED_PRECISION"
# MXFP8: e4m3 weights, one UE8M0 exponent per 1x32 group along K (vLLM mxfp8_utils.MXFP8_BLOCK_SIZE)
MXFP8_GROUP = 32
# the lists an entry of not_converted can come from, for naming it in a refusal
IGNORE_LIST_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules", "exclude")


@dataclass(frozen=True)
class ModuleScheme:
    """The block size of the modules a pattern names (Quark's per-layer configs; None: no blocks there):
    `pattern` is an fnmatch pattern over the module name, or, without `*`, a name the module is part of
    (vLLM's reading of layer_quant_config's keys)."""

    pattern: str
    block: tuple[int, int] | None

    def matches(self, module: str) -> bool:
        if "*" in self.pattern or "?" in self.pattern:
            return fnmatch.fnmatchcase(module, self.pattern)
        return module in self.pattern


@dataclass
class QuantSettings:
    method: str | None  # "fp8", "compressed-tensors" or None
    key: str | None = None  # the config.json section holding quantization_config: None (top level) or "text_config"
    file: str = CONFIG_NAME  # hf_quant_config.json when ModelOpt's sidecar supplied it (config.READ_FROM_KEY)
    block: tuple[int, int] | None = None
    activation_scheme: str | None = None  # "dynamic" | "static"
    scale_fmt: str | None = None  # "ue8m0" when the config claims it
    not_converted: list[str] = field(default_factory=list)  # modules_to_not_convert / ignored_layers / ignore
    problems: list[CheckpointError] = field(default_factory=list)
    # packed 4-bit formats the config declares (a Kind value -> elements per scale along K); the
    # classifier accepts a packed tensor only when its format is declared here
    packed: dict[str, int] = field(default_factory=dict)
    expert_dtype: str | None = None  # DeepSeek-V4: "fp4" (MXFP4 routed experts) or "fp8"
    # MXFP8 declared (quant_method mxfp8, ModelOpt MXFP8, compressed-tensors mxfp8-quantized): elements per
    # UE8M0 scale along K; an e4m3 weight with a uint8/e8m0 scale is then read as MXFP8 (see mxfp8.py)
    mxfp8_group: int | None = None
    # modules whose block differs from `block`, first match wins (a dialect with per-layer settings)
    schemes: tuple[ModuleScheme, ...] = ()
    _ignore: IgnoreList | None = field(default=None, repr=False, compare=False)

    def block_for(self, module: str) -> tuple[int, int] | None:
        """The block size of one module: the first scheme naming it gives it, else the checkpoint's."""
        for scheme in self.schemes:
            if scheme.matches(module):
                return scheme.block
        return self.block

    def ignore_list(self) -> IgnoreList:
        """not_converted compiled once (again only if a reader added entries since)."""
        if self._ignore is None or len(self._ignore.entries) != len(self.not_converted):
            self._ignore = IgnoreList(list(self.not_converted))
        return self._ignore

    def lists_as_not_converted(self, module: str) -> bool:
        return self.ignore_list().matches(module)

    def refuse(self, message: str, fix: str) -> None:
        """Record a problem with the quantization config, naming the file and section it came from."""
        self.problems.append(CheckpointError(message, file=self.file, key=self.key, fix=fix))

    @property
    def where(self) -> str:
        """For messages and inspect: "config.json", "config.json:text_config" or "hf_quant_config.json"."""
        return self.file + (f":{self.key}" if self.key else "")


def parse_block_size(value: Any, key: str | None) -> tuple[int, int]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise CheckpointError(
        f"weight_block_size {value!r} is not two positive integers",
        file=CONFIG_NAME,
        key=key,
        fix="fix config.json or assert the block size with --block-size 128,128",
    )


def normalized_method(raw: Any) -> str | None:
    """quant_method as vLLM compares it (ModelConfig lowercases it and spells compressed_tensors with a
    hyphen): "FP8", "MXFP4" or "Compressed_Tensors" select the same reader as their lowercase forms."""
    if raw is None:
        return None
    return str(raw).lower().replace("compressed_tensors", "compressed-tensors")


def fmt_problem(fmt: Any) -> str | None:
    """None when `fmt` names e4m3fn; otherwise what it names instead (e5m2 and fnuz are other types)."""
    spelled = str(fmt).lower()
    if spelled in E4M3_SPELLINGS:
        return None
    if "e5m2" in spelled:
        return f"fmt {fmt!r} is e5m2 FP8, not e4m3"
    if "fnuz" in spelled:
        return f"fmt {fmt!r} is AMD's e4m3fnuz (exponent bias 8), not e4m3fn"
    return f"fmt {fmt!r} is not a known spelling of e4m3 FP8"
