"""Read an input's quantization_config (fp8 or compressed-tensors) into one neutral description."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError
from ..source.config import CONFIG_NAME, READ_FROM_KEY, find_quantization_config
from .ignore_list import REGEX_PREFIX, IgnoreList

FLOAT_QUANTIZED_FORMATS = ("float-quantized", "naive-quantized")
# How configs spell the one FP8 type fp8conv reads: DeepSeek "e4m3", MiniMax-M2 torch's "float8_e4m3fn",
# safetensors' "F8_E4M3", Mistral's "fp8_e4m3". Compared lowercased.
E4M3_SPELLINGS = frozenset({"e4m3", "e4m3fn", "float8_e4m3fn", "float8_e4m3", "f8_e4m3", "fp8_e4m3", "fp8_e4m3fn"})
# Methods that are plain FP8 under another name: Meta's Llama-3.1 FP8 release (channel weight_scale [N, 1]).
FP8_ALIASES = ("fbgemm_fp8",)
# Packed 4-bit formats a config can declare -> elements per scale along K (see formats.Kind)
MXFP4_GROUP = 32
NVFP4_GROUP = 16
# ModelOpt quant_algo values whose weights are NVFP4 (W4A16: the same weights, activations left in bf16)
MODELOPT_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
# ModelOpt FP8 algos whose tensors are fp8conv's per-tensor / channel FP8 (vLLM's ModelOptFp8Config)
MODELOPT_FP8_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")
MODELOPT_MXFP8_ALGO = "MXFP8"
MODELOPT_MIXED_ALGO = "MIXED_PRECISION"
# MXFP8: e4m3 weights, one UE8M0 exponent per 1x32 group along K (vLLM mxfp8_utils.MXFP8_BLOCK_SIZE)
MXFP8_GROUP = 32


@dataclass
class QuantSettings:
    method: str | None  # "fp8", "compressed-tensors" or None
    key: str | None = None  # the config.json section holding quantization_config: None (top level) or "text_config"
    file: str = CONFIG_NAME  # hf_quant_config.json when ModelOpt's sidecar supplied it (config.READ_FROM_KEY)
    block: tuple[int, int] | None = None
    activation_scheme: str | None = None  # "dynamic" | "static"
    scale_fmt: str | None = None  # "ue8m0" when the config claims it
    not_converted: list[str] = field(default_factory=list)  # modules_to_not_convert / ignored_layers / ignore
    problems: list[CheckpointError] = field(default_factory=list)
    # packed 4-bit formats the config declares (a Kind value -> elements per scale along K); the
    # classifier accepts a packed tensor only when its format is declared here
    packed: dict[str, int] = field(default_factory=dict)
    expert_dtype: str | None = None  # DeepSeek-V4: "fp4" (MXFP4 routed experts) or "fp8"
    # MXFP8 declared (quant_method mxfp8, ModelOpt MXFP8, compressed-tensors mxfp8-quantized): elements per
    # UE8M0 scale along K; an e4m3 weight with a uint8/e8m0 scale is then read as MXFP8 (see mxfp8.py)
    mxfp8_group: int | None = None
    _ignore: IgnoreList | None = field(default=None, repr=False, compare=False)

    def ignore_list(self) -> IgnoreList:
        """not_converted compiled once (again only if a reader added entries since)."""
        if self._ignore is None or len(self._ignore.entries) != len(self.not_converted):
            self._ignore = IgnoreList(list(self.not_converted))
        return self._ignore

    def lists_as_not_converted(self, module: str) -> bool:
        return self.ignore_list().matches(module)

    def refuse(self, message: str, fix: str) -> None:
        """Record a problem with the quantization config, naming the file and section it came from."""
        self.problems.append(CheckpointError(message, file=self.file, key=self.key, fix=fix))

    @property
    def where(self) -> str:
        """For messages and inspect: "config.json", "config.json:text_config" or "hf_quant_config.json"."""
        return self.file + (f":{self.key}" if self.key else "")


def parse_block_size(value: Any, key: str | None) -> tuple[int, int]:
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return (int(value[0]), int(value[1]))
    raise CheckpointError(
        f"weight_block_size {value!r} is not two positive integers",
        file=CONFIG_NAME,
        key=key,
        fix="fix config.json or assert the block size with --block-size 128,128",
    )


def read_quant_settings(config: dict[str, Any] | None) -> QuantSettings:
    qconfig, key = find_quantization_config(config)
    if qconfig is None:
        return QuantSettings(method=None, key=key)
    raw = qconfig.get("quant_method")
    method = normalized_method(raw)
    source_file = str(qconfig.get(READ_FROM_KEY, CONFIG_NAME))
    settings = QuantSettings(method=method, key=key, file=source_file)
    if method == "fp8" or method in FP8_ALIASES:
        _read_fp8(qconfig, settings)
        _read_expert_dtype(config or {}, qconfig, settings)
    elif method == "compressed-tensors":
        _read_compressed_tensors(qconfig, settings)
    elif method == "mxfp4":
        _read_gpt_oss_mxfp4(qconfig, settings)
    elif method == "mxfp8":
        _read_mxfp8_tagged(qconfig, settings)
    elif method is not None and method.startswith("modelopt"):  # vLLM's test; also modelopt_fp4
        _read_modelopt(qconfig, settings)
    elif method == "nvfp4":
        settings.refuse(
            f"quantization_config.quant_method {raw!r} names no NVFP4 checkpoint layout fp8conv knows",
            fix="fp8conv reads NVFP4 from compressed-tensors (nvfp4-pack-quantized) and ModelOpt "
            "(quant_method 'modelopt', quant_algo 'NVFP4') checkpoints",
        )
    else:
        settings.refuse(
            f"quantization_config.quant_method {raw!r} is not supported",
            fix="fp8conv reads quant_method 'fp8', 'compressed-tensors', 'mxfp4' (gpt-oss), 'mxfp8' and 'modelopt'",
        )
    _refuse_unsafe_patterns(qconfig, settings)
    return settings


# the lists an entry of not_converted can come from, for naming it in a refusal
IGNORE_LIST_KEYS = ("modules_to_not_convert", "ignored_layers", "ignore", "exclude_modules")


def _refuse_unsafe_patterns(qconfig: dict[str, Any], s: QuantSettings) -> None:
    """A `re:` entry that is no regex, or that could backtrack without bound, is refused by name, in one
    line, before anything is matched against it (ignore_list.unsafe_regex)."""
    for entry, reason in s.ignore_list().refused.items():
        sections = [qconfig] + [qconfig[k] for k in ("quantization",) if isinstance(qconfig.get(k), dict)]
        key = next(
            (k for sec in sections for k in IGNORE_LIST_KEYS if isinstance(sec.get(k), list) and entry in sec[k]),
            "ignore",
        )
        s.refuse(
            f"quantization_config.{key} entry {entry!r}: the regex after {REGEX_PREFIX!r} {reason}",
            fix="write the entry as plain module names, or as a regex without nested repeats or backreferences",
        )


def normalized_method(raw: Any) -> str | None:
    """quant_method as vLLM compares it (ModelConfig lowercases it and spells compressed_tensors with a
    hyphen): "FP8", "MXFP4" or "Compressed_Tensors" select the same reader as their lowercase forms."""
    if raw is None:
        return None
    return str(raw).lower().replace("compressed_tensors", "compressed-tensors")


def _read_fp8(q: dict[str, Any], s: QuantSettings) -> None:
    if q.get("weight_block_size") is not None:
        try:
            s.block = parse_block_size(q["weight_block_size"], s.key)
        except CheckpointError as exc:
            s.problems.append(exc)
    fmt_problem = _fmt_problem(q.get("fmt", "e4m3"))
    if fmt_problem:
        s.refuse(fmt_problem, fix="fp8conv reads e4m3 (float8_e4m3fn) FP8 only")
    # fbgemm_fp8 quantizes activations per token at run time (bounded by activation_scale_ub): dynamic
    s.activation_scheme = q.get("activation_scheme", "dynamic" if s.method in FP8_ALIASES else None)
    s.scale_fmt = q.get("scale_fmt")
    for key in ("modules_to_not_convert", "ignored_layers"):
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]
    _read_mxfp4_store_dtype(q, s)


def _read_mxfp4_store_dtype(q: dict[str, Any], s: QuantSettings) -> None:
    """MXFP4 routed experts inside an fp8 config: MiMo-V2.5-Pro-FP4 `store_dtype: mxfp4`, Ling
    `routed_experts_quant_method: mxfp4` (vLLM's Fp8Config.store_dtype, which loads those experts with its
    MXFP4 MoE method: uint8 [N, K/2] codes, uint8 E8M0 scales [N, K/32], named weight_scale or, Ling,
    weight_scale_inv). The packed tensors are then read as MXFP4, never as FP8."""
    declared = {k: q[k] for k in ("store_dtype", "routed_experts_quant_method") if q.get(k) is not None}
    if not declared:
        return
    kinds = {str(v).lower() for v in declared.values()}
    if kinds != {"mxfp4"}:
        s.refuse(
            f"quantization_config declares {declared}; fp8conv reads MXFP4 routed experts only",
            fix="fp8conv reads store_dtype / routed_experts_quant_method 'mxfp4' inside an fp8 config",
        )
        return
    group = q.get("routed_experts_group_size", q.get("mxfp4_block_size", MXFP4_GROUP))
    if group != MXFP4_GROUP:
        s.refuse(f"MXFP4 experts in groups of {group!r}, not 32", fix="MXFP4 has one E8M0 scale per 32 values")
        return
    s.packed["mxfp4"] = MXFP4_GROUP


def _read_mxfp8_tagged(q: dict[str, Any], s: QuantSettings) -> None:
    """MiniMax-M3 style `quant_method: mxfp8` + `ignored_layers`: vLLM loads it as ModelOpt MXFP8
    (ModelOptMxFp8Config.from_config); a ModelOpt-shaped section inside is read as ModelOpt."""
    if isinstance(q.get("quantization"), dict) or q.get("quant_algo"):
        _read_modelopt(q, s)
        return
    s.mxfp8_group = MXFP8_GROUP
    s.activation_scheme = "dynamic"  # MXFP8 activations are quantized at run time
    if q.get("weight_block_size") not in (None, [1, MXFP8_GROUP]):
        s.refuse(
            f"quant_method 'mxfp8' with weight_block_size {q['weight_block_size']!r}",
            fix=f"MXFP8 has one E8M0 scale per 1x{MXFP8_GROUP} group: weight_block_size [1, 32] or none",
        )
    for key in ("ignored_layers", "modules_to_not_convert"):  # MiniMax; transformers-style saves
        if isinstance(q.get(key), list):
            s.not_converted += [str(m) for m in q[key]]


def _fmt_problem(fmt: Any) -> str | None:
    """None when `fmt` names e4m3fn; otherwise what it names instead (e5m2 and fnuz are other types)."""
    spelled = str(fmt).lower()
    if spelled in E4M3_SPELLINGS:
        return None
    if "e5m2" in spelled:
        return f"fmt {fmt!r} is e5m2 FP8, not e4m3"
    if "fnuz" in spelled:
        return f"fmt {fmt!r} is AMD's e4m3fnuz (exponent bias 8), not e4m3fn"
    return f"fmt {fmt!r} is not a known spelling of e4m3 FP8"


def _read_compressed_tensors(q: dict[str, Any], s: QuantSettings) -> None:
    top_format = q.get("format")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        s.refuse("compressed-tensors config has no config_groups", fix="fix config.json")
        return
    blocks = set()
    for gname, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        fmt = (group.get("format") if isinstance(group, dict) else None) or top_format
        if not isinstance(weights, dict):
            continue
        packed = _packed_group(fmt, weights, gname, s)
        if packed is not None:
            s.packed[packed[0]] = packed[1]
            continue
        if fmt == "mxfp8-quantized":
            _mxfp8_group(weights, gname, s)
            continue
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or fmt not in FLOAT_QUANTIZED_FORMATS:
            s.refuse(
                f"compressed-tensors group {gname!r} is {fmt} {weights.get('type')}"
                f"{weights.get('num_bits')} weights, not FP8",
                fix="fp8conv converts FP8 (float-quantized, 8-bit float) checkpoints only",
            )
            continue
        if weights.get("strategy") == "block":
            try:
                blocks.add(parse_block_size(weights.get("block_structure"), s.key))
            except CheckpointError as exc:
                s.problems.append(exc)
        acts = group.get("input_activations")
        if isinstance(acts, dict):
            s.activation_scheme = "dynamic" if acts.get("dynamic") else "static"
    if len(blocks) > 1:
        s.refuse(
            f"config groups use different block structures {sorted(blocks)}",
            fix="fp8conv needs one block size per checkpoint",
        )
    elif blocks:
        s.block = blocks.pop()
    if isinstance(q.get("ignore"), list):
        s.not_converted += [str(m) for m in q["ignore"]]


def _mxfp8_group(w: dict[str, Any], gname: str, s: QuantSettings) -> None:
    """compressed-tensors mxfp8-quantized (MXFP8QuantizationCompressor): 8-bit float weights, strategy
    group, group_size 32, uint8 E8M0 weight_scale."""
    fp8_groups = w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") == "group"
    if fp8_groups and w.get("group_size") == MXFP8_GROUP:
        s.mxfp8_group = MXFP8_GROUP
        s.activation_scheme = "dynamic"
        return
    s.refuse(
        f"compressed-tensors group {gname!r} is mxfp8-quantized {w.get('type')}{w.get('num_bits')} with "
        f"strategy {w.get('strategy')!r}, group_size {w.get('group_size')!r}",
        fix="fp8conv reads mxfp8-quantized as 8-bit float weights, strategy group, group_size 32",
    )


def _read_expert_dtype(config: dict[str, Any], q: dict[str, Any], s: QuantSettings) -> None:
    """DeepSeek-V4: expert_dtype at the top level (V4) or, reportedly, inside quantization_config."""
    sections = [q, config] + [config[k] for k in ("text_config",) if isinstance(config.get(k), dict)]
    value = next((sec["expert_dtype"] for sec in sections if sec.get("expert_dtype") is not None), None)
    if value is None:
        return
    s.expert_dtype = str(value)
    if value == "fp4":
        s.packed["mxfp4"] = MXFP4_GROUP
    elif value != "fp8":
        s.refuse(
            f"expert_dtype {value!r} is neither 'fp4' nor 'fp8'",
            fix="fp8conv reads DeepSeek-V4 experts in MXFP4 (fp4) or block FP8 (fp8)",
        )


def _read_gpt_oss_mxfp4(q: dict[str, Any], s: QuantSettings) -> None:
    """gpt-oss: MXFP4 experts as *_blocks / *_scales; modules_to_not_convert stay bf16."""
    s.packed["mxfp4-gpt-oss"] = MXFP4_GROUP
    if isinstance(q.get("modules_to_not_convert"), list):
        s.not_converted += [str(m) for m in q["modules_to_not_convert"]]


def _read_modelopt(q: dict[str, Any], s: QuantSettings) -> None:
    """ModelOpt, in either form vLLM reads: hf_quant_config.json's {"quantization": {quant_algo, group_size,
    exclude_modules}} (also found nested in config.json), or config.json's flat {quant_algo, group_size,
    ignore}. quant_algo is compared upper-cased; W4A16_NVFP4 has NVFP4's weights (bf16 activations);
    FP8 is per-tensor, FP8_PER_CHANNEL_PER_TOKEN channel; MIXED_PRECISION names an algo per layer."""
    nested = q.get("quantization")
    section = nested if isinstance(nested, dict) else q
    raw, group = section.get("quant_algo"), section.get("group_size")
    if str(raw).upper() == MODELOPT_MIXED_ALGO:
        _read_modelopt_mixed(section, s)
    elif not _modelopt_algo(raw, group, s, where="quant_algo"):
        return
    for key in ("exclude_modules", "ignore"):
        if isinstance(section.get(key), list):
            s.not_converted += [str(m) for m in section[key]]


def _modelopt_algo(raw: Any, group: Any, s: QuantSettings, where: str) -> bool:
    """Record what one ModelOpt algo (compared upper-cased) declares; False (and a refusal) for one fp8conv
    does not read."""
    algo = str(raw).upper()
    if algo in MODELOPT_NVFP4_ALGOS and group in (None, NVFP4_GROUP):
        s.packed["nvfp4-modelopt"] = NVFP4_GROUP
    elif algo in MODELOPT_FP8_ALGOS:
        s.activation_scheme = "static" if algo == "FP8" else "dynamic"  # FP8 ships a static input_scale
    elif algo == MODELOPT_MXFP8_ALGO:
        s.mxfp8_group = MXFP8_GROUP
        s.activation_scheme = s.activation_scheme or "dynamic"
    else:
        s.refuse(
            f"ModelOpt {where} {raw!r} with group_size {group!r} is not supported",
            fix=f"fp8conv reads ModelOpt {', '.join(MODELOPT_FP8_ALGOS + MODELOPT_NVFP4_ALGOS)} (group_size 16), "
            f"{MODELOPT_MXFP8_ALGO} and {MODELOPT_MIXED_ALGO} of those",
        )
        return False
    return True


def _read_modelopt_mixed(section: dict[str, Any], s: QuantSettings) -> None:
    """MIXED_PRECISION: `quantized_layers` maps each module to its own {quant_algo, group_size} (vLLM's
    ModelOptMixedPrecisionConfig); each algo is declared as if it were the checkpoint's only one, and the
    tensors of each layer then say which it is (dtypes and companions, as for any checkpoint)."""
    layers = section.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        s.refuse(
            "ModelOpt quant_algo MIXED_PRECISION has no quantized_layers mapping",
            fix="fix the quantization config: MIXED_PRECISION lists each quantized module's quant_algo",
        )
        return
    algos: dict[str, tuple[str, Any, Any]] = {}
    for module, info in layers.items():
        entry = info if isinstance(info, dict) else {}
        raw = entry.get("quant_algo")
        algos.setdefault(str(raw).upper(), (module, raw, entry.get("group_size")))
    for module, raw, group in algos.values():
        _modelopt_algo(raw, group, s, where=f"quantized_layers[{module!r}].quant_algo")
    if "FP8" in algos:
        s.activation_scheme = "static"


def _packed_group(fmt: Any, w: dict[str, Any], gname: str, s: QuantSettings) -> tuple[str, int] | None:
    """A compressed-tensors group of packed 4-bit weights: (format, group size), or None if not packed."""
    if fmt == "pack-quantized" and w.get("num_bits") == 4 and w.get("type") == "int":
        kind, ok = "int4-pack-quantized", w.get("strategy") == "group" and w.get("symmetric") is True
    elif fmt == "nvfp4-pack-quantized":
        kind = "nvfp4"
        ok = w.get("num_bits") == 4 and w.get("type") == "float" and w.get("strategy") == "tensor_group"
    elif fmt == "mxfp4-pack-quantized":  # compressed-tensors' MXFP4PackedCompressor: no global scale
        kind = "mxfp4-pack-quantized"
        ok = w.get("num_bits") == 4 and w.get("type") == "float" and w.get("strategy") == "group"
        ok = ok and w.get("symmetric", True) is True
    else:
        return None
    group = w.get("group_size")
    if not ok or not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 2:
        s.refuse(
            f"compressed-tensors group {gname!r} is {fmt} with strategy {w.get('strategy')!r}, "
            f"symmetric {w.get('symmetric')!r}, group_size {group!r}",
            fix="fp8conv reads symmetric group-wise INT4 and NVFP4 (tensor_group) packed weights only",
        )
        return None
    if kind == "nvfp4" and group != NVFP4_GROUP:
        s.refuse(f"NVFP4 group {gname!r} has group_size {group}, not 16", fix="fix config.json")
        return None
    if kind == "mxfp4-pack-quantized" and group != MXFP4_GROUP:
        s.refuse(f"MXFP4 group {gname!r} has group_size {group}, not 32", fix="fix config.json")
        return None
    if s.packed.get(kind, group) != group:
        s.refuse(
            f"config groups use different {kind} group sizes ({s.packed[kind]} and {group})",
            fix="fp8conv needs one group size per packed format",
        )
        return None
    return kind, group


def module_matches(module: str, patterns: list[str]) -> bool:
    """compressed-tensors / vLLM style: 're:<regex>', an exact module name, a parent module or a trailing
    name part; a pattern with shell wildcards (ModelOpt's exclude_modules, e.g. 'model.layers.*.mlp*') is
    matched as vLLM's ModelOpt reader matches it, fnmatch over the whole module name (or a parent module's).
    Compiles `patterns` on every call: matching many modules, use QuantSettings.lists_as_not_converted
    (ignore_list.IgnoreList), which compiles them once."""
    return IgnoreList(list(patterns)).matches(module)
