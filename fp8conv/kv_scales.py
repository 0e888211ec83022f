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


def dropped_kv_scales(index: CheckpointIndex, plain: list[str], quantized: bool, target: str) -> list[str]:
    """With --to bf16, the plain tensors that are KV-cache scales: float tensors named as above, in a
    checkpoint whose config declares a quantization (a bf16 model's own parameter of such a name is left
    alone). Other targets drop none."""
    if not quantized or target != "bf16":
        return []
    return [n for n in plain if n.endswith(KV_SCALE_SUFFIXES) and index.entry(n).dtype in FLOAT_SCALE_DTYPES]


def dropped_warning(names: list[str]) -> str:
    more = len(names) - NAMED_IN_WARNING
    shown = ", ".join(names[:NAMED_IN_WARNING]) + (f" and {more} more" if more > 0 else "")
    return (
        f"{len(names)} KV-cache scale tensor(s) dropped ({shown}): a bf16 output has no quantization_config, "
        "so no engine loads them (transformers would report them as unexpected keys)"
    )
