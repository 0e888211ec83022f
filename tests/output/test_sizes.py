"""The space check's count of what a run writes (output.sizes.output_bytes) against its plain definition:
every shard's header as the writer makes it, every JSON document and the manifest record as json.dumps
writes them, each in whole 4 KiB blocks. The count takes shortcuts (headers counted, not written; the
record's documents measured from their text): they must give the same number, ASCII documents or not."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions
from fp8conv.output import sizes
from fp8conv.output.manifest import Manifest
from fp8conv.output.sizes import output_bytes
from fp8conv.plan.conversion import SAFETENSORS_METADATA, Action, ConversionPlan, Job, ShardPlan, plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from fp8conv.source.config import dump_json
from fp8conv.storage.writer import TensorSpec, safetensors_header

BLOCK = 1  # the count's filesystem block, made one byte: a count off by a byte shows


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _reference(plan, copied: list[int], manifest: Manifest, note: str | None) -> int:
    total = sum(_blocks(len(safetensors_header(s.specs, SAFETENSORS_METADATA)) + s.nbytes) for s in plan.shards)
    total += sum(_blocks(n) for n in copied) + _blocks(len(note or ""))
    docs = [*plan.json_files.values(), *([plan.index_document()] if plan.write_index else [])]
    docs += [plan.config] if plan.config is not None else []
    total += sum(_blocks(len(dump_json(d))) for d in docs)
    entry = {"size": 2**63, "sha256": "0" * 64, "mtime_ns": 2**63, "inode": 2**63}
    record = {
        "options": manifest.options,
        "input": manifest.input,
        "shards": dict.fromkeys((s.name for s in plan.shards), entry),
        "extra": manifest.extra,
        "finalize": {"copy_files": plan.copy_files, "json_files": plan.json_files, "docs": docs},
    }
    return total + 2 * _blocks(len(json.dumps(record, indent=2)) + 1024) + 2 * BLOCK


@pytest.mark.parametrize("json_files", [{}, {"generation_config.json": {"note": "ünïcødé ✓"}}, {"a.json": {}}])
@pytest.mark.parametrize("to", ["bf16", "block"])
def test_the_count_is_the_plain_definitions(make_tiny, monkeypatch, json_files, to) -> None:
    monkeypatch.setattr(sizes, "BLOCK_BYTES", BLOCK)
    ckpt = open_checkpoint(make_tiny(num_shards=3).path)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to=to))
    plan = dataclasses.replace(plan, json_files=json_files)
    manifest = Manifest("0.1.0", {"to": to}, {"shards": ["a"]}, extra={"source": {"x": [1, 2]}})
    for note in (None, "a model card note"):
        counted = output_bytes(plan, list(plan.shards), [10, 5000], manifest, note)
        assert counted == _reference(plan, [10, 5000], manifest, note)


@pytest.mark.parametrize(
    "names",
    [
        ["model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight_scale_inv", "lm_head.weight"],
        ["ünïcødé.weight", 'quo"te.weight', "plain.weight"],  # names the index writes as UTF-8 or escaped
        ["twice.weight", "twice.weight", "once.weight"],  # a name twice: the index's dict keeps one
    ],
)
def test_the_index_is_counted_as_written(monkeypatch, names) -> None:
    monkeypatch.setattr(sizes, "BLOCK_BYTES", BLOCK)
    specs = [TensorSpec(name, "BF16", (i + 1, 3)) for i, name in enumerate(names)]
    shards = [
        ShardPlan("model-00001-of-00002.safetensors", [Job(specs[0].name, Action.COPY, (specs[0],))]),
        ShardPlan("mödel-2.safetensors", [Job(s.name, Action.COPY, (s,)) for s in specs[1:]]),
    ]
    plan = ConversionPlan(ConvertOptions(to="bf16"), shards, True, {"model_type": "x"}, (), ())
    manifest = Manifest("0.1.0", {"to": "bf16"}, {})
    assert output_bytes(plan, shards, [], manifest, None) == _reference(plan, [], manifest, None)
