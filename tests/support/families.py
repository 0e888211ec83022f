"""Tiny models of every published FP8 family, in the layout of that family's FP8 release.

Each fixture is a real transformers model (built from a config dict, bf16, `save_pretrained`; hidden and
intermediate sizes that are not multiples of 128, 2-3 layers, 4 experts, vocabulary 300), then rewritten
by this file's own quantization code into the family's published layout: the tensor names, the scale
names, dtypes and shapes, and the config's quantization_config as the releases have them. Where a
release uses names transformers has no class for (remote code, Mistral-native files, per-expert tensors
of a model transformers 5 keeps fused) the tensors are renamed or built by hand here, and the fixture
says `hf_loadable=False` with the reason.

API (kept stable for other test files):

    build_family(name, folder) -> FamilyFixture
    FAMILIES: tuple of every name
    fixture.path            the checkpoint folder (several shards + index + config.json)
    fixture.config          the config.json written
    fixture.reference       name -> tensor: what the bf16 output must hold once rounded: every FP8
                            weight as the float32 product float32(q) * float32(scale) of the plain
                            definition below, every other tensor as stored (scales not included)
    fixture.fp8_weights     names of the weights stored as FP8
    fixture.layout          "block" | "channel" | "tensor" | "mxfp4"
    fixture.hf_loadable     whether transformers can load the converted output (else: tensors/config only)
    fixture.hf_class        the transformers class to load it with
    fixture.why_not_loadable  the reason, when hf_loadable is False
    fixture.refusal         for an input fp8conv must refuse: a piece of the expected message
    fixture.unexpected_prefixes  tensor-name prefixes transformers does not map (MTP layers)
    fixture.extra_files     files beside the HF shards (Mistral: consolidated.safetensors, params.json)

Building one takes 0.5-3 s (the first also imports transformers' model code).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.reference import dequant_block_reference

FP8_MAX = 448.0
BLOCK = (128, 128)
HIDDEN = 200  # not a multiple of 128
INTER = 330
MOE_INTER = 136
VOCAB = 300


@dataclass
class FamilyFixture:
    name: str
    path: Path
    config: dict[str, Any]
    reference: dict[str, torch.Tensor]
    fp8_weights: frozenset[str]
    layout: str
    hf_loadable: bool
    hf_class: str = "AutoModelForCausalLM"
    why_not_loadable: str | None = None
    refusal: str | None = None
    unexpected_prefixes: tuple[str, ...] = ()  # tensors transformers does not map (MTP layers)
    extra_files: tuple[str, ...] = ()  # files beside the HF shards (consolidated.safetensors, params.json)
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Quantization: the plain definitions (pad to whole blocks, amax / 448, clamp, cast; scales stored in the
# family's dtype first, so that the stored scale is exactly the one the FP8 values were divided by).


def _scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, ue8m0: bool) -> torch.Tensor:
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale.to(dtype)


def quantize_2d(w: torch.Tensor, layout: str, scale_dtype: torch.dtype, ue8m0: bool = False):
    """(q, stored scale, float32 dequantized truth) for one [N, K] weight."""
    w = w.to(torch.float32)
    n, k = w.shape
    if layout == "block":
        bn, bk = BLOCK
        gn, gk = math.ceil(n / bn), math.ceil(k / bk)
        padded = torch.zeros(gn * bn, gk * bk)
        padded[:n, :k] = w
        blocks = padded.view(gn, bn, gk, bk)
        scale = _scale_from_amax(blocks.abs().amax(dim=(1, 3)), scale_dtype, ue8m0)
        s = scale.to(torch.float32)[:, None, :, None]
        q = (blocks / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(gn * bn, gk * bk)[:n, :k]
        q = q.contiguous()
        return q, scale, dequant_block_reference(q, scale, BLOCK, torch.float32)
    if layout == "channel":
        scale = _scale_from_amax(w.abs().amax(dim=1, keepdim=True), scale_dtype, ue8m0)  # [N, 1]
    elif layout == "tensor":
        scale = _scale_from_amax(w.abs().amax().reshape(()), scale_dtype, ue8m0)
    else:
        raise ValueError(layout)
    q = (w / scale.to(torch.float32)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale, q.to(torch.float32) * scale.to(torch.float32)


def quantize_3d(w: torch.Tensor, scale_dtype: torch.dtype):
    """Fused [E, N, K] experts, block FP8 per expert: scale [E, ceil(N/128), ceil(K/128)]."""
    parts = [quantize_2d(w[e], "block", scale_dtype) for e in range(w.shape[0])]
    return tuple(torch.stack([p[i] for p in parts]) for i in range(3))


# ---------------------------------------------------------------------------------------------------
# The families


@dataclass(frozen=True)
class Spec:
    model_type: str
    hf: dict[str, Any]  # config kwargs
    layout: str  # block | channel | tensor | mxfp4
    qconfig: Callable[[dict[str, Any]], dict[str, Any]]  # hf config.json -> quantization_config
    fp8: Callable[[str, torch.Tensor], bool]  # which tensors the release stores as FP8
    scale_name: str = "weight_scale_inv"
    scale_dtype: torch.dtype = torch.float32
    scale_shape: tuple[int, ...] | None = None  # per-tensor: (1,) or () ; channel [N,1] always
    act_scale: str | None = None  # input_scale | activation_scale (static activations)
    ue8m0: bool = False
    hf_class: str = "AutoModelForCausalLM"
    model_class: str | None = None  # for from_config when not a causal LM
    post: Callable[[dict[str, torch.Tensor], dict[str, Any], Path], None] | None = None  # before quantizing
    after: Callable[[FamilyFixture, dict[str, torch.Tensor]], None] | None = None  # after writing
    hf_loadable: bool = True
    why_not_loadable: str | None = None
    refusal: str | None = None
    unexpected_prefixes: tuple[str, ...] = ()


_NEVER = re.compile(
    r"(embed|norm|lm_head|\.gate\.weight$|_gate\.weight$|router|visual|e_score|shared_head|eh_proj|mtp\.fc)"
)


def _linear(name: str, t: torch.Tensor) -> bool:
    """A Linear weight every FP8 release quantizes: 2-D `.weight`, not embeddings/norms/routers/heads."""
    return name.endswith(".weight") and t.dim() == 2 and not _NEVER.search(name)


def _fp8_block(extra: dict[str, Any] | None = None) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def make(_: dict[str, Any]) -> dict[str, Any]:
        qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
        return {**qc, **(extra or {})}

    return make


def _ct(strategy: str, ignore: Callable[[dict[str, Any]], list[str]], static: bool = False):
    def make(cfg: dict[str, Any]) -> dict[str, Any]:
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        weights["observer"] = "minmax"
        acts = {"num_bits": 8, "type": "float", "symmetric": True}
        acts |= {"strategy": "tensor", "dynamic": False} if static else {"strategy": "token", "dynamic": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": weights,
                    "input_activations": acts,
                    "output_activations": None,
                }
            },
            "ignore": ignore(cfg),
            "kv_cache_scheme": None,
        }

    return make


def _layers(cfg: dict[str, Any]) -> range:
    return range(cfg.get("num_hidden_layers", 0))


_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=48)
_SMALL = dict(hidden_size=HIDDEN, num_hidden_layers=2, vocab_size=VOCAB, intermediate_size=INTER, **_ATTN)
_DEEPSEEK = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=2,
    vocab_size=VOCAB,
    intermediate_size=INTER,
    moe_intermediate_size=MOE_INTER,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_group=1,
    topk_group=1,
)


def _add_mtp(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
    """DeepSeek-V3 / GLM-4.5 MTP layer `model.layers.{num_hidden_layers}`: a copy of the last decoder
    layer plus enorm/hnorm/eh_proj/shared_head (transformers does not build it: tensors by hand)."""
    n = cfg["num_hidden_layers"]
    last = f"model.layers.{n - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        tensors[f"model.layers.{n}." + name[len(last) :]] = tensors[name].clone()
    gen = torch.Generator().manual_seed(7)
    p = f"model.layers.{n}."
    tensors[p + "enorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors[p + "hnorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors[p + "eh_proj.weight"] = (torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    tensors[p + "shared_head.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    cfg["num_nextn_predict_layers"] = 1


def _add_qwen3_next_mtp(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
    """Qwen3-Next ships its MTP module as `mtp.*` (a full-attention MoE layer, `mtp.fc` and norms), which
    transformers ignores on load; built by hand from the last (full-attention) layer."""
    last = f"model.layers.{cfg['num_hidden_layers'] - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        tensors["mtp.layers.0." + name[len(last) :]] = tensors[name].clone()
    gen = torch.Generator().manual_seed(8)
    tensors["mtp.fc.weight"] = (torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.02).to(torch.bfloat16)
    for norm in ("mtp.norm", "mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden"):
        tensors[norm + ".weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    cfg["mtp_num_hidden_layers"] = 1


def _kimi_config(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
    """Kimi-K2 ships DeepSeek-V3 tensors under model_type kimi_k2 with remote code."""
    cfg["model_type"] = "kimi_k2"
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }


def _float32(*patterns: str):
    def post(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
        for name in tensors:
            if any(re.search(p, name) for p in patterns):
                tensors[name] = tensors[name].to(torch.float32)

    return post


def _chain(*posts):
    def post(tensors, cfg, folder):
        for p in posts:
            p(tensors, cfg, folder)

    return post


def _split_fused_experts(transposed: bool):
    """transformers 5 keeps experts fused ([E, 2I, H] gate_up and [E, H, I] down; Llama-4 stores the
    transpose); the FP8 releases store one Linear per expert: `experts.E.{gate,up,down}_proj.weight`."""

    def post(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
        for name in [k for k in tensors if k.endswith("experts.gate_up_proj")]:
            prefix = name[: -len("gate_up_proj")]
            gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
            if transposed:  # Llama-4: gate_up [E, H, 2I], down [E, I, H]
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
                tensors[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()

    return post


_MISTRAL_NAMES = (
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.q_proj\.", ".attention.wq."),
    (r"\.self_attn\.k_proj\.", ".attention.wk."),
    (r"\.self_attn\.v_proj\.", ".attention.wv."),
    (r"\.self_attn\.o_proj\.", ".attention.wo."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.weight_scale_inv$", ".qscale_weight"),
    (r"\.activation_scale$", ".qscale_act"),
)


def mistral_name(hf_name: str) -> str:
    for pattern, repl in _MISTRAL_NAMES:
        hf_name = re.sub(pattern, repl, hf_name)
    return hf_name


def _mistral_consolidated(fixture: FamilyFixture, tensors: dict[str, torch.Tensor]) -> None:
    """Mistral releases ship the same FP8 weights again in Mistral-native names beside the HF shards
    (`consolidated.safetensors`, `qscale_weight` / `qscale_act`) with `params.json`, the config vLLM
    reads with --config-format mistral. Built by renaming (the rotary permutation of wq/wk that
    Mistral's own files have is left out: only the names, dtypes and the quantization entry matter)."""
    from safetensors.torch import save_file

    cfg = fixture.config
    save_file(
        {mistral_name(n): t for n, t in tensors.items()},
        str(fixture.path / "consolidated.safetensors"),
        metadata={"format": "pt"},
    )
    params = {
        "dim": cfg["hidden_size"],
        "n_layers": cfg["num_hidden_layers"],
        "head_dim": cfg["head_dim"],
        "hidden_dim": cfg["intermediate_size"],
        "n_heads": cfg["num_attention_heads"],
        "n_kv_heads": cfg["num_key_value_heads"],
        "rope_theta": 1000000.0,
        "norm_eps": 1e-05,
        "vocab_size": cfg["vocab_size"],
        "tied_embeddings": False,
        "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_act": "TENSOR"},
    }
    (fixture.path / "params.json").write_text(json.dumps(params, indent=2))
    fixture.extra_files = ("consolidated.safetensors", "params.json")


def _mxfp4(tensors: dict[str, torch.Tensor], cfg: dict[str, Any], _: Path) -> None:
    """gpt-oss: fused experts as MXFP4, `*_blocks` uint8 [E, N, K/32, 16] + `*_scales` uint8 [E, N, K/32]."""
    gen = torch.Generator().manual_seed(3)
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # transformers keeps [E, K, N]; the release stores [E, N, K]
        e, n, k = w.shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=gen)
        tensors[name + "_scales"] = torch.randint(118, 130, (e, n, k // 32), dtype=torch.uint8, generator=gen)


def _not_converted_qwen3_next(cfg: dict[str, Any]) -> list[str]:
    out = ["lm_head", "model.embed_tokens", "model.norm"]
    for i in _layers(cfg):
        p = f"model.layers.{i}."
        out += [p + "input_layernorm", p + "post_attention_layernorm", p + "mlp.gate", p + "mlp.shared_expert_gate"]
        if cfg["layer_types"][i] == "linear_attention":
            out += [p + "linear_attn.in_proj_ba", p + "linear_attn.conv1d", p + "linear_attn.norm"]
            out += [p + "linear_attn.A_log", p + "linear_attn.dt_bias"]
        else:
            out += [p + "self_attn.q_norm", p + "self_attn.k_norm"]
    return out


def _qwen3_next_fp8(name: str, t: torch.Tensor) -> bool:
    return _linear(name, t) and "in_proj_ba" not in name


def _llama31_skip(cfg: dict[str, Any]) -> list[str]:
    """Meta's Llama-3.1-405B-FP8: every attention projection and the first and last layers' MLP stay bf16."""
    n = cfg["num_hidden_layers"]
    out = []
    for i in range(n):
        out += [f"model.layers.{i}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if i in (0, n - 1):
            out += [f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    return [*out, "lm_head"]


def _llama31_fp8(name: str, t: torch.Tensor) -> bool:
    return _linear(name, t) and ".layers.1.mlp." in name


def _glm_ignore(cfg: dict[str, Any]) -> list[str]:
    n = cfg["num_hidden_layers"]
    routers = [f"model.layers.{i}.mlp.gate" for i in range(cfg["first_k_dense_replace"], n + 1)]
    return ["lm_head", *routers, f"model.layers.{n}.eh_proj"]


def _router_ignore(router: str):
    def ignore(cfg: dict[str, Any]) -> list[str]:
        return ["lm_head"] + [f"model.layers.{i}.{router}" for i in _layers(cfg)]

    return ignore


_QWEN3_VL_MOE = dict(
    text_config=dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 8, 8]},
        **_ATTN,
    ),
    vision_config=dict(
        depth=1,
        hidden_size=64,
        intermediate_size=96,
        num_heads=2,
        out_hidden_size=HIDDEN,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=[0],
    ),
)

_MOE4 = dict(num_experts=4, num_experts_per_tok=2)

SPECS: dict[str, Spec] = {
    "deepseek-v3": Spec(
        "deepseek_v3",
        _DEEPSEEK,
        "block",
        _fp8_block(),
        _linear,
        post=_chain(_float32(r"e_score_correction_bias"), _add_mtp),
        unexpected_prefixes=("model.layers.2.",),
    ),
    "deepseek-v3.1": Spec(
        "deepseek_v3",
        _DEEPSEEK,
        "block",
        _fp8_block({"scale_fmt": "ue8m0"}),
        _linear,
        ue8m0=True,
        post=_chain(_float32(r"e_score_correction_bias"), _add_mtp),
        unexpected_prefixes=("model.layers.2.",),
    ),
    "kimi-k2": Spec(
        "deepseek_v3",
        _DEEPSEEK,
        "block",
        _fp8_block(),
        _linear,
        post=_chain(_float32(r"e_score_correction_bias"), _kimi_config),
        hf_loadable=False,
        why_not_loadable="model_type kimi_k2 needs the release's remote code",
    ),
    "deepseek-v3.2": Spec(
        "deepseek_v32",
        dict(_DEEPSEEK, index_n_heads=2, index_head_dim=32, index_topk=4),
        "block",
        _fp8_block({"scale_fmt": "ue8m0"}),
        _linear,  # indexer.wq_b / indexer.wk FP8; weights_proj (excluded below) and k_norm bf16
        ue8m0=True,
        post=_float32(r"e_score_correction_bias"),
    ),
    "qwen3-8b": Spec(
        "qwen3", dict(_SMALL, num_hidden_layers=2), "block", _fp8_block(), _linear, scale_dtype=torch.bfloat16
    ),
    "qwen3-4b-2507": Spec(
        "qwen3",
        dict(_SMALL, tie_word_embeddings=True),
        "block",
        _fp8_block(),
        _linear,
        scale_dtype=torch.float16,
    ),
    "qwen3-moe": Spec(
        "qwen3_moe",
        dict(_SMALL, moe_intermediate_size=MOE_INTER, decoder_sparse_step=1, **_MOE4),
        "block",
        _fp8_block(),
        _linear,
        scale_dtype=torch.bfloat16,
    ),
    "qwen3-next": Spec(
        "qwen3_next",
        dict(
            _SMALL,
            moe_intermediate_size=MOE_INTER,
            shared_expert_intermediate_size=264,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            layer_types=["linear_attention", "full_attention"],
            **_MOE4,
        ),
        "block",
        lambda cfg: _fp8_block({"modules_to_not_convert": _not_converted_qwen3_next(cfg)})(cfg),
        _qwen3_next_fp8,
        post=_add_qwen3_next_mtp,
        unexpected_prefixes=("mtp.",),
    ),
    "qwen2-moe": Spec(
        "qwen2_moe",
        dict(_SMALL, moe_intermediate_size=MOE_INTER, shared_expert_intermediate_size=264, **_MOE4),
        "block",
        _fp8_block(),
        _linear,
    ),
    "qwen3-vl-moe": Spec(
        "qwen3_vl_moe",
        _QWEN3_VL_MOE,
        "block",
        _fp8_block({"modules_to_not_convert": ["lm_head", "model.visual"]}),
        _linear,
        scale_dtype=torch.bfloat16,
        hf_class="Qwen3VLMoeForConditionalGeneration",
        model_class="Qwen3VLMoeForConditionalGeneration",
        post=_split_fused_experts(transposed=False),
        hf_loadable=False,
        why_not_loadable="transformers keeps Qwen3-VL-MoE experts fused and maps no per-expert names",
    ),
    "qwen3-vl-moe-fused": Spec(
        "qwen3_vl_moe",
        _QWEN3_VL_MOE,
        "block",
        _fp8_block({"modules_to_not_convert": ["lm_head", "model.visual"]}),
        lambda n, t: _linear(n, t) or n.endswith(("experts.gate_up_proj", "experts.down_proj")),
        hf_class="Qwen3VLMoeForConditionalGeneration",
        model_class="Qwen3VLMoeForConditionalGeneration",
    ),
    "glm-4.5": Spec(
        "glm4_moe",
        dict(
            _SMALL,
            attention_bias=True,
            moe_intermediate_size=MOE_INTER,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            partial_rotary_factor=0.5,
        ),
        "channel",
        _ct("channel", _glm_ignore),
        _linear,
        scale_name="weight_scale",
        scale_dtype=torch.bfloat16,
        post=_chain(_float32(r"e_score_correction_bias"), _add_mtp),
        unexpected_prefixes=("model.layers.2.",),
    ),
    "minimax-m2": Spec(
        "minimax_m2",
        dict(
            _SMALL,
            intermediate_size=MOE_INTER,  # the experts' width (transformers' grouped mm wants 16-byte rows)
            num_local_experts=4,
            num_experts_per_tok=2,
            rotary_dim=24,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "block",
        _fp8_block({"fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}),
        _linear,
        post=_float32(r"block_sparse_moe\.gate\.weight$", r"e_score_correction_bias"),
    ),
    "mixtral-autofp8": Spec(
        "mixtral",
        dict(_SMALL, intermediate_size=MOE_INTER, num_local_experts=4, num_experts_per_tok=2),
        "tensor",
        lambda cfg: {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "ignored_layers": _router_ignore("block_sparse_moe.gate")(cfg),
        },
        _linear,
        scale_name="weight_scale",
        scale_shape=(1,),
        act_scale="input_scale",
    ),
    "llama-3.1-fbgemm": Spec(
        "llama",
        dict(_SMALL, num_hidden_layers=3),
        "channel",
        lambda cfg: {
            "quant_method": "fbgemm_fp8",
            "activation_scale_ub": 1200.0,
            "modules_to_not_convert": _llama31_skip(cfg),
        },
        _llama31_fp8,
        scale_name="weight_scale",
    ),
    "llama-ct-tensor": Spec(
        "llama",
        _SMALL,
        "tensor",
        _ct("tensor", lambda cfg: ["lm_head"], static=True),
        _linear,
        scale_name="weight_scale",
        scale_shape=(1,),
        act_scale="input_scale",
    ),
    "llama-ct-channel": Spec(
        "llama",
        _SMALL,
        "channel",
        _ct("channel", lambda cfg: ["lm_head"]),
        _linear,
        scale_name="weight_scale",
    ),
    "llama-4": Spec(
        "llama4_text",
        dict(
            _SMALL,
            intermediate_size=MOE_INTER,  # experts (and the shared expert)
            intermediate_size_mlp=INTER,  # dense layers
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
        ),
        "channel",
        _ct("channel", lambda cfg: ["re:.*self_attn.*", "re:.*router", "lm_head"]),
        lambda n, t: _linear(n, t) and ".self_attn." not in n,
        scale_name="weight_scale",
        scale_dtype=torch.bfloat16,
        post=_split_fused_experts(transposed=True),
        hf_loadable=False,
        why_not_loadable="transformers keeps Llama-4 experts fused and maps no per-expert names",
    ),
    "ministral-3": Spec(
        "ministral3",
        _SMALL,
        "tensor",
        lambda cfg: {
            "activation_scheme": "static",
            "dequantize": False,
            "modules_to_not_convert": ["lm_head"],
            "quant_method": "fp8",
            "weight_block_size": None,
        },
        _linear,
        scale_shape=(),
        act_scale="activation_scale",
        after=_mistral_consolidated,
    ),
    "gpt-oss": Spec(
        "gpt_oss",
        # intermediate_size a multiple of MXFP4's 32: down_proj's blocks hold whole groups of it (330 held
        # 320, a width config.json disagreed with)
        dict(_SMALL, hidden_size=224, intermediate_size=320, num_local_experts=4, num_experts_per_tok=2),
        "mxfp4",
        lambda cfg: {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
        lambda n, t: False,
        post=_mxfp4,
        hf_loadable=False,
        why_not_loadable="refused",
        # --to bf16 converts (test_families checks it against transformers' own MXFP4 decoder, and
        # tests/model/test_packed.py loads the result as transformers' gpt-oss); FP8 targets are refused
        refusal="gpt-oss MXFP4 experts have no FP8 layout",
    ),
}
# DeepSeek-V3.2's indexer: wq_b and wk are FP8, weights_proj and k_norm stay bf16.
SPECS["deepseek-v3.2"] = Spec(
    **{
        **SPECS["deepseek-v3.2"].__dict__,
        "fp8": lambda n, t: _linear(n, t) and "indexer.weights_proj" not in n,
    }
)

FAMILIES = tuple(SPECS)


def _make_model(spec: Spec):
    import transformers

    config = transformers.AutoConfig.for_model(spec.model_type, **spec.hf)
    torch.manual_seed(0)
    if spec.model_class:
        return getattr(transformers, spec.model_class)(config).to(torch.bfloat16)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def _write_shards(folder: Path, tensors: dict[str, torch.Tensor], shards: int = 3) -> None:
    from safetensors.torch import save_file

    names = sorted(tensors)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map |= {n: fname for n in part}
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_family(name: str, folder: Path, spec: Spec | None = None) -> FamilyFixture:
    """Build family `name` (or a `spec` of the test's own, under that name) in `folder` (created; must not
    exist or be empty)."""
    from safetensors.torch import load_file

    spec = spec or SPECS[name]
    folder = Path(folder)
    staging = folder.with_name(folder.name + ".hf")
    _make_model(spec).save_pretrained(staging)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(staging.glob("*.safetensors")):
        tensors |= load_file(shard)
    config = json.loads((staging / "config.json").read_text())
    for f in staging.iterdir():
        f.unlink()
    staging.rmdir()
    if spec.post:
        spec.post(tensors, config, folder)

    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    fp8: set[str] = set()
    gen = torch.Generator().manual_seed(11)
    for tname, t in tensors.items():
        if not spec.fp8(tname, t):
            out[tname] = reference[tname] = t
            continue
        fp8.add(tname)
        base = tname.removesuffix(".weight")
        scale_key = f"{base}.{spec.scale_name}" if tname.endswith(".weight") else f"{tname}_scale_inv"
        if t.dim() == 3:
            q, scale, deq = quantize_3d(t, spec.scale_dtype)
        else:
            q, scale, deq = quantize_2d(t, spec.layout, spec.scale_dtype, spec.ue8m0)
            if spec.scale_shape is not None:
                scale = scale.reshape(spec.scale_shape)
        out[tname], out[scale_key], reference[tname] = q, scale, deq
        if spec.act_scale:  # static activation scales: dropped by every conversion
            act = (torch.rand((), generator=gen) * 0.05 + 0.01).reshape(spec.scale_shape or ())
            out[f"{base}.{spec.act_scale}"] = act.to(spec.scale_dtype)

    config["quantization_config"] = spec.qconfig(config)
    folder.mkdir(parents=True, exist_ok=True)
    _write_shards(folder, out)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    fixture = FamilyFixture(
        name=name,
        path=folder,
        config=config,
        reference=reference,
        fp8_weights=frozenset(fp8),
        layout=spec.layout,
        hf_loadable=spec.hf_loadable,
        hf_class=spec.hf_class,
        why_not_loadable=spec.why_not_loadable,
        refusal=spec.refusal,
        unexpected_prefixes=spec.unexpected_prefixes,
    )
    if spec.after:
        spec.after(fixture, out)
    return fixture
