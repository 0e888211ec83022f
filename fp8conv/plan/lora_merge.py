"""--merge-lora: the plan's jobs for the weights a LoRA adapter targets, and the adapter checked against the
base before anything runs. A targeted weight keeps its output (names, dtypes, shapes, the target's scheme),
computed from its float32 values plus the adapter's delta (rewrite.lora_merge): a block FP8 weight kept
as stored (KEEP_BLOCKS) is quantized afresh in the same blocks instead, so its fused partners (q/k/v,
gate/up) stay in one scheme. What a merge cannot reach is refused by name: packed 4-bit weights, rows in
chunks, weights kept byte for byte for their hard-coded geometry, a target the base lacks or whose shape
differs."""

from __future__ import annotations

import dataclasses
from pathlib import PurePosixPath

from ..errors import CheckpointError, OptionsError
from ..model.classify import PACKED
from ..model.families import model_type_of
from ..options import ConvertOptions
from ..source.checkpoint import Checkpoint
from ..source.lora_adapter import LoraAdapter, LoraTerm, open_adapter
from ..storage.safetensors_file import TensorEntry
from .conversion import Action, ConversionPlan, Job, ShardPlan


def with_lora_merge(
    plan: ConversionPlan, adapter: LoraAdapter, ckpt: Checkpoint, source: str
) -> tuple[ConversionPlan, LoraAdapter]:
    """The plan with every targeted weight's job merging it, and the adapter's problems and warnings
    (`source`: the checkpoint as the user named it, for the adapter's base_model_name_or_path); and the
    adapter as the base stores its targets (for_base), which the run merges."""
    adapter, problems = for_base(adapter, ckpt)
    targets = adapter.targets  # once: a release plans 100k jobs
    found: set[str] = set()
    shards = []
    for shard in plan.shards:
        jobs = []
        for job in shard.jobs:
            target = _target_of(job, targets)
            if target is None:
                jobs.append(job)
                continue
            found.add(target)
            problem = _problem(job, target, adapter, ckpt)
            if problem is not None:
                problems.append(problem)
            action = Action.QUANTIZE if job.action is Action.KEEP_BLOCKS else job.action
            jobs.append(dataclasses.replace(job, action=action, merge=target))
        shards.append(ShardPlan(shard.name, tuple(jobs)))
    for missing in sorted(targets - found):
        problems.append(
            CheckpointError(
                f"targets {missing}, which the base checkpoint does not have",
                tensor=_adapter_tensor(adapter, missing),
                file=str(adapter.weights),
                fix="merge the adapter into the model it was trained on",
            )
        )
    merged = dataclasses.replace(
        plan,
        shards=tuple(shards),
        problems=(*plan.problems, *problems),
        warnings=(*plan.warnings, *_base_model_warning(adapter, source)),
    )
    return merged, adapter


# Model types whose transformers 5 experts class holds gate_up_proj [E, 2I, H] (gate rows, then up rows) and
# down_proj [E, H, I], not transposed: the layout PEFT computes a parameter LoRA's delta in (ParamWrapper),
# read off each class's own flags by tests/rewrite/test_lora_merge.py. Another model type's is refused.
FUSED_LORA_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "deepseek_v3")


def for_base(adapter: LoraAdapter, ckpt: Checkpoint) -> tuple[LoraAdapter, list[CheckpointError]]:
    """The adapter's fused experts terms (target_parameters) as the base stores those experts: the 3-D
    parameter itself, or one Linear per expert (`experts.E.gate_proj` the gate rows, `up_proj` the up rows,
    `down_proj`); and the problems of the model type. Other terms as they are."""
    terms: dict[str, LoraTerm] = {}
    problems = []
    model_type = model_type_of(ckpt.config)
    for name, term in adapter.terms.items():
        if not term.experts:
            terms[name] = term
            continue
        if model_type not in FUSED_LORA_MODEL_TYPES:
            problems.append(
                CheckpointError(
                    f"is a LoRA on {name}, a fused experts parameter; fp8conv knows how transformers lays those out "
                    f"for {', '.join(FUSED_LORA_MODEL_TYPES)} only, not for model_type {model_type}",
                    tensor=term.a,
                    file=str(adapter.weights),
                    fix="merge with PEFT into a bf16 copy",
                )
            )
            continue
        split = _per_expert(name, term, adapter.entries)
        kept_fused = name in ckpt.index.locations or not all(n in ckpt.index.locations for n in split)
        terms.update({name: term} if kept_fused else split)  # (a fused name the base lacks: refused below)
    return dataclasses.replace(adapter, terms=terms), problems


def _per_expert(name: str, term: LoraTerm, entries: dict[str, TensorEntry]) -> dict[str, LoraTerm]:
    """A fused experts parameter's term as one term per expert Linear, by the base weight's name."""
    experts, parameter = name.rpartition(".")[::2]
    out = entries[term.b].shape[0]
    if parameter == "down_proj":
        parts = {"down_proj": None}
    else:
        parts = {"gate_proj": (0, out // 2), "up_proj": (out // 2, out)}
    return {
        f"{experts}.{e}.{linear}.weight": dataclasses.replace(term, expert=e, rows=rows)
        for e in range(term.experts)
        for linear, rows in parts.items()
    }


def _target_of(job: Job, targets: set[str]) -> str | None:
    for name in (job.spec.name, job.source):
        if name in targets:
            return name
    return None


def _problem(job: Job, target: str, adapter: LoraAdapter, ckpt: Checkpoint) -> CheckpointError | None:
    """Why this job cannot take the adapter's change, or None."""
    shard = ckpt.index.shard_of(job.source).name
    why = None
    if job.fmt is not None and job.fmt.kind in PACKED:
        why = "is a packed 4-bit weight; fp8conv does not merge LoRA into packed experts"
    elif job.action is Action.COPY and job.fmt is not None:
        why = "is kept byte for byte (its loaders hard-code its block geometry), so it cannot take a merge"
    elif job.out_chunks > 1 or job.plain_rows:
        why = "stores its rows in chunks (a pre-sharded fused projection); fp8conv does not merge into those"
    if why is not None:
        return CheckpointError(why, tensor=job.source, shard=shard, fix="merge with PEFT into a bf16 copy")
    base = tuple(ckpt.index.entry(job.source).shape)
    term, tensor = adapter.terms.get(target), _adapter_tensor(adapter, target)
    if term is not None:
        got = term.delta_shape(adapter.entries)
        what = f"B @ A is {list(got)}" + (" (an embedding's, transposed)" if term.embedding else "")
    else:
        got = tuple(adapter.entries[tensor].shape)
        what = f"the adapter's whole tensor is {list(got)}"
    if got != base:
        return CheckpointError(
            f"{what}, but {target} is {list(base)} in the base ({shard})",
            tensor=tensor,
            file=str(adapter.weights),
            fix="merge the adapter into the model it was trained on",
        )
    return None


def _adapter_tensor(adapter: LoraAdapter, target: str) -> str:
    term = adapter.terms.get(target)
    return term.a if term is not None else adapter.replacements[target]


def _base_model_warning(adapter: LoraAdapter, source: str) -> list[str]:
    """A warning where the adapter names its base and that name is not the checkpoint's (an FP8 release of
    the same model, "X-FP8", fits "X"): its shapes fit (checked), its training may not."""
    if not adapter.base_model:
        return []

    def stem(name: str) -> str:
        return PurePosixPath(name.rstrip("/")).name.lower().removesuffix("-fp8")

    if stem(adapter.base_model) == stem(source):
        return []
    return [
        f"the adapter was trained on {adapter.base_model} (its adapter_config.json), and the base here is {source}: "
        "every target's shape fits; check it is the same model"
    ]


def merge_options(options: ConvertOptions) -> tuple[ConvertOptions, LoraAdapter | None]:
    """The adapter --merge-lora names (None without one), and the options with its hash, as the manifest
    records them: options that already hold a hash (a resume's, a part's, verify's) must name this very
    adapter."""
    if not options.merge_lora:
        return options, None
    adapter = open_adapter(options.merge_lora)
    if options.merge_lora_sha256 not in (None, adapter.sha256):
        raise OptionsError(
            f"--merge-lora {options.merge_lora} is not the adapter this run must merge: its files' sha256 is "
            f"{adapter.sha256[:16]}..., and {options.merge_lora_sha256[:16]}... is named (by the output's manifest, "
            "or --merge-lora-sha256)",
            fix="pass that adapter, or convert again with --overwrite",
        )
    return dataclasses.replace(options, merge_lora_sha256=adapter.sha256), adapter
