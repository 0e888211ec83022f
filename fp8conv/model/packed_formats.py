"""Packed 4-bit weights: which format, confirmed by dtypes, companion shapes and config.json together.

A byte holds two 4-bit codes, the low nibble first (element 2i in bits 0-3, 2i+1 in bits 4-7); an
int32 of compressed-tensors INT4 holds eight, element 8g+j in bits [4j, 4j+4), which on a
little-endian file is the same nibble stream. K is never guessed: it is twice the packed width (eight
times for int32), and the scale grid must be exactly K / group along K, or the tensor is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from dataclasses import dataclass

from ..dtypes import FP8_E4M3
from ..source.index import CheckpointIndex
from .quant_settings import QuantSettings
from .weight_format import Kind, WeightFormat

E8M0_DTYPES = ("F8_E8M0", "U8")  # UE8M0 exponents: float8_e8m0fnu, or uint8 as gpt-oss stores them
INT4_SCALE_DTYPES = ("BF16", "F16", "F32")
CODES_PER_ELEMENT = {"U8": 2, "I8": 2, "I32": 8}
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # a per-expert routed weight: mlp.experts.E.gate_proj
CONFIG_DECLARES = {
    Kind.MXFP4: "expert_dtype 'fp4' (DeepSeek-V4), or store_dtype / routed_experts_quant_method 'mxfp4' in an fp8 "
    "config (MiMo-V2.5-Pro-FP4, Ling)",
    Kind.MXFP4_GPT_OSS: "quant_method 'mxfp4' (gpt-oss)",
    Kind.NVFP4: "a compressed-tensors nvfp4-pack-quantized group",
    Kind.NVFP4_MODELOPT: "quant_method 'modelopt' with quant_algo 'NVFP4' (or ModelOpt's hf_quant_config.json)",
    Kind.INT4: "a compressed-tensors pack-quantized group of 4-bit int weights",
    Kind.MXFP4_CT: "a compressed-tensors mxfp4-pack-quantized group",
}


@dataclass(frozen=True)
class _PackedNames:
    """What a packed weight's name says: its format, the output's name and its companions' names."""

    kind: Kind
    out_name: str
    scale: str
    global_scale: str | None = None  # NVFP4's one float32
    shape_tensor: str | None = None  # compressed-tensors INT4's unpacked shape


def classify_packed(
    index: CheckpointIndex,
    settings: QuantSettings | None,
    name: str,
    names: Container[str],
    companions: tuple[str, ...],
) -> WeightFormat:
    """`name` is a packed weight (X.weight_packed, X_blocks) or an int8/uint8 X.weight with a scale."""
    entry = index.entry(name)
    refuse = _refuser(name, companions)
    if name.endswith("_blocks"):
        base = name[: -len("_blocks")]
        found = _PackedNames(Kind.MXFP4_GPT_OSS, base, base + "_scales")
    elif name.endswith(".weight_packed"):
        base = name[: -len(".weight_packed")]
        if entry.dtype == "I32":
            found = _PackedNames(
                Kind.INT4, base + ".weight", base + ".weight_scale", shape_tensor=base + ".weight_shape"
            )
        elif _has_e8m0(index, base + ".weight_scale", names):  # MXFP4: E8M0 scales; NVFP4's are e4m3
            found = _PackedNames(Kind.MXFP4_CT, base + ".weight", base + ".weight_scale")
        else:
            found = _PackedNames(Kind.NVFP4, base + ".weight", base + ".weight_scale", base + ".weight_global_scale")
        if base + ".weight_zero_point" in names:
            return refuse(
                f"has {base}.weight_zero_point: asymmetric packed weights are not supported",
                "fp8conv reads symmetric INT4 only",
            )
    else:  # X.weight, int8 / uint8, with a scale companion
        named = _byte_weight_names(index, settings, name, names)
        if isinstance(named, tuple):
            return refuse(*named[:2], scale=named[2])
        found = named
    if found.kind in (Kind.MXFP4_GPT_OSS, Kind.NVFP4, Kind.INT4, Kind.MXFP4_CT):  # named by their companions
        companions = tuple(c for c in companions if c not in (found.scale, found.global_scale, found.shape_tensor))
    return _confirmed(index, settings, name, names, companions, found)


def _byte_weight_names(
    index: CheckpointIndex, settings: QuantSettings | None, name: str, names: Container[str]
) -> _PackedNames | tuple[str, str, str]:
    """An int8 / uint8 X.weight with a scale: DeepSeek-V4 MXFP4 (X.scale), MXFP4 routed experts of an fp8
    config (an E8M0 weight_scale_inv / weight_scale), Quark's MXFP4 (an E8M0 weight_scale, any layer), or
    ModelOpt NVFP4 (e4m3 weight_scale); else
    (reason, fix, scale) of its refusal."""
    base = name[: -len(".weight")]
    entry = index.entry(name)
    mxfp4_in_fp8 = [base + x for x in (".weight_scale_inv", ".weight_scale") if _has_e8m0(index, base + x, names)]
    if base + ".scale" in names:
        return _PackedNames(Kind.MXFP4, name, base + ".scale")
    if mxfp4_in_fp8 and settings is not None and settings.method == "quark":  # any module its config names
        return _PackedNames(Kind.MXFP4, name, mxfp4_in_fp8[0])  # _confirmed checks the declaration
    if mxfp4_in_fp8 and settings is not None and settings.method == "fp8":
        if not ROUTED_EXPERT.search(name):  # vLLM's Fp8Config gives only RoutedExperts its MXFP4 method
            return (
                f"is {entry.dtype} with an E8M0 scale, but MXFP4 inside an fp8 config (store_dtype / "
                "routed_experts_quant_method) covers routed experts (.experts.E.) only",
                "engines load this module as FP8; the checkpoint is in a layout fp8conv does not know",
                mxfp4_in_fp8[0],
            )
        return _PackedNames(Kind.MXFP4, name, mxfp4_in_fp8[0])  # _confirmed checks the declaration
    found = _PackedNames(Kind.NVFP4_MODELOPT, name, base + ".weight_scale", base + ".weight_scale_2")
    if found.scale not in names or index.entry(found.scale).dtype != FP8_E4M3:
        present = [base + s for s in (".weight_scale", ".weight_scale_inv") if base + s in names]
        return (
            f"{entry.dtype} weights with a {index.entry(present[0]).dtype} scale are int8, not FP8 or packed FP4",
            "fp8conv converts FP8 and packed 4-bit (MXFP4, NVFP4, INT4) weights only",
            present[0],
        )
    return found


def _has_e8m0(index: CheckpointIndex, scale: str, names: Container[str]) -> bool:
    return scale in names and index.entry(scale).dtype in E8M0_DTYPES


def _refuser(name: str, companions: tuple[str, ...]) -> Callable[..., WeightFormat]:
    def refuse(reason: str, fix: str, kind: Kind = Kind.UNSUPPORTED, scale: str | None = None) -> WeightFormat:
        return WeightFormat(name, kind, scale=scale, companions=companions, reason=reason, fix=fix)

    return refuse


def _confirmed(
    index: CheckpointIndex,
    settings: QuantSettings | None,
    name: str,
    names: Container[str],
    companions: tuple[str, ...],
    found: _PackedNames,
) -> WeightFormat:
    """The names classify_packed found, confirmed: the scale there, the format declared by config.json,
    every shape fitting it; then the weight's unpacked shape."""
    kind, scale = found.kind, found.scale
    declared = settings.packed if settings is not None else {}
    where = settings.where if settings is not None else "config.json"
    entry = index.entry(name)
    refuse = _refuser(name, companions)
    if scale not in names:
        return refuse(f"is packed 4-bit but has no scale {scale}", "re-download the shard that holds the scale")
    if kind not in declared:
        return refuse(
            f"looks like packed 4-bit {kind} ({entry.dtype} with {index.entry(scale).dtype} {scale}) but "
            f"{where} does not declare it: it needs {CONFIG_DECLARES[kind]}",
            "fp8conv decides packed formats from the tensors and config.json together; fix config.json",
            scale=scale,
        )
    group = declared[kind]
    problem = _shape_problem(index, name, found, group, names)
    if problem:
        return refuse(problem, "the checkpoint is damaged or in a layout fp8conv does not know", scale=scale)
    if kind is Kind.MXFP4_GPT_OSS:
        *lead, n, g, _ = entry.shape
        shape = (*lead, n, g * 32)
    else:
        shape = (*entry.shape[:-1], entry.shape[-1] * CODES_PER_ELEMENT[entry.dtype])
    return WeightFormat(
        name,
        kind,
        scale=scale,
        companions=companions,
        group=group,
        global_scale=found.global_scale,
        shape_tensor=found.shape_tensor,
        shape=shape,
        out_name=found.out_name,
    )


def _shape_problem(
    index: CheckpointIndex, name: str, found: _PackedNames, group: int, names: Container[str]
) -> str | None:
    """Why the tensors do not fit the format, or None."""
    kind, scale, global_scale, shape_tensor = found.kind, found.scale, found.global_scale, found.shape_tensor
    w, s = index.entry(name), index.entry(scale)
    want_w = {
        Kind.MXFP4: ("I8", "U8"),
        Kind.MXFP4_GPT_OSS: ("U8",),
        Kind.NVFP4: ("U8",),
        Kind.NVFP4_MODELOPT: ("U8",),
        Kind.INT4: ("I32",),
        Kind.MXFP4_CT: ("U8",),
    }[kind]
    e8m0 = (Kind.MXFP4, Kind.MXFP4_GPT_OSS, Kind.MXFP4_CT)
    want_s = E8M0_DTYPES if kind in e8m0 else INT4_SCALE_DTYPES if kind is Kind.INT4 else (FP8_E4M3,)
    if w.dtype not in want_w:
        return f"{kind} weights are {'/'.join(want_w)}, not {w.dtype}"
    if s.dtype not in want_s:
        return f"{kind} scale {scale} is {s.dtype}, not {'/'.join(want_s)}"
    if kind is Kind.MXFP4_GPT_OSS:
        if len(w.shape) < 3 or w.shape[-1] != 16:
            return f"gpt-oss blocks have shape {list(w.shape)}; [..., rows, K/32, 16] (16 bytes per 32) expected"
        if s.shape != w.shape[:-1]:
            return f"scale {scale} has shape {list(s.shape)} but the blocks {list(w.shape)} need {list(w.shape[:-1])}"
        return None
    if len(w.shape) < 2 or (kind in (Kind.NVFP4, Kind.NVFP4_MODELOPT) and len(w.shape) != 2):
        return f"a packed weight of shape {list(w.shape)} is not a matrix"
    k = w.shape[-1] * CODES_PER_ELEMENT[w.dtype]
    if k % group:
        return f"K = {k} (from {list(w.shape)}) is not a multiple of the group size {group}"
    expected = (*w.shape[:-1], k // group)
    if s.shape != expected:
        return f"scale {scale} has shape {list(s.shape)} but K = {k} in groups of {group} needs {list(expected)}"
    if global_scale is not None:
        if global_scale not in names:
            return f"has no global scale {global_scale}"
        g = index.entry(global_scale)
        if g.dtype != "F32" or g.numel != 1:
            return f"global scale {global_scale} is {g.dtype} {list(g.shape)}, not one float32"
    if shape_tensor is not None:
        if shape_tensor not in names:
            return f"has no {shape_tensor} (compressed-tensors writes the unpacked shape there)"
        t = index.entry(shape_tensor)
        if t.dtype not in ("I32", "I64") or t.shape != (len(w.shape),):
            return f"{shape_tensor} is {t.dtype} {list(t.shape)}, not {len(w.shape)} integers"
    return None


def packed_output_shape(fmt: WeightFormat) -> tuple[int, ...]:
    """The unpacked weight as written: [..., N, K], except gpt-oss's experts, [E, K, N] as transformers'
    bf16 GptOssExperts holds them (convert_moe_packed_tensors transposes the same way)."""
    assert fmt.shape is not None
    if fmt.kind is Kind.MXFP4_GPT_OSS:
        return (*fmt.shape[:-2], fmt.shape[-1], fmt.shape[-2])
    return fmt.shape
