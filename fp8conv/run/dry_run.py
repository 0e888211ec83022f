"""`convert --dry-run`: what a run would do, as a value the CLI prints. Planned by prepare(), the code a
real run plans with, so it meets the same refusals; nothing is written and torch is never imported."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from ..options import ConvertOptions, RunOptions
from ..output.finish import assign_parts
from ..plan.bands import BASE_BYTES, bands_held, held_bytes, write_limits
from ..plan.conversion import RunJob, Strategy
from ..plan.strategy import RunShard
from ..records import collector_paused
from .prepare import PreparedRun, prepare

# What a dry run leaves to the real run: it needs torch, or the tensors' bytes.
NOT_CHECKED = (
    "scale values (zero, negative, NaN/Inf): `fp8conv inspect --scales` reads them",
    "the --device (choosing one loads torch)",
)


@dataclass
class ShardSummary:
    name: str  # output shard
    tensors: int  # output tensors in it
    nbytes: int  # tensor data
    strategies: dict[str, int]  # Strategy value -> jobs executed that way
    state: str = "convert"  # or "kept" (--resume: finished earlier and checks out), "other part" (--part)
    part: int | None = None  # --part / -j N: the part (1-based) that converts it


@dataclass
class PlanSummary:
    output: str
    target: str
    shards: list[ShardSummary]
    files_copied: list[str]
    files_rewritten: list[str]  # JSON files besides config.json written rewritten (Mistral params.json)
    files_skipped: list[tuple[str, str]]
    writes_config: bool  # config.json, rewritten for the target (the input may have none)
    writes_index: bool  # model.safetensors.index.json
    warnings: list[str]
    band_elements: int  # a BANDED job's band, ~elements (from --max-memory)
    max_memory: int | None
    # the figures --max-memory is checked against: what the process holds besides tensors, the writer's
    # buffers, the bands held when a job is BANDED, and the tensor whose job holds the most at once beyond
    # that (rewritten whole, or read as whole gpt-oss experts): (name, why, ~bytes)
    process_bytes: int = BASE_BYTES
    writer_bytes: int = 0  # the shard writer's segments and copy buffer (fewer under --max-memory)
    band_bytes: int = 0
    largest_held: tuple[str, str, int] | None = None
    not_checked: list[str] = field(default_factory=lambda: list(NOT_CHECKED))

    @property
    def tensors(self) -> int:
        return sum(s.tensors for s in self.shards if s.state == "convert")

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards if s.state == "convert")

    @property
    def strategies(self) -> dict[str, int]:
        """Jobs of each strategy over the shards this run converts."""
        total: Counter[str] = Counter()
        for shard in self.shards:
            if shard.state == "convert":
                total.update(shard.strategies)
        return _in_strategy_order(total)

    def to_dict(self) -> dict[str, Any]:
        totals = {"tensors": self.tensors, "bytes": self.nbytes, "strategies": self.strategies}
        return asdict(self) | {"totals": totals}


@collector_paused()  # the summary's pass over 100k jobs is made with the plan's millions of records alive
def dry_run(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    run: RunOptions | None = None,
    parts: int | None = None,
) -> PlanSummary:
    """The plan convert(source, output, options, run=run) would execute, refused as it would be (but for
    NOT_CHECKED). `parts`: the run is split into that many parts (-j N); each shard says which."""
    options = options or ConvertOptions()
    how = run or RunOptions()
    prep = prepare(source, output, options, how, dry_run=True)
    plan = prep.plan
    part_of = {}
    count = parts or (how.part[1] if how.part else None)
    if count is not None:
        part_of = {name: i + 1 for i, names in enumerate(assign_parts(plan.shards, count)) for name in names}
    # the jobs holding memory beyond the writer's: banded or rewritten whole (held_bytes is None for the rest)
    held = [j for j in _jobs_run(prep) if j.strategy is Strategy.BANDED or j.strategy is Strategy.WHOLE]
    return PlanSummary(
        output=str(output),
        target=plan.target,
        shards=[_shard_summary(s, prep, part_of.get(s.name)) for s in prep.run.shards],
        files_copied=list(plan.copy_files),
        files_rewritten=sorted(plan.json_files),
        files_skipped=list(plan.skipped_files),
        writes_config=plan.config is not None,
        writes_index=plan.write_index,
        warnings=list(prep.warnings),
        band_elements=prep.band_elements,
        max_memory=how.max_memory,
        writer_bytes=write_limits(how.max_memory, how.tuning).nbytes,
        band_bytes=bands_held([(j, prep.ckpt.index.entry(j.source)) for j in held if j.strategy is Strategy.BANDED]),
        largest_held=_largest_held(prep, held),
    )


_STRATEGY, _OUTPUTS = attrgetter("strategy"), attrgetter("outputs")


def _shard_summary(shard: RunShard, prep: PreparedRun, part: int | None) -> ShardSummary:
    state = "kept" if shard.name in prep.keep else "other part" if shard.name in prep.others else "convert"
    # counted in C, by the members (an enum's .value is a Python-level lookup, 100k of them)
    strategies = Counter(map(_STRATEGY, shard.jobs))
    return ShardSummary(
        name=shard.name,
        tensors=sum(map(len, map(_OUTPUTS, shard.jobs))),
        nbytes=shard.nbytes,
        strategies={s.value: strategies[s] for s in Strategy if strategies[s]},
        state=state,
        part=part,
    )


def _in_strategy_order(counts: Counter[str]) -> dict[str, int]:
    return {s.value: counts[s.value] for s in Strategy if counts[s.value]}


def _jobs_run(prep: PreparedRun) -> list[RunJob]:
    """The jobs this run executes: not those of shards kept from an earlier run or of other parts."""
    return [job for s in prep.run.shards if s.name not in prep.keep | prep.others for job in s.jobs]


def _largest_held(prep: PreparedRun, jobs: list[RunJob]) -> tuple[str, str, int] | None:
    """The job of `jobs` that holds the most memory at once beyond its bands, why, and ~how much
    (stream.held_bytes, what --max-memory is checked against)."""
    held = [
        (found[1], job.source, found[0])
        for job in jobs
        for found in [held_bytes(job, prep.ckpt.index.entry(job.source))]
        if found is not None
    ]
    if not held:
        return None
    nbytes, name, why = max(held)
    return name, why, nbytes
