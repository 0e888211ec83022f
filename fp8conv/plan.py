"""Pure planning: checkpoint + classification + options -> every output file, tensor, dtype and shape.

No tensor bytes are read here, so every refusal happens in seconds, before the long run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import rewrite_for_dequantized
from .dtypes import DEQUANT_TARGETS, ELEMENT_BYTES
from .errors import OptionsError, PlanRefused
from .formats import CONVERTIBLE, Classification, WeightFormat
from .source import Checkpoint
from .writer import TensorSpec

SAFETENSORS_METADATA = {"format": "pt"}
TARGETS = ("bf16", "channel", "block")


@dataclass(frozen=True)
class Job:
    """One output tensor: copied byte for byte from `source`, or dequantized from it with `fmt`."""

    spec: TensorSpec
    source: str
    fmt: WeightFormat | None = None

    @property
    def is_copy(self) -> bool:
        return self.fmt is None


@dataclass(frozen=True)
class ShardPlan:
    name: str  # output file name, relative to the output directory
    source_shard: str
    jobs: list[Job]

    @property
    def specs(self) -> list[TensorSpec]:
        return [j.spec for j in self.jobs]

    @property
    def nbytes(self) -> int:
        return sum(j.spec.nbytes for j in self.jobs)


@dataclass
class ConversionPlan:
    target: str
    dtype_name: str
    shards: list[ShardPlan]
    write_index: bool
    config: dict[str, Any] | None
    copy_files: list[str]
    skipped_files: list[tuple[str, str]]
    warnings: list[str] = field(default_factory=list)

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def index_document(self) -> dict[str, Any]:
        weight_map = {j.spec.name: s.name for s in self.shards for j in s.jobs}
        return {
            "metadata": {"total_size": self.output_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }


def plan_dequantize(ckpt: Checkpoint, cls: Classification, dtype_name: str = "bfloat16") -> ConversionPlan:
    """Plan --to bf16 (or float16/float32): every convertible FP8 weight dequantized, all else copied."""
    if dtype_name not in DEQUANT_TARGETS:
        raise OptionsError(f"--dtype {dtype_name} is not one of {', '.join(DEQUANT_TARGETS)}")
    if cls.problems:
        raise PlanRefused(cls.problems)
    out_dtype = DEQUANT_TARGETS[dtype_name][0]
    index = ckpt.index
    plain = set(cls.plain)
    shards = []
    for shard in index.shards:
        jobs = []
        for name, entry in shard.header.tensors.items():
            fmt = cls.weights.get(name)
            if fmt is not None and fmt.kind in CONVERTIBLE:
                jobs.append(Job(TensorSpec(name, out_dtype, entry.shape), name, fmt))
            elif name in plain:
                jobs.append(Job(TensorSpec(name, entry.dtype, entry.shape), name))
        # larger elements first keeps every tensor aligned to its element size, as safetensors does
        jobs.sort(key=lambda j: -ELEMENT_BYTES[j.spec.dtype])
        shards.append(ShardPlan(shard.name, shard.name, jobs))
    config = rewrite_for_dequantized(ckpt.config, dtype_name) if ckpt.config is not None else None
    warnings = list(cls.warnings)
    if config is None:
        warnings.append("the input has no config.json, so the output has none either")
    return ConversionPlan(
        target="bf16",
        dtype_name=dtype_name,
        shards=shards,
        write_index=index.index_file is not None or len(shards) > 1,
        config=config,
        copy_files=list(ckpt.other_files),
        skipped_files=list(ckpt.skipped_files),
        warnings=warnings,
    )
