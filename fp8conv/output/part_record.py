"""A fan-out part's record (.fp8conv/part-I-of-N.json) checked before finalize uses any of it.

Anyone who can write into OUT can write these records, and finalize runs them: every key is checked
against its schema (types included), every name is a plain relative path inside OUT that is not one of
the files finalize writes itself, and `copy_from` must be the input the parts converted (its shards
and config.json as recorded) with every file to copy a regular file inside it. So a record cannot make
finalize copy /etc/passwd into OUT, write JSON outside OUT, or copy a file anywhere.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..errors import Fp8ConvError, OutputError
from ..source.config import CONFIG_NAME
from ..source.index import INDEX_NAME
from ..storage.digest import stream_sha256
from ..storage.input_files import plain_relative
from .manifest import MANIFEST, check_record
from .provenance import hub_snapshot_of

_RESERVED = {INDEX_NAME, CONFIG_NAME}


def check_part_record(doc: dict[str, Any], label: str, fix: str) -> None:
    """The record's shared keys (manifest.check_record, the requantization record included) and, once
    complete, its finalize payload."""
    check_record(doc, label, fix, OutputError)

    def bad(key: str, what: str) -> Fp8ConvError:
        return OutputError(f"is damaged: {key} is not {what}", file=label, key=key, fix=fix)

    if "all_scales_pow2" in doc and not isinstance(doc["all_scales_pow2"], bool):
        raise bad("all_scales_pow2", "true or false")
    if "source" in doc and not isinstance(doc["source"], dict):
        raise bad("source", "an object")
    if not doc.get("complete"):
        return
    fin = doc["finalize"]
    shards = fin["planned_shards"]
    if not isinstance(shards, list) or not all(plain_relative(s) and s.endswith(".safetensors") for s in shards):
        raise bad("finalize.planned_shards", "a list of shard names inside the output")
    if not isinstance(fin["copy_from"], str) or not os.path.isabs(fin["copy_from"]):
        raise bad("finalize.copy_from", "an absolute path")
    taken = _RESERVED | set(shards)
    copies = fin["copy_files"]
    if not isinstance(copies, list) or not all(_is_own_name(n, taken) for n in copies):
        raise bad("finalize.copy_files", "a list of file names inside the output")
    json_files = fin.get("json_files")
    if json_files is not None and (
        not isinstance(json_files, dict)
        or not all(_is_own_name(n, taken) and isinstance(d, dict) for n, d in json_files.items())
    ):
        raise bad("finalize.json_files", "an object of file names inside the output and their JSON objects")
    for key in ("index", "config"):
        if fin[key] is not None and not isinstance(fin[key], dict):
            raise bad(f"finalize.{key}", "an object or null")
    if not isinstance(fin["claims_ue8m0"], bool):
        raise bad("finalize.claims_ue8m0", "true or false")
    if fin.get("model_card_note") is not None and not isinstance(fin["model_card_note"], str):
        raise bad("finalize.model_card_note", "a string or null")


def check_copy_source(copy_from: Path, input_record: dict[str, Any], copy_files: list[str], label: str) -> None:
    """`copy_from` holds the input the parts converted (every shard with its recorded size, config.json
    with its recorded hash), and every file to copy is a regular file inside it (in the Hub cache, a
    link to the same repo's blobs): a record naming another directory is refused."""
    fix = "convert every part again with --overwrite"
    where = f"{label} under finalize.copy_from"
    for shard in input_record.get("shards", []):
        name = shard.get("name") if isinstance(shard, dict) else None
        st = _stat_inside(copy_from, name) if isinstance(name, str) else None
        if st is None or st.st_size != shard.get("size"):
            raise OutputError(f"{copy_from} does not hold the input the parts converted", file=where, fix=fix)
    config_sha = input_record.get("config_sha256")
    if config_sha is not None and _sha256(copy_from / CONFIG_NAME) != config_sha:
        raise OutputError(f"{copy_from}'s config.json is not the one the parts converted", file=where, fix=fix)
    for rel in copy_files:
        if _stat_inside(copy_from, rel) is None:
            raise OutputError(f"{rel} is not a regular file inside the input {copy_from}", file=where, fix=fix)


def _stat_inside(root: Path, rel: str) -> os.stat_result | None:
    """`root / rel` when it is a plain relative name resolving to a regular file inside root (or, for a
    Hub cache snapshot, inside the repo's blobs)."""
    if not plain_relative(rel):
        return None
    real = Path(os.path.realpath(root / rel))
    bounds = [Path(os.path.realpath(root))]
    if hub_snapshot_of(root) is not None:
        bounds.append(bounds[0].parent.parent / "blobs")
    if not any(real.is_relative_to(b) for b in bounds):
        return None
    try:
        st = real.stat()
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _sha256(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:  # a Hub snapshot's config.json is a link to its blob: followed here
            return stream_sha256(f)
    except OSError:
        return None


def _is_own_name(name: object, taken: set[str]) -> bool:
    """A file finalize may write: inside OUT, outside .fp8conv, not a shard, the index or config.json."""
    return plain_relative(name) and name not in taken and not str(name).startswith(f"{MANIFEST.parent}/")
