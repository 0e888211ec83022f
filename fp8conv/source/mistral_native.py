"""Mistral-native releases (Mistral-Large-3, Medium-3.5): `consolidated*.safetensors` + `params.json`,
tensors `layers.{L}.attention.wq_a.weight` with per-tensor `.qscale_weight` (a multiplier: vLLM's
MistralLarge3ForCausalLM maps it to `.weight_scale`) and `.qscale_act` (`.input_scale`).

When a release ships only those, they are the checkpoint: converted in their own names, one output file
per input file, `params.json` rewritten, which vLLM loads with `--load-format mistral --config-format
mistral`. What vLLM reads (vllm/transformers_utils/configs/mistral.py, _remap_mistral_quantization_args):
`quantization` is either `qformat_weight: fp8_e4m3` (per-tensor FP8 only: it becomes quant_method fp8 with
no weight_block_size) or a compressed-tensors entry, passed through as the quantization_config. So:

- bf16: `quantization` removed.
- channel: compressed-tensors FP8_DYNAMIC; scales named `.qscale_weight` [N, 1], the name vLLM's dense
  Mistral loader (llama.py maybe_remap_mistral) permutes with wq/wk's rotary row order when it has more
  than one element, and MistralLarge3 renames to `.weight_scale`.
- block: compressed-tensors FP8_BLOCK (strategy block, block_structure); scales named `.weight_scale`
  [N/b, K/b] (compressed-tensors' name; a `.qscale_weight` grid would be permuted as if per row).
- mxfp8 / ue8m0 scales: refused (no compressed-tensors spelling vLLM's Mistral loader was confirmed to read).

The `ignore` list is matched against vLLM's module names (compressed-tensors should_ignore_layer; neither
MistralLarge3ForCausalLM nor LlamaForCausalLM has an hf_to_vllm_mapper that would map it), so each
unquantized module is written in the name the loader gives it. When HF shards are present too, they are
the checkpoint and the consolidated files are skipped, as before.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from ..errors import CheckpointError
from .config import MISTRAL_PARAMS_NAME

NATIVE_PREFIX = "consolidated"
NATIVE_SCALE_SUFFIX = ".qscale_weight"
NATIVE_ACTIVATION_SUFFIX = ".qscale_act"
# attention / KV-cache scales of Mistral's fake quantizers (vLLM: kv_scale, attn.q_scale, k_scale, v_scale)
FAKE_QUANTIZER = re.compile(r"\.(?:kv|q|k|v)_fake_quantizer\.qscale_act$")
# MistralLarge3ForCausalLM.remapping (vllm/model_executor/models/mistral_large_3.py), module part only
_MLA_MODULES = [
    (r"layers\.(\d+)\.attention\.wq_a", r"model.layers.\1.self_attn.q_a_proj"),
    (r"layers\.(\d+)\.attention\.wq_b", r"model.layers.\1.self_attn.q_b_proj"),
    (r"layers\.(\d+)\.attention\.wkv_a_with_mqa", r"model.layers.\1.self_attn.kv_a_proj_with_mqa"),
    (r"layers\.(\d+)\.attention\.wkv_b", r"model.layers.\1.self_attn.kv_b_proj"),
    (r"layers\.(\d+)\.attention\.wo", r"model.layers.\1.self_attn.o_proj"),
    (r"layers\.(\d+)\.gate", r"model.layers.\1.mlp.gate"),
    (r"layers\.(\d+)\.feed_forward\.w([123])", r"model.layers.\1.mlp.<w\2>"),
    (r"layers\.(\d+)\.shared_experts\.w([123])", r"model.layers.\1.mlp.shared_experts.<w\2>"),
    (r"layers\.(\d+)\.experts\.(\d+)\.w([123])", r"model.layers.\1.mlp.experts.\2.<w\3>"),
    (r"output", "lm_head"),
]
# LlamaForCausalLM.mistral_mapping (vllm/model_executor/models/llama.py): the dense Mistral layout
_DENSE_MODULES = [
    (r"layers\.(\d+)\.attention\.w([qkvo])", r"model.layers.\1.self_attn.\2_proj"),
    (r"layers\.(\d+)\.feed_forward\.w([123])", r"model.layers.\1.mlp.<w\2>"),
    (r"output", "lm_head"),
]
_W = {"<w1>": "gate_proj", "<w2>": "down_proj", "<w3>": "up_proj"}


def is_native(name: str) -> bool:
    return name.startswith(NATIVE_PREFIX) and name.endswith(".safetensors")


def hf_shards_first(top_level: list[str]) -> list[str]:
    """The top-level .safetensors that are the checkpoint: the HF-named ones when there are any (the
    consolidated files are then Mistral's second copy of the same weights), else the consolidated ones."""
    hf = [name for name in top_level if not is_native(name)]
    return hf or top_level


def native_only(shard_names: list[str], has_config: bool, other_files: list[str]) -> bool:
    """A release of consolidated files and params.json only, with no HF shard and no config.json."""
    return (
        bool(shard_names)
        and not has_config
        and MISTRAL_PARAMS_NAME in other_files
        and all(is_native(n) for n in shard_names)
    )


def engine_layout(params: dict[str, Any]) -> str | None:
    """Which vLLM class loads these names (configs/mistral.py adapt_config_dict): 'mla' for
    MistralLarge3ForCausalLM (MLA; MoE with shared experts, or dense MLA, which it gives one shared
    expert), 'dense' for MistralForCausalLM (no MoE); None for the rest (Mixtral's MoE), not confirmed."""
    moe = params.get("moe")
    if params.get("qk_nope_head_dim"):
        return "mla" if not moe or (isinstance(moe, dict) and (moe.get("num_shared_experts") or 0) > 0) else None
    return "dense" if not moe else None


def native_problems(
    shard: str, first_fp8: str | None, to: str, params: dict[str, Any], pow2: bool, block_rows: int
) -> list[CheckpointError]:
    """FP8 targets of a Mistral-native-only release that vLLM's Mistral loader cannot read as written."""
    if to == "bf16":
        return []
    why = None
    layout = engine_layout(params)
    if to == "int8":
        why = "vLLM's Mistral loader has no confirmed reading of INT8 weights (compressed-tensors int-quantized) there"
    elif pow2:
        why = (
            f"params.json's quantization is read as fp8_e4m3 per-tensor or compressed-tensors only, and vLLM's "
            f"Mistral loader has no confirmed reading of {'MXFP8' if to == 'mxfp8' else 'ue8m0 block scales'} there"
        )
    elif layout is None:
        why = "its params.json is a MoE without MLA or shared experts (Mixtral): FP8 names not confirmed"
    elif to == "block" and layout == "dense" and block_rows % _head_dim(params):
        # vLLM permutes wq/wk rows within each head at load (rotary order) but not a block grid
        why = (
            f"vLLM permutes wq/wk rows within each head of {_head_dim(params)} at load, which moves rows across "
            f"{block_rows}-row scale blocks"
        )
    if why is None:
        return []
    return [
        CheckpointError(
            f"is a Mistral-native release (consolidated files + params.json, no config.json): {why}, so --to {to} "
            "would not load as written",
            tensor=first_fp8,
            shard=shard,
            fix="convert with --to bf16 or --to channel, or use the release's HF-format files",
        )
    ]


def _head_dim(params: dict[str, Any]) -> int:
    head_dim = params.get("head_dim") or params.get("dim", 0) // max(params.get("n_heads", 1), 1)
    return int(head_dim) or 1


def native_scale_name(scale: str, to: str) -> str:
    """The written scale's name in the loader's spelling (see the module docstring)."""
    if to == "channel" and scale.endswith(".weight_scale"):
        return scale[: -len(".weight_scale")] + NATIVE_SCALE_SUFFIX
    if to == "block" and scale.endswith(".weight_scale_inv"):
        return scale[: -len("_inv")]
    return scale


def engine_module(module: str, layout: str, multimodal: bool) -> str:
    """A native module name as vLLM names the layer (what compressed-tensors' ignore is matched against);
    a name outside the text model (vision encoder, adapter) is kept: vLLM builds those unquantized."""
    for pattern, repl in _MLA_MODULES if layout == "mla" else _DENSE_MODULES:
        if re.fullmatch(pattern, module):
            name = re.sub(_W_KEYS, lambda m: _W[m.group(0)], re.sub(pattern, repl, module))
            # Pixtral (params.json with a vision encoder) builds the text model under language_model
            return "language_model." + name if multimodal else name
    return module


_W_KEYS = re.compile("|".join(re.escape(k) for k in _W))


def native_params(params: dict[str, Any], channel_or_block: dict[str, Any], ignore: list[str]) -> dict[str, Any]:
    """params.json with `quantization` the compressed-tensors entry, its ignore in vLLM's module names."""
    out = copy.deepcopy(params)
    layout = engine_layout(params) or "dense"
    multimodal = bool(params.get("vision_encoder") or (params.get("multimodal") or {}).get("vision_encoder_args"))
    quant = copy.deepcopy(channel_or_block)
    quant["ignore"] = sorted({engine_module(m, layout, multimodal) for m in ignore})
    out["quantization"] = quant
    return out


def fake_quantizer_warning(names: list[str]) -> str:
    return (
        f"{len(names)} Mistral fake-quantizer activation / KV-cache scale(s) ({names[0]}, ...) dropped: "
        "the output declares no static activation or KV-cache quantization for them to apply to"
    )
