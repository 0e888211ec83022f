"""How each planned job executes, chosen once, right after planning: the band size comes from the
run's memory cap. The scheduler dispatches on Job.strategy and nothing else."""

from __future__ import annotations

from dataclasses import replace

from .index import CheckpointIndex
from .plan import Action, ConversionPlan, Job, Strategy
from .safetensors_file import TensorEntry
from .stream import band_rows, streamable


def strategy_of(job: Job, entry: TensorEntry, band_elements: int) -> Strategy:
    if job.spec.shape == entry.shape:  # not padded: bytes that stay as they are go file to file
        if job.action is Action.COPY:
            return Strategy.COPY_FILE
        if job.action is Action.KEEP_BLOCKS:
            return Strategy.KEEP_WEIGHT_BYTES
    if streamable(job, entry, band_elements):
        return Strategy.BANDED
    return Strategy.WHOLE


def choose_strategies(plan: ConversionPlan, index: CheckpointIndex, band_elements: int) -> None:
    """Set every job's strategy (and a BANDED job's rows per band) for bands of ~band_elements."""
    for shard in plan.shards:
        for i, job in enumerate(shard.jobs):
            entry = index.entry(job.source)
            strategy = strategy_of(job, entry, band_elements)
            rows = band_rows(job, band_elements) if strategy is Strategy.BANDED else 0
            shard.jobs[i] = replace(job, strategy=strategy, band_rows=rows)
