"""Each job's execution is chosen once, after planning, and is what the run does."""

from __future__ import annotations

from dataclasses import replace

import pytest

import fp8conv
from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions, RunOptions, Tuning
from fp8conv.plan.bands import band_elements_for
from fp8conv.plan.conversion import Action, Strategy, plan_conversion
from fp8conv.plan.strategy import choose_strategies
from fp8conv.source.checkpoint import open_checkpoint


def _planned(path, band_elements: int, **options):
    ckpt = open_checkpoint(path)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config, None), ConvertOptions(**options))
    assert not plan.problems
    return ckpt, choose_strategies(plan, ckpt.index, band_elements).jobs()


@pytest.mark.parametrize(
    ("options", "weights"),
    [
        ({"to": "bf16"}, Strategy.BANDED),
        ({"to": "channel"}, Strategy.BANDED),
        ({"to": "block"}, Strategy.KEEP_WEIGHT_BYTES),
        ({"to": "block", "pad_for_tp": 8}, None),  # padded: some kept whole, the rest file to file
    ],
)
def test_every_job_gets_one_strategy(tiny, options, weights):
    ckpt, jobs = _planned(tiny.path, 3000, **options)
    for job in jobs:
        entry = ckpt.index.entry(job.source)
        padded = job.spec.shape != entry.shape
        if job.action is Action.COPY:
            assert job.strategy is (Strategy.WHOLE if padded else Strategy.COPY_FILE), job.source
        elif padded:
            assert job.strategy is Strategy.WHOLE, job.source
        elif weights is Strategy.BANDED and entry.numel <= 3000:
            assert job.strategy is Strategy.WHOLE, job.source  # one band or less: whole
        else:
            assert job.strategy is (weights or Strategy.KEEP_WEIGHT_BYTES), job.source
        if job.strategy is Strategy.BANDED:
            n, k = entry.shape
            block = job.fmt.math_block((n, k))[0] if job.fmt else 1
            assert job.band_rows % block == 0 and job.band_rows * k <= max(3000, block * k)
        else:
            assert job.band_rows == 0
    assert any(j.strategy is Strategy.BANDED for j in jobs) == (weights is Strategy.BANDED)


def test_the_default_band_keeps_tiny_weights_whole(tiny):
    _, jobs = _planned(tiny.path, band_elements_for(None), to="bf16")
    assert all(j.strategy is not Strategy.BANDED for j in jobs)
    assert {j.strategy for j in jobs if j.action is Action.DEQUANTIZE} == {Strategy.WHOLE}


@pytest.mark.parametrize(
    ("options", "streams"),
    [
        (ConvertOptions(to="block", pad_for_tp=8), "copied"),  # padded weights are never banded
        (ConvertOptions(to="channel"), "banded"),
    ],
    ids=["block-padded", "channel"],
)
def test_the_run_executes_the_strategy_the_plan_chose(tiny, tmp_path, monkeypatch, options, streams):
    """The scheduler reads the plan's choice: force every job WHOLE and nothing is streamed or copied
    file to file, yet the output is the same bytes (small bands: the plan's own choice streams some)."""
    import fp8conv.run.prepare as prepare
    from fp8conv.rewrite.banded import BandedJob
    from fp8conv.storage.writer import ShardWriter

    seen: dict[str, list] = {"banded": [], "copied": []}
    real_band, real_copy = BandedJob.__init__, ShardWriter.copy_range
    monkeypatch.setattr(BandedJob, "__init__", lambda self, *a: seen["banded"].append(a) or real_band(self, *a))
    monkeypatch.setattr(ShardWriter, "copy_range", lambda self, *a: seen["copied"].append(a) or real_copy(self, *a))
    small = RunOptions(tuning=Tuning(convert_band_elements=3000))
    fp8conv.convert(tiny.path, tmp_path / "chosen", options, run=small)
    assert seen[streams], f"nothing {streams} in the run with small bands"
    chosen = prepare.choose_strategies

    def all_whole(plan, index, band_elements, *capped):
        run = chosen(plan, index, band_elements, *capped)
        shards = tuple(replace(s, jobs=tuple(replace(j, strategy=Strategy.WHOLE) for j in s.jobs)) for s in run.shards)
        return replace(run, shards=shards)

    seen["banded"].clear()
    seen["copied"].clear()
    monkeypatch.setattr(prepare, "choose_strategies", all_whole)
    fp8conv.convert(tiny.path, tmp_path / "whole", options, run=small)
    assert not seen["banded"] and not seen["copied"]
    for f in (tmp_path / "chosen").glob("*.safetensors"):
        assert f.read_bytes() == (tmp_path / "whole" / f.name).read_bytes()
