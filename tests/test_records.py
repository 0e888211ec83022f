"""Records copied without __init__ (records.like) equal the ones __init__ makes; the collector is paused
while plans are built and restored as it was."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from fp8conv.model.weight_format import Kind, WeightFormat
from fp8conv.plan.conversion import Action, Job, RunJob, ShardPlan, Strategy
from fp8conv.records import collector_paused, like
from fp8conv.storage.writer import TensorSpec


def test_a_copy_equals_what_replace_makes():
    proto = WeightFormat("a.weight", Kind.BLOCK, "a.weight_scale_inv", (), block=(128, 128))
    copy = like(proto, weight="b.weight", scale="b.weight_scale_inv", companions=("b.input_scale",))
    expected = dataclasses.replace(proto, weight="b.weight", scale="b.weight_scale_inv", companions=("b.input_scale",))
    assert copy == expected and hash(copy) == hash(expected) and repr(copy) == repr(expected)
    assert proto.weight == "a.weight"  # the prototype is not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        copy.weight = "c.weight"  # type: ignore[misc]


def test_a_record_with_post_init_is_refused():
    with pytest.raises(TypeError, match="__post_init__"):
        like(ShardPlan("model.safetensors", []), name="other.safetensors")


def test_a_run_job_holds_every_field_of_its_job():
    job = Job("w", Action.KEEP_BLOCKS, (TensorSpec("w", "F8_E4M3", (256, 256)),), None, (128, 128), 2)
    run_job = RunJob.of(job, Strategy.BANDED, 64)
    expected = RunJob(
        source="w",
        action=Action.KEEP_BLOCKS,
        outputs=job.outputs,
        fmt=None,
        out_block=(128, 128),
        pad_parts=2,
        strategy=Strategy.BANDED,
        band_rows=64,
    )
    assert run_job == expected and hash(run_job) == hash(expected)
    assert {f.name for f in dataclasses.fields(RunJob)} == set(vars(run_job))


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_paused_and_restored_as_it_was(enabled: bool):
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() is enabled
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("planning failed")
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
