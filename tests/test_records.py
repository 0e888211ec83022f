"""Records copied without __init__ (records.like) equal the ones __init__ makes; the collector is paused
while plans are built and restored as it was."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

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


def test_the_dry_run_summary_is_made_with_the_collector_paused(tmp_path, monkeypatch):
    """A dry run's summary walks every job while the plan's records are alive: with the collector on, a full
    collection over them took a tenth of a release's dry run."""
    import fp8conv.run.dry_run as dry_run_module
    from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

    path = write_checkpoint(
        tmp_path / "in",
        {
            "model.layers.0.mlp.down_proj.weight": fp8((256, 256)),
            "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2),
        },
        fp8_block_config(),
    )
    seen: list[bool] = []
    real = dry_run_module.bands_held  # the summary's last pass over the jobs

    def held(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(dry_run_module, "bands_held", held)
    was = gc.isenabled()
    gc.enable()
    try:
        dry_run_module.dry_run(path, tmp_path / "out")
        assert seen == [False] and gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
