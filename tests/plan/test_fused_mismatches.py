"""The fused-group check (every module an engine fuses quantized all or none) against its plain definition:
it matches only the tensors that can share a group with the smaller side, and must find what matching
every tensor finds, in the same order."""

from __future__ import annotations

import random
from types import SimpleNamespace

from fp8conv.dtypes import FP8_E4M3
from fp8conv.model.families import fused_group
from fp8conv.plan.conversion import Action, Job, ShardPlan, fused_mismatches
from fp8conv.storage.writer import TensorSpec


def _reference(shards: list[ShardPlan]) -> list[tuple[str, str]]:
    """(FP8 member named, plain member named) of each mismatched group, by matching every job."""
    schemes: dict[str, dict[str, bool]] = {}
    for shard in shards:
        for job in shard.jobs:
            group = fused_group(job.source)
            if group is not None:
                schemes.setdefault(group, {})[job.source] = job.spec.dtype == FP8_E4M3
    found = []
    for members in schemes.values():
        if len(set(members.values())) > 1:
            found.append((min(n for n, q in members.items() if q), min(n for n, q in members.items() if not q)))
    return found


def _names(rng: random.Random) -> list[str]:
    names = []
    for layer in range(4):
        p = f"model.layers.{layer}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + f"mlp.experts.{e}.{x}_proj.weight" for e in range(6) for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "mlp.gate.weight"]
    rng.shuffle(names)
    return names


def _plan(names: list[str], quantized: set[str]) -> list[ShardPlan]:
    jobs = [Job(n, Action.COPY, (TensorSpec(n, FP8_E4M3 if n in quantized else "BF16", (8, 8)),)) for n in names]
    return [ShardPlan("a.safetensors", jobs[: len(jobs) // 2]), ShardPlan("b.safetensors", jobs[len(jobs) // 2 :])]


def test_fused_mismatches_are_what_matching_every_tensor_finds() -> None:
    rng = random.Random(24)
    ckpt = SimpleNamespace(index=SimpleNamespace(shard_of=lambda name: SimpleNamespace(name="a.safetensors")))
    mismatched = 0
    for share in (0.02, 0.3, 0.7, 0.98, 0.0, 1.0):  # the FP8 side smaller, larger, empty, everything
        for _ in range(20):
            names = _names(rng)
            quantized = {n for n in names if rng.random() < share}
            shards = _plan(names, quantized)
            found = [
                (p.tensor, p.problem.split(" while ")[1].split(" stays")[0])
                for p in fused_mismatches(shards, ckpt, None)
            ]
            assert found == _reference(shards)
            mismatched += bool(found)
    assert mismatched > 20  # the draws reach mismatches, and their absence
