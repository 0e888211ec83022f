"""Pure planning: checkpoint + classification + options -> every output file, tensor, dtype and shape.

No tensor bytes are read here, so every refusal happens in seconds, before the long run.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Container
from dataclasses import dataclass, field, replace
from enum import Enum
from itertools import chain, compress
from operator import attrgetter, itemgetter, methodcaller, mul, not_
from typing import Any

from ..dtypes import DEQUANT_TARGETS, ELEMENT_BYTES, FP8_E4M3, FP8_MAX_GAUDI2, FP8_MAX_STANDARD
from ..errors import CheckpointError, OptionsError
from ..model.classify import CONVERTIBLE, PACKED, V4_SCALE_SUFFIX, Classification, Kind, WeightFormat, module_of
from ..model.families import FUSED_EXPERTS, NO_ROLE_TAILS, Family, fused_module, model_type_of, role_of, table_family
from ..model.family_widths import family_of, role_shapes, width_disagreements, width_settings
from ..model.geometry import stated_geometry
from ..model.interleaved import interleaved_problems, reads_fused_channel
from ..model.kv_scales import declare_kv_cache, dropped_warning, kv_scale_names, per_head_kv_scales
from ..model.mimo_kv import fused_qkv_chunks, fused_qkv_problems, mimo_text_config
from ..model.mlp_layout import (
    MlpPadding,
    Pad,
    RoleSplit,
    is_quantizable_linear,
    plan_mlp_padding,
    text_config,
    updated_widths_config,
)
from ..model.packed_formats import packed_output_shape
from ..options import DEFAULT_BLOCK, MXFP8_GROUP, UE8M0_BLOCK, ConvertOptions
from ..records import copied_as
from ..source.checkpoint import Checkpoint
from ..source.config import (
    MISTRAL_PARAMS_NAME,
    compressed_tensors_block,
    find_quantization_config,
    load_config,
    rewrite_for_block,
    rewrite_for_channel,
    rewrite_for_dequantized,
    rewrite_for_int8,
    rewrite_for_mxfp8,
    rewrite_mistral_params,
)
from ..source.index import Shard
from ..source.mistral_native import (
    FAKE_QUANTIZER,
    fake_quantizer_warning,
    native_only,
    native_params,
    native_problems,
    native_scale_name,
)
from ..storage.writer import TensorSpec
from .expert_fold import shape_fold

SAFETENSORS_METADATA = {"format": "pt"}
DEEPSEEK_V4_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v41_text")  # expert_dtype, the `.scale` names
DEQUANTIZE_NAME = {name: target[0] for name, target in DEQUANT_TARGETS.items()}
# an embedding table (transformers-5 FP8Embedding), not a Linear named after one (embed_vision.embedding_projection)
_EMBEDDING = re.compile(
    r"(?:^|\.)(?:embed_tokens|tok_embeddings|word_embeddings|wte|embeddings?|\w*_embedding)\.weight$"
)


def _maybe_embedding(name: str) -> bool:
    """What every name _EMBEDDING matches contains: a test far cheaper than the regex, for 100k weights."""
    return "emb" in name or "wte" in name


class Action(str, Enum):
    COPY = "copy"  # the bytes, unchanged (zero-padded along the MLP width with --pad-for-tp)
    DEQUANTIZE = "dequantize"  # FP8 -> bf16/f16/f32
    QUANTIZE = "quantize"  # FP8 (dequantized in float32) or float -> FP8 with new channel/block scales
    KEEP_BLOCKS = "keep-blocks"  # block FP8 kept as is: weight bytes, scales widened to float32
    QUANTIZE_POW2 = "quantize-pow2"  # FP8 with E8M0 scales (ue8m0 blocks, MXFP8): fp8conv.rewrite.pow2


class Strategy(str, Enum):
    """How a job executes, chosen once per run (fp8conv.plan.strategy) and read by the scheduler only."""

    COPY_FILE = "copy-file"  # bytes go file to file, never held whole (an unpadded COPY)
    KEEP_WEIGHT_BYTES = "keep-weight-bytes"  # KEEP_BLOCKS unpadded: weight file to file, scale rewritten
    BANDED = "banded"  # a large 2-D FP8 weight rewritten band by band of rows
    WHOLE = "whole"  # read whole, rewritten by rewrite.jobs.run_job


@dataclass(frozen=True)
class Job:
    """One input weight (or plain tensor) and the output tensors it becomes: the weight first."""

    source: str
    action: Action
    outputs: tuple[TensorSpec, ...]
    fmt: WeightFormat | None = None  # how the source is quantized; None for a float tensor
    out_block: tuple[int, int] | None = None  # QUANTIZE: output block; None means one scale per row
    pad_parts: int = 1  # padded: the padded axis holds this many widths (fused gate_up), each padded
    # rows stored in chunks (fmt.chunked): an FP8 output keeps them, each chunk on its own scale grid
    # (out_chunks of them); a float output is written in the plain order engines read (plain_rows)
    out_chunks: int = 1
    plain_rows: bool = False
    merge: str | None = None  # --merge-lora: the adapter's key (the base weight's name) merged into the weight

    @property
    def spec(self) -> TensorSpec:
        return self.outputs[0]

    @property
    def nbytes(self) -> int:
        return sum([o.nbytes for o in self.outputs])  # a list: no generator made for two outputs


@dataclass(frozen=True, kw_only=True)
class RunJob(Job):
    """A planned job and how one run executes it: made from the plan's Job by fp8conv.plan.strategy (the plan
    itself is never rewritten), read by the scheduler."""

    strategy: Strategy
    band_rows: int = 0  # BANDED: rows per band

    @classmethod
    def of(cls, job: Job, strategy: Strategy, band_rows: int = 0) -> RunJob:
        return copied_as(cls, job, strategy=strategy, band_rows=band_rows)  # a release has 100k jobs


_OUTPUTS, _DTYPE, _SHAPE = attrgetter("outputs"), attrgetter("dtype"), attrgetter("shape")
_JOBS, _SOURCE, _FIRST = attrgetter("jobs"), attrgetter("source"), itemgetter(0)


@dataclass(frozen=True)
class ShardPlan:
    name: str  # output file name, relative to the output directory
    jobs: tuple[Job, ...]

    def __post_init__(self) -> None:  # frozen all the way down: a list handed in is held as a tuple
        object.__setattr__(self, "jobs", tuple(self.jobs))

    @property
    def specs(self) -> list[TensorSpec]:
        """Layout order. The order tensors are produced in (each weight, then its scale) when that keeps
        every tensor aligned to its element size, as it does for real model shapes: the writer then
        hashes the file as it goes and never reads it back. Otherwise larger elements first, which is
        always aligned (what safetensors itself does); those files are hashed partly by reading back."""
        specs = [o for j in self.jobs for o in j.outputs]
        offset = 0
        for spec in specs:
            if offset % ELEMENT_BYTES[spec.dtype]:
                return sorted(specs, key=lambda s: -ELEMENT_BYTES[s.dtype])
            offset += spec.nbytes
        return specs

    @property
    def nbytes(self) -> int:
        """Every output's bytes, element size times elements, summed in C: a Python step per tensor (a
        property of each job and spec) cost a tenth of a dry run over a release's 100k jobs."""
        specs = list(chain.from_iterable(map(_OUTPUTS, self.jobs)))
        sizes = map(ELEMENT_BYTES.__getitem__, map(_DTYPE, specs))
        return sum(map(mul, sizes, map(math.prod, map(_SHAPE, specs))))


@dataclass(frozen=True)
class ConversionPlan:
    """A value, made once by plan_conversion: a run's strategies (fp8conv.plan.strategy) and warnings are
    computed from it, never written into it. The config and JSON documents are dicts, for JSON."""

    options: ConvertOptions
    shards: tuple[ShardPlan, ...]
    write_index: bool
    config: dict[str, Any] | None
    copy_files: tuple[str, ...]
    skipped_files: tuple[tuple[str, str], ...]
    claims_ue8m0: bool = False  # --to block: write scale_fmt ue8m0 if every output scale is a power of two
    json_files: dict[str, dict[str, Any]] = field(default_factory=dict)  # other JSON files, rewritten
    problems: tuple[CheckpointError, ...] = ()
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # lists handed in are held as tuples
        for name in ("shards", "copy_files", "skipped_files", "problems", "warnings"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @property
    def target(self) -> str:
        return self.options.to

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def index_document(self) -> dict[str, Any]:
        weight_map = {o.name: s.name for s in self.shards for j in s.jobs for o in j.outputs}
        return {"metadata": {"total_size": self.output_bytes}, "weight_map": dict(sorted(weight_map.items()))}


def plan_conversion(
    ckpt: Checkpoint, cls: Classification, options: ConvertOptions, only: Collection[str] | None = None
) -> ConversionPlan:
    """Every output tensor and file. Refused inputs are planned as copies; the caller checks problems.
    `only`: plan these tensors and no others (expert_fold's, for an estimate: not a plan to run)."""
    planner = _Planner(ckpt, cls, options)
    chosen = None if only is None else _by_shard(ckpt, only)
    shards = _without_empty(
        [
            ShardPlan(s.name, planner.jobs_for(s, None if chosen is None else chosen.get(s.name, [])))
            for s in ckpt.index.shards
        ]
    )
    # the config before the problems and warnings are gathered: planning it adds to the planner's
    config = planner.output_config()
    problems = [*cls.problems, *planner.problems, *fused_mismatches(shards, ckpt, planner.family)]
    problems += _width_problems(ckpt, config, shards, cls, planner.family)
    problems += fused_qkv_problems(ckpt.index, ckpt.config, cls.weights, options.to)
    if options.to in ("block", "mxfp8"):
        fp8 = [(j.spec.name, s.name) for s in shards for j in s.jobs if j.spec.dtype == FP8_E4M3]
        problems += interleaved_problems(
            ckpt.config, fp8, "block --scale-fmt ue8m0" if planner.pow2 and options.to == "block" else options.to
        )
    warnings = [*cls.warnings, *planner.warnings]
    native = _plan_mistral_native(ckpt, cls, planner, shards)
    if config is None and native is None:  # Mistral-native files have params.json, rewritten for the output
        warnings.append("the input has no config.json, so the output has none either")
    if native is None:
        files, native_problems_, native_warnings = _plan_mistral_params(ckpt, config, options.to), (), ()
    else:
        files, shards, native_problems_, native_warnings = native.files, native.shards, native.problems, native.warnings
    return ConversionPlan(
        options=options,
        shards=tuple(shards),
        write_index=ckpt.index.index_file is not None or len(shards) > 1,
        config=config,
        copy_files=files.copy_files,
        skipped_files=files.skipped_files,
        # --scale-fmt ue8m0 writes scale_fmt itself; otherwise kept where every written scale is a power of two
        claims_ue8m0=options.to == "block" and options.scale_fmt is None and cls.settings.scale_fmt == "ue8m0",
        json_files=files.json_files,
        problems=(*problems, *files.problems, *native_problems_),
        warnings=(*warnings, *native_warnings),
    )


@dataclass(frozen=True)
class _Native:
    """A Mistral-native-only release as planned: its params.json rewritten, its scales renamed."""

    files: _OtherFiles
    shards: list[ShardPlan]
    problems: tuple[CheckpointError, ...]
    warnings: tuple[str, ...]


def _plan_mistral_native(
    ckpt: Checkpoint, cls: Classification, planner: _Planner, shards: list[ShardPlan]
) -> _Native | None:
    """A release of Mistral-native files only: converted in their own names, scales named as vLLM's Mistral
    loader reads them, params.json's quantization rewritten (fp8conv.source.mistral_native). None: not one."""
    shard_names = [s.name for s in ckpt.index.shards]
    if not native_only(shard_names, ckpt.config is not None, ckpt.other_files):
        return None
    copied = tuple(name for name in ckpt.other_files if name != MISTRAL_PARAMS_NAME)
    skipped = tuple(ckpt.skipped_files)
    try:
        params = load_config(ckpt.root / MISTRAL_PARAMS_NAME)
    except CheckpointError as exc:
        return _Native(_OtherFiles(copied, skipped, {}), shards, (exc,), ())
    first = next(iter(cls.weights), None)
    shard = ckpt.index.shard_of(first).name if first else shard_names[0]
    to = planner.options.to
    problems = tuple(native_problems(shard, first, to, params, planner.pow2, planner.out_block[0]))
    fakes = [n for n in ckpt.index.locations if FAKE_QUANTIZER.search(n)]
    warnings = (fake_quantizer_warning(fakes),) if fakes else ()
    ignore = sorted(set(planner.unquantized_linears))
    if to == "bf16":
        rewritten = rewrite_mistral_params(params, None, to) or params
        return _Native(_OtherFiles(copied, skipped, {MISTRAL_PARAMS_NAME: rewritten}), shards, problems, warnings)
    if to == "channel":
        flavor = "float8_e4m3fnuz" if planner.options.fp8_max == FP8_MAX_GAUDI2 else None
        quant = rewrite_for_channel({}, ignore, flavor)["quantization_config"]
    elif to == "int8":  # (refused: native_problems; the params as they would be)
        quant = rewrite_for_int8({}, ignore)["quantization_config"]
    else:
        quant = compressed_tensors_block(planner.out_block, ignore)
    files = _OtherFiles(copied, skipped, {MISTRAL_PARAMS_NAME: native_params(params, quant, ignore)})
    renamed = [
        ShardPlan(
            s.name,
            [
                replace(
                    j, outputs=(j.outputs[0], *(replace(o, name=native_scale_name(o.name, to)) for o in j.outputs[1:]))
                )
                if j.action in (Action.QUANTIZE, Action.KEEP_BLOCKS)
                else j
                for j in s.jobs
            ],
        )
        for s in shards
    ]
    return _Native(files, renamed, problems, warnings)


@dataclass(frozen=True)
class _OtherFiles:
    """The input's other files: copied, skipped (and why), or rewritten JSON; a problem reading them."""

    copy_files: tuple[str, ...]
    skipped_files: tuple[tuple[str, str], ...]
    json_files: dict[str, dict[str, Any]]
    problems: tuple[CheckpointError, ...] = ()


def _plan_mistral_params(ckpt: Checkpoint, config: dict[str, Any] | None, target: str) -> _OtherFiles:
    """A copied params.json would still declare the input's FP8 to vLLM --config-format mistral."""
    copied, skipped = tuple(ckpt.other_files), tuple(ckpt.skipped_files)
    if MISTRAL_PARAMS_NAME not in copied:
        return _OtherFiles(copied, skipped, {})
    try:
        params = load_config(ckpt.root / MISTRAL_PARAMS_NAME)
    except CheckpointError as exc:
        return _OtherFiles(copied, skipped, {}, (exc,))
    copied = tuple(name for name in copied if name != MISTRAL_PARAMS_NAME)
    rewritten = rewrite_mistral_params(params, config, target)
    if rewritten is None:
        spelled = "INT8 (no confirmed reading in vLLM's Mistral loader)" if target == "int8" else "block FP8"
        why = f"Mistral-format config with no spelling for {spelled}; config.json describes the output"
        return _OtherFiles(copied, (*skipped, (MISTRAL_PARAMS_NAME, why)), {})
    return _OtherFiles(copied, skipped, {MISTRAL_PARAMS_NAME: rewritten})


# how a row-scaled target is named in messages
_ROW_SCALED = {"channel": "channel FP8", "int8": "INT8 W8A8"}


class _Planner:
    def __init__(self, ckpt: Checkpoint, cls: Classification, options: ConvertOptions) -> None:
        self.ckpt, self.cls, self.options = ckpt, cls, options
        self.problems: list[CheckpointError] = []
        self.warnings: list[str] = []
        self.unquantized_linears: list[str] = []
        self.kept_fused_experts: list[str] = []  # bf16 fused experts a block run could not quantize
        self.out_block = options.block_size or cls.block_size or DEFAULT_BLOCK
        self.pow2 = options.to == "mxfp8" or options.scale_fmt == "ue8m0"  # scales written as E8M0
        if options.to == "mxfp8":
            self.out_block = MXFP8_GROUP
        # an unquantized checkpoint (e.g. bf16 after fine-tuning) gets its Linears quantized
        self.quantize_floats = options.to != "bf16" and not cls.holds_quantized()
        self.row_dtype = "I8" if options.to == "int8" else FP8_E4M3  # a row-scaled target's weights
        # a model_type the table does not name has its roles found by rule from the tensors (roles.py)
        self.family = input_family(ckpt, cls)
        self.padding: MlpPadding | None = None
        # transformers-5 FineGrainedFP8Config saves write quantization_config.expert_dtype "fp8" too
        self.deepseek_v4 = cls.settings.expert_dtype is not None and model_type_of(ckpt.config) in DEEPSEEK_V4_TYPES
        if options.to == "int8" and self.deepseek_v4:
            self.problems.append(_int8_v4_problem(ckpt, cls))
        if options.pad_for_tp:
            packed = next((w.weight for w in cls.weights.values() if w.kind in PACKED), None)
            if self.deepseek_v4 or packed is not None:
                # its MLP names (ffn.experts.E.w1, *_blocks, weight_packed) are not the ones padding knows:
                # config.json would claim padded widths the tensors do not have. Named by a packed weight
                raise OptionsError(
                    "--pad-for-tp does not know the MLP layout of DeepSeek-V4 or packed 4-bit checkpoints",
                    tensor=packed,
                    shard=None if packed is None else ckpt.index.shard_of(packed).name,
                    fix="convert without --pad-for-tp",
                )
            self.padding = plan_mlp_padding(
                ckpt.config,
                options.pad_for_tp,
                self.out_block,
                role_splits(ckpt, cls),
                options.pad_roles,
                self.family,
            )
            self.warnings += self.padding.warnings
        self.plain = set(cls.plain)
        mimo = mimo_text_config(ckpt.config)
        self.fused_qkv_chunks = fused_qkv_chunks(mimo) if mimo is not None else None
        self._unpadded: dict[tuple[int, ...], Pad] = {}
        # (format kind, its block, plain scale rows, shape, padded shape, parts) -> block job's action and grid
        self._block_kinds: dict[tuple[Any, ...], tuple[Action, tuple[int, ...]]] = {}
        # FP8 outputs keep the KV-cache scales (vLLM applies them under an fp8 / compressed-tensors config);
        # a bf16 output has no quantization_config, so it drops them
        self.kv_scales = kv_scale_names(ckpt.index, cls.plain, cls.settings.method is not None)
        if options.to == "bf16" and self.kv_scales:
            self.plain -= set(self.kv_scales)
            self.warnings.append(dropped_warning(self.kv_scales))
            self.kv_scales = []
        self.problems += per_head_kv_scales(ckpt.index, self.kv_scales, "block" if self.pow2 else options.to)
        if options.scale_fmt == "ue8m0" and self.out_block != UE8M0_BLOCK:
            self.problems.append(_ue8m0_block_problem(ckpt, cls, self.out_block))

    def jobs_for(self, shard: Shard, only: list[str] | None = None) -> list[Job]:
        """The shard's jobs in file order; `only`: of these of its tensors alone (in file order)."""
        shard_name, tensors = shard.name, shard.header.tensors
        jobs = []
        # `only`: this shard's part of a folded estimate's few thousand, not its every tensor
        chosen = tensors.items() if only is None else [(n, tensors[n]) for n in only]
        weights, plain = self.cls.weights, self.plain
        for name, entry in chosen:
            fmt = weights.get(name)
            if fmt is None and name not in plain:
                continue  # a scale or companion, written with its weight
            try:
                pad = self._padded(name, entry.shape, shard_name)
            except CheckpointError as exc:
                self.problems.append(exc)
                pad = Pad(entry.shape)
            if fmt is not None and fmt.kind in PACKED:
                jobs.append(self._packed_job(fmt, shard_name))
            elif fmt is not None and fmt.kind in CONVERTIBLE and self._kept_as_stored(name, fmt):
                jobs += self._stored_copies(fmt)
            elif fmt is not None and fmt.kind in CONVERTIBLE:
                jobs.append(self._quantized_job(name, fmt, entry.shape, pad))
            else:
                jobs.append(self._plain_job(name, entry.dtype, entry.shape, pad))
        return jobs

    def _kept_as_stored(self, name: str, fmt: WeightFormat) -> bool:
        """An FP8 output keeps a tensor whose geometry the family's loaders hard-code (model.geometry)."""
        return (
            self.options.to != "bf16"
            and fmt.kind is Kind.BLOCK
            and fmt.block is not None
            and stated_geometry(self.ckpt.config, name) == fmt.block
        )

    def _stored_copies(self, fmt: WeightFormat) -> list[Job]:
        """The weight and its scale as stored, one COPY job of two outputs: bytes file to file, each as
        large as it is (a 91 GiB Engram table streams)."""
        assert fmt.scale is not None
        index = self.ckpt.index
        specs = tuple(TensorSpec(n, index.entry(n).dtype, index.entry(n).shape) for n in (fmt.weight, fmt.scale))
        return [Job(fmt.weight, Action.COPY, specs, fmt)]

    def _padded(self, name: str, shape: tuple[int, ...], shard: str) -> Pad:
        padded = self.padding.padded_shape(name, shape, shard) if self.padding is not None else None
        if padded is None:  # one unpadded Pad per shape (frozen), not one per tensor
            padded = self._unpadded.get(shape) or self._unpadded.setdefault(shape, Pad(shape))
        return padded

    def _quantized_job(self, name: str, fmt: WeightFormat, shape: tuple[int, ...], pad: Pad) -> Job:
        to, out_shape = self.options.to, pad.shape
        if to == "bf16":
            out_dtype = DEQUANT_TARGETS[self.options.dtype][0]
            plain = fmt.chunked is not None  # vLLM reads a float fused projection in the plain order
            return Job(name, Action.DEQUANTIZE, (TensorSpec(name, out_dtype, shape),), fmt, plain_rows=plain)
        if _maybe_embedding(name) and _EMBEDDING.search(name):  # no engine builds an FP8 embedding: dequantized
            self.warnings.append(f"{name} is an FP8 embedding; written as bf16 (engines load embeddings unquantized)")
            return Job(name, Action.DEQUANTIZE, (TensorSpec(name, "BF16", shape),), fmt)
        base = module_of(name)
        if self.pow2:
            return self._pow2_job(name, base, out_shape, fmt, pad.parts)
        if self.options.row_scaled:  # (a chunked fused projection is refused: fused_qkv_problems)
            if not name.endswith(".weight") and not (to == "channel" and reads_fused_channel(self.ckpt.config, name)):
                self.problems.append(
                    CheckpointError(
                        f"is a fused expert parameter as transformers 5 saves it; no engine reads {_ROW_SCALED[to]} "
                        "(compressed-tensors) in that layout",
                        tensor=name,
                        shard=self.ckpt.index.shard_of(name).name,
                        fix="convert with --to bf16, or --to block (transformers' fused FP8 layout)",
                    )
                )
            outputs = _channel_outputs(base, out_shape, name, self.row_dtype)
            return Job(name, Action.QUANTIZE, outputs, fmt, None, pad.parts)
        # what the job is but for its names, once per kind of weight (a release has 100k in a few dozen)
        chunks = fmt.chunked.chunks if fmt.chunked is not None else 1
        key = (fmt.kind, fmt.block, fmt.row_scales is None, shape, out_shape, pad.parts, chunks)
        known = self._block_kinds.get(key)
        if known is None:
            keep = fmt.kind is Kind.BLOCK and fmt.block == self.out_block and self.options.fp8_max == FP8_MAX_STANDARD
            # scales in another unit (MiMo's per-head K/V) are written on the plain grid; chunked rows keep
            # their per-chunk grid (a plain grid over chunks of whole blocks is that grid too)
            if fmt.chunked is None:
                keep = keep and fmt.row_scales is None
            else:
                keep = keep and (fmt.row_scales is not None or shape[-2] // chunks % self.out_block[0] == 0)
            # a fused [gate; up] whose halves are not whole blocks has blocks spanning both: padding each half
            # moves rows of one input block into two output blocks, so it is quantized afresh
            keep = keep and _parts_whole_blocks(shape, out_shape, pad.parts, self.out_block)
            action = Action.KEEP_BLOCKS if keep else Action.QUANTIZE
            known = self._block_kinds[key] = (action, chunked_grid(out_shape, self.out_block, chunks))
        scale = _block_scale_name(fmt, base) or name + "_scale_inv"
        outputs = (TensorSpec(name, FP8_E4M3, out_shape), TensorSpec(scale, "F32", known[1]))
        return Job(name, known[0], outputs, fmt, self.out_block, pad.parts, out_chunks=chunks)

    def _packed_job(self, fmt: WeightFormat, shard_name: str) -> Job:
        """A packed 4-bit weight: dequantized in float32, then rounded once or quantized to FP8."""
        assert fmt.out_name is not None
        shape = packed_output_shape(fmt)
        if self.options.to == "bf16":
            out_dtype = DEQUANTIZE_NAME[self.options.dtype]
            return Job(fmt.weight, Action.DEQUANTIZE, (TensorSpec(fmt.out_name, out_dtype, shape),), fmt)
        if fmt.kind is Kind.MXFP4_GPT_OSS:
            self.problems.append(
                CheckpointError(
                    f"gpt-oss MXFP4 experts have no FP8 layout that transformers or vLLM load (--to {self.options.to})",
                    tensor=fmt.weight,
                    shard=shard_name,
                    fix="convert gpt-oss with --to bf16",
                )
            )
        base = module_of(fmt.out_name)  # never padded: --pad-for-tp refuses packed checkpoints
        if self.pow2:
            return replace(self._pow2_job(fmt.out_name, base, shape, fmt, 1), source=fmt.weight)
        if self.options.row_scaled:
            return Job(fmt.weight, Action.QUANTIZE, _channel_outputs(base, shape, None, self.row_dtype), fmt, None)
        outputs = _block_outputs(base, shape, self.out_block, fmt.out_name, _block_scale_name(fmt, base))
        return Job(fmt.weight, Action.QUANTIZE, outputs, fmt, self.out_block)

    def _pow2_job(self, name: str, base: str, shape: tuple[int, ...], fmt: WeightFormat | None, parts: int) -> Job:
        """E8M0 scales: MXFP8's uint8 [.., N, K/32] `weight_scale`, or ue8m0 blocks' float8_e8m0fnu grid."""
        shard = self.ckpt.index.shard_of(fmt.weight if fmt is not None else name).name
        if self.options.to == "mxfp8":
            self.problems += mxfp8_shape_problems(name, shape, shard)
            outputs = (TensorSpec(name, FP8_E4M3, shape), TensorSpec(name + "_scale", "U8", _grid(shape, MXFP8_GROUP)))
        else:
            chunks = fmt.chunked.chunks if fmt is not None and fmt.chunked is not None else 1
            scale_name = (_block_scale_name(fmt, base) if fmt is not None else None) or name + "_scale_inv"
            scale = TensorSpec(scale_name, self._ue8m0_dtype(fmt), chunked_grid(shape, self.out_block, chunks))
            outputs = (TensorSpec(name, FP8_E4M3, shape), scale)
            return Job(name, Action.QUANTIZE_POW2, outputs, fmt, self.out_block, parts, out_chunks=chunks)
        return Job(name, Action.QUANTIZE_POW2, outputs, fmt, self.out_block, parts)

    def _ue8m0_dtype(self, fmt: WeightFormat | None) -> str:
        """How --scale-fmt ue8m0 stores a weight's power-of-two scales: float32 (DeepSeek-V3.1's layout,
        what every block-FP8 client reads) unless asked otherwise, or the input stores them as E8M0 under
        DeepSeek-V4's `.scale` (then its output keeps that storage, as V4's loaders read it)."""
        asked = self.options.scale_dtype
        v4 = fmt is not None and fmt.scale is not None and fmt.scale.endswith(V4_SCALE_SUFFIX)
        return "F8_E8M0" if asked == "e8m0" or (asked is None and v4) else "F32"

    def _plain_job(self, name: str, dtype: str, shape: tuple[int, ...], pad: Pad) -> Job:
        out_shape = pad.shape
        is_linear = is_quantizable_linear(name, dtype, len(shape), self.family)
        listed = self.cls.settings.lists_as_not_converted(module_of(name))
        if self.quantize_floats and is_linear and not listed:
            base = module_of(name)
            if self.fused_qkv_chunks is not None and name.endswith(".self_attn.qkv_proj.weight"):
                self.problems.append(
                    CheckpointError(
                        f"is MiMo's fused qkv_proj in a float checkpoint (read as plain [Q; K; V]); as FP8 the engines "
                        f"read it in {self.fused_qkv_chunks} chunks, each on its own scale grid, which fp8conv does "
                        "not write from a float input",
                        tensor=name,
                        shard=self.ckpt.index.shard_of(name).name,
                        fix="convert the FP8 release itself, or keep this checkpoint in bf16",
                    )
                )
            if self.pow2:
                return self._pow2_job(name, base, out_shape, None, pad.parts)
            if self.options.row_scaled:
                outputs = _channel_outputs(base, out_shape, None, self.row_dtype)
                return Job(name, Action.QUANTIZE, outputs, None, None, pad.parts)
            block = self.out_block
            return Job(name, Action.QUANTIZE, _block_outputs(base, out_shape, block), None, block, pad.parts)
        fused_channel = len(shape) == 3 and reads_fused_channel(self.ckpt.config, name)
        if fused_channel and self.quantize_floats and self.options.to == "channel" and not listed:
            # its engine reads these 3-D parameters as channel FP8, `<param>_scale` [E, out, 1] (vLLM InklingMoE)
            return Job(name, Action.QUANTIZE, _channel_outputs(name, out_shape, name), None, None, pad.parts)
        if name.endswith(".weight") and len(shape) >= 2 and dtype != FP8_E4M3 and not _embedding_table(name, shape):
            self.unquantized_linears.append(module_of(name))
        elif (m := FUSED_EXPERTS.match(name)) and len(shape) == 3 and dtype != FP8_E4M3:
            if self._block_fused_experts(name, out_shape, listed):
                block = self.out_block
                return Job(name, Action.QUANTIZE, _block_outputs(name, out_shape, block, name), None, block, pad.parts)
            # transformers swaps every `*.experts` module not listed for FP8 experts (and vLLM quantizes
            # a FusedMoE not ignored): bf16 fused experts left as they are must be listed, or they load as garbage
            self.unquantized_linears.append(m.group(1))
            if self.options.row_scaled and self.family is not None and not self.family.fused_experts_beside_channel:
                self.problems.append(
                    CheckpointError(
                        f"is a fused 3-D expert parameter; transformers loads {self.family.name} experts under a "
                        "compressed-tensors config one Linear per expert (experts.E.gate_proj ...), so it would not "
                        f"load beside {_ROW_SCALED[self.options.to]}",
                        tensor=name,
                        shard=self.ckpt.index.shard_of(name).name,
                        fix="convert with --to block or --to bf16",
                    )
                )
        return Job(name, Action.COPY, (TensorSpec(name, dtype, out_shape),), pad_parts=pad.parts)

    def _block_fused_experts(self, name: str, shape: tuple[int, ...], listed: bool) -> bool:
        """A bf16 fused 3-D expert parameter quantized in place as 3-D block FP8 (--to block): where the
        family's engine loads that layout (Family.block_fused_experts) and each gate / up half is whole
        row blocks (vLLM splits gate_up_proj_scale_inv in two along its rows); else kept and listed."""
        if not (self.quantize_floats and self.options.to == "block" and not self.pow2 and not listed):
            return False
        if self.family is None or not self.family.block_fused_experts:
            return False
        bn, gate_up = self.out_block[0], name.endswith("gate_up_proj")
        if not (gate_up or name.endswith("down_proj")):
            return False  # a fused up_proj alone (non-gated): no loader mapping for it was confirmed
        hidden = text_config(self.ckpt.config or {}).get("hidden_size")
        # [E, 2I, H] / [E, H, I], as transformers 5 saves them (not the transposed [E, H, 2I])
        if shape[-1 if gate_up else -2] != hidden:
            return False
        width = shape[-2] // 2 if gate_up else shape[-1]
        if width % bn == 0 and (not gate_up or shape[-2] % 2 == 0):
            return True
        if not self.kept_fused_experts:  # one line for every such tensor (a release has thousands)
            self.warnings.append(
                f"fused expert parameters ({name}, ...) kept bf16 and listed as not converted: their expert width "
                f"{width} is not whole {bn}-row blocks, and vLLM splits the fused gate/up scale grid in halves; "
                "--pad-for-tp pads them to whole blocks"
            )
        self.kept_fused_experts.append(name)
        return False

    def output_config(self) -> dict[str, Any] | None:
        config = self.ckpt.config
        if config is None:
            return None
        to = self.options.to
        if to == "bf16":
            return _with_expert_dtype(rewrite_for_dequantized(config, self.options.dtype), None)
        ignore = sorted(set(self.unquantized_linears))
        # DeepSeek-V4: every expert is FP8 now (block FP8 with float32 scales, as V4's Base model ships)
        expert_dtype = "fp8" if self.deepseek_v4 else None
        if to == "channel":
            flavor = "float8_e4m3fnuz" if self.options.fp8_max == FP8_MAX_GAUDI2 else None
            out = _with_expert_dtype(rewrite_for_channel(config, ignore, flavor), expert_dtype)
        elif to == "int8":  # (DeepSeek-V4 is refused: int8_v4_problem)
            out = rewrite_for_int8(config, ignore)
        elif to == "mxfp8":
            spelling = self.options.mxfp8_format or "compressed-tensors"
            out = _with_expert_dtype(rewrite_for_mxfp8(config, ignore, spelling), expert_dtype)
            if self.padding is not None:
                updated_widths_config(out, self.padding)
        else:
            out = _with_expert_dtype(rewrite_for_block(config, self.out_block, ignore), expert_dtype)
            if self.options.scale_fmt == "ue8m0":
                # DeepSeek-V3.1's spelling: DeepGEMM takes the scales as they are
                out["quantization_config"]["scale_fmt"] = "ue8m0"
            if self.padding is not None:
                updated_widths_config(out, self.padding)
            if self.cls.settings.activation_scheme == "static":
                self.warnings.append("activation_scheme was static; block FP8 is written with dynamic activations")
        input_qconfig = find_quantization_config(config)[0]
        # ModelOpt's config.json spelling reads compressed-tensors' kv_cache_scheme, as --to channel writes it
        kv_target = "channel" if to == "mxfp8" else to
        self.warnings += declare_kv_cache(out["quantization_config"], input_qconfig, self.kv_scales, kv_target)
        return out


# The last name part of an embedding table (embed_tokens, word_embeddings, pos_embed, wte): never a Linear
# (Inkling's `model.llm.unembed` is its LM head: a Linear)
_EMBEDDING_TABLE = re.compile(r"(?:(?<!un)embed|embedding|embeddings|emb|wte|wpe|tokens)$")


def _embedding_table(name: str, shape: tuple[int, ...]) -> bool:
    """An embedding (not listed in ignore); a 2-D `*embed*` module whose own name is a projection
    (Gemma-4's embed_vision.embedding_projection, a patch_embedder.input_proj) is a Linear."""
    if "embed" not in name:
        return False
    return len(shape) != 2 or bool(_EMBEDDING_TABLE.search(module_of(name)))


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def chunked_grid(shape: tuple[int, ...], block: tuple[int, int], chunks: int) -> tuple[int, ...]:
    """The block grid of a weight whose rows are `chunks` chunks, each on its own grid, stacked."""
    if chunks == 1:
        return _grid(shape, block)
    return (*shape[:-2], chunks * math.ceil(shape[-2] // chunks / block[0]), math.ceil(shape[-1] / block[1]))


def mxfp8_shape_problems(name: str, shape: tuple[int, ...], shard: str) -> list[CheckpointError]:
    """MXFP8 holds a Linear's [N, K] weight (or fused experts' [E, N, K]) whose K is whole 1x32 groups."""
    if not name.endswith(".weight"):
        why = "is a fused expert parameter as transformers 5 saves it; no engine reads MXFP8 in that layout"
        return [CheckpointError(why, tensor=name, shard=shard, fix="convert with --to bf16 or --to block")]
    if len(shape) < 2 or shape[-1] % MXFP8_GROUP[1]:
        return [
            CheckpointError(
                f"has K = {shape[-1] if shape else 0}, not a multiple of {MXFP8_GROUP[1]}: MXFP8 has one scale per "
                f"1x{MXFP8_GROUP[1]} group along K",
                tensor=name,
                shard=shard,
                fix="convert with --to block or --to channel",
            )
        ]
    return []


def _ue8m0_block_problem(ckpt: Checkpoint, cls: Classification, block: tuple[int, int]) -> CheckpointError:
    """DeepGEMM's power-of-two scales come in 128x128 blocks only."""
    blocks = [f.weight for f in cls.weights.values() if f.kind is Kind.BLOCK]
    name = next(iter(blocks or cls.weights), None) or next(iter(cls.plain), "")
    shard = ckpt.index.shard_of(name).name if name else None
    return CheckpointError(
        f"would be written in {block[0]}x{block[1]} blocks; --scale-fmt ue8m0 (DeepGEMM) takes 128x128 blocks only",
        tensor=name or None,
        shard=shard,
        fix="add --block-size 128,128, or drop --scale-fmt ue8m0",
    )


def _channel_outputs(
    base: str, shape: tuple[int, ...], weight: str | None = None, dtype: str = FP8_E4M3
) -> tuple[TensorSpec, ...]:
    # X.weight -> X.weight_scale; a bare fused parameter X (transformers 5) -> X_scale
    weight = weight or base + ".weight"
    return (
        TensorSpec(weight, dtype, shape),
        TensorSpec(weight + "_scale", "F32", (*shape[:-1], 1)),
    )


def _block_outputs(
    base: str,
    shape: tuple[int, ...],
    block: tuple[int, int],
    weight: str | None = None,
    scale_name: str | None = None,
) -> tuple[TensorSpec, ...]:
    weight = weight or base + ".weight"
    return (
        TensorSpec(weight, FP8_E4M3, shape),
        TensorSpec(scale_name or weight + "_scale_inv", "F32", _grid(shape, block)),
    )


def _block_scale_name(fmt: WeightFormat, base: str) -> str | None:
    """DeepSeek-V4 names block scales `<module>.scale`; its output keeps that name (None: the default)."""
    return base + V4_SCALE_SUFFIX if fmt.scale is not None and fmt.scale.endswith(V4_SCALE_SUFFIX) else None


def _int8_v4_problem(ckpt: Checkpoint, cls: Classification) -> CheckpointError:
    """DeepSeek-V4's loaders take its experts' dtype from expert_dtype (fp8 or fp4): none reads INT8."""
    first = next(iter(cls.weights), None)
    return CheckpointError(
        "is DeepSeek-V4, whose loaders (vLLM, sglang, transformers) read its experts as expert_dtype fp8 or fp4; "
        "none reads INT8 experts",
        tensor=first,
        shard=ckpt.index.shard_of(first).name if first else None,
        fix="convert with --to bf16, --to channel or --to block",
    )


def _with_expert_dtype(config: dict[str, Any], value: str | None) -> dict[str, Any]:
    """DeepSeek-V4's expert_dtype (top level, text_config, or inside quantization_config) set or dropped."""
    sections = [config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    for section in sections:
        if "expert_dtype" in section or (value is not None and section is config):
            if value is None:
                section.pop("expert_dtype", None)
            else:
                section["expert_dtype"] = value
        qc = section.get("quantization_config")
        if isinstance(qc, dict) and "expert_dtype" in qc:
            qc["expert_dtype"] = value
            if value is None:
                qc.pop("expert_dtype")
    return config


def _parts_whole_blocks(shape: tuple[int, ...], out_shape: tuple[int, ...], parts: int, block: tuple[int, int]) -> bool:
    if parts == 1 or shape == out_shape:
        return True
    axis = next(i for i in range(len(shape)) if shape[i] != out_shape[i]) - len(shape)
    return (shape[axis] // parts) % block[axis] == 0


def _by_shard(ckpt: Checkpoint, names: Collection[str]) -> dict[str, list[str]]:
    """Shard name -> those of `names` it holds, in its file order (header entries are by offset)."""
    found: dict[str, list[str]] = {}
    for name in sorted(names, key=lambda n: ckpt.index.entry(n).start):
        found.setdefault(ckpt.index.shard_of(name).name, []).append(name)
    return found


_SHARD_NAME = re.compile(r"^(.*-)(\d+)-of-(\d+)(\.safetensors)$")


def _without_empty(shards: list[ShardPlan]) -> list[ShardPlan]:
    """No output shard for an input shard whose every tensor is dropped (one holding only scales, with
    --to bf16). The rest are renumbered when the input is numbered PREFIX-i-of-N (what save_pretrained
    and huggingface_hub write): the output then reads 1..M of M, as its own files are, instead of
    'of-N' with gaps. Other names are kept as they are."""
    kept = [s for s in shards if s.jobs]
    if len(kept) == len(shards) or not kept:
        return shards
    matches = [_SHARD_NAME.match(s.name) for s in shards]
    numbered = all(m and int(m.group(2)) == i + 1 and int(m.group(3)) == len(shards) for i, m in enumerate(matches))
    if not numbered or len({(m.group(1), m.group(4), len(m.group(2))) for m in matches if m}) != 1:
        return kept
    first = matches[0]
    assert first is not None
    digits = len(first.group(2))
    return [
        ShardPlan(f"{first.group(1)}{i + 1:0{digits}d}-of-{len(kept):0{digits}d}{first.group(4)}", s.jobs)
        for i, s in enumerate(kept)
    ]


INPUT_WIDTHS_FIX = "config.json and the tensors disagree: correct config.json (or the tensors)"


def input_family(ckpt: Checkpoint, cls: Classification, among: Container[str] | None = None) -> Family | None:
    """The input's family; for a model_type the table does not name, found by rule from the tensors of
    `among` (inspect's expert_fold), else of shape_fold: one expert standing for each module's others, which
    agree with it in name past the index and shape, all the rules read. The first call decides."""
    if "family" not in cls.memo:
        # the table's, when it names the model_type: the tensors' shapes (200k) are gathered only for the rules
        known = table_family(ckpt.config) if ckpt.config else None
        if known is None and ckpt.config:
            asked = shape_fold(ckpt, cls) if among is None else among
            shapes = [t for t in cls.input_shapes(ckpt.index) if t[0] in asked]
            known = family_of(ckpt.config, role_shapes(shapes, cls.unpacked_names()))
        cls.memo["family"] = known
    return cls.memo["family"]


# a role tensor of a gated MLP: engines merge its gate with the up projection (vLLM MergedColumnParallelLinear)
_GATED = re.compile(r"(?:\.(?:gate_proj|w1)\.weight|gate_up_proj(?:\.weight)?)$")


def role_splits(ckpt: Checkpoint, cls: Classification, among: Container[str] | None = None) -> list[RoleSplit]:
    """Each MLP role the input has, in the family's order: its first tensor (in file order), whether a --to
    block run writes any of its tensors as FP8 and whether it is gated (mlp_layout.RoleSplit). Found in one
    pass for every plan and report. A packed 4-bit weight plays the role of the weight it unpacks to.
    `among`: ask these tensors alone (inspect's expert_fold, whose folded experts agree with the one standing
    for them in name past the index, shape, format and listing: all this reads); the first call decides."""
    if "role_splits" not in cls.memo:
        family, found = input_family(ckpt, cls, among), {}
        weights, settings = cls.weights, cls.settings
        quantize_floats = family is not None and not cls.holds_quantized()
        packed = cls.unpacked_names()
        names = ckpt.index.locations if among is None else [n for n in ckpt.index.locations if n in among]
        for name in names if family is not None else ():
            # asked of every name but scales and packed weights: the width checks ask it again
            named, hit = name, None if name.endswith(NO_ROLE_TAILS) else role_of(family, name)
            if hit is None and name in packed:
                named = packed[name]
                hit = role_of(family, named)
            if hit is None:
                continue
            role, tensor = hit
            split = found.get(id(role))  # by identity: a role's hash walks its patterns
            if split is not None and split.block_fp8 and split.gated:
                continue  # nothing more to learn of this role (a release's 100k expert weights)
            fmt = weights.get(name)
            fp8 = fmt is not None and fmt.kind in CONVERTIBLE | PACKED
            if not fp8 and quantize_floats:  # a bf16 checkpoint: its Linears quantized as the planner does
                entry = ckpt.index.entry(name)
                linear = is_quantizable_linear(name, entry.dtype, len(entry.shape), family)
                fp8 = linear and not settings.lists_as_not_converted(module_of(name))
            gated = tensor.parts > 1 or _GATED.search(named) is not None
            if split is None:
                found[id(role)] = RoleSplit(role, named, fp8, gated)
            elif (fp8 and not split.block_fp8) or (gated and not split.gated):
                found[id(role)] = replace(split, block_fp8=split.block_fp8 or fp8, gated=split.gated or gated)
        order = family.roles if family is not None else ()
        cls.memo["role_splits"] = sorted(found.values(), key=lambda split: order.index(split.role))
    return cls.memo["role_splits"]


def input_width_problems(
    ckpt: Checkpoint, cls: Classification, fix: str = INPUT_WIDTHS_FIX, among: Container[str] | None = None
) -> list[CheckpointError]:
    """config.json against the input's tensors, checked once whatever the number of plans (and, once they
    agree, whatever the fix a message would name). Asked first of the folded tensors, `among` (inspect's
    expert_fold) or the shape_fold the rules made, when there is one: folded experts agree with the one
    standing for them in shape and in all a width's verdict reads (name past the expert index, layer), so a
    check of those that finds nothing is the whole check; one that finds something is made again on every
    tensor, which names each. (Without a fold, every tensor at once: a fold costs more than that check; at
    Kimi-K2.5's 208k tensors it was no faster and held 34 MB more.) A packed 4-bit weight is asked as the
    weight it unpacks to."""
    key = "widths:" + fix
    if key not in cls.memo:
        found: list[CheckpointError] = []
        if not cls.memo.get("widths agree"):
            shapes, family = cls.input_shapes(ckpt.index), input_family(ckpt, cls, among)
            asked, unpacked = among if among is not None else cls.memo.get("shape_fold"), cls.unpacked_names()
            folded = None if asked is None else [t for t in shapes if t[0] in asked]
            if folded is None or width_disagreements(ckpt.config, folded, fix, family, unpacked):
                found = width_disagreements(ckpt.config, shapes, fix, family, unpacked)
        cls.memo[key] = found
        cls.memo["widths agree"] = not found
    return list(cls.memo[key])


def _width_problems(
    ckpt: Checkpoint,
    config: dict[str, Any] | None,
    shards: list[ShardPlan],
    cls: Classification,
    family: Family | None,
) -> list[CheckpointError]:
    """config.json and the tensors must agree on every MLP width, in the input and in the output (whose
    roles are the input's: the same names, padded where --pad-for-tp pads them)."""
    problems = input_width_problems(ckpt, cls)
    if problems or config is None or _widths_as_input(ckpt, config, shards, cls, family):
        return problems
    # each job's weight: its scales and companions are no MLP role's tensors (their grids are no widths)
    outputs = ((j.spec.name, j.spec.shape, s.name) for s in shards for j in s.jobs)
    return width_disagreements(
        config,
        outputs,
        "the output's config.json would disagree with its tensors (a bug: please report it)",
        family,
    )


def _widths_as_input(
    ckpt: Checkpoint, config: dict[str, Any], shards: list[ShardPlan], cls: Classification, family: Family | None
) -> bool:
    """Whether the output's width check is the input's, which found nothing: the same config values read and
    every job's weight what the input's check read, same name and shape (its input tensor; a packed weight
    unpacked, by the name and shape it unpacks to; nothing padded or renamed). A pass over the jobs costs a
    fifth of asking each of a release's 100k weights its role again."""
    if family is None or ckpt.config is None or width_settings(config, family) != width_settings(ckpt.config, family):
        return False
    locations, unpacked = ckpt.index.locations, cls.unpacked_names()
    for shard in shards:
        for job in shard.jobs:
            spec = job.outputs[0]
            if spec.name == job.source and spec.shape == locations[job.source][1].shape:
                continue
            fmt = job.fmt  # (unpacked to its own name: a ModelOpt uint8 X.weight)
            if fmt is None or spec.name != unpacked.get(job.source) or spec.shape != fmt.shape:
                return False
    return True


def fused_mismatches(shards: list[ShardPlan], ckpt: Checkpoint, family: Family | None) -> list[CheckpointError]:
    """Modules an engine fuses must all be quantized or all not, or vLLM refuses to load them.

    A group can disagree only when both sides have members: the fused group of every tensor on the smaller
    side (the few plain ones of an FP8 output) is found, then only those tensors of the other side whose
    name starts with one of those groups' modules are matched (a group's module is its members' start).
    The jobs' names and dtypes, the two sides and the prefix test are found in C (a release has 100k)."""
    jobs = list(chain.from_iterable(map(_JOBS, shards)))
    names = list(map(_SOURCE, jobs))
    quantized = list(map(FP8_E4M3.__eq__, map(_DTYPE, map(_FIRST, map(_OUTPUTS, jobs)))))
    fp8 = list(compress(range(len(names)), quantized))
    plain = list(compress(range(len(names)), map(not_, quantized)))
    if not fp8 or not plain:
        return []
    small, large = (fp8, plain) if len(fp8) <= len(plain) else (plain, fp8)
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for i in small:
        found = fused_module(names[i], family)
        if found is not None:
            groups.setdefault(found, []).append((i, names[i]))
    modules = tuple({module for module, _ in groups})
    starts_a_module = methodcaller("startswith", modules)
    for i in compress(large, map(starts_a_module, map(names.__getitem__, large))) if modules else ():
        found = fused_module(names[i], family)
        if found is not None and found in groups:
            groups[found].append((i, names[i]))
    problems = []
    for members in sorted(groups.values(), key=lambda m: min(m)):  # first met in the jobs' order
        if len({quantized[i] for i, _ in members}) > 1:
            fp8_names = sorted(n for i, n in members if quantized[i])
            plain_names = sorted(n for i, n in members if not quantized[i])
            problems.append(
                CheckpointError(
                    f"would be FP8 while {plain_names[0]} stays unquantized, but engines fuse them into one layer",
                    tensor=fp8_names[0],
                    shard=ckpt.index.shard_of(fp8_names[0]).name,
                    fix="quantize both or neither (check modules_to_not_convert / ignore lists)",
                )
            )
    return problems
