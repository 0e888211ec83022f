"""KV-cache (and FP8 attention) scales an FP8 checkpoint may carry beside its weights.

Their names, as vLLM loads them (maybe_remap_kv_scale_name, and the get_cache_scale of its
compressed-tensors, Quark and FP8 configs): `.k_scale` / `.v_scale` / `.q_scale` (on the attention
module, or ModelOpt's `self_attn.k_proj.k_scale`), the deprecated `.kv_scale`, compressed-tensors'
`k_proj.output_scale`, `self_attn.prob_output_scale` / `.prob_scale`, and `.k_cache.scale`.

An engine reads them only under a quantization_config that declares an FP8 KV cache
(compressed-tensors kv_cache_scheme, ModelOpt kv_cache_quant_algo). No output config fp8conv writes
declares one, so they are dropped from every output, and the run says so: left in, transformers reports
them as unexpected keys, and nothing would apply them.
"""

from __future__ import annotations

from .dtypes import FLOAT_SCALE_DTYPES
from .index import CheckpointIndex

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


def kv_cache_scales(index: CheckpointIndex, plain: list[str], quantized: bool) -> list[str]:
    """The plain tensors that are KV-cache scales: float tensors named as above, in a checkpoint whose
    config declares a quantization (a bf16 model's own parameter of such a name is left alone)."""
    if not quantized:
        return []
    return [n for n in plain if n.endswith(KV_SCALE_SUFFIXES) and index.entry(n).dtype in FLOAT_SCALE_DTYPES]


def dropped_warning(names: list[str], target: str) -> str:
    more = len(names) - NAMED_IN_WARNING
    shown = ", ".join(names[:NAMED_IN_WARNING]) + (f" and {more} more" if more > 0 else "")
    return (
        f"{len(names)} KV-cache scale tensor(s) dropped ({shown}): the --to {target} output's config.json "
        "declares no FP8 KV cache, so no engine would apply them (an FP8 KV cache run from the output uses "
        "uncalibrated scales unless calibrated again)"
    )
