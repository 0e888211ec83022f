"""An independent set of family fixtures (no code shared with tests/support/families.py), run through the CLI
to every target and checked the way an engine would read the output.

Variants the main family fixtures do not cover: multimodal wrappers with `text_config` and a bf16 vision
tower (Llama-4, Mistral-3 / Ministral-3, Qwen3-VL dense), scales in another shard than their weights
(plus a shard holding only scales), one model.safetensors with no index, DeepSeek-V3.1 scales stored
as float8_e8m0fnu and as uint8 exponents with two shared experts, GLM-4.5 with three layers and its MTP
layer, MiniMax-M2 and a Qwen3 whose every width is under one block, Qwen2.5 dense with q/k/v biases.

Each model is built with transformers (`save_pretrained`), quantized by this file's own code (pad to
whole blocks, amax / 448, clamp, cast) into the published layout, then: inspect; --to bf16 (bit-exact
to one rounding of the float32 product, logits equal to a model of those weights); --to channel
(compressed-tensors loads it, logits equal to a model of the output's own q * scale, every unquantized
Linear listed in `ignore`); --to block --pad-for-tp 2/4/8 (config widths agree with the tensors, the
dequantized weights cropped back equal the reference, zeros in the padding, logits unchanged to within
the rounding of the reductions, tests/support/reductions.py, the one helper imported from tests/); verify.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp8conv.cli.commands import main
from tests.support.reductions import assert_same_function

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

E4M3_MAX = 448.0
TOKENS = torch.tensor([[2, 9, 41, 5, 88, 201, 13, 4, 60]])
_ATT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def _qwen3_vl_text(**moe: int) -> dict:
    """The small Qwen3-VL text tower of the variants below (`moe`: Qwen3-VL-MoE's expert keys), made anew
    for each: transformers may rewrite a config's rope_parameters in place."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    return dict(
        hidden_size=200, num_hidden_layers=2, vocab_size=256, intermediate_size=330, **moe, rope_parameters=rope, **_ATT
    )


def _qwen3_vl_vision() -> dict:
    return dict(
        depth=1,
        hidden_size=64,
        intermediate_size=96,
        num_heads=2,
        out_hidden_size=200,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=[0],
    )


# ---------------------------------------------------------------------------------------------------
# This file's own quantization: the plain definitions, nothing imported from fp8conv or tests/.


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x)))


def _q_block(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], float32 scale [ceil(N/128), ceil(K/128)]), DeepSeek's zero-padded blocks."""
    n, k = w.shape
    gn, gk = -(-n // 128), -(-k // 128)
    full = torch.zeros(gn * 128, gk * 128)
    full[:n, :k] = w.float()
    tiles = full.reshape(gn, 128, gk, 128)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale = _pow2_ceil(scale)
    q = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(gn * 128, gk * 128)[:n, :k].contiguous(), scale


def _dq_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    rows = scale.float().repeat_interleave(128, 0)[:n]
    return q.float() * rows.repeat_interleave(128, 1)[:, :k]


def _q_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _q_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().amax()
    scale = amax / E4M3_MAX if amax > 0 else torch.tensor(1.0)
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reshape(())


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


# ---------------------------------------------------------------------------------------------------
# The variants


@dataclass(frozen=True)
class Variant:
    model_type: str
    hf: dict
    layout: str  # block | channel | tensor
    quantized: Callable[[str, torch.Tensor], bool]
    qconfig: Callable[[dict], dict]
    scale_store: str = "float32"  # float32 | bfloat16 | float16 | e8m0 | uint8 (block) ; weight_scale[_inv]
    loader: str = "AutoModelForCausalLM"
    loadable: bool = True  # transformers maps every tensor name of the release
    extra_prefixes: tuple[str, ...] = ()  # tensors transformers does not build (MTP)
    storage: str = "shards"  # shards | scales-apart | single
    # config keys whose widths the output must state as padded: (key path, tensor regex, axis)
    widths: tuple[tuple[str, str, int], ...] = ()
    post: Callable[[dict, dict], None] | None = None
    logits_via: str | None = None  # a submodule to run for text-only logits (transformers' Llama-4 wrapper fails)
    refused: tuple[tuple[str, str], ...] = ()  # (target, the piece of the one-line refusal)


def _fp8_block(**extra) -> Callable[[dict], dict]:
    return lambda cfg: {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        **extra,
    }


def _ct_channel(ignore: Callable[[dict], list[str]]) -> Callable[[dict], dict]:
    def make(cfg: dict) -> dict:
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "channel",
                        "symmetric": True,
                        "dynamic": False,
                    },
                    "input_activations": {
                        "num_bits": 8,
                        "type": "float",
                        "strategy": "token",
                        "symmetric": True,
                        "dynamic": True,
                    },
                }
            },
            "ignore": ignore(cfg),
        }

    return make


_PLAIN = re.compile(
    r"embed|norm|lm_head|router|\.gate\.weight$|vision|visual|multi_modal_projector|eh_proj|shared_head|e_score|patch"
)


def _linears(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and not _PLAIN.search(name)


def _llama4_experts_per_expert(tensors: dict, cfg: dict) -> None:
    """The FP8 releases store one Linear per expert; transformers keeps [E, H, 2I] / [E, I, H] fused."""
    for name in [n for n in tensors if n.endswith("feed_forward.experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        gu, down = tensors.pop(name).transpose(1, 2), tensors.pop(p + "down_proj").transpose(1, 2)
        half = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            tensors[f"{p}{e}.gate_proj.weight"] = gu[e, :half].contiguous()
            tensors[f"{p}{e}.up_proj.weight"] = gu[e, half:].contiguous()
            tensors[f"{p}{e}.down_proj.weight"] = down[e].contiguous()


def _glm_mtp(tensors: dict, cfg: dict) -> None:
    """GLM-4.5's MTP layer model.layers.{num_hidden_layers}: a MoE layer plus enorm/hnorm/eh_proj/shared_head."""
    n = cfg["num_hidden_layers"]
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    for name in [k for k in tensors if k.startswith(src)]:
        tensors[dst + name[len(src) :]] = tensors[name].clone()
    g = torch.Generator().manual_seed(5)
    h = cfg["hidden_size"]
    tensors[dst + "eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.03).bfloat16()
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[dst + norm + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
    # the release's MTP layer carries its own embedding and head, both bf16
    tensors[dst + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[dst + "shared_head.head.weight"] = (torch.randn(cfg["vocab_size"], h, generator=g) * 0.03).bfloat16()
    cfg["num_nextn_predict_layers"] = 1


def _f32(pattern: str) -> Callable[[dict, dict], None]:
    def post(tensors: dict, cfg: dict) -> None:
        for n in tensors:
            if re.search(pattern, n):
                tensors[n] = tensors[n].float()

    return post


_DS = dict(
    hidden_size=160,
    num_hidden_layers=2,
    vocab_size=256,
    intermediate_size=264,
    moe_intermediate_size=72,
    n_routed_experts=4,
    n_shared_experts=2,  # shared width 144: moe_intermediate_size * n_shared_experts
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_group=1,
    topk_group=1,
)
_DS_WIDTHS = (
    ("intermediate_size", r"layers\.0\.mlp\.(gate|up)_proj\.weight$", -2),
    ("intermediate_size", r"layers\.0\.mlp\.down_proj\.weight$", -1),
    ("moe_intermediate_size", r"mlp\.experts\.\d+\.(gate|up)_proj\.weight$", -2),
    ("moe_intermediate_size", r"mlp\.experts\.\d+\.down_proj\.weight$", -1),
    ("moe_intermediate_size*n_shared_experts", r"mlp\.shared_experts\.(gate|up)_proj\.weight$", -2),
    ("moe_intermediate_size*n_shared_experts", r"mlp\.shared_experts\.down_proj\.weight$", -1),
)
_DENSE_WIDTHS = (
    ("intermediate_size", r"layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
    ("intermediate_size", r"layers\.\d+\.mlp\.down_proj\.weight$", -1),
)


VARIANTS: dict[str, Variant] = {
    # Llama-4 multimodal: text_config llama4_text, vision tower and projector bf16, attention and routers
    # bf16 (the release's ignore list names them), per-expert channel FP8, intermediate_size_mlp dense.
    "llama4-multimodal": Variant(
        "llama4",
        dict(
            text_config=dict(
                hidden_size=200,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=136,
                intermediate_size_mlp=330,
                num_local_experts=3,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                **_ATT,
            ),
            vision_config=dict(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=64,
                patch_size=16,
                vision_output_dim=64,
                projector_input_dim=64,
                projector_output_dim=64,
            ),
        ),
        "channel",
        lambda n, t: _linears(n, t) and ".self_attn." not in n,
        _ct_channel(
            lambda cfg: [
                "re:.*self_attn.*",
                "re:.*router",
                "re:vision_model.*",
                "re:multi_modal_projector.*",
                "language_model.lm_head",
            ]
        ),
        loader="Llama4ForConditionalGeneration",
        loadable=False,  # transformers maps no per-expert names for Llama-4
        post=_llama4_experts_per_expert,
        widths=(
            ("text_config.intermediate_size_mlp", r"layers\.0\.feed_forward\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size_mlp", r"layers\.0\.feed_forward\.down_proj\.weight$", -1),
            (
                "text_config.intermediate_size",
                r"feed_forward\.(experts\.\d+|shared_expert)\.(gate|up)_proj\.weight$",
                -2,
            ),
            ("text_config.intermediate_size", r"feed_forward\.(experts\.\d+|shared_expert)\.down_proj\.weight$", -1),
        ),
    ),
    # Mistral-3 / Ministral-3 multimodal: per-tensor weight_scale_inv [] + activation_scale, static,
    # weight_block_size null; the Pixtral vision tower and the projector stay bf16.
    "mistral3-multimodal": Variant(
        "mistral3",
        dict(
            text_config=dict(
                model_type="ministral3",
                hidden_size=200,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=330,
                **_ATT,
            ),
            vision_config=dict(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=64,
                patch_size=16,
                head_dim=32,
            ),
            tie_word_embeddings=False,
        ),
        "tensor",
        _linears,
        lambda cfg: {
            "quant_method": "fp8",
            "activation_scheme": "static",
            "weight_block_size": None,
            "dequantize": False,
            "modules_to_not_convert": ["vision_tower", "multi_modal_projector", "lm_head"],
        },
        loader="Mistral3ForConditionalGeneration",
        widths=(
            ("text_config.intermediate_size", r"language_model\.model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"language_model\.model\.layers\.\d+\.mlp\.down_proj\.weight$", -1),
        ),
    ),
    # Qwen3-VL dense FP8 (Qwen3-VL-8B-Instruct-FP8 layout): block, bf16 scales, visual bf16.
    "qwen3-vl-dense": Variant(
        "qwen3_vl",
        dict(
            text_config=_qwen3_vl_text(),
            vision_config=_qwen3_vl_vision(),
            tie_word_embeddings=False,
        ),
        "block",
        _linears,
        _fp8_block(modules_to_not_convert=["lm_head", "model.visual"]),
        scale_store="bfloat16",
        loader="Qwen3VLForConditionalGeneration",
        widths=(
            ("text_config.intermediate_size", r"language_model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"language_model\.layers\.\d+\.mlp\.down_proj\.weight$", -1),
        ),
    ),
    # Qwen2.5 dense (model_type qwen2, q/k/v biases), block FP8; every scale in the last shard, one shard
    # holding nothing but scales.
    "qwen2.5-scales-apart": Variant(
        "qwen2",
        dict(
            hidden_size=200,
            num_hidden_layers=2,
            vocab_size=256,
            intermediate_size=330,
            tie_word_embeddings=False,
            **_ATT,
        ),
        "block",
        _linears,
        _fp8_block(),
        storage="scales-apart",
        widths=_DENSE_WIDTHS,
    ),
    # Qwen3 with tied embeddings (no lm_head tensor), float16 scales, one model.safetensors, no index.
    "qwen3-tied-single-file": Variant(
        "qwen3",
        dict(
            hidden_size=200,
            num_hidden_layers=2,
            vocab_size=256,
            intermediate_size=330,
            tie_word_embeddings=True,
            **_ATT,
        ),
        "block",
        _linears,
        _fp8_block(),
        scale_store="float16",
        storage="single",
        widths=_DENSE_WIDTHS,
    ),
    # Every width under one block (N < 128 everywhere): hidden 96, intermediate 72.
    "qwen3-under-one-block": Variant(
        "qwen3",
        dict(
            hidden_size=96, num_hidden_layers=2, vocab_size=256, intermediate_size=72, tie_word_embeddings=False, **_ATT
        ),
        "block",
        _linears,
        _fp8_block(),
        widths=_DENSE_WIDTHS,
    ),
    # DeepSeek-V3.1 with ue8m0 scales stored as float8_e8m0fnu, and as uint8 exponents (2^(b-127)).
    "deepseek-v3.1-e8m0": Variant(
        "deepseek_v3",
        _DS,
        "block",
        _linears,
        _fp8_block(scale_fmt="ue8m0"),
        scale_store="e8m0",
        post=_f32(r"e_score_correction_bias"),
        widths=_DS_WIDTHS,
    ),
    "deepseek-v3.1-uint8": Variant(
        "deepseek_v3",
        _DS,
        "block",
        _linears,
        _fp8_block(scale_fmt="ue8m0"),
        scale_store="uint8",
        post=lambda t, c: (_f32(r"e_score_correction_bias")(t, c), _glm_mtp(t, c)),
        extra_prefixes=("model.layers.2.",),
        widths=_DS_WIDTHS,
    ),
    # Llama with mlp_bias: the gate/up biases have the intermediate width too.
    "llama-mlp-bias": Variant(
        "llama",
        dict(
            hidden_size=200,
            num_hidden_layers=2,
            vocab_size=256,
            intermediate_size=330,
            mlp_bias=True,
            attention_bias=True,
            **_ATT,
        ),
        "block",
        _linears,
        _fp8_block(),
        widths=(*_DENSE_WIDTHS, ("intermediate_size", r"mlp\.(gate|up)_proj\.bias$", -1)),
    ),
    # An unquantized multimodal checkpoint (fine-tuned bf16 Qwen3-VL): fp8conv quantizes its Linears.
    "qwen3-vl-bf16-input": Variant(
        "qwen3_vl",
        dict(
            text_config=_qwen3_vl_text(),
            vision_config=_qwen3_vl_vision(),
            tie_word_embeddings=False,
        ),
        "none",
        lambda n, t: False,
        lambda cfg: None,
        loader="Qwen3VLForConditionalGeneration",
        widths=(
            ("text_config.intermediate_size", r"language_model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"language_model\.layers\.\d+\.mlp\.down_proj\.weight$", -1),
        ),
    ),
    # A bf16 Qwen3-VL-MoE as transformers 5 saves it (fine-tuned): fused 3-D experts [E, 2I, H] / [E, H, I].
    "qwen3-vl-moe-bf16-fused": Variant(
        "qwen3_vl_moe",
        dict(
            text_config=_qwen3_vl_text(
                moe_intermediate_size=136, num_experts=3, num_experts_per_tok=2, decoder_sparse_step=1
            ),
            vision_config=_qwen3_vl_vision(),
            tie_word_embeddings=False,
        ),
        "none",
        lambda n, t: False,
        lambda cfg: None,
        loader="Qwen3VLMoeForConditionalGeneration",
        widths=(
            ("text_config.moe_intermediate_size", r"experts\.gate_up_proj$", -2, 2),
            ("text_config.moe_intermediate_size", r"experts\.down_proj$", -1),
        ),
    ),
    # A bf16 Mistral-3 (fine-tuned): the Pixtral tower and the projector (with its patch merger) stay bf16.
    "mistral3-bf16-input": Variant(
        "mistral3",
        dict(
            text_config=dict(
                model_type="ministral3",
                hidden_size=200,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=330,
                **_ATT,
            ),
            vision_config=dict(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=64,
                patch_size=16,
                head_dim=32,
            ),
            tie_word_embeddings=False,
        ),
        "none",
        lambda n, t: False,
        lambda cfg: None,
        loader="Mistral3ForConditionalGeneration",
        widths=(
            ("text_config.intermediate_size", r"language_model\.model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"language_model\.model\.layers\.\d+\.mlp\.down_proj\.weight$", -1),
        ),
    ),
    # A bf16 Llama-4 (fine-tuned) as transformers saves it: fused experts transposed, [E, H, 2I] / [E, I, H].
    "llama4-bf16-fused": Variant(
        "llama4",
        dict(
            text_config=dict(
                hidden_size=200,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=136,
                intermediate_size_mlp=330,
                num_local_experts=3,
                num_experts_per_tok=1,
                interleave_moe_layer_step=2,
                **_ATT,
            ),
            vision_config=dict(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=64,
                patch_size=16,
                vision_output_dim=64,
                projector_input_dim=64,
                projector_output_dim=64,
            ),
        ),
        "none",
        lambda n, t: False,
        lambda cfg: None,
        loader="Llama4ForConditionalGeneration",
        logits_via="language_model",
        refused=(("channel", "transformers loads Llama-4 experts under a compressed-tensors config one Linear"),),
        widths=(
            ("text_config.intermediate_size_mlp", r"layers\.0\.feed_forward\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"experts\.gate_up_proj$", -1, 2),
            ("text_config.intermediate_size", r"experts\.down_proj$", -2),
            ("text_config.intermediate_size", r"shared_expert\.(gate|up)_proj\.weight$", -2),
        ),
    ),
    # Qwen2.5-VL, compressed-tensors FP8_DYNAMIC (RedHatAI-style): the vision tower (with gate/up/down MLPs of
    # its own width) ignored by a regex.
    "qwen2.5-vl-ct": Variant(
        "qwen2_5_vl",
        dict(
            text_config=dict(
                hidden_size=200,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=330,
                rope_scaling={"type": "mrope", "mrope_section": [5, 10, 10]},
                num_attention_heads=4,
                num_key_value_heads=2,
                bos_token_id=1,
                eos_token_id=2,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=64,
                intermediate_size=96,
                num_heads=2,
                out_hidden_size=200,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
                fullatt_block_indexes=[0],
            ),
            tie_word_embeddings=False,
        ),
        "channel",
        _linears,
        _ct_channel(lambda cfg: ["lm_head", "re:visual.*"]),
        loader="Qwen2_5_VLForConditionalGeneration",
        widths=(
            ("text_config.intermediate_size", r"^model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"^model\.layers\.\d+\.mlp\.down_proj\.weight$", -1),
        ),
    ),
    # GLM-4.5V: glm4v_moe with text_config glm4v_moe_text, per-expert channel FP8, the vision tower's own
    # gate/up/down MLPs bf16.
    "glm4.5v-ct": Variant(
        "glm4v_moe",
        dict(
            text_config=dict(
                hidden_size=160,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=264,
                moe_intermediate_size=72,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                attention_bias=True,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 3, 3],
                    "partial_rotary_factor": 0.5,
                },
                **_ATT,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=64,
                intermediate_size=96,
                num_heads=2,
                out_hidden_size=160,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
            ),
            tie_word_embeddings=False,
        ),
        "channel",
        _linears,
        _ct_channel(lambda cfg: ["lm_head", "re:.*mlp.gate$", "re:model.visual.*"]),
        loader="Glm4vMoeForConditionalGeneration",
        post=_f32(r"e_score_correction_bias"),
        widths=(
            ("text_config.intermediate_size", r"layers\.0\.mlp\.(gate|up)_proj\.weight$", -2),
            ("text_config.intermediate_size", r"layers\.0\.mlp\.down_proj\.weight$", -1),
            ("text_config.moe_intermediate_size", r"mlp\.(experts\.\d+|shared_experts)\.(gate|up)_proj\.weight$", -2),
            ("text_config.moe_intermediate_size", r"mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight$", -1),
        ),
    ),
    # GLM-4.5 with three decoder layers (one dense) and its MTP layer model.layers.3, channel FP8 with
    # float32 scales, routers and lm_head ignored, q/k/v biases.
    "glm4.5-3-layers-mtp": Variant(
        "glm4_moe",
        dict(
            hidden_size=160,
            num_hidden_layers=3,
            vocab_size=256,
            intermediate_size=264,
            moe_intermediate_size=72,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            attention_bias=True,
            partial_rotary_factor=0.5,
            **_ATT,
        ),
        "channel",
        _linears,
        _ct_channel(
            lambda cfg: (
                ["lm_head"]
                + [f"model.layers.{i}.mlp.gate" for i in range(1, 4)]
                + ["model.layers.3.eh_proj", "model.layers.3.shared_head.head"]
            )
        ),
        post=lambda t, c: (_f32(r"e_score_correction_bias")(t, c), _glm_mtp(t, c)),
        extra_prefixes=("model.layers.3.",),
        widths=(
            ("intermediate_size", r"layers\.0\.mlp\.(gate|up)_proj\.weight$", -2),
            ("intermediate_size", r"layers\.0\.mlp\.down_proj\.weight$", -1),
            ("moe_intermediate_size", r"mlp\.(experts\.\d+|shared_experts)\.(gate|up)_proj\.weight$", -2),
            ("moe_intermediate_size", r"mlp\.(experts\.\d+|shared_experts)\.down_proj\.weight$", -1),
        ),
    ),
    # MiniMax-M2 with every width under one block: fmt float8_e4m3fn, w1/w2/w3, float32 router and bias.
    "minimax-m2-small": Variant(
        "minimax_m2",
        dict(
            hidden_size=96,
            num_hidden_layers=2,
            vocab_size=256,
            intermediate_size=48,
            num_local_experts=3,
            num_experts_per_tok=2,
            rotary_dim=16,
            use_qk_norm=True,
            **_ATT,
        ),
        "block",
        _linears,
        _fp8_block(fmt="float8_e4m3fn", modules_to_not_convert=["gate", "e_score_correction_bias", "lm_head"]),
        post=_f32(r"block_sparse_moe\.gate\.weight$|e_score_correction_bias"),
        widths=(
            ("intermediate_size", r"experts\.\d+\.w[13]\.weight$", -2),
            ("intermediate_size", r"experts\.\d+\.w2\.weight$", -1),
        ),
    ),
}


@dataclass
class Built:
    path: Path
    config: dict
    reference: dict[str, torch.Tensor]  # float32 product for FP8 weights, the stored tensor otherwise
    fp8: set[str]
    variant: Variant


def _store_scale(scale: torch.Tensor, how: str) -> torch.Tensor:
    if how == "e8m0":
        return scale.to(torch.float8_e8m0fnu)
    if how == "uint8":
        return (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)
    return scale.to(getattr(torch, how))


def _stored_value(stored: torch.Tensor, how: str) -> torch.Tensor:
    if how in ("e8m0", "uint8"):
        return torch.pow(2.0, stored.view(torch.uint8).double() - 127).float()
    return stored.float()


def build(name: str, folder: Path) -> Built:
    v = VARIANTS[name]
    config_obj = transformers.AutoConfig.for_model(v.model_type, **v.hf)
    torch.manual_seed(1)
    if v.loader == "AutoModelForCausalLM":
        model = transformers.AutoModelForCausalLM.from_config(config_obj, dtype=torch.bfloat16)
    else:
        model = getattr(transformers, v.loader)(config_obj).to(torch.bfloat16)
    staging = folder.with_name(folder.name + "-hf")
    model.save_pretrained(staging)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(staging.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = json.loads((staging / "config.json").read_text())
    if v.post:
        v.post(tensors, config)
    out, ref, fp8 = {}, {}, set()
    pow2 = v.scale_store in ("e8m0", "uint8")
    for n, t in tensors.items():
        if not v.quantized(n, t):
            out[n] = ref[n] = t
            continue
        base = n.removesuffix(".weight")
        if v.layout == "block":
            q, s = _q_block(t, pow2)
            stored = _store_scale(s, v.scale_store)
            out[base + ".weight_scale_inv"] = stored
            ref[n] = _dq_block(q, _stored_value(stored, v.scale_store))
        elif v.layout == "channel":
            q, s = _q_rows(t)
            out[base + ".weight_scale"] = s
            ref[n] = q.float() * s
        else:  # Mistral: per-tensor weight_scale_inv [] and a static activation_scale []
            q, s = _q_tensor(t)
            out[base + ".weight_scale_inv"] = s
            out[base + ".activation_scale"] = torch.tensor(0.02)
            ref[n] = q.float() * s
        out[n] = q
        fp8.add(n)
    if v.qconfig(config) is not None:
        config["quantization_config"] = v.qconfig(config)
    folder.mkdir(parents=True)
    _write(folder, out, v.storage)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return Built(folder, config, ref, fp8, v)


def _write(folder: Path, tensors: dict[str, torch.Tensor], storage: str) -> None:
    if storage == "single":
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
        return
    names = sorted(tensors)
    if storage == "scales-apart":  # weights in two shards, every scale in a third, a fourth of scales only
        scales = [n for n in names if "scale" in n]
        rest = [n for n in names if n not in scales]
        groups = [
            rest[: len(rest) // 2],
            rest[len(rest) // 2 :],
            scales[: len(scales) // 2],
            scales[len(scales) // 2 :],
        ]
    else:
        per = -(-len(names) // 3)
        groups = [names[i : i + per] for i in range(0, len(names), per)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(folder / fname), {"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )


# ---------------------------------------------------------------------------------------------------
# Checks


def _cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.output


def _read(folder: Path) -> dict[str, torch.Tensor]:
    got: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        got.update(load_file(f))
    return got


def _index_consistent(folder: Path) -> None:
    files = {p.name for p in folder.glob("*.safetensors")}
    index = folder / "model.safetensors.index.json"
    if index.exists():
        assert set(json.loads(index.read_text())["weight_map"].values()) == files


def _plain_linears(b: Built, quantized: set[str]) -> set[str]:
    linears = {
        n.removesuffix(".weight")
        for n, t in b.reference.items()
        if n.endswith(".weight") and t.dim() == 2 and n not in quantized and "embed" not in n
    }
    # fused 3-D experts (transformers' `*.experts` modules) left unquantized
    experts = {n.rsplit(".", 1)[0] for n, t in b.reference.items() if t.dim() == 3 and n.endswith("_proj")}
    return linears | {m for m in experts if not any(n.startswith(m + ".") for n in quantized)}


def _quantized(b: Built, got: dict[str, torch.Tensor]) -> set[str]:
    """The FP8 weights of an output: the input's, or for an unquantized input those fp8conv chose."""
    quantized = {n for n in b.reference if got[n].dtype == torch.float8_e4m3fn}
    assert b.fp8 <= quantized and (b.variant.layout == "none" or quantized == b.fp8), sorted(quantized ^ b.fp8)
    # as in every FP8 release: vision towers and multimodal projectors stay in their float dtype
    assert not [n for n in quantized if re.search(r"vision|visual|multi_modal_projector", n)]
    return quantized


def _listed(module: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif module == p or module.endswith("." + p):
            return True
    return False


def _unpad(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The leading corner of a padded tensor; a fused [gate; up] (gate_up_proj) holds two halves, each
    padded at its own end."""
    parts = 2 if name.endswith("gate_up_proj") else 1
    for axis, want in enumerate(shape):
        if t.shape[axis] != want:
            size = want // parts
            t = torch.cat([c.narrow(axis, 0, size) for c in t.chunk(parts, dim=axis)], dim=axis)
    return t


def _no_stale_quant(config: dict) -> None:
    """Only the top-level quantization_config may describe the output: none left under text_config."""
    for key in ("text_config", "vision_config"):
        assert "quantization_config" not in config.get(key, {}), key


def _width(config: dict, path: str) -> int:
    section = config
    *parents, key = path.split(".")
    for p in parents:
        section = section[p]
    if "*" in key:
        a, b = key.split("*")
        return section[a] * section[b]
    return section[key]


def _logits(b: Built, folder: Path, **kw) -> torch.Tensor:
    cls = getattr(transformers, b.variant.loader)
    model, info = cls.from_pretrained(folder, dtype=torch.bfloat16, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(b.variant.extra_prefixes) for k in info["unexpected_keys"]), info["unexpected_keys"]
    if b.variant.logits_via:
        model = getattr(model, b.variant.logits_via)
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def _model_of(b: Built, folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    folder.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    plain = json.loads(json.dumps(config))
    plain.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(plain))
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = build(name, tmp_path_factory.mktemp("independent") / name)
        return cache[name]

    return get


NAMES = tuple(VARIANTS)


@pytest.mark.parametrize("name", NAMES)
def test_inspect(built, name):
    b = built(name)
    code, out = _cli("inspect", b.path, "--json")
    report = json.loads(out)
    assert code == 0 and not report["problems"], out
    assert sum(report["formats"].get(k, 0) for k in ("block-fp8", "channel-fp8", "per-tensor-fp8")) == len(b.fp8), (
        report
    )


@pytest.mark.parametrize("name", NAMES)
def test_bf16(built, tmp_path, name):
    b = built(name)
    out = tmp_path / "bf16"
    code, text = _cli("convert", b.path, "--to", "bf16", "-o", out, "-q")
    assert code == 0, text
    got = _read(out)
    expected = {n: t.bfloat16() if n in b.fp8 else t for n, t in b.reference.items()}
    assert set(got) == set(expected)
    for n, t in expected.items():
        assert _bits(got[n], t), n
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config)
    _index_consistent(out)
    assert _cli("verify", b.path, out)[0] == 0
    if b.variant.loadable:
        ref = _model_of(b, tmp_path / "ref", expected, b.config)
        got_logits = _logits(b, out)
        assert got_logits.abs().max() > 0 and torch.equal(got_logits, _logits(b, ref))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("name", NAMES)
def test_channel(built, tmp_path, name):
    b = built(name)
    out = tmp_path / "channel"
    code, text = _cli("convert", b.path, "--to", "channel", "-o", out, "-q")
    refusal = dict(b.variant.refused).get("channel")
    if refusal:  # one line, naming the tensor and the fix; nothing written that looks complete
        assert code == 1 and refusal in text and "tensor '" in text and len(text.strip().splitlines()) == 2, text
        assert not (out / "config.json").exists()
        return
    assert code == 0, text
    got = _read(out)
    quantized = _quantized(b, got)
    dq = {}
    for n, ref in b.reference.items():
        if n not in quantized:
            assert _bits(got[n], ref), n
            dq[n] = ref
            continue
        q, s = got[n], got[n.removesuffix(".weight") + ".weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == (ref.shape[0], 1), n
        eq, es = _q_rows(ref)  # this file's own per-row quantization of the float32 reference
        assert _bits(q, eq) and _bits(s, es), n
        dq[n] = (q.float() * s).bfloat16()
    assert set(got) == set(b.reference) | {n.removesuffix(".weight") + ".weight_scale" for n in quantized}
    config = json.loads((out / "config.json").read_text())
    _no_stale_quant(config)
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "weight_block_size" not in json.dumps(qc)
    missing = {m for m in _plain_linears(b, quantized) if not _listed(m, qc["ignore"])}
    assert not missing, f"unquantized Linears not in ignore: {sorted(missing)}"
    assert not [n for n in quantized if _listed(n.removesuffix(".weight"), qc["ignore"])]  # no FP8 module ignored
    _index_consistent(out)
    assert _cli("verify", b.path, out)[0] == 0
    if b.variant.loadable:
        pytest.importorskip("compressed_tensors")
        ref = _model_of(b, tmp_path / "ref", dq, b.config)
        cfg = transformers.CompressedTensorsConfig(run_compressed=False)
        got_logits = _logits(b, out, quantization_config=cfg)
        assert got_logits.abs().max() > 0 and torch.equal(got_logits, _logits(b, ref))


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("name", NAMES)
def test_block_padded(built, tmp_path, name, tp):
    b = built(name)
    out = tmp_path / "block"
    code, text = _cli("convert", b.path, "--to", "block", "--pad-for-tp", tp, "-o", out, "-q")
    assert code == 0, text
    got = _read(out)
    config = json.loads((out / "config.json").read_text())
    _no_stale_quant(config)
    # every width the config states is the width of every tensor of that role, and splits into whole blocks
    for key, pattern, axis, *factor in b.variant.widths:
        width = _width(config, key)
        assert width % (128 * tp) == 0, (key, width)
        matched = [n for n in got if re.search(pattern, n)]
        assert matched, pattern
        for n in matched:
            assert got[n].shape[axis] == width * (factor or [1])[0], (n, list(got[n].shape), key, width)
    quantized = _quantized(b, got)
    dequantized, unpadded = {}, {}
    for n, ref in b.reference.items():
        t = got[n]
        if n in quantized:
            scale = got[n.removesuffix(".weight") + ".weight_scale_inv"]
            grid = (math.ceil(t.shape[0] / 128), math.ceil(t.shape[1] / 128))
            assert scale.dtype == torch.float32 and tuple(scale.shape) == grid, n
            full = _dq_block(t, scale)
        else:
            full = t.float()
        crop = _unpad(n, full, tuple(ref.shape))
        assert full.count_nonzero() == crop.count_nonzero(), n  # zeros in the padding
        if b.variant.layout == "block" and n in b.fp8:
            assert torch.equal(crop, ref), n  # the same blocks, scales widened exactly
        elif n in quantized:  # requantized into 128x128 blocks: within one e4m3 step of the reference
            r = ref.float()
            assert ((crop - r).abs() <= r.abs() * 2**-3 + r.abs().max() * 2**-8).all(), n
        else:
            assert _bits(crop.to(ref.dtype), ref), n
        dequantized[n] = full.bfloat16() if n in quantized else t
        unpadded[n] = crop.bfloat16() if n in quantized else crop.to(ref.dtype)
    qc = config["quantization_config"]
    if (b.config.get("quantization_config") or {}).get("scale_fmt") == "ue8m0":  # every scale a power of two
        assert qc.get("scale_fmt") == "ue8m0"
        for n in quantized:
            s = got[n.removesuffix(".weight") + ".weight_scale_inv"]
            assert torch.equal(s, _pow2_ceil(s)), n
    listed = qc.get("modules_to_not_convert", [])
    missing = {m for m in _plain_linears(b, quantized) if not _listed(m, listed)}
    assert not missing, f"unquantized Linears not listed: {sorted(missing)}"
    assert qc.get("ignored_layers", []) == listed and qc["weight_block_size"] == [128, 128]
    _index_consistent(out)
    code, text = _cli("verify", b.path, out)
    assert code == 0, text
    report = json.loads(_cli("inspect", out, "--json")[1])  # what fp8conv itself says of its output
    assert not report["problems"] and report["tp_indivisible"][str(tp)] == [], report["tp_indivisible"]
    if tp == 2:  # an output whose config states a width its tensors do not have: verify and inspect say so
        key = b.variant.widths[0][0].split("*")[0]
        section = config
        for part in key.split(".")[:-1]:
            section = section[part]
        section[key.split(".")[-1]] = _width(b.config, key)
        (out / "config.json").write_text(json.dumps(config))
        code, text = _cli("verify", b.path, out)
        assert code == 1 and key.split(".")[-1] in text, text
        code, text = _cli("inspect", out, "--json")
        assert key.split(".")[-1] in text and json.loads(text)["problems"], text
        return
    if b.variant.loadable and tp == 4:  # the padded model computes what the unpadded one does
        padded = _model_of(b, tmp_path / "padded", dequantized, config)
        plain = {n: (t.bfloat16() if n in b.fp8 else t) for n, t in b.reference.items()}
        a, r = _logits(b, padded), _logits(b, _model_of(b, tmp_path / "ref", plain, b.config))
        if b.variant.layout in ("block",):
            assert_same_function(a, r)  # tests/support/reductions.py: the reductions' rounding, not exact
        else:  # requantized: the padded model computes what a model of the same dequantized weights, unpadded, does
            same = _model_of(b, tmp_path / "cropped", unpadded, b.config)
            assert_same_function(a, _logits(b, same))


@pytest.mark.parametrize("name", ["qwen2.5-scales-apart"])
def test_two_workers_write_what_one_does(built, tmp_path, name):
    """-j 2 splits the shards between processes; scales in another worker's shard are still found."""
    b = built(name)
    one, two = tmp_path / "one", tmp_path / "two"
    for out, jobs in ((one, "1"), (two, "2")):
        code, text = _cli("convert", b.path, "--to", "block", "--pad-for-tp", "4", "-o", out, "-q", "-j", jobs)
        assert code == 0, text
    names = sorted(p.name for p in one.glob("*.safetensors"))
    assert names == sorted(p.name for p in two.glob("*.safetensors"))
    for n in names:
        assert (one / n).read_bytes() == (two / n).read_bytes(), n
    assert _cli("verify", b.path, two)[0] == 0
