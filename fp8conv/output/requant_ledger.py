"""The requantization record as a run keeps it on disk: each shard's tensors' reports are saved with
the manifest entry that records the shard finished, so an interrupted run's manifest holds the reports
of exactly the shards it finished, and `--resume` (or a part retried with --resume) carries the kept
shards' reports instead of losing them: the final record is the one an uninterrupted run writes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..plan.conversion import Action, ConversionPlan, Job, ShardPlan
from .requant_report import TensorError, requant_record


def reported_weights(shard: ShardPlan) -> list[str]:
    """The shard's weights that a run reports on (requantized to power-of-two scales, quantized to INT8
    rows, or merged with a LoRA adapter), by output name."""
    return [job.spec.name for job in shard.jobs if _reported(job)]


def _reported(job: Job) -> bool:
    int8 = job.action is Action.QUANTIZE and job.spec.dtype == "I8"
    return job.action is Action.QUANTIZE_POW2 or int8 or job.merge is not None


def kept_reports(
    plan: ConversionPlan, intact: set[str], saved: Mapping[str, TensorError]
) -> tuple[set[str], dict[str, TensorError]]:
    """Of the shards an interrupted run finished (`intact`), those whose every reported weight has its
    report in the run's saved record, and those reports. A shard lacking one (a record written before
    reports were saved per shard, or cut by hand) is redone: the same bytes, and its report measured."""
    keep: set[str] = set()
    reports: dict[str, TensorError] = {}
    for shard in plan.shards:
        weights = reported_weights(shard)
        if shard.name in intact and all(w in saved for w in weights):
            keep.add(shard.name)
            reports.update((w, saved[w]) for w in weights)
    return keep, reports


class Ledger:
    """The reports of the shards committed so far (the kept shards' first), as the manifest saves them."""

    def __init__(self, plan: ConversionPlan, kept: Mapping[str, TensorError], measured: Mapping[str, TensorError]):
        # measured: the run's live reports by weight (the scheduler's totals): a shard's are all in before
        # its commit is submitted, so the write thread reads only keys the main thread has finished writing
        self._weights = {shard.name: reported_weights(shard) for shard in plan.shards}
        self._measured = measured
        self.reports = dict(kept)

    def committed(self, shard: str) -> dict[str, Any] | None:
        """The record to save with `shard`'s manifest entry; None when the shard adds no report (the
        record saved so far stands: summarising every tensor again per shard is wasted work)."""
        weights = self._weights[shard]
        if not weights:
            return None
        self.reports.update((w, self._measured[w]) for w in weights)
        return requant_record(self.reports)
