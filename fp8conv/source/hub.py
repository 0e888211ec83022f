"""Hub IDs through huggingface_hub: its cache, its offline mode (HF_HUB_OFFLINE=1), allow_patterns so
that only what a conversion needs is downloaded, and remote safetensors headers for `inspect`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..storage.header import parse_header
from ..storage.safetensors_file import ShardHeader

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Weights as safetensors, and every file a model needs beside them; never other weight formats.
ALLOW_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.jinja",
    "*.py",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.md",
    "LICENSE*",
]
HEADER_ONLY_PATTERNS = ["*.json"]
# --stream: everything but the shards, which are fetched one by one
SMALL_FILE_PATTERNS = [p for p in ALLOW_PATTERNS if p != "*.safetensors"]


def looks_like_repo_id(location: str) -> bool:
    return bool(REPO_ID.match(location)) and not Path(location).exists()


def _hub_error(repo_id: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"{repo_id} cannot be fetched from the Hugging Face Hub ({type(exc).__name__}: {exc})".replace("\n", " "),
        fix="check the ID and --revision, the network or HF_HUB_OFFLINE, or download it and pass the folder",
    )


def snapshot(
    repo_id: str,
    revision: str | None,
    *,
    headers_only: bool = False,
    cached_only: bool = False,
    weights: bool = True,
) -> Path:
    """The local snapshot folder of `repo_id` (downloaded into the huggingface_hub cache if needed);
    weights=False leaves the shards out (--stream fetches them one by one)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=HEADER_ONLY_PATTERNS
                if headers_only
                else (ALLOW_PATTERNS if weights else SMALL_FILE_PATTERNS),
                local_files_only=cached_only,
            )
        )
    except Exception as exc:  # huggingface_hub raises many kinds; each becomes one clear line
        raise _hub_error(repo_id, exc) from exc


def snapshot_files(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """The local snapshot folder of `repo_id` holding (at most) the files `patterns` name: a LoRA adapter's."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # huggingface_hub raises many kinds; each becomes one clear line
        raise _hub_error(repo_id, exc) from exc


def remote_headers(repo_id: str, revision: str | None) -> dict[str, ShardHeader]:
    """Every shard's header read remotely (a few KB per shard), without downloading weights."""
    from huggingface_hub import HfApi

    try:
        meta = HfApi().get_safetensors_metadata(repo_id, revision=revision)
    except Exception as exc:
        raise _hub_error(repo_id, exc) from exc
    headers = {}
    for filename, file_meta in meta.files_metadata.items():
        headers[filename] = parse_header(remote_header_json(file_meta), None, filename)
    return headers


def remote_header_json(file_meta: Any) -> bytes:
    """A remote header as the JSON a shard holds, for the validator local headers go through
    (huggingface_hub parsed it, and checked nothing)."""
    doc: dict[str, Any] = {}
    if file_meta.metadata:
        doc["__metadata__"] = file_meta.metadata
    for name, info in file_meta.tensors.items():
        offsets = info.data_offsets
        doc[name] = {
            "dtype": info.dtype,
            "shape": info.shape,
            "data_offsets": list(offsets) if isinstance(offsets, tuple) else offsets,
        }
    return json.dumps(doc).encode()
