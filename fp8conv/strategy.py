"""How each planned job executes, chosen once, right after planning: the band size comes from the
run's memory cap. The scheduler dispatches on Job.strategy and nothing else."""

from __future__ import annotations

from dataclasses import replace

from .index import CheckpointIndex
from .plan import Action, ConversionPlan, Job, Strategy
from .safetensors_file import TensorEntry
from .stream import BYTES_PER_BAND_ELEMENT, IN_SLOTS, band_rows, expert_banded, expert_input_bytes, streamable


def strategy_of(job: Job, entry: TensorEntry, band_elements: int) -> Strategy:
    if job.spec.shape == entry.shape:  # not padded: bytes that stay as they are go file to file
        if job.action is Action.COPY:
            return Strategy.COPY_FILE
        if job.action is Action.KEEP_BLOCKS:
            return Strategy.KEEP_WEIGHT_BYTES
    if streamable(job, entry, band_elements):
        return Strategy.BANDED
    return Strategy.WHOLE


def choose_strategies(plan: ConversionPlan, index: CheckpointIndex, band_elements: int, capped: bool = False) -> None:
    """Set every job's strategy (and a BANDED job's rows per band) for bands of ~band_elements. `capped`
    (--max-memory): gpt-oss experts' bands are sized for the run's largest expert read, since the
    scheduler's input buffers keep that size from job to job (stream.bands_held)."""
    for shard in plan.shards:
        for i, job in enumerate(shard.jobs):
            shard.jobs[i] = replace(job, strategy=strategy_of(job, index.entry(job.source), band_elements))
    banded = [job for shard in plan.shards for job in shard.jobs if job.strategy is Strategy.BANDED]
    largest = max((expert_input_bytes(job) for job in banded if expert_banded(job)), default=0)
    for shard in plan.shards:
        for i, job in enumerate(shard.jobs):
            if job.strategy is Strategy.BANDED:
                elements = band_elements
                if capped and expert_banded(job):  # the budget less the larger reads' buffers
                    elements -= -(-IN_SLOTS * (largest - expert_input_bytes(job)) // BYTES_PER_BAND_ELEMENT)
                shard.jobs[i] = replace(job, band_rows=band_rows(job, max(1, elements)))
