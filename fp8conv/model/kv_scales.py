"""KV-cache (and FP8 attention) scales an FP8 checkpoint may carry beside its weights.

Their names, as vLLM loads them (maybe_remap_kv_scale_name, and the get_cache_scale of its
compressed-tensors, Quark and FP8 configs): `.k_scale` / `.v_scale` / `.q_scale` (on the attention
module, or ModelOpt's `self_attn.k_proj.k_scale`), the deprecated `.kv_scale`, compressed-tensors'
`k_proj.output_scale`, `self_attn.prob_output_scale` / `.prob_scale`, and `.k_cache.scale`.

vLLM attaches a KV-cache method to every attention layer under an fp8 or compressed-tensors
quantization_config, kv_cache_scheme or not (Fp8Config / CompressedTensorsConfig.get_quant_method), and
applies these scales when it runs an FP8 KV cache (--kv-cache-dtype fp8): the channel and block outputs
keep them. A bf16 output has no quantization_config: no engine loads them there (vLLM skips names its
model lacks; transformers reports them as unexpected keys), so --to bf16 drops them and says so.

Whether vLLM runs an FP8 KV cache by default is the config's call: a compressed-tensors `kv_cache_scheme`
turns kv_cache_dtype "auto" into fp8 (Attention.__init__), as ModelOpt's `kv_cache_quant_algo` does
(resolve_kv_cache_dtype_string); an fp8 config declares nothing (Fp8Config.from_config reads no KV key), so
it runs FP8 only with --kv-cache-dtype fp8. The channel output declares what the input declared, in
compressed-tensors' spelling; the block output cannot, and says so.
"""

from __future__ import annotations

import copy
from typing import Any

from ..dtypes import FLOAT_SCALE_DTYPES
from ..errors import CheckpointError
from ..source.index import CheckpointIndex
from .quant_settings import normalized_method

KV_SCALE_SUFFIXES = (
    ".k_scale",
    ".v_scale",
    ".q_scale",
    ".kv_scale",
    ".prob_scale",
    ".k_proj.output_scale",
    ".v_proj.output_scale",
    ".q_proj.output_scale",
    ".prob_output_scale",
    ".k_cache.scale",
    ".v_cache.scale",
)
NAMED_IN_WARNING = 3
# ModelOpt's FP8 KV cache (per-tensor static k/v scales) as compressed-tensors 0.20 dumps QuantizationArgs
# for it: what its ModelOpt converter writes as kv_cache_scheme, and what vLLM validates (8-bit float,
# tensor strategy, symmetric).
FP8_KV_CACHE_SCHEME: dict[str, Any] = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "tensor",
    "dynamic": False,
}


def kv_scale_names(index: CheckpointIndex, plain: list[str], quantized: bool) -> list[str]:
    """The plain tensors that are KV-cache scales: float tensors named as above, in a checkpoint whose
    config declares a quantization (a bf16 model's own parameter of such a name is left alone)."""
    if not quantized:
        return []
    return [n for n in plain if n.endswith(KV_SCALE_SUFFIXES) and index.entry(n).dtype in FLOAT_SCALE_DTYPES]


def input_kv_declaration(qconfig: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """What the input's quantization_config declares about its KV cache: (the compressed-tensors
    kv_cache_scheme saying the same, None when there is no such spelling; the declaration as written, for
    messages, None when it declares nothing). Read where vLLM reads it: kv_cache_scheme at the top level
    (compressed-tensors, ModelOpt's flat form), ModelOpt's kv_cache_quant_algo, nested or top level, or
    Quark's export.kv_cache_group (an FP8 per-tensor output scale on each k_proj / v_proj)."""
    method = normalized_method(qconfig.get("quant_method")) if qconfig else None
    if method == "quark":  # vLLM's QuarkConfig: export.kv_cache_group's output_tensors, FP8 per tensor
        export = qconfig.get("export") or qconfig.get("json_export_config") or {} if qconfig else {}
        group = export.get("kv_cache_group") if isinstance(export, dict) else None
        if not group:
            return None, None
        return copy.deepcopy(FP8_KV_CACHE_SCHEME), f"Quark kv_cache_group {group}"
    # MiniMax's quant_method mxfp8 is read as ModelOpt MXFP8, its kv_cache_quant_algo with it
    if method is None or not (method in ("compressed-tensors", "mxfp8") or method.startswith("modelopt")):
        return None, None  # vLLM's Fp8Config (and the others fp8conv reads) read no KV-cache key
    scheme = qconfig.get("kv_cache_scheme")
    if isinstance(scheme, dict):
        return copy.deepcopy(scheme), f"kv_cache_scheme {scheme}"
    nested = qconfig.get("quantization")
    algo = (nested if isinstance(nested, dict) else {}).get("kv_cache_quant_algo") or qconfig.get("kv_cache_quant_algo")
    if algo is None:
        return None, None
    said = f"ModelOpt kv_cache_quant_algo {algo!r}"
    return (copy.deepcopy(FP8_KV_CACHE_SCHEME) if str(algo).lower() == "fp8" else None), said


def declare_kv_cache(
    output_qconfig: dict[str, Any], input_qconfig: dict[str, Any] | None, kept: list[str], target: str
) -> list[str]:
    """Put the input's KV-cache declaration in a channel output's compressed-tensors config, when the output
    keeps KV scales; returns the warnings for what cannot be declared. Never declares without scales (vLLM
    would run an FP8 KV cache at scale 1.0); never invents one the input did not make (vLLM would switch
    the KV cache to FP8 where the input ran it unquantized)."""
    scheme, said = input_kv_declaration(input_qconfig)
    if said is None:
        return []
    if not kept:
        return [
            f"the input declares {said} but carries no KV-cache scale: the output declares no KV-cache quantization"
        ]
    if target == "channel" and scheme is not None:
        output_qconfig["kv_cache_scheme"] = scheme
        return []
    if target == "block":
        why = "an fp8 config has no KV-cache declaration (vLLM's Fp8Config reads none)"
    elif target == "int8":  # for hardware without FP8: an FP8 KV cache is the server's choice, not the file's
        why = "an INT8 output is for hardware without FP8, so it declares no FP8 KV cache"
    else:
        why = "compressed-tensors has no spelling for it that vLLM loads"
    return [
        f"the input declares {said}; {why}, so vLLM runs this output with an unquantized KV cache unless "
        f"served with --kv-cache-dtype fp8, which applies the {len(kept)} KV-cache scale tensor(s) kept"
    ]


def per_head_kv_scales(index: CheckpointIndex, kept: list[str], target: str) -> list[CheckpointError]:
    """--to block: vLLM's Fp8KVCacheMethod loads one scale per layer and fails on per-head ones
    (compressed-tensors kv_cache_scheme strategy attn_head), which only a compressed-tensors config declares."""
    if target != "block":
        return []
    return [
        CheckpointError(
            f"is a per-head KV-cache scale {list(index.entry(n).shape)}; an fp8 config loads one KV-cache scale "
            "per layer (vLLM's Fp8KVCacheMethod refuses more)",
            tensor=n,
            shard=index.shard_of(n).name,
            fix="convert with --to channel (which keeps kv_cache_scheme strategy attn_head) or --to bf16",
        )
        for n in kept
        if index.entry(n).numel > 1
    ]


def dropped_warning(names: list[str]) -> str:
    more = len(names) - NAMED_IN_WARNING
    shown = ", ".join(names[:NAMED_IN_WARNING]) + (f" and {more} more" if more > 0 else "")
    return (
        f"{len(names)} KV-cache scale tensor(s) dropped ({shown}): a bf16 output has no quantization_config, "
        "so no engine loads them (transformers would report them as unexpected keys)"
    )
