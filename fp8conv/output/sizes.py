"""Every byte a run writes into OUT, for the space check: the shards with their headers, the copied
and rewritten files, the model card's note, the manifest (and a part's record) with its temporary copy
beside it while it is replaced, the index and config.json; each file in whole filesystem blocks."""

from __future__ import annotations

import json
from typing import Any

from ..plan.conversion import SAFETENSORS_METADATA, ConversionPlan, ShardPlan
from ..source.config import dump_json
from ..storage.writer import safetensors_header_size
from .manifest import Manifest

BLOCK_BYTES = 4096  # what a small file takes on disk at least (ext4, xfs)
_SHARD_ENTRY = {"size": 2**63, "sha256": "0" * 64, "mtime_ns": 2**63, "inode": 2**63}


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def output_bytes(
    plan: ConversionPlan,
    written: list[ShardPlan],
    copied_sizes: list[int],
    manifest: Manifest,
    card_note: str | None,
) -> int:
    """What this run adds to OUT, at most: `written` are the shards it writes, `copied_sizes` the sizes
    of the files it copies."""
    total = sum(_blocks(safetensors_header_size(s.specs, SAFETENSORS_METADATA) + s.nbytes) for s in written)
    total += sum(_blocks(n) for n in copied_sizes) + _blocks(len(card_note or ""))
    docs: list[dict[str, Any]] = list(plan.json_files.values())
    if plan.write_index:
        docs.append(plan.index_document())
    if plan.config is not None:
        docs.append(plan.config)
    texts = [dump_json(d) for d in docs]
    total += sum(_blocks(len(t)) for t in texts)
    record = {
        "options": manifest.options,
        "input": manifest.input,
        "shards": dict.fromkeys((s.name for s in plan.shards), _SHARD_ENTRY),
        "extra": manifest.extra,
        "finalize": {"copy_files": plan.copy_files, "json_files": plan.json_files, "docs": docs},
    }
    manifest_bytes = _blocks(_record_length(record, texts) + 1024)
    return total + 2 * manifest_bytes + 2 * BLOCK_BYTES  # the manifest and its temporary; .fp8conv and the lock


_DOCS_DEPTH = 3  # record -> "finalize" -> "docs" -> each document


def _record_length(record: dict[str, Any], texts: list[bytes]) -> int:
    """len(json.dumps(record, indent=2)), its documents (record["finalize"]["docs"]) taken from their text as
    written (`texts`, dump_json's) rather than encoded again (a release's index is 200k names): the same
    text, ASCII, but each line after the first indented by its depth. Encoded whole when a text is not ASCII
    (the record escapes what dump_json writes as UTF-8)."""
    docs = record["finalize"]["docs"]
    if not docs or not all(t.isascii() for t in texts):
        return len(json.dumps(record, indent=2))
    empty = len(json.dumps({**record, "finalize": {**record["finalize"], "docs": []}}, indent=2))
    # "[" then each document on its own line at its depth, "," between them, "]" on a line one level out
    items = sum(len(t) - 1 + (t.count(b"\n") - 1) * 2 * _DOCS_DEPTH + 1 + 2 * _DOCS_DEPTH for t in texts)
    listed = 2 + items + (len(texts) - 1) + 1 + 2 * (_DOCS_DEPTH - 1)
    return empty - len("[]") + listed
