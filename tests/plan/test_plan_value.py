"""The plan is a value: frozen once made; a run's strategies and warnings are computed from it, never
written into it, and its warnings do not depend on the order its parts are assembled in."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import Action, Job, Strategy, plan_conversion
from fp8conv.plan.strategy import choose_strategies
from fp8conv.source.checkpoint import open_checkpoint

STATIC = "activation_scheme was static; block FP8 is written with dynamic activations"


def _planned(path, **options):
    ckpt = open_checkpoint(path)
    return ckpt, plan_conversion(ckpt, classify(ckpt.index, ckpt.config, None), ConvertOptions(**options))


def test_a_made_plan_cannot_be_changed(tiny):
    _, plan = _planned(tiny.path, to="block")
    shard, job = plan.shards[0], plan.shards[0].jobs[0]
    changes = [(plan, "warnings", ()), (plan, "config", None), (shard, "jobs", ()), (job, "action", None)]
    for obj, name, value in changes:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, value)
    for held in (plan.shards, shard.jobs, plan.warnings, plan.problems, plan.copy_files, plan.skipped_files):
        assert isinstance(held, tuple), type(held)  # nothing to append to, no item to replace
    with pytest.raises(AttributeError):
        plan.warnings.append("x")  # type: ignore[attr-defined]


def test_strategies_are_computed_from_the_plan_not_written_into_it(tiny):
    ckpt, plan = _planned(tiny.path, to="bf16")
    shards = plan.shards
    run = choose_strategies(plan, ckpt.index, 3000)
    assert plan.shards is shards and all(type(j) is Job for s in plan.shards for j in s.jobs)
    assert run.plan is plan and [s.name for s in run.shards] == [s.name for s in plan.shards]
    planned = [j for s in plan.shards for j in s.jobs]
    assert [j.source for j in run.jobs()] == [j.source for j in planned]
    for job, mine in zip(planned, run.jobs(), strict=True):  # the plan's job, with only its execution added
        assert Job(**{f.name: getattr(mine, f.name) for f in dataclasses.fields(Job)}) == job
    assert {j.strategy for j in run.jobs()} >= {Strategy.BANDED, Strategy.COPY_FILE}
    assert all((j.band_rows > 0) == (j.strategy is Strategy.BANDED) for j in run.jobs())


def test_the_output_configs_warnings_reach_the_plan(tiny):
    """Planning config.json adds warnings (here: a static activation scheme written dynamic); the plan
    gathers them once the config is planned, whatever order its fields are listed in."""
    path = tiny.path / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["activation_scheme"] = "static"
    path.write_text(json.dumps(config))
    _, plan = _planned(tiny.path, to="block")
    assert plan.config is not None and not plan.problems
    assert plan.warnings.count(STATIC) == 1, plan.warnings
    _, bf16 = _planned(tiny.path, to="bf16")  # bf16 has no activations to declare
    assert STATIC not in bf16.warnings and all(j.action is not Action.KEEP_BLOCKS for s in bf16.shards for j in s.jobs)
