"""The classifier: what format each weight is in, decided from dtypes, companion shapes and config.

Never by element size, never by dividing a shape by a grid: the block size comes from config.json
(or --block-size) and every scale grid must be exactly ceil(shape / block) to confirm it.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Container, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import FP8_E4M3, SCALE_DTYPES
from ..errors import CheckpointError
from ..records import like
from ..source.config import CONFIG_NAME
from ..source.index import CheckpointIndex
from ..source.mistral_native import FAKE_QUANTIZER, NATIVE_ACTIVATION_SUFFIX, NATIVE_SCALE_SUFFIX
from ..storage.safetensors_file import TensorEntry
from .geometry import forced_block
from .ignore_list import IgnoreList
from .mimo_kv import mimo_row_scales
from .mxfp8 import classify_mxfp8
from .packed_formats import classify_packed
from .quant_config import read_quant_settings
from .quant_settings import QuantSettings
from .weight_format import CONVERTIBLE, PACKED, Kind, WeightFormat

# Mistral-native consolidated files name them `.qscale_weight` / `.qscale_act` (fp8conv.source.mistral_native)
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", NATIVE_SCALE_SUFFIX)
ACTIVATION_SCALE_SUFFIXES = (".input_scale", ".activation_scale", NATIVE_ACTIVATION_SUFFIX)
BARE_SCALE_SUFFIXES = ("_scale_inv", "_scale")  # of a fused 3-D expert parameter without `.weight`
PACKED_SUFFIXES = (".weight_packed", "_blocks")  # compressed-tensors packed FP4/INT4, gpt-oss MXFP4
V4_SCALE_SUFFIX = ".scale"  # DeepSeek-V4 names a weight's scale `<module>.scale`
_SCALE_NAMES = SCALE_SUFFIXES + ACTIVATION_SCALE_SUFFIXES


@dataclass
class Classification:
    weights: dict[str, WeightFormat]  # quantized (or refused) weights by name
    plain: list[str]  # passed through unchanged
    problems: list[CheckpointError]  # refusals found while classifying
    warnings: list[str]
    block_size: tuple[int, int] | None
    block_source: str | None  # "config.json", "config.json:text_config", "--block-size" or None
    settings: QuantSettings
    # not_converted entries that name no tensor's module (GLM-5's `self_attn.indexers_proj`): reported,
    # and never matched to another tensor by guess
    unmatched_not_converted: list[str] = field(default_factory=list)
    # what planning derives from the input alone, once per checkpoint: inspect plans it eight times
    memo: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def quant_method(self) -> str | None:
        return self.settings.method

    def holds_quantized(self) -> bool:
        """Whether any weight is FP8 or packed 4-bit; else (a bf16 checkpoint) an FP8 target quantizes its
        Linears. Asked by every plan and the TP table: found once."""
        if "holds_quantized" not in self.memo:
            self.memo["holds_quantized"] = any(w.kind in CONVERTIBLE | PACKED for w in self.weights.values())
        return self.memo["holds_quantized"]

    @property
    def checkpoint_format(self) -> str:
        kinds = {w.kind for w in self.weights.values()}
        if not kinds:
            return str(Kind.UNQUANTIZED)
        for worst in (Kind.UNSUPPORTED, Kind.UNVERIFIED):
            if worst in kinds:
                return str(worst)
        if len(kinds) == 1:
            return str(next(iter(kinds)))
        return "mixed(" + "+".join(sorted(str(k) for k in kinds)) + ")"

    def kind_counts(self) -> dict[str, int]:
        counts = Counter(str(w.kind) for w in self.weights.values())
        counts[str(Kind.UNQUANTIZED)] += len(self.plain)
        return dict(sorted(counts.items()))

    def input_shapes(self, index: CheckpointIndex) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, shard) of every input tensor, a packed 4-bit weight by the shape it unpacks to
        (a ModelOpt uint8 `.weight` [N, K/2] is [N, K]): the shape config.json's widths describe."""
        memo = self.memo.get("input_shapes")
        if memo is not None and memo[0] is index:
            return memo[1]
        shapes = []
        for name, (shard, entry) in index.locations.items():
            fmt = self.weights.get(name)
            unpacked = fmt.shape if fmt is not None and fmt.kind in PACKED else None
            shapes.append((name, unpacked or entry.shape, shard.name))
        self.memo["input_shapes"] = (index, shapes)
        return shapes

    def unpacked_names(self) -> dict[str, str]:
        """A packed 4-bit weight's name -> the name it unpacks to (X.weight_packed -> X.weight, X_blocks ->
        X): the name whose MLP role it plays, checked by its unpacked shape (input_shapes)."""
        if "unpacked_names" not in self.memo:
            self.memo["unpacked_names"] = {
                name: fmt.out_name for name, fmt in self.weights.items() if fmt.kind in PACKED and fmt.out_name
            }
        return self.memo["unpacked_names"]


@dataclass
class _Context:
    index: CheckpointIndex
    block: tuple[int, int] | None
    block_where: str | None
    problems: list[CheckpointError] = field(default_factory=list)
    settings: QuantSettings | None = None
    _sorted_names: list[str] | None = None
    # (weight shape, scale shape, scale dtype, a fused gate_up) -> the WeightFormat those make (_classify_scaled)
    verdicts: dict[tuple[Any, ...], WeightFormat] = field(default_factory=dict)
    activation_scales: bool = True  # any tensor named like an activation scale (_classify_weights)
    # module -> its weight scales in SCALE_SUFFIXES order; the modules with a DeepSeek-V4 `.scale` (_scale_names)
    weight_scales: dict[str, tuple[str, ...]] = field(default_factory=dict)
    v4_scaled: set[str] = field(default_factory=set)
    # a packed weight's layout -> (its verdict, the module it was made for) (_packed)
    packed_verdicts: dict[tuple[Any, ...], tuple[WeightFormat, str]] = field(default_factory=dict)

    def shard(self, name: str) -> str:
        return self.index.shard_of(name).name

    def block_for(self, weight: str) -> tuple[int, int] | None:
        """The block size of a weight's module: --block-size or the checkpoint's, unless a dialect gives its
        module another (Quark's per-layer block_size)."""
        if self.settings is None or not self.settings.schemes or self.block_where == "--block-size":
            return self.block
        return self.settings.block_for(module_of(weight))

    def sorted_names(self) -> list[str]:
        """Every tensor name in order, sorted once: a name's companions are found by bisection."""
        if self._sorted_names is None:
            self._sorted_names = sorted(self.index.locations)
        return self._sorted_names


def classify(
    index: CheckpointIndex, config: dict[str, Any] | None, block_size: tuple[int, int] | None = None
) -> Classification:
    """Classify every tensor. `block_size` is the user's --block-size assertion, if any."""
    settings = read_quant_settings(config)
    problems: list[CheckpointError] = list(settings.problems)  # every step below adds to this one list
    block, block_source = _block_size(settings, block_size, problems)
    ctx = _Context(index, block, block_source, problems, settings)
    # every module's listing found at once (classify, plans and folds ask it); a scale is no module
    ignore = settings.ignore_list() if settings.not_converted else None
    modules = {module_of(n) for n in index.locations if not n.endswith(_SCALE_NAMES)} if ignore else set()
    if ignore is not None:
        ignore.prime(modules)
    weights, consumed = _classify_weights(ctx)
    reread = mimo_row_scales(index, config, weights, block)  # MiMo's K/V scales made per KV head
    consumed.update(n for name, fmt in reread.items() if fmt is not weights.get(name) for n in fmt.consumed)
    weights = reread
    plain, orphans = _leftovers(ctx, weights, consumed)
    problems += orphans
    warnings: list[str] = []
    listed = _listed_weights(ignore, weights) if ignore is not None else set()
    for fmt in weights.values():
        if fmt.kind in (Kind.UNVERIFIED, Kind.UNSUPPORTED):
            problems.append(
                CheckpointError(
                    f"is {fmt.kind}: {fmt.reason}",
                    tensor=fmt.weight,
                    shard=ctx.shard(fmt.weight),
                    fix=fmt.fix,
                )
            )
        elif listed and fmt.weight in listed and fmt.kind in CONVERTIBLE | PACKED:
            what = "FP8" if fmt.kind in CONVERTIBLE else str(fmt.kind)
            warnings.append(f"{fmt.weight} is {what} although {settings.where} lists its module as not converted")
    if settings.method is not None and not weights:
        warnings.append(f"{settings.where} declares quant_method {settings.method!r} but no tensor is FP8")
    unmatched = _unmatched_not_converted(modules, settings, warnings, config)
    return Classification(
        weights=weights,
        plain=plain,
        problems=problems,
        warnings=warnings,
        block_size=block,
        block_source=block_source,
        settings=settings,
        unmatched_not_converted=unmatched,
    )


def _listed_weights(ignore: IgnoreList, weights: dict[str, WeightFormat]) -> set[str]:
    """The weights whose module the (primed) ignore list names, from the few modules it matched, not 100k
    lookups."""
    return {w for m in ignore.matched() for w in (m + ".weight", m) if w in weights and module_of(w) == m}


UNMATCHED_NAMED = 3  # entries a warning names; inspect --json lists them all


def _unmatched_not_converted(
    modules: set[str], settings: QuantSettings, warnings: list[str], config: dict[str, Any] | None
) -> list[str]:
    """The ignore list's entries that match no tensor's module, warned about once with a count. A model that
    ties its word embeddings has an lm_head with no tensor of its own (it is the embedding), which
    compressed-tensors lists all the same: that entry names a module, and is not reported."""
    if not settings.not_converted:
        return []
    unmatched = settings.ignore_list().unmatched(modules)
    if _ties_embeddings(config):
        unmatched = [e for e in unmatched if e != "lm_head" and not e.endswith(".lm_head")]
    if unmatched:
        named = ", ".join(repr(e) for e in unmatched[:UNMATCHED_NAMED])
        more = f" and {len(unmatched) - UNMATCHED_NAMED} more" if len(unmatched) > UNMATCHED_NAMED else ""
        warnings.append(
            f"{settings.where} lists {len(unmatched)} module(s) as not converted that match no tensor "
            f"({named}{more}): they change nothing, and no other tensor is taken for them"
        )
    return unmatched


def _ties_embeddings(config: dict[str, Any] | None) -> bool:
    sections = [config or {}, (config or {}).get("text_config")]
    return any(isinstance(c, dict) and c.get("tie_word_embeddings") is True for c in sections)


def _block_size(
    settings: QuantSettings, asserted: tuple[int, int] | None, problems: list[CheckpointError]
) -> tuple[tuple[int, int] | None, str | None]:
    """(block size, where it comes from): --block-size when given (refused when config.json disagrees),
    else config.json's."""
    if asserted is not None and settings.block is not None and asserted != settings.block:
        problems.append(
            CheckpointError(
                f"the block size is {list(settings.block)} but --block-size asserts {list(asserted)}",
                file=CONFIG_NAME,
                key=settings.key,
                fix="drop --block-size, or fix config.json if you know it is wrong",
            )
        )
    block, block_source = (asserted, "--block-size") if asserted else (settings.block, settings.where)
    return block, None if block is None else block_source


def _classify_weights(ctx: _Context) -> tuple[dict[str, WeightFormat], set[str]]:
    """Every quantized (or refused) weight by name, and the companions (scales ...) they consume."""
    locations = ctx.index.locations  # a dict: membership as a set's, without building one
    weights: dict[str, WeightFormat] = {}
    consumed: set[str] = set()
    ctx.weight_scales, ctx.v4_scaled, ctx.activation_scales = _scale_names(locations)
    for name, (_, entry) in locations.items():
        if name.endswith(_SCALE_NAMES):  # half the names: a scale is its weight's companion, never packed
            continue
        fmt = _classify_one(ctx, entry, locations)
        if fmt is not None:
            weights[name] = fmt
            consumed.update(fmt.consumed)
    return weights, consumed


_WEIGHT_SCALE_TAILS = {suffix[1:]: i for i, suffix in enumerate(SCALE_SUFFIXES)}  # suffixes without their dot
_ACTIVATION_TAILS = frozenset(suffix[1:] for suffix in ACTIVATION_SCALE_SUFFIXES)
_V4_SCALE_TAIL = V4_SCALE_SUFFIX[1:]


def _scale_names(names: Iterable[str]) -> tuple[dict[str, tuple[str, ...]], set[str], bool]:
    """In one pass: each module's weight scales (in SCALE_SUFFIXES order), the modules with a DeepSeek-V4
    `.scale`, and whether any tensor is an activation scale (static FP8, ModelOpt: only then looked for by
    every weight). A name ends with a suffix `.x` (x without a dot) exactly when its last part is x: one
    dict lookup per name, where a weight's three candidate scale names were built and looked up each."""
    scales: dict[str, tuple[str, ...]] = {}
    v4: set[str] = set()
    several = []
    activation = False
    for name in names:
        module, _, tail = name.rpartition(".")
        if tail in _WEIGHT_SCALE_TAILS:
            found = scales.get(module)
            if found is None:
                scales[module] = (name,)
            else:
                scales[module] = (*found, name)
                several.append(module)
        elif tail == _V4_SCALE_TAIL:
            v4.add(module)
        elif tail in _ACTIVATION_TAILS:
            activation = True
    for module in several:
        scales[module] = tuple(sorted(scales[module], key=lambda n: _WEIGHT_SCALE_TAILS[n.rpartition(".")[2]]))
    return scales, v4, activation


def _leftovers(
    ctx: _Context, weights: dict[str, WeightFormat], consumed: set[str]
) -> tuple[list[str], list[CheckpointError]]:
    """The tensors no weight is or consumes, in one pass: the plain ones (passed through unchanged), and
    the problems of scales left over (the shard holding their weight is missing)."""
    plain, orphans = [], []
    for name in ctx.index.locations:
        if name in weights or name in consumed:
            continue
        (orphans if name.endswith(_SCALE_NAMES) else plain).append(name)
    problems = [
        CheckpointError(
            f"is a scale but there is no FP8 weight {_weight_of(name)!r} for it",
            tensor=name,
            shard=ctx.shard(name),
            fix="the checkpoint is incomplete: re-download the shard that holds the weight",
        )
        for name in orphans
        if not FAKE_QUANTIZER.search(name)  # Mistral's have no weight
    ]
    return plain, problems


def module_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def _weight_of(companion: str) -> str:
    for suffix in _SCALE_NAMES:
        if companion.endswith(suffix):
            return companion[: -len(suffix)] + ".weight"
    return companion


def _classify_one(ctx: _Context, entry: TensorEntry, names: Container[str]) -> WeightFormat | None:
    """A WeightFormat for a weight that is quantized (or looks it), None for everything else."""
    name = entry.name
    if name.endswith(".weight"):
        base: str | None = name[:-7]
        scales = ctx.weight_scales.get(base, ())
        # a release's 100k FP8 weights: exactly one scale (no DeepSeek-V4 `.scale` beside it) says the layout
        if entry.dtype == FP8_E4M3 and len(scales) == 1 and base not in ctx.v4_scaled:
            companions = _companions(base, names) if ctx.activation_scales else ()
            return _classify_scaled(ctx, entry, ctx.index.entry(scales[0]), companions)
    elif name.endswith(PACKED_SUFFIXES):
        return _packed(ctx, entry, names)
    elif name.endswith(_SCALE_NAMES):
        return None
    elif name.endswith(V4_SCALE_SUFFIX) and name.removesuffix(V4_SCALE_SUFFIX) + ".weight" in names:
        return None  # DeepSeek-V4's companion; consumed by its weight (or left plain if that is float)
    else:
        base, scales = None, ()
    if base and base in ctx.v4_scaled and entry.dtype in (FP8_E4M3, "I8", "U8"):
        scales = (*scales, base + V4_SCALE_SUFFIX)
    if scales and entry.dtype in ("I8", "U8"):  # never by element size: by the scale and config.json
        return classify_packed(ctx.index, ctx.settings, name, names, _companions(base, names) if base else ())
    if entry.dtype != FP8_E4M3:
        return _not_fp8(ctx, entry, base, scales, names)
    if base is None:
        return _bare_fp8(ctx, entry, names)
    return _fp8_weight(ctx, entry, base, scales, names)


def _not_fp8(
    ctx: _Context, entry: TensorEntry, base: str | None, scales: tuple[str, ...], names: Container[str]
) -> WeightFormat | None:
    """A tensor that is not float8_e4m3fn: another FP8 refused, a float one with a stray scale flagged."""
    name = entry.name
    if entry.dtype.startswith("F8_"):
        return WeightFormat(
            name,
            Kind.UNSUPPORTED,
            scale=scales[0] if scales else None,
            companions=_companions(base, names) if base else (),
            reason=f"{entry.dtype} weights are not float8_e4m3fn",
            fix="fp8conv reads e4m3fn FP8 only",
        )
    if scales:
        ctx.problems.append(
            CheckpointError(
                f"has a scale ({scales[0]}) but the weight is {entry.dtype}, not FP8",
                tensor=name,
                shard=ctx.shard(name),
                fix="the checkpoint is inconsistent: remove the stray scale or re-download",
            )
        )
        return WeightFormat(name, Kind.UNQUANTIZED, scale=scales[0])
    return None


def _bare_fp8(ctx: _Context, entry: TensorEntry, names: Container[str]) -> WeightFormat:
    """An FP8 tensor not named `.weight`: transformers 5 saves fused MoE experts as bare parameters,
    `experts.gate_up_proj` [E, 2I, H] with `experts.gate_up_proj_scale_inv` [E, gn, gk] (its
    FineGrainedFP8 layout); anything else has no known scale."""
    name = entry.name
    bare = [name + s for s in BARE_SCALE_SUFFIXES if name + s in names]
    if len(bare) == 1 and len(entry.shape) == 3:
        # transformers' static FP8Experts: one activation scale per expert, `<param>_activation_scale` [E]
        activation = tuple(n for n in (name + "_activation_scale",) if n in names)
        return _classify_scaled(ctx, entry, ctx.index.entry(bare[0]), activation)
    return WeightFormat(
        name,
        Kind.UNSUPPORTED,
        reason="an FP8 tensor that is not a '.weight' has no known scale",
        fix="fp8conv converts FP8 linear weights with their scales",
    )


def _fp8_weight(
    ctx: _Context, entry: TensorEntry, base: str, scales: tuple[str, ...], names: Container[str]
) -> WeightFormat:
    """An FP8 `.weight`: exactly one scale, whose shape then says the layout."""
    name = entry.name
    if len(scales) > 1:
        return WeightFormat(
            name,
            Kind.UNSUPPORTED,
            scale=scales[0],
            companions=(scales[1], *_companions(base, names)),
            reason=f"has both {scales[0]} and {scales[1]}; which one applies is ambiguous",
            fix="remove the stale scale",
        )
    if not scales:
        ctx.problems.append(
            CheckpointError(
                f"is FP8 but has no scale ({base}.weight_scale_inv or {base}.weight_scale)",
                tensor=name,
                shard=ctx.shard(name),
                fix="the checkpoint is incomplete: re-download the shard that holds the scale",
            )
        )
        return WeightFormat(name, Kind.UNVERIFIED, reason="no scale", fix="re-download")
    return _classify_scaled(ctx, entry, ctx.index.entry(scales[0]), _companions(base, names))


_NAME_FIELDS = ("scale", "global_scale", "shape_tensor", "out_name")  # a packed verdict's names but weight's


def _packed(ctx: _Context, entry: TensorEntry, names: Container[str]) -> WeightFormat:
    """A packed weight (X.weight_packed, X_blocks). Kimi-K2.5 has 69k of them in a few dozen layouts: a
    verdict with no reason is made once per layout (its suffix, dtype and shape, and its companions', each
    named past the module) and copied with this weight's module put in every name."""
    name = entry.name
    base = name[: -len(".weight_packed")] if name.endswith(".weight_packed") else name[: -len("_blocks")]
    companions = _packed_companions(name, ctx.sorted_names())
    locations = ctx.index.locations
    layout = tuple((c[len(base) :], locations[c][1].dtype, locations[c][1].shape) for c in companions)
    key = (name[len(base) :], entry.dtype, entry.shape, layout)
    known = ctx.packed_verdicts.get(key)
    if known is not None:
        proto, cut = known[0], len(known[1])
        renamed = {f: base + v[cut:] for f in _NAME_FIELDS if (v := getattr(proto, f)) is not None}
        return like(proto, weight=name, companions=tuple(base + c[cut:] for c in proto.companions), **renamed)
    fmt = classify_packed(ctx.index, ctx.settings, name, names, companions)
    named = [getattr(fmt, f) for f in _NAME_FIELDS] + list(fmt.companions)
    if fmt.reason is None and fmt.fix is None and all(n is None or n.startswith(base) for n in named):
        ctx.packed_verdicts[key] = (fmt, base)
    return fmt


def _packed_companions(name: str, ordered: list[str]) -> tuple[str, ...]:
    """compressed-tensors: X.weight_packed + X.weight_scale/...; gpt-oss: X_blocks + X_scales. `ordered`:
    every tensor name, sorted: the names under each prefix are one run of it, found by bisection."""
    if name.endswith("_blocks"):
        prefixes: tuple[str, ...] = (name[: -len("_blocks")] + "_scales",)
    else:
        prefixes = (name[: -len(".weight_packed")] + ".weight_", name[: -len(".weight_packed")] + ".input_")
    found = []
    for prefix in prefixes:
        i = bisect.bisect_left(ordered, prefix)
        while i < len(ordered) and ordered[i].startswith(prefix):
            found.append(ordered[i])
            i += 1
    return tuple(sorted(n for n in found if n != name))


def _companions(base: str, names: Container[str]) -> tuple[str, ...]:
    found: tuple[str, ...] = ()  # a loop, not a generator into tuple(): 100k weights, mostly none found
    for suffix in ACTIVATION_SCALE_SUFFIXES:
        if base + suffix in names:
            found += (base + suffix,)
    return found


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def _classify_scaled(ctx: _Context, w: TensorEntry, s: TensorEntry, companions: tuple[str, ...]) -> WeightFormat:
    """The layout the scale's shape says. A release has 100k weights in a few dozen (shape, scale)
    pairs: a verdict with no reason (it names no tensor) is made once per pair and copied with the names."""
    settings = ctx.settings
    block = ctx.block_for(w.name)
    key = (w.shape, s.shape, s.dtype, w.name.endswith("gate_up_proj"), block)
    memo = ctx.verdicts if settings is None or settings.mxfp8_group is None else None  # MXFP8: not memoized
    verdict = memo.get(key) if memo is not None else None
    if verdict is not None:
        return like(verdict, weight=w.name, scale=s.name, companions=companions)
    fmt = _scaled_format(ctx, w, s, companions, block)
    if memo is not None and fmt.reason is None and fmt.fix is None:
        memo[key] = fmt
    return fmt


def _scaled_format(
    ctx: _Context, w: TensorEntry, s: TensorEntry, companions: tuple[str, ...], block: tuple[int, int] | None
) -> WeightFormat:
    """The layout the scale's shape says, under `block`: the module's block size (the checkpoint's, or its
    scheme's where a dialect sets one per layer)."""

    def make(kind: Kind, reason: str | None = None, fix: str | None = None, block=None) -> WeightFormat:
        return WeightFormat(w.name, kind, s.name, companions, block=block, reason=reason, fix=fix)

    if s.dtype not in SCALE_DTYPES:
        return make(
            Kind.UNSUPPORTED,
            f"scale {s.name} is {s.dtype}; scales must be float32/bfloat16/float16 or UE8M0 (e8m0/uint8)",
            "the checkpoint is corrupt or in a format fp8conv does not know",
        )
    if len(w.shape) < 2:
        return make(Kind.UNSUPPORTED, f"an FP8 weight of shape {list(w.shape)} is not a matrix")
    settings = ctx.settings
    if settings is not None and settings.mxfp8_group is not None:
        mxfp8 = classify_mxfp8(w, s, settings.mxfp8_group, companions, settings.where)
        if mxfp8 is not None:
            return mxfp8
    lead, n = w.shape[:-2], w.shape[-2]
    # one scale for the whole tensor, or one per expert of a fused [E, N, K] tensor
    if (s.numel == 1 and len(s.shape) <= 1) or (lead and s.shape == lead):
        return make(Kind.PER_TENSOR)
    if s.shape == (*lead, n) and n > 1:
        return make(Kind.CHANNEL)
    if lead and block is None and s.shape == (*lead, 1, 1):  # transformers' FP8Experts, per expert
        return make(Kind.PER_TENSOR)
    if _per_half(w, s, block):  # transformers' FP8Experts: one scale per gate / up half, gate first
        return make(Kind.PER_TENSOR, block=(n // 2, w.shape[-1]))
    if len(s.shape) != len(w.shape) or s.shape[:-2] != lead:
        return make(
            Kind.UNVERIFIED,
            f"scale {s.name} has shape {list(s.shape)}, which fits no FP8 layout of {list(w.shape)}",
            "the checkpoint is corrupt or in a format fp8conv does not know",
        )
    if block is None:
        if s.shape == (*lead, n, 1):
            return make(Kind.CHANNEL)
        return make(
            Kind.UNVERIFIED,
            f"scale {s.name} is a {list(s.shape[-2:])} grid but no weight_block_size confirms the block size",
            "if the checkpoint uses 128x128 blocks, assert it with --block-size 128,128",
        )
    expected = _grid(w.shape, block)
    if s.shape != expected:
        forced = forced_block(w.shape, s.shape, block)  # one scale per row (or column): exact
        if forced is not None:
            return make(Kind.BLOCK, block=forced)
        return make(
            Kind.UNVERIFIED,
            f"scale {s.name} has shape {list(s.shape)} but blocks of {list(block)} "
            f"({ctx.block_where}) need {list(expected)}",
            "the scale grid does not match the block size; check weight_block_size / --block-size",
        )
    return make(Kind.BLOCK, block=block)


def _per_half(w: TensorEntry, s: TensorEntry, block: tuple[int, int] | None) -> bool:
    """A fused `experts.gate_up_proj` [E, 2I, H] with a per-tensor `_scale_inv` [E, 2, 1]: FP8Experts
    allocates two scale rows when no block size is set (min_sf_out=2), and its kernel takes the block
    from the scale's shape, so each scale covers one half ([gate; up], gate first, as _apply_gate splits)."""
    lead = w.shape[:-2]
    return (
        block is None
        and len(lead) == 1
        and w.name.endswith("gate_up_proj")
        and w.shape[-2] % 2 == 0
        and s.shape == (*lead, 2, 1)
    )


def has_partial_blocks(fmt: WeightFormat, shape: tuple[int, ...]) -> bool:
    return (
        fmt.kind is Kind.BLOCK
        and fmt.block is not None
        and (shape[-2] % fmt.block[0] != 0 or shape[-1] % fmt.block[1] != 0)
    )
