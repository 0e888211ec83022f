"""Options as values: what shapes the output (ConvertOptions), how a run goes (RunOptions) and how its work
is cut (Tuning, a part of RunOptions).

Both are frozen and check themselves once, when made: a value that exists is valid, so convert, verify
and the CLI never check an option again. Torch-free: the CLI builds them before torch is loaded.
ConvertOptions is recorded in the output's manifest; to_dict/from_dict are that record and also what
`convert -j N` hands its worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from .backends import DEVICES
from .dtypes import DEQUANT_TARGETS, FP8_MAX_GAUDI2, FP8_MAX_STANDARD, INT8_MAX
from .errors import OptionsError
from .model.families import ROLE_GROUPS
from .storage.direct_io import ALIGN
from .storage.preread import PIECE_BYTES
from .storage.shard_reader import DIRECT_MIN_BYTES
from .storage.writer import MAX_SEGMENTS, SEGMENT_BYTES

if TYPE_CHECKING:
    from .source.shard_fetch import ShardSource

TARGETS = ("bf16", "channel", "block", "mxfp8", "int8")
# one float32 scale per output row, dynamic per-token activations (compressed-tensors): FP8 or INT8 weights
ROW_SCALED_TARGETS = ("channel", "int8")
SCALE_FORMATS = ("ue8m0",)  # --to block --scale-fmt: power-of-two scales (stored as SCALE_DTYPES say)
# --scale-dtype, how --scale-fmt ue8m0 stores its power-of-two scales: float32 (DeepSeek-V3.1's weight_scale_inv,
# what every block-FP8 client reads) or float8_e8m0fnu (DeepSeek-V4's `.scale`; mlx-lm reads its raw byte,
# mistral.rs refuses it). Unset: float32, but e8m0 where the input stores it so (a V4 `.scale`)
SCALE_DTYPES = ("float32", "e8m0")
# --mxfp8-format, how --to mxfp8 spells its config: compressed-tensors' mxfp8-quantized (vLLM's
# CompressedTensorsW8A8Mxfp8, and transformers through compressed-tensors) or ModelOpt's quant_algo MXFP8
MXFP8_FORMATS = ("compressed-tensors", "modelopt")
DEFAULT_BLOCK = (128, 128)  # the output block when neither --block-size nor the input says
UE8M0_BLOCK = (128, 128)  # the only block DeepGEMM takes power-of-two scales in
MXFP8_GROUP = (1, 32)  # MXFP8: one E8M0 scale per 32 values along K
DEFAULT_DTYPE = "bfloat16"
DEFAULT_DEVICE = "auto"
DEFAULT_PREFETCH = 1  # --stream: output shards whose inputs are fetched ahead of the one converting
# progress(bytes_written_so_far, total_bytes_planned)
ProgressCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertOptions:
    """Everything that changes the output's bytes; recorded in the manifest, so resume, the parts of a
    fan-out and verify see the same."""

    to: str = "bf16"
    dtype: str = DEFAULT_DTYPE  # --to bf16: the output dtype
    block_size: tuple[int, int] | None = None  # asserts the input's block size; the output's for --to block
    fp8_max: float = FP8_MAX_STANDARD  # 240: the Gaudi2 range (--to channel)
    pad_for_tp: int | None = None  # --to block: pad MLP widths so each of N ranks holds whole blocks
    pad_roles: tuple[str, ...] | None = None  # with pad_for_tp: the MLP roles padded (None: all)
    keep_model_card: bool = False  # README.md copied unchanged (by default a "Converted with fp8conv" note is added)
    scale_fmt: str | None = None  # --to block: "ue8m0" writes power-of-two scales
    scale_dtype: str | None = None  # with ue8m0: how they are stored (SCALE_DTYPES; None: by the input)
    mxfp8_format: str | None = None  # --to mxfp8: the config's spelling (MXFP8_FORMATS; None: compressed-tensors)
    merge_lora: str | None = None  # --merge-lora: a PEFT LoRA adapter (folder or Hub ID) merged into the weights
    # the adapter's sha256 (source.lora_adapter): filled in when the run opens it, so a manifest names the
    # very adapter, and a resume, a part or verify with another one is refused
    merge_lora_sha256: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def row_scaled(self) -> bool:
        """One scale per output row (--to channel, --to int8): the same plan, another element type."""
        return self.to in ROW_SCALED_TARGETS

    @property
    def quant_max(self) -> float:
        """The largest magnitude a written weight code holds: the FP8 range, or 127 for INT8."""
        return INT8_MAX if self.to == "int8" else self.fp8_max

    def validate(self) -> None:
        if self.to not in TARGETS:
            raise OptionsError(f"--to {self.to} is not one of {', '.join(TARGETS)}")
        if self.dtype not in DEQUANT_TARGETS:
            raise OptionsError(f"--dtype {self.dtype} is not one of {', '.join(DEQUANT_TARGETS)}")
        if self.block_size is not None and (len(self.block_size) != 2 or min(self.block_size) < 1):
            raise OptionsError(f"--block-size {self.block_size} is not two positive integers", fix="e.g. 128,128")
        if self.fp8_max not in (FP8_MAX_STANDARD, FP8_MAX_GAUDI2):
            raise OptionsError(f"--fp8-max {self.fp8_max:g} is not 448 (standard) or 240 (Gaudi2)")
        if self.fp8_max != FP8_MAX_STANDARD and self.to != "channel":
            raise OptionsError(
                "--fp8-max 240 / --target gaudi2 applies to --to channel only",
                fix="only the compressed-tensors config can tell vllm-gaudi the weights are pre-scaled",
            )
        if self.pad_for_tp is not None and (self.to not in ("block", "mxfp8") or self.pad_for_tp < 1):
            raise OptionsError("--pad-for-tp N (N >= 1) applies to --to block only, or --to mxfp8")
        if self.scale_fmt is not None and (self.to != "block" or self.scale_fmt not in SCALE_FORMATS):
            raise OptionsError(
                f"--scale-fmt {self.scale_fmt} applies to --to block only, and is one of {', '.join(SCALE_FORMATS)}",
                fix="--to mxfp8 writes E8M0 scales without it",
            )
        if self.scale_dtype is not None and (self.scale_fmt is None or self.scale_dtype not in SCALE_DTYPES):
            raise OptionsError(
                f"--scale-dtype {self.scale_dtype} applies with --scale-fmt ue8m0 only, and is one of "
                f"{', '.join(SCALE_DTYPES)}"
            )
        if self.mxfp8_format is not None and (self.to != "mxfp8" or self.mxfp8_format not in MXFP8_FORMATS):
            raise OptionsError(
                f"--mxfp8-format {self.mxfp8_format} applies to --to mxfp8 only, and is one of "
                f"{', '.join(MXFP8_FORMATS)}"
            )
        if self.merge_lora_sha256 is not None and not self.merge_lora:
            raise OptionsError("merge_lora_sha256 is an adapter's hash, and no --merge-lora adapter is given")
        if self.pad_roles is not None:
            if self.pad_for_tp is None:
                raise OptionsError("--pad-roles applies with --pad-for-tp only")
            unknown = [r for r in self.pad_roles if r not in ROLE_GROUPS] or ([] if self.pad_roles else ["(none)"])
            if unknown:
                raise OptionsError(f"--pad-roles {','.join(unknown)} is not a list of {', '.join(ROLE_GROUPS)}")

    def to_dict(self) -> dict[str, Any]:
        """The manifest's record. Options added since a field was introduced are left out at their
        default, so manifests of runs without them stay as they were (and still resume)."""
        d = asdict(self)
        d["block_size"] = list(self.block_size) if self.block_size else None
        if self.pad_roles is None:
            d.pop("pad_roles")
        else:
            d["pad_roles"] = list(self.pad_roles)
        if not self.keep_model_card:
            d.pop("keep_model_card")
        for optional in ("scale_fmt", "scale_dtype", "mxfp8_format", "merge_lora", "merge_lora_sha256"):
            if d[optional] is None:
                d.pop(optional)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConvertOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise OptionsError(
                f"unknown conversion option(s) {', '.join(unknown)}", fix="use the fp8conv that wrote it"
            )
        opts = dict(d)
        for key in ("block_size", "pad_roles"):
            if opts.get(key) is not None:
                opts[key] = tuple(opts[key])
        return cls(**opts)


@dataclass(frozen=True)
class Tuning:
    """How a run's work is cut: band, segment and read sizes. The output's bytes are the same whatever
    these say (the defaults are the measured fast ones); tests make them small so that a tiny checkpoint
    takes every path: many bands, many segments, direct reads of every size. Not a user option (the CLI's
    --tuning is hidden)."""

    # a converted weight's band: ~4M elements, 4 MB of FP8 in, 8 MB of bf16 out; --max-memory makes it
    # smaller, never larger (plan/bands.py)
    convert_band_elements: int = 1 << 22
    # Float32 elements of one of verify's bands: 16 MiB. The bound check keeps up to about ten band-sized
    # float32 temporaries alive (the dequantized input, q, the scale expanded twice, amax, the difference,
    # the bound), so verify's peak is the interpreter's ~230 MiB plus ~200 MiB, whatever the tensor's size
    # (measured: 64 MiB bands peaked at 0.9 GiB). A band is still 256+ rows of a real model's widest
    # weight, so the Python per band is noise next to its arithmetic (check/verify_bands.py).
    verify_band_elements: int = 4 << 20
    packed_chunk_elements: int = 1 << 18  # float32 values decoded at once, packed bands to FP8 (rewrite/unpack.py)
    segment_bytes: int = SEGMENT_BYTES  # the shard writer's aligned segments (storage/writer.py)
    max_segments: int = MAX_SEGMENTS  # segments a shard writer holds at once without --max-memory
    direct_min_bytes: int = DIRECT_MIN_BYTES  # smaller input reads go through the page cache (shard_reader.py)
    piece_bytes: int = PIECE_BYTES  # warm start's unit of reading ahead and of release (storage/preread.py)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise OptionsError(f"tuning {f.name} {value!r} is not an integer")
        for name in ("convert_band_elements", "verify_band_elements", "packed_chunk_elements", "max_segments"):
            if getattr(self, name) < 1:
                raise OptionsError(f"tuning {name} {getattr(self, name)} is not a positive integer")
        if self.direct_min_bytes < 0:
            raise OptionsError(f"tuning direct_min_bytes {self.direct_min_bytes} is negative")
        for name in ("segment_bytes", "piece_bytes"):  # direct I/O reads and writes them at aligned offsets
            if getattr(self, name) < ALIGN or getattr(self, name) % ALIGN:
                raise OptionsError(f"tuning {name} {getattr(self, name)} is not a positive multiple of {ALIGN}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tuning:
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionsError(f"unknown tuning value(s) {', '.join(unknown)}")
        return cls(**d)


DEFAULT_TUNING = Tuning()


@dataclass(frozen=True)
class RunOptions:
    """How one run goes; the output's bytes are the same whatever these say."""

    overwrite: bool = False  # replace the checkpoint in a non-empty output directory
    resume: bool = False  # keep the shards an interrupted run finished that still check out
    part: tuple[int, int] | None = None  # (I, N): convert only the I-th of N parts of the shards
    device: str = DEFAULT_DEVICE  # where the arithmetic runs (every backend writes the same bits)
    allow_nonfinite: bool = False  # convert weights whose scales hold NaN/Inf instead of refusing
    space_check: bool = True  # compare the planned output size with the free space first
    verify_after: bool = False  # read the output back and check it
    revision: str | None = None  # Hub branch, tag or commit
    max_memory: int | None = None  # bytes; large weights stream in smaller bands
    direct_io: bool = True  # large reads and all shard writes bypass the page cache where it is allowed
    stream: bool | ShardSource = False  # a Hub ID's shards fetched `prefetch` ahead, or a ShardSource's
    evict_input: bool = False  # --stream: each input shard removed once every output reading it is written
    prefetch: int = DEFAULT_PREFETCH
    tuning: Tuning = DEFAULT_TUNING  # how the work is cut (tests: small bands and segments); never the bytes
    progress: ProgressCallback | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.part is not None and (len(self.part) != 2 or not 1 <= self.part[0] <= self.part[1]):
            raise OptionsError(f"--part {self.part} is not I/N with 1 <= I <= N", fix="e.g. --part 2/8")
        if self.device not in DEVICES:
            raise OptionsError(f"--device {self.device} is not one of {', '.join(DEVICES)}")
        if self.evict_input and self.stream is False:
            raise OptionsError("--evict-input needs --stream", fix="add --stream, or drop --evict-input")
        if self.stream is not False and self.part is not None:
            raise OptionsError(
                "--stream converts in one process: do not combine it with -j or --part", fix="stream with one process"
            )
        if self.prefetch < 0:
            raise OptionsError(f"--prefetch {self.prefetch} is negative", fix="give 0 or more shards")

    def to_dict(self) -> dict[str, Any]:
        """For another process (`convert -j N`'s workers): plain values only. A progress callback or a
        ShardSource cannot cross, and is refused rather than dropped."""
        if self.progress is not None or not isinstance(self.stream, bool):
            raise OptionsError("a progress callback or a ShardSource cannot be sent to another process")
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "progress"}
        d["part"] = list(self.part) if self.part else None
        d["tuning"] = self.tuning.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunOptions:
        known = {f.name for f in fields(cls)} - {"progress"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise OptionsError(f"unknown run option(s) {', '.join(unknown)}")
        opts = dict(d)
        if opts.get("part") is not None:
            opts["part"] = tuple(opts["part"])
        if "tuning" in opts:
            opts["tuning"] = Tuning.from_dict(opts["tuning"])
        return cls(**opts)


_Options = TypeVar("_Options", ConvertOptions, RunOptions)
_FIELDS = {cls: frozenset(f.name for f in fields(cls)) for cls in (ConvertOptions, RunOptions)}


def options_from(
    values: Mapping[str, Any], parse: Mapping[str, Callable[[Any], Any]] | None = None
) -> tuple[ConvertOptions, RunOptions]:
    """Both values from one mapping keyed by their field names (the CLI names its parameters after the
    fields, so an option is one field and one click option). `parse`: field -> what turns its raw value
    (text) into the field's; each value is parsed and made in turn, ConvertOptions first, so the first
    refusal is the one it always was. A name neither value has is a bug: refused."""
    parse = parse or {}
    unknown = sorted(set(values) - _FIELDS[ConvertOptions] - _FIELDS[RunOptions])
    if unknown:
        raise TypeError(f"not an option field: {', '.join(unknown)}")

    def made(cls: type[_Options]) -> _Options:  # parsed in the fields' order, whatever the command line's
        names = [f.name for f in fields(cls) if f.name in values]
        return cls(**{k: parse[k](values[k]) if k in parse else values[k] for k in names})

    return made(ConvertOptions), made(RunOptions)
