"""How each planned job executes, chosen once, right after planning: the band size comes from the
run's memory cap. The choice is a value of its own (RunPlan), computed from the plan and never written
into it; the scheduler dispatches on RunJob.strategy and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from ..options import ConvertOptions
from ..source.index import CheckpointIndex
from ..storage.safetensors_file import TensorEntry
from .bands import BYTES_PER_BAND_ELEMENT, IN_SLOTS, band_rows, expert_banded, expert_input_bytes, streamable
from .conversion import Action, ConversionPlan, Job, RunJob, ShardPlan, Strategy


@dataclass(frozen=True)
class RunShard(ShardPlan):
    """A planned output shard, each job with its execution."""

    jobs: tuple[RunJob, ...]


@dataclass(frozen=True)
class RunPlan:
    """A plan and how this run executes it: the plan's shards, in its order, of RunJobs."""

    plan: ConversionPlan
    shards: tuple[RunShard, ...]

    @property
    def options(self) -> ConvertOptions:
        return self.plan.options

    @property
    def output_bytes(self) -> int:
        return self.plan.output_bytes

    def jobs(self) -> list[RunJob]:
        return [job for shard in self.shards for job in shard.jobs]


def strategy_of(job: Job, entry: TensorEntry, band_elements: int) -> Strategy:
    if job.merge is not None:  # a LoRA delta is added to the whole float32 weight (rewrite.lora_merge)
        return Strategy.WHOLE
    if job.spec.shape == entry.shape:  # not padded: bytes that stay as they are go file to file
        if job.action is Action.COPY:
            return Strategy.COPY_FILE
        if job.action is Action.KEEP_BLOCKS:
            return Strategy.KEEP_WEIGHT_BYTES
    if streamable(job, entry, band_elements):
        return Strategy.BANDED
    return Strategy.WHOLE


def choose_strategies(
    plan: ConversionPlan, index: CheckpointIndex, band_elements: int, capped: bool = False
) -> RunPlan:
    """Every job's strategy (and a BANDED job's rows per band) for bands of ~band_elements. `capped`
    (--max-memory): gpt-oss experts' bands are sized for the run's largest expert read, since the
    scheduler's input buffers keep that size from job to job (stream.bands_held)."""
    jobs = [job for shard in plan.shards for job in shard.jobs]
    chosen = [strategy_of(job, index.entry(job.source), band_elements) for job in jobs]
    banded = [j for j, s in zip(jobs, chosen, strict=True) if s is Strategy.BANDED]
    largest = max((expert_input_bytes(j) for j in banded if expert_banded(j)), default=0)

    def banded_job(job: Job) -> RunJob:
        elements = band_elements
        if capped and expert_banded(job):  # the budget less the larger reads' buffers
            elements -= -(-IN_SLOTS * (largest - expert_input_bytes(job)) // BYTES_PER_BAND_ELEMENT)
        return RunJob.of(job, Strategy.BANDED, band_rows(job, max(1, elements)))

    # in the plan's order, shard by shard
    run_jobs = iter(
        [RunJob.of(j, s) if s is not Strategy.BANDED else banded_job(j) for j, s in zip(jobs, chosen, strict=True)]
    )
    return RunPlan(plan, tuple(RunShard(s.name, tuple(islice(run_jobs, len(s.jobs)))) for s in plan.shards))
