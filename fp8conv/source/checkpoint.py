"""Resolve <ckpt> into a Checkpoint: its shards (via the index), its config and its other files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage.input_files import containment_root as containment_root  # re-exported: where it used to live
from ..storage.input_files import is_contained_file
from ..storage.safetensors_file import ShardHeader
from . import hub
from .config import (
    CONFIG_NAME,
    MISTRAL_PARAMS_NAME,
    MODELOPT_CONFIG_NAME,
    READ_FROM_KEY,
    load_config,
    present,
    with_modelopt_config,
)
from .index import INDEX_NAME, CheckpointIndex, load_index
from .mistral_native import hf_shards_first

# Files that hold the same weights in another format: copying them would ship unconverted weights.
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5")
# Folders that are tool metadata, never part of a model.
SKIPPED_DIRS = frozenset({".git", ".cache", ".fp8conv", "__pycache__"})


@dataclass
class Checkpoint:
    root: Path
    index: CheckpointIndex
    config: dict[str, Any] | None
    single_file: bool
    other_files: list[str] = field(default_factory=list)  # relative paths, copied unchanged
    skipped_files: list[tuple[str, str]] = field(default_factory=list)  # (relative path, why)

    def classification_config(self) -> dict[str, Any] | None:
        """The config its tensors are classified by: config.json; for a Mistral-native checkpoint
        (params.json alone), params.json's compressed-tensors `quantization` as the quantization_config,
        which vLLM's Mistral reader passes through (fp8conv's own native block FP8 states its block size
        only there)."""
        if self.config is not None:
            return self.config
        path = self.root / MISTRAL_PARAMS_NAME
        if not present(path):
            return None
        quant = load_config(path).get("quantization")
        if isinstance(quant, dict) and quant.get("quant_method") == "compressed-tensors":
            return {"quantization_config": {**quant, READ_FROM_KEY: MISTRAL_PARAMS_NAME}}
        return None


def open_checkpoint(
    location: str | os.PathLike[str], *, revision: str | None = None, headers_only: bool = False
) -> Checkpoint:
    """A local folder or .safetensors file, or a Hub repo ID (through huggingface_hub's cache).
    `headers_only` (inspect): a Hub ID not in the cache is read remotely, headers and JSON files only."""
    if isinstance(location, str) and hub.looks_like_repo_id(location):
        if headers_only:
            try:
                return _open_directory(hub.snapshot(location, revision, cached_only=True))
            except CheckpointError:
                return _open_remote(location, revision)
        return _open_directory(hub.snapshot(location, revision))
    path = Path(location)
    if not path.exists():
        raise CheckpointError(
            f"{location} does not exist", fix="give a checkpoint directory, a .safetensors file or a Hub repo ID"
        )
    if not path.is_dir():  # a file; a FIFO or a device is refused when opened, never read
        return _open_single_file(path)
    return _open_directory(path)


def _open_remote(repo_id: str, revision: str | None) -> Checkpoint:
    root = hub.snapshot(repo_id, revision, headers_only=True)  # config.json and the index, a few KB
    headers = hub.remote_headers(repo_id, revision)
    index_file = root / INDEX_NAME
    index = load_index(root, [], index_file if present(index_file) else None, headers=headers)
    config = _read_config(root)
    return Checkpoint(root=root, index=index, config=config, single_file=False)


def open_with_headers(root: Path, headers: dict[str, ShardHeader]) -> Checkpoint:
    """A folder whose shards are not all there yet (--stream): the index from `headers`, the config and
    the other files from the folder."""
    index_file = root / INDEX_NAME
    index = load_index(root, [], index_file if present(index_file) else None, headers=headers)
    config = _read_config(root)
    ckpt = Checkpoint(root=root, index=index, config=config, single_file=False)
    _list_other_files(ckpt)
    return ckpt


def _read_config(root: Path) -> dict[str, Any] | None:
    """config.json with hf_quant_config.json's quantization, each opened inside the checkpoint."""
    config_path = root / CONFIG_NAME
    return with_modelopt_config(load_config(config_path) if present(config_path) else None, root)


def _open_single_file(path: Path) -> Checkpoint:
    if path.suffix != ".safetensors":
        raise CheckpointError(
            "is not a .safetensors file",
            file=path.name,
            fix="fp8conv reads safetensors only (it never unpickles .bin/.pt files)",
        )
    root = path.parent
    config = _read_config(root)
    index = load_index(root, [path.name], None)
    return Checkpoint(root=root, index=index, config=config, single_file=True)


def _open_directory(root: Path) -> Checkpoint:
    index_file = root / INDEX_NAME
    # Mistral's consolidated files are the checkpoint only when no HF shard is there (fp8conv.source.mistral_native)
    top_level = hf_shards_first(sorted(p.name for p in root.glob("*.safetensors") if p.is_file()))
    if present(index_file):
        index = load_index(root, [], index_file)
    elif top_level:
        index = load_index(root, top_level, None)
    else:
        bins = sorted(p.name for p in root.iterdir() if p.suffix in OTHER_WEIGHT_SUFFIXES)
        hint = (
            f"found {', '.join(bins[:3])}: fp8conv never unpickles .bin/.pt files; use a safetensors copy"
            if bins
            else "point at a folder holding *.safetensors (and model.safetensors.index.json)"
        )
        raise CheckpointError(f"{root} holds no .safetensors files", fix=hint)
    config = _read_config(root)  # every file opened inside the checkpoint (input_files.open_beneath)
    ckpt = Checkpoint(root=root, index=index, config=config, single_file=False)
    _list_other_files(ckpt)
    return ckpt


def _list_other_files(ckpt: Checkpoint) -> None:
    """Everything that is not a shard, the index or config.json is copied, except other weights,
    hf_quant_config.json (config.json describes the output's quantization), links out of the
    checkpoint and what is not a regular file (a FIFO, a device: never opened)."""
    own = {s.name for s in ckpt.index.shards} | {INDEX_NAME, CONFIG_NAME}
    for dirpath, dirnames, filenames in os.walk(ckpt.root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for fname in sorted(filenames):
            rel = (Path(dirpath) / fname).relative_to(ckpt.root).as_posix()
            if rel in own:
                continue
            refused = is_contained_file(ckpt.root, rel)
            if refused is not None:
                ckpt.skipped_files.append((rel, refused))
                continue
            if rel == MODELOPT_CONFIG_NAME:
                why = (
                    "the input's ModelOpt quantization, which vLLM would apply to an output whose config.json has none"
                )
                ckpt.skipped_files.append((rel, why))
            elif rel.startswith("consolidated") and fname.endswith(".safetensors"):
                why = "Mistral-native copy of the weights, not converted: the output is the HF-format checkpoint"
                ckpt.skipped_files.append((rel, why))
            elif fname.endswith(".safetensors") or fname.endswith(".safetensors.index.json"):
                ckpt.skipped_files.append((rel, "safetensors weights that are not part of this checkpoint"))
            elif fname.endswith(OTHER_WEIGHT_SUFFIXES) and _looks_like_weights(fname):
                ckpt.skipped_files.append((rel, "weights in a pickle format fp8conv does not read"))
            else:
                ckpt.other_files.append(rel)


def _looks_like_weights(fname: str) -> bool:
    # tokenizers and training args also use .bin/.model; only skip files named like weights
    stem = fname.lower()
    return stem.startswith(("pytorch_model", "model", "consolidated", "tf_model", "flax_model")) or (
        not stem.endswith(".bin")
    )
