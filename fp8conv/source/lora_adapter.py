"""A PEFT LoRA adapter (--merge-lora), read the way PEFT reads it: adapter_config.json and the tensors'
headers in adapter_model.safetensors. Torch-free: the plan is checked against it before anything runs.

For each targeted module PEFT saves `base_model.model.<module>.lora_A.weight` [r, K] and `lora_B.weight`
[N, r] (an Embedding: `lora_embedding_A` [r, V], `lora_embedding_B` [D, r], its delta transposed), and its
merge adds (B @ A) x scaling to `<module>.weight`, scaling = alpha / r (alpha / sqrt(r) with use_rslora),
r and alpha per module from rank_pattern / alpha_pattern (peft.utils.other.get_pattern_key: the first
pattern p, in the file's order, with the module's name matching `(.*\\.)?(p)$`). Whole tensors it saves
beside them (`modules_to_save`, an embedding's `base_layer` when save_embedding_layers) replace the base
tensor of that name. Anything else is refused by name: other PEFT types, DoRA, LoRA biases, parameters
(target_parameters), layer replication, trainable tokens, tensors of no known role.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage.digest import stream_sha256
from ..storage.header import read_header
from ..storage.safetensors_file import TensorEntry
from .hub import looks_like_repo_id, snapshot_files

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
FLOAT_DTYPES = ("F32", "BF16", "F16")
_LINEAR = (".lora_A.weight", ".lora_B.weight")
_EMBEDDING = (".lora_embedding_A", ".lora_embedding_B")
_BASE_LAYER = ".base_layer.weight"  # an embedding saved whole beside its LoRA (save_embedding_layers)
# adapter_config.json keys whose non-empty values change what a merge is; fp8conv does not do them
_REFUSED_KEYS = {
    "use_dora": "DoRA (its magnitude vector rescales each merged row)",
    "lora_bias": "LoRA biases",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable tokens",
    "use_qalora": "QALoRA",
}


# transformers 5's fused experts parameters, in the order every experts class (5.25) registers them: the
# order PEFT nests their ParamWrappers in (the first innermost), which is all that tells their factors apart
FUSED_PARAMETERS = ("gate_up_proj", "down_proj")
_WRAPPED = ".base_layer"


@dataclass(frozen=True)
class LoraTerm:
    """One module's low-rank update: adapter tensors a [r, K] and b [N, r] (an embedding: a [r, V], b [D, r],
    the delta transposed) and the factor PEFT multiplies b @ a by. A fused experts parameter's
    (target_parameters, `experts` E > 0): a [E*r, K] and b [N, r*E] (PEFT's ParamWrapper: expert e's factors
    a.reshape(E, r, K)[e] and b.reshape(N, r, E)[:, :, e]), the delta [E, N, K]; or one expert's rows of it
    (`expert`, `rows`), where the base stores one Linear per expert."""

    a: str
    b: str
    rank: int
    scaling: float
    embedding: bool = False
    experts: int = 0
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def delta_shape(self, entries: dict[str, TensorEntry]) -> tuple[int, ...]:
        rows, cols = entries[self.b].shape[0], entries[self.a].shape[1]
        if self.rows is not None:
            rows = self.rows[1] - self.rows[0]
        if self.experts and self.expert is None:
            return (self.experts, rows, cols)
        return (cols, rows) if self.embedding else (rows, cols)


@dataclass(frozen=True)
class LoraAdapter:
    """The adapter as a merge reads it: terms and whole replacements by the base weight's name."""

    location: str  # as given: a folder or a Hub ID
    weights: Path
    sha256: str  # of adapter_model.safetensors then adapter_config.json: what a manifest records
    base_model: str | None
    terms: dict[str, LoraTerm]
    replacements: dict[str, str]  # base tensor name -> the adapter tensor that replaces it
    entries: dict[str, TensorEntry]

    @property
    def targets(self) -> set[str]:
        return set(self.terms) | set(self.replacements)


def open_adapter(location: str, revision: str | None = None) -> LoraAdapter:
    """The adapter in a folder, or a Hub ID's (through the huggingface_hub cache); refused by name when PEFT
    would merge something fp8conv does not."""
    folder = Path(location)
    if not folder.is_dir() and looks_like_repo_id(location):
        folder = snapshot_files(location, revision, [ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin"])
    config_path, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    if not config_path.is_file():
        raise CheckpointError(
            f"{location} has no {ADAPTER_CONFIG}", file=str(folder), fix="pass the folder PEFT's save_pretrained wrote"
        )
    if not weights.is_file():
        pickle = (folder / "adapter_model.bin").is_file()
        raise CheckpointError(
            f"has no {ADAPTER_WEIGHTS}" + (" (only adapter_model.bin, a pickle fp8conv never loads)" if pickle else ""),
            file=str(folder),
            fix="save the adapter with safe_serialization=True (PEFT's default)",
        )
    config = _adapter_config(config_path)
    header = read_header(weights, ADAPTER_WEIGHTS)
    terms, replacements = _terms(config, header.tensors, str(weights))
    return LoraAdapter(
        location=location,
        weights=weights,
        sha256=_digest(weights, config_path),
        base_model=config.get("base_model_name_or_path") or None,
        terms=terms,
        replacements=replacements,
        entries=header.tensors,
    )


def _adapter_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"is not readable JSON ({exc})", file=str(path)) from None
    if not isinstance(config, dict):
        raise CheckpointError("is not a JSON object", file=str(path))
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(
            f"is a {peft_type} adapter; fp8conv merges LoRA adapters only", file=str(path), key="peft_type"
        )
    for key, what in _REFUSED_KEYS.items():
        if config.get(key):
            raise CheckpointError(
                f"asks for {what}, which fp8conv does not merge",
                file=str(path),
                key=key,
                fix="merge with PEFT into a bf16 copy, or train a plain LoRA",
            )
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise CheckpointError(f"{key} is not a positive number", file=str(path), key=key)
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise CheckpointError("is not an object", file=str(path), key=key)
    other = [t for t in config.get("target_parameters") or [] if t.rpartition(".")[2] not in FUSED_PARAMETERS]
    if other:
        raise CheckpointError(
            f"targets parameter {other[0]}; fp8conv merges LoRA on fused experts' {' and '.join(FUSED_PARAMETERS)} "
            "only",
            file=str(path),
            key="target_parameters",
            fix="fp8conv merges plain LoRA (lora_A / lora_B) adapters",
        )
    return config


def _terms(
    config: dict[str, Any], entries: dict[str, TensorEntry], file: str
) -> tuple[dict[str, LoraTerm], dict[str, str]]:
    """Each module's term (by its base weight's name) and the whole tensors, from the adapter's names."""
    pairs: dict[str, dict[str, str]] = {}
    replacements: dict[str, str] = {}
    for name, entry in entries.items():
        if not name.startswith(PEFT_PREFIX):
            raise _unknown(name, file, f"is not under PEFT's {PEFT_PREFIX!r}")
        if entry.dtype not in FLOAT_DTYPES:
            raise CheckpointError(
                f"is {entry.dtype}; an adapter's tensors are floats ({', '.join(FLOAT_DTYPES)})",
                tensor=name,
                shard=file,
            )
        inner = name[len(PEFT_PREFIX) :]
        suffix = next((s for s in (*_LINEAR, *_EMBEDDING) if inner.endswith(s)), None)
        if suffix is not None:
            module = inner[: -len(suffix)]
            pairs.setdefault(module, {})["a" if suffix in (_LINEAR[0], _EMBEDDING[0]) else "b"] = name
            pairs[module]["embedding" if suffix in _EMBEDDING else "linear"] = suffix
        elif inner.endswith(_BASE_LAYER):
            replacements[inner[: -len(_BASE_LAYER)] + ".weight"] = name
        elif ".lora_" in inner or ".modules_to_save." in inner:
            raise _unknown(name, file, "is a LoRA tensor of a kind fp8conv does not merge")
        else:  # modules_to_save: the whole tensor, under the base's own name
            replacements[inner] = name
    terms = {}
    for module, pair in pairs.items():
        parameter = _parameter_of(module, config.get("target_parameters") or [], pair, file)
        if parameter is None:
            terms[module + ".weight"] = _term(module, pair, config, entries, file)
        else:
            terms[parameter] = _parameter_term(parameter, pair, config, entries, file)
    return terms, replacements


def _parameter_of(module: str, targets: list[str], pair: dict[str, str], file: str) -> str | None:
    """target_parameters: the fused experts parameter whose ParamWrapper saved these factors, by PEFT's
    nesting (tuners_utils._inject_parameters: parameters wrapped in the order the module registers them,
    each wrapper around the last, so the first is the innermost, `.base_layer` once per wrapper outside
    it). None for a module's own LoRA."""
    unwrapped, depth = module, 0
    while unwrapped.endswith(_WRAPPED):
        unwrapped, depth = unwrapped[: -len(_WRAPPED)], depth + 1

    def targeted(parameter: str) -> bool:
        key = f"{unwrapped}.{parameter}"
        return any(key == t or key.endswith("." + t) for t in targets)

    params = [p for p in FUSED_PARAMETERS if targeted(p)]
    if not params and depth:
        raise _unknown(pair.get("a") or pair["b"], file, "wraps no parameter target_parameters names")
    if not params:
        return None
    if depth >= len(params):
        raise _unknown(pair.get("a") or pair["b"], file, f"is nested {depth} deep, and {unwrapped} has {len(params)}")
    return f"{unwrapped}.{params[len(params) - 1 - depth]}"


def _parameter_term(
    parameter: str, pair: dict[str, str], config: dict[str, Any], entries: dict[str, TensorEntry], file: str
) -> LoraTerm:
    """A fused experts parameter's factors: a [E*r, K], b [N, r*E] (PEFT's ParamWrapper, its rank and alpha
    looked up by the parameter's name)."""
    if "a" not in pair or "b" not in pair or "embedding" in pair:
        raise _unknown(pair.get("a") or pair["b"], file, "is not a ParamWrapper's lora_A / lora_B pair")
    a, b = entries[pair["a"]], entries[pair["b"]]
    rank, scaling = _rank_and_scaling(config, parameter)
    experts = a.shape[0] // rank if len(a.shape) == 2 else 0
    if len(b.shape) != 2 or experts < 1 or a.shape[0] != experts * rank or b.shape[1] != experts * rank:
        raise CheckpointError(
            f"has shape {list(a.shape)} with {list(b.shape)} for its partner: not E x rank {rank} for {parameter}",
            tensor=a.name,
            shard=file,
            fix="the adapter's files disagree; save it again",
        )
    return LoraTerm(a.name, b.name, rank, scaling, experts=experts)


def _term(
    module: str, pair: dict[str, str], config: dict[str, Any], entries: dict[str, TensorEntry], file: str
) -> LoraTerm:
    if "a" not in pair or "b" not in pair:
        have = pair.get("a") or pair.get("b")
        raise CheckpointError("has no partner (lora_A without lora_B or the reverse)", tensor=have, shard=file)
    if "embedding" in pair and "linear" in pair:
        raise _unknown(pair["a"], file, "mixes Linear and Embedding LoRA names for one module")
    a, b = entries[pair["a"]], entries[pair["b"]]
    rank, scaling = _rank_and_scaling(config, module)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise CheckpointError(
            f"has shape {list(a.shape)} with {list(b.shape)} for its partner, not the rank {rank} the config gives "
            f"{module}",
            tensor=a.name,
            shard=file,
            fix="the adapter's files disagree; save it again",
        )
    return LoraTerm(a.name, b.name, rank, scaling, embedding="embedding" in pair)


def _rank_and_scaling(config: dict[str, Any], key: str) -> tuple[int, float]:
    """A module's (or parameter's) rank and PEFT's factor: alpha / r, or alpha / sqrt(r) with use_rslora;
    r and alpha by rank_pattern / alpha_pattern where a pattern matches `key`."""
    rank = int(_pattern_value(config, "rank_pattern", key, config["r"]))
    alpha = float(_pattern_value(config, "alpha_pattern", key, config["lora_alpha"]))
    return rank, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pattern_value(config: dict[str, Any], key: str, module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first pattern matching the module's name, else the default."""
    for pattern, value in (config.get(key) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _unknown(name: str, file: str, why: str) -> CheckpointError:
    return CheckpointError(why, tensor=name, shard=file, fix="fp8conv merges plain LoRA (lora_A / lora_B) adapters")


def _digest(*paths: Path) -> str:
    with contextlib.ExitStack() as files:
        return stream_sha256(*(files.enter_context(open(path, "rb")) for path in paths))
