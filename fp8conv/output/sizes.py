"""Every byte a run writes into OUT, for the space check: the shards with their headers, the copied
and rewritten files, the model card's note, the manifest (and a part's record) with its temporary copy
beside it while it is replaced, the index and config.json; each file in whole filesystem blocks."""

from __future__ import annotations

import json
from itertools import chain
from operator import attrgetter
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
    # each JSON document as written: (bytes, newlines, ASCII), the index's counted (a release's is 200k names)
    measures = [_measure(dump_json(d)) for d in plan.json_files.values()]
    measures += [_index_measure(plan)] if plan.write_index else []
    measures += [_measure(dump_json(plan.config))] if plan.config is not None else []
    total += sum(_blocks(n) for n, _, _ in measures)
    manifest_bytes = _blocks(_record_length(plan, manifest, measures) + 1024)
    return total + 2 * manifest_bytes + 2 * BLOCK_BYTES  # the manifest and its temporary; .fp8conv and the lock


_Measure = tuple[int, int, bool]  # a JSON text's bytes, its newlines, whether it is ASCII
_OUTPUTS, _NAME, _JOBS = attrgetter("outputs"), attrgetter("name"), attrgetter("jobs")


def _measure(text: bytes) -> _Measure:
    return len(text), text.count(b"\n"), text.isascii()


def _index_measure(plan: ConversionPlan) -> _Measure:
    """dump_json(plan.index_document())'s measure, counted: its tensor names encoded as one JSON array in C,
    its brackets and commas taken off, each shard's name times its tensors, and the text around them (the
    entries' order, which sorting sets, changes no count). A name twice is measured from the document."""
    names = list(map(_NAME, chain.from_iterable(map(_OUTPUTS, chain.from_iterable(map(_JOBS, plan.shards))))))
    if not names or len(set(names)) != len(names):
        return _measure(dump_json(plan.index_document()))
    encoded = json.dumps(names, ensure_ascii=False, separators=(",", ":")).encode()
    shards = [
        (json.dumps(s.name, ensure_ascii=False).encode(), sum(map(len, map(_OUTPUTS, s.jobs)))) for s in plan.shards
    ]
    head = f'{{\n  "metadata": {{\n    "total_size": {plan.output_bytes}\n  }},\n  "weight_map": {{'
    # each entry "\n    name: shard", a comma between two, then "\n  }\n}\n"
    entries = len(encoded) - 2 - (len(names) - 1) + sum(len(shard) * count for shard, count in shards)
    nbytes = len(head) + entries + len(names) * len("\n    : ") + len(names) - 1 + len("\n  }\n}\n")
    ascii_text = encoded.isascii() and all(shard.isascii() for shard, _ in shards)
    return nbytes, head.count("\n") + len(names) + 3, ascii_text


_DOCS_DEPTH = 3  # record -> "finalize" -> "docs" -> each document


def _record_length(plan: ConversionPlan, manifest: Manifest, measures: list[_Measure]) -> int:
    """len(json.dumps(record, indent=2)) of a part's manifest record, which carries every document to write
    (record["finalize"]["docs"]), measured from the documents' text as written rather than encoded again: the
    same text, ASCII, but each line after the first indented by its depth. Encoded whole when a document is
    not ASCII (the record escapes what dump_json writes as UTF-8)."""
    record: dict[str, Any] = {
        "options": manifest.options,
        "input": manifest.input,
        "shards": dict.fromkeys((s.name for s in plan.shards), _SHARD_ENTRY),
        "extra": manifest.extra,
        "finalize": {"copy_files": plan.copy_files, "json_files": plan.json_files, "docs": []},
    }
    if not all(ascii_text for _, _, ascii_text in measures):
        docs = [*plan.json_files.values(), *([plan.index_document()] if plan.write_index else [])]
        record["finalize"]["docs"] = docs + ([plan.config] if plan.config is not None else [])
        return len(json.dumps(record, indent=2))
    empty = len(json.dumps(record, indent=2))
    if not measures:
        return empty
    # "[" then each document on its own line at its depth, "," between them, "]" on a line one level out
    items = sum(n - 1 + (lines - 1) * 2 * _DOCS_DEPTH + 1 + 2 * _DOCS_DEPTH for n, lines, _ in measures)
    listed = 2 + items + (len(measures) - 1) + 1 + 2 * (_DOCS_DEPTH - 1)
    return empty - len("[]") + listed
