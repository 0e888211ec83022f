"""`fp8conv inspect`: what a checkpoint is, from headers only (no tensor bytes are read)."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import Fp8ConvError
from ..model.classify import Classification, Kind, classify, has_partial_blocks
from ..model.families import ROLE_GROUPS, Family, model_type_of, text_config
from ..model.mlp_layout import RoleSplit, tp_report
from ..options import DEFAULT_BLOCK, TARGETS, ConvertOptions
from ..plan.conversion import input_family, input_width_problems, plan_conversion, role_splits
from ..plan.expert_fold import expert_fold
from ..records import collector_paused
from ..source.checkpoint import Checkpoint, open_checkpoint
from .deepgemm_ready import deepgemm_readiness

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ANY_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")  # LAYER_RE's every match, and more
# Encoders beside the decoder, whose layers are numbered on their own (Step-3.7's 47 vision layers beside 45
# decoder layers): never multi-token-prediction layers
TOWER = re.compile(r"(?:^|\.)(?:vision\w*|visual|audio\w*|sound\w*)\.")


@dataclass
class PartialBlockTensor:
    name: str
    shape: list[int]
    block: list[int]
    grid: list[int]


@dataclass
class InspectReport:
    source: str
    format: str
    quant_method: str | None
    block_size: list[int] | None
    block_size_from: str | None
    shards: int
    tensors: int
    total_bytes: int
    formats: dict[str, int]
    dtypes: dict[str, int]
    estimated_output_bytes: dict[str, int]
    partial_block_tensors: list[PartialBlockTensor]
    num_hidden_layers: int | None
    mtp_layers: list[int]
    mtp_modules: list[str]  # top-level multi-token-prediction modules: Qwen3.5's mtp.layers.0, V4's mtp.0
    tp_indivisible: dict[str, list[str]]  # TP size -> MLP widths that would not give each rank whole blocks
    # TP size -> --pad-roles choice ("dense,shared,routed", "dense,shared", ...) -> --to block bytes
    padded_output_bytes: dict[str, dict[str, int]]
    family: str | None  # the family table's entry for the model_type, None if it has none
    problems: list[str]
    warnings: list[str] = field(default_factory=list)
    scales_read: bool = False  # --scales: the scale tensors were read and their problems are listed too
    deepgemm_ready: str | None = None  # block FP8: yes / no: why / unknown (fp8conv.check.deepgemm_ready)
    # the quantization config's not-converted list (modules_to_not_convert / ignore / ...): its length and
    # the entries that match no tensor
    not_converted_entries: int = 0
    not_converted_unmatched: list[str] = field(default_factory=list)
    # MXFP8 weights' scale groups ([1, 32]: one E8M0 scale per 32 values of a row); they have no block size
    mxfp8_groups: list[list[int]] = field(default_factory=list)
    # block FP8 weights by their block ("32x32", "1x32": a grid of one scale per row under a declared
    # 32x32, model.geometry), when there is more than one; and MiMo's chunked rows, by layout
    block_geometries: dict[str, int] = field(default_factory=dict)
    chunked_layouts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@collector_paused()
def inspect(
    source: str | os.PathLike[str],
    block_size: tuple[int, int] | None = None,
    revision: str | None = None,
    scales: bool = False,
) -> InspectReport:
    """Headers only: a Hub ID not in the local cache is read remotely without downloading weights.
    `scales`: also read every scale tensor (only those) and list the problems convert refuses them for
    (zero, negative, NaN/Inf); a Hub ID is then downloaded first, as convert does."""
    ckpt = open_checkpoint(source, revision=revision, headers_only=not scales)
    cls = classify(ckpt.index, ckpt.classification_config(), block_size)
    scale_problems: list[Fp8ConvError] = []
    if scales and not cls.problems:  # as in convert: a checkpoint its headers refuse has its scales unread
        from ..plan.preflight import check_scales  # torch: plain inspect starts without it

        scale_problems = list(check_scales(ckpt, cls, allow_nonfinite=False)[0])
    layers = _num_hidden_layers(ckpt.config)
    partial = _partial_block_tensors(ckpt, cls)
    dtypes = Counter(e.dtype for _, e in ckpt.index.locations.values())
    block = cls.block_size or DEFAULT_BLOCK
    # roles found from the folded checkpoint (expert_fold, made for the estimates anyway): a module's agreeing
    # experts are asked once, not 100k times
    fold = expert_fold(ckpt, cls)
    family = input_family(ckpt, cls, among=fold)
    tp_bad = tp_report(ckpt.config, block, role_splits(ckpt, cls, among=fold), family)
    widths = input_width_problems(ckpt, cls, "config.json and the tensors disagree: correct config.json", among=fold)
    warnings = _warnings(ckpt, cls, scales, family)
    return InspectReport(
        source=str(source),
        format=cls.checkpoint_format,
        quant_method=cls.quant_method,
        block_size=list(cls.block_size) if cls.block_size else None,
        block_size_from=cls.block_source,
        shards=len(ckpt.index.shards),
        tensors=len(ckpt.index.locations),
        total_bytes=ckpt.index.total_bytes,
        formats=cls.kind_counts(),
        dtypes=dict(sorted(dtypes.items())),
        estimated_output_bytes=estimate_output_bytes(ckpt, cls),
        partial_block_tensors=partial,
        num_hidden_layers=layers,
        mtp_layers=_mtp_layers(ckpt, layers),
        mtp_modules=_mtp_modules(ckpt),
        tp_indivisible=tp_bad,
        padded_output_bytes={}
        if widths
        else padded_output_bytes(ckpt, cls, block, [int(tp) for tp, bad in tp_bad.items() if bad]),
        family=family.name if family else None,
        problems=[p.one_line() for p in [*cls.problems, *widths, *scale_problems]],
        warnings=warnings,
        scales_read=scales and not cls.problems,
        deepgemm_ready=deepgemm_readiness(ckpt, cls, scales and not cls.problems),
        not_converted_entries=len(cls.settings.not_converted),
        not_converted_unmatched=list(cls.unmatched_not_converted),
        mxfp8_groups=[
            list(g) for g in sorted({f.block for f in cls.weights.values() if f.kind is Kind.MXFP8 and f.block})
        ],
        block_geometries=_block_geometries(cls),
        chunked_layouts=dict(Counter(f.chunked.layout for f in cls.weights.values() if f.chunked is not None)),
    )


def _block_geometries(cls: Classification) -> dict[str, int]:
    """Block FP8 weights per block geometry, most first; {} when there is one (the declared) or none."""
    counts = Counter(f"{f.block[0]}x{f.block[1]}" for f in cls.weights.values() if f.kind is Kind.BLOCK and f.block)
    return dict(counts.most_common()) if len(counts) > 1 else {}


def _partial_block_tensors(ckpt: Checkpoint, cls: Classification) -> list[PartialBlockTensor]:
    """Block FP8 weights whose edge blocks are partial (a shape not a multiple of the block)."""
    partial = []
    for fmt in cls.weights.values():
        shape = ckpt.index.entry(fmt.weight).shape
        if has_partial_blocks(fmt, shape) and fmt.block:
            grid = [math.ceil(shape[-2] / fmt.block[0]), math.ceil(shape[-1] / fmt.block[1])]
            partial.append(PartialBlockTensor(fmt.weight, list(shape), list(fmt.block), grid))
    return partial


def _warnings(ckpt: Checkpoint, cls: Classification, scales: bool, family: Family | None) -> list[str]:
    warnings = list(cls.warnings) + [f"{path} is not copied: {why}" for path, why in ckpt.skipped_files]
    if scales and cls.problems:
        warnings.append("--scales: the scales are not read while the headers show problems; fix those first")
    if family is not None and family.by_rule:
        warnings.append(
            f"model_type {model_type_of(ckpt.config)!r} is not in the family table: its MLP roles are found by "
            f"rule ({family.name.split('roles by rule: ', 1)[-1].rstrip(')')})"
        )
        warnings += family.refusals
    return warnings


def inspect_invocation(block_size: tuple[int, int] | None, revision: str | None, scales: bool = False) -> str:
    """The `fp8conv inspect` that lists the problems convert found with these options (for its refusals)."""
    words = ["fp8conv inspect"] + (["--scales"] if scales else [])
    words += [f"--block-size {block_size[0]},{block_size[1]}"] if block_size else []
    return " ".join(words + ([f"--revision {revision}"] if revision else []))


def pad_role_choices(
    splits: list[RoleSplit], config: dict[str, Any] | None, tp: int, block: tuple[int, int]
) -> list[tuple[str, ...]]:
    """The --pad-roles worth offering at this TP: every MLP role the checkpoint has; and, when it has routed
    experts, the roles left once they are not padded (expert-parallel experts are not split across ranks),
    minus any role sharing their width key, offered only where it pads something and leaves no role it
    drops split into partial blocks."""
    c = text_config(config or {})
    whole = {id(s): w is None or s.whole_per_rank(w, tp, block) for s in splits for w in [s.role.width.of(c)]}
    if all(whole.values()):
        return []
    everything = tuple(g for g in ROLE_GROUPS if any(s.role.group == g for s in splits))
    routed_keys = {s.role.width.key for s in splits if s.role.group == "routed"}
    rest = tuple(
        g
        for g in everything
        if g != "routed" and all(s.role.width.key not in routed_keys for s in splits if s.role.group == g)
    )
    dropped = [s for s in splits if s.role.group not in rest and s.role.group != "routed"]
    pads = any(not whole[id(s)] for s in splits if s.role.group in rest)
    useful = routed_keys and rest and pads and all(whole[id(s)] for s in dropped)
    return [everything] + ([rest] if useful else [])


def padded_output_bytes(
    ckpt: Checkpoint, cls: Classification, block: tuple[int, int], tps: list[int]
) -> dict[str, dict[str, int]]:
    """--to block --pad-for-tp N bytes for each TP size and role choice, from the plans convert would run."""
    sizes: dict[str, dict[str, int]] = {}
    for tp in tps:
        for roles in pad_role_choices(role_splits(ckpt, cls), ckpt.config, tp, block):
            try:  # the options check themselves when made (an empty role list is refused there)
                nbytes, problems = _planned_bytes(ckpt, cls, ConvertOptions(to="block", pad_for_tp=tp, pad_roles=roles))
            except Fp8ConvError:
                continue
            if not problems:
                sizes.setdefault(str(tp), {})[",".join(roles)] = nbytes
    return sizes


def estimate_output_bytes(ckpt: Checkpoint, cls: Classification) -> dict[str, int]:
    """Bytes of tensor data each target would write, from the same plan convert would run
    (weights that would be refused are counted as they are)."""
    return {to: _planned_bytes(ckpt, cls, ConvertOptions(to=to))[0] for to in TARGETS}


def _planned_bytes(ckpt: Checkpoint, cls: Classification, options: ConvertOptions) -> tuple[int, bool]:
    """The plan's output bytes and whether it has problems, planned with experts folded (expert_fold)."""
    fold = expert_fold(ckpt, cls)
    plan = plan_conversion(ckpt, cls, options, only=fold)
    return sum(job.nbytes * fold[job.source] for shard in plan.shards for job in shard.jobs), bool(plan.problems)


def _num_hidden_layers(config: dict[str, Any] | None) -> int | None:
    for section in (config or {}, (config or {}).get("text_config") or {}):
        value = section.get("num_hidden_layers") if isinstance(section, dict) else None
        if isinstance(value, int):
            return value
    return None


def _mtp_layers(ckpt: Checkpoint, num_hidden_layers: int | None) -> list[int]:
    """Layers numbered at or past num_hidden_layers: DeepSeek's multi-token-prediction layers."""
    if num_hidden_layers is None:
        return []
    # every layer index any name holds, found in C over all the names at once: mostly none is past the last
    # decoder layer, and the names need no walk
    indices = _ANY_LAYER_INDEX.findall("\n".join(ckpt.index.locations))
    if all(int(i) < num_hidden_layers for i in set(indices)):
        return []
    # a name's first `layers.N.` lies in its parent module and the dot after it (its last part has no dot):
    # searched once per module, not per tensor (a weight and its scales share one)
    parents = {name.rpartition(".")[0] for name in ckpt.index.locations}
    found = set()
    for parent in parents:
        m = LAYER_RE.search(parent + ".")
        # the few modules past num_hidden_layers are asked whether they are a tower's, or in a top-level MTP
        # module (listed by _mtp_modules: MiMo's model.mtp.layers.N)
        if m and int(m.group(1)) >= num_hidden_layers and not (TOWER.search(parent) or parent.startswith(MTP_STARTS)):
            found.add(int(m.group(1)))
    return sorted(found)


MTP_MODULE = re.compile(r"^((?:model\.)?mtp\.(?:layers\.)?\d+)\.")  # the module as named: MiMo's keeps model.
MTP_STARTS = ("mtp.", "model.mtp.")


def _mtp_modules(ckpt: Checkpoint) -> list[str]:
    """Top-level MTP / draft modules (Qwen3.5 and Nemotron-H mtp.layers.N, DeepSeek-V4's mtp.N,
    MiMo's model.mtp.layers.N), whatever num_hidden_layers says."""
    found = {
        m.group(1)
        for name in ckpt.index.locations
        if name.startswith(MTP_STARTS)  # what every MTP_MODULE match begins with: tested first, in C
        for m in [MTP_MODULE.match(name)]
        if m
    }
    return sorted(found, key=lambda s: int(s.rsplit(".", 1)[1]))
