"""MLP roles by rule, for a model_type the family table does not name.

Engines load MLP tensors by a few naming conventions (`mlp.experts.{E}.{gate,up,down}_proj`, fused 3-D
`experts.gate_up_proj` / `down_proj`, Step-3.5's stacked `moe.{gate,up,down}_proj.weight`, `w1/w2/w3`,
`shared_expert(s)` / `share_expert` / `shared_mlp`, Nemotron-H's `mixer.`, a 2-D fused `mlp.gate_up_proj`,
Granite's `input_linear` / `output_linear`). Each role found is given the
config key whose value its tensors have; a role whose tensors fit no candidate key, or two keys, is not
guessed: --pad-for-tp is refused naming the tensors and the keys. One whose tensors have none of the widths
config.json states under keys naming the role (Family.misfits) disagrees with config.json: every target is
refused, as for a family of the table. What rules cannot know (fused groups an
engine builds, modules engines keep unquantized whatever the config says, unusual width keys) is in
EXCEPTIONS, by model_type. No torch.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .families import (
    _MLA,
    _QKV,
    _UNQUANTIZED_BASE,
    NO_ROLE_TAILS,
    Family,
    MlpRole,
    MlpTensor,
    Width,
    WidthMisfit,
    _gate_up_down,
    in_vision,
    layer_factor,
    layer_key,
    model_type_of,
    register,
    text_config,
    width_axis,
)

_GATE_UP = r"(?:gate_proj|up_proj|w1|w3|linear_gate)"  # (Hy-V4 names its gate projection linear_gate)
_DOWN = r"(?:down_proj|w2)"
# Experts sit in an MLP module, or (Gemma-4 26B-A4B: layers.N.experts.gate_up_proj beside layers.N.mlp and
# layers.N.router) in the decoder layer itself
_EXPERT_HOME = r"(?:(?:mlp|feed_forward|block_sparse_moe|ffn|mixer|moe)\.)?"
_SHARED_HOME = (
    r"(?:(?:mlp|feed_forward|block_sparse_moe|ffn|mixer|moe)\.)?(?:shared_experts?|share_expert|shared_mlp)\."
)
# (Kimi-Linear's dense first layer is a `block_sparse_moe` of gate/up/down_proj; LongCat-Flash has two dense
# MLPs per layer, `mlps.0` and `mlps.1`)
_DENSE_HOME = r"(?:mlp|feed_forward|ffn|mixer|block_sparse_moe|mlps\.\d+)\."


def _fused(home: str) -> tuple[MlpTensor, ...]:
    """transformers 5's fused 3-D experts, [E, 2I, H] / [E, H, I] or transposed; Nemotron-H's
    non-gated experts fuse up_proj alone ([E, I, H])."""
    prefix = home + r"experts\."
    return (
        MlpTensor(re.compile(prefix + r"gate_up_proj$"), -2, parts=2, alt_axis=-1),
        MlpTensor(re.compile(prefix + r"(?:gate_proj|up_proj)$"), -2, alt_axis=-1),
        MlpTensor(re.compile(prefix + r"down_proj$"), -1, alt_axis=-2),
    )


# Step-3.5 / 3.7: every expert of a layer stacked in one 3-D tensor [E, out, in] under `moe.`
_STACKED = (
    MlpTensor(re.compile(r"moe\.(?:gate_proj|up_proj)\.weight$"), -2),
    MlpTensor(re.compile(r"moe\.down_proj\.weight$"), -1),
)


def _fused_gate_up(home: str) -> tuple[MlpTensor, ...]:
    """One 2-D [gate; up] Linear [2I, H] (GLM-4, Phi-3: gate_up_proj) with its down_proj; Granite's
    input_linear / output_linear, the same two (3-D [E, 2I, H] / [E, H, I] for its experts)."""
    return (
        MlpTensor(re.compile(home + r"(?:gate_up_proj|input_linear)\.weight$"), -2, parts=2),
        MlpTensor(re.compile(home + r"output_linear\.weight$"), -1),
    )


ROLE_TENSORS: dict[str, tuple[MlpTensor, ...]] = {
    "routed": _gate_up_down(_EXPERT_HOME + r"experts\.\d+\.", _GATE_UP, _DOWN)
    + _fused(_EXPERT_HOME)
    + _STACKED
    + _fused_gate_up(r"block_sparse_moe\."),
    "shared": _gate_up_down(_SHARED_HOME, _GATE_UP, _DOWN) + _fused_gate_up(_SHARED_HOME),
    "dense": _gate_up_down(_DENSE_HOME, _GATE_UP, _DOWN) + _fused_gate_up(r"(?:mlp|feed_forward|ffn)\."),
}
# The config keys each role's width may have, most specific first; a role takes the one its tensors fit.
WIDTH_CANDIDATES: dict[str, tuple[Width, ...]] = {
    "dense": (
        Width("intermediate_size"),
        Width("intermediate_size_mlp"),
        Width("dense_intermediate_size"),
        Width("ffn_hidden_size"),  # LongCat-Flash (transformers configuration_longcat_flash.py)
    ),
    "routed": (
        Width("moe_intermediate_size"),
        Width("intermediate_size"),
        Width("expert_intermediate_size"),
        Width("expert_ffn_hidden_size"),  # LongCat-Flash
    ),
    "shared": (
        Width("shared_expert_intermediate_size"),
        Width("moe_shared_expert_intermediate_size"),
        Width("share_expert_dim"),
        Width("moe_intermediate_size", "n_shared_experts"),
        Width("moe_intermediate_size", "num_shared_experts"),
        Width("moe_intermediate_size", "moe_num_shared_experts"),  # ERNIE-4.5-MoE (modeling_ernie4_5_moe.py)
        Width("intermediate_size", "num_shared_experts"),  # Cohere2-MoE (modeling_cohere2_moe.py)
        Width("intermediate_size", "moe_num_shared_experts"),  # Aria (modeling_aria.py)
        # dots3_note (transformers configuration_dots3_note.py): shared_experts_intermediate_size * n_shared_experts
        Width("shared_experts_intermediate_size", "n_shared_experts"),
        Width("shared_experts_intermediate_size"),
        Width("shared_intermediate_size"),  # MiniMax-M3 (transformers configuration_minimax_m3_vl.py)
        Width("intermediate_size"),
    ),
}
_HOMES = r"(?:mlp|feed_forward|block_sparse_moe|ffn|mixer|moe)"
# Inside an MLP and without a width: routers (Hunyuan's gate.wg, Granite's router.layer) and their biases (ERNIE's
# moe_statics), norms, latent projections (hidden-sized), activation parameters (Apertus' xIELU act_fn.alpha_p ...)
MLP_OTHER = re.compile(
    rf"\.{_HOMES}\.(?:(?:router\.)?gate\.(?:wg\.)?\w+|router\.(?:\w+\.)?\w+|(?:moe_statics\.)?e_score_correction_bias"
    r"|expert_bias|router_bias|experts\.e_score_correction_bias|shared_expert_gate\.weight|fc[12]_latent_proj\.\w+"
    r"|\w*norm\w*\.\w+|act_fn\.\w+)$"
)
# Kept unquantized by every engine whatever the config says: routers (Step's moe.gate, Nemotron's
# mixer.gate, Hy3's mlp.router.gate, Hunyuan's mlp.gate.wg: vLLM hunyuan_v1.py builds it with quant_config=None),
# convolutions (Mamba / gated-delta-net conv1d), DSA indexer scores, audio towers and patch mergers that are not
# in `vision*`; head-wise attention gates (Step-3.5's and Laguna's self_attn.g_proj, [heads, hidden]: the Step
# releases list it as not converted, and its few rows split over TP ranks are no whole 128-row blocks). And every
# Linear outside the decoder layers: FP8 releases quantize the layers' Linears only, and what sits outside them
# is, in a model the table does not know, a multimodal projector by another name (Step-3.7's vit_large_projector,
# MiniCPM-V's merger, PaddleOCR-VL's mlp_AR) that engines may build unquantized; kept in its dtype and listed,
# it loads.
_UNQUANTIZED_RULES = (
    rf"\.{_HOMES}\.gate\.(?:wg\.)?weight$|\.router\.|conv1d|\.indexer\.weights_proj\.|audio|patch_merge_mlp"
    r"|\.self_attn\.g_proj\.|^(?!.*(?:^|\.)(?:layers?|h|blocks?|mtp)\.\d+\.)"
)
FUSED_RULES = (
    _QKV,
    _MLA,
    re.compile(
        r"^(.*\.(?:shared_experts?|share_expert|shared_mlp|mlp|feed_forward|ffn|mixer)\.)" + _GATE_UP + r"\.weight$"
    ),
    re.compile(r"^(.*\.experts\.)\d+\.(?:gate_proj|up_proj|down_proj|w1|w2|w3|linear_gate)\.weight$"),
    re.compile(r"^(.*\.moe\.)(?:gate_proj|up_proj|down_proj)\.weight$"),
)


@dataclass(frozen=True)
class Exceptions:
    """What a family's names cannot tell: fused groups an engine builds, modules kept unquantized."""

    fused: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = ()
    block_fused_experts: bool = False  # Family.block_fused_experts
    # (role group, config flag): while the flag is on (or absent: its default), the model's code derives the
    # role's width from the keys, so no key states it (nothing to check it against, nothing padding could write)
    derived_widths: tuple[tuple[str, str], ...] = ()


_QWEN3_5 = Exceptions(
    # vLLM's qwen3_5.py loads in_proj_qkv + in_proj_z as one in_proj_qkvz, in_proj_b + in_proj_a as in_proj_ba
    fused=(
        r"^(.*\.linear_attn\.)(?:in_proj_qkv|in_proj_z)\.weight$",
        r"^(.*\.linear_attn\.)(?:in_proj_b|in_proj_a)\.weight$",
    ),
    # the releases keep in_proj_b / in_proj_a (64 rows at most per rank) and mtp.fc in bf16
    unquantized=(r"\.linear_attn\.in_proj_[ba]\.", r"(?:^|\.)mtp\.fc\."),
    # vLLM's qwen3_5.py maps experts.gate_up_proj* -> w13_weight*, scale included, chunking it in gate/up halves
    block_fused_experts=True,
)
EXCEPTIONS: dict[str, Exceptions] = {
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), _QWEN3_5),
    # LFM2 (transformers modeling_lfm2.py, Lfm2MLP): with block_auto_adjust_ff_dim the MLP is 2/3 of
    # intermediate_size, times block_ffn_dim_multiplier, rounded up to block_multiple_of (12288 -> 8192)
    "lfm2": Exceptions(derived_widths=(("dense", "block_auto_adjust_ff_dim"),)),
}


def rule_family(config: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> Family:
    """The family of an unnamed model_type: its MLP roles found from the names, each width key matched
    to the tensors' widths."""
    model_type = model_type_of(config)
    c = text_config(config)
    hidden = c.get("hidden_size") if isinstance(c.get("hidden_size"), int) else None
    found, mixers = _role_tensors(shapes)
    roles: list[MlpRole] = []
    refusals: list[str] = []
    misfits: list[WidthMisfit] = []
    extra = EXCEPTIONS.get(model_type, Exceptions())
    derived = {group: flag for group, flag in extra.derived_widths if c.get(flag, True) is not False}
    for group in ("dense", "routed", "shared"):
        if found[group] and group in derived:
            refusals.append(
                f"config.json states no width of the {group} MLP ({next(iter(found[group].values()))}): "
                f"{model_type_of(config)}'s code derives it from intermediate_size while {derived[group]} is on"
            )
        elif found[group]:
            width, refusal = _match_width(group, found[group], c, hidden)
            if width is not None:
                roles.append(MlpRole(group, width, ROLE_TENSORS[group]))
            else:
                refusals.append(refusal)
            misfit = _misfit(group, found[group], c, hidden, width, roles)
            if misfit is not None:
                misfits.append(misfit)
    labels = ", ".join(f"{r.group} {r.width.label}" for r in roles) or "no MLP roles"
    family = Family(
        name=f"{model_type} (roles by rule: {labels})",
        model_types=(model_type,),
        roles=tuple(roles),
        fused=(*FUSED_RULES, *(re.compile(p) for p in extra.fused)),
        unquantized=re.compile("(" + "|".join((_UNQUANTIZED_BASE, _UNQUANTIZED_RULES, *extra.unquantized)) + ")"),
        mlp_other=MLP_OTHER,
        refusals=tuple(refusals),
        misfits=tuple(misfits),
        mlp_mixers=mixers,
        by_rule=True,
        block_fused_experts=extra.block_fused_experts,
    )
    register(family)
    return family


_ROLE_MATCH = re.compile(
    "|".join(f"(?P<{g}{i}>{t.pattern.pattern})" for g, tensors in ROLE_TENSORS.items() for i, t in enumerate(tensors))
)
# audio towers are not language MLPs either (the rules' reach beyond the table's: families.in_vision)
_AUDIO = re.compile(r"(?:^|\.)audio\w*\.")
# (example name, shape, tensor) of each distinct kind of role tensor: a 200k-name checkpoint has a few dozen
_Kinds = dict[str, dict[tuple[int, tuple[int, ...]], str]]


def _role_of_name(name: str) -> tuple[str, int] | None:
    """(group, index in ROLE_TENSORS[group]) of a decoder-layer tensor (language model and MTP)."""
    rest = layer_key(name)
    role = None if rest is None else _role_in_layer(rest)
    if role is None or in_vision(name) or ("audio" in name and _AUDIO.search(name)):
        return None
    return role


@functools.lru_cache(maxsize=1 << 16)
def _role_in_layer(rest: str) -> tuple[str, int] | None:
    m = _ROLE_MATCH.match(rest)
    if m is None or m.lastgroup is None:
        return None
    group = m.lastgroup.rstrip("0123456789")
    return group, int(m.lastgroup[len(group) :])


def _role_tensors(shapes: Mapping[str, tuple[int, ...]]) -> tuple[_Kinds, frozenset[str]]:
    """Each role group's distinct (tensor, shape) with an example name; the `mixer.` modules holding them."""
    found: _Kinds = {g: {} for g in ROLE_TENSORS}
    mixers = set()
    for name, shape in shapes.items():
        if name.endswith(NO_ROLE_TAILS):
            continue
        role = _role_of_name(name)
        if role is None:
            continue
        kinds = found[role[0]]
        kind = (role[1], shape if type(shape) is tuple else tuple(shape))
        if kind not in kinds:
            kinds[kind] = name
        if (i := name.find(".mixer.")) >= 0:  # Nemotron-H: this layer's mixer is an MLP
            mixers.add(name[: i + len(".mixer.")])
    return found, frozenset(mixers)


def _kinds_of(
    group: str, tensors: dict[tuple[int, tuple[int, ...]], str]
) -> list[tuple[str, tuple[int, ...], MlpTensor]]:
    """(example name, shape, role tensor) of each distinct kind _role_tensors found for the group."""
    return [(name, shape, ROLE_TENSORS[group][i]) for (i, shape), name in tensors.items()]


def _match_width(
    group: str, tensors: dict[tuple[int, tuple[int, ...]], str], c: dict[str, Any], hidden: int | None
) -> tuple[Width | None, str]:
    """The one candidate key every tensor of the role fits; else None and the refusal naming them."""
    kinds = _kinds_of(group, tensors)
    fits = []
    for width in WIDTH_CANDIDATES[group]:
        value = width.of(c)
        if value is not None and all(
            width_axis(t, s, value * layer_factor(c, group, n), hidden) is not None for n, s, t in kinds
        ):
            fits.append(width)
    keys = list(dict.fromkeys(w.key for w in fits))
    named = [w for w in fits if "share" in w.key]
    if group == "shared" and len(keys) > 1 and len({w.key for w in named}) == 1:
        # a key naming the shared experts sizes them wherever a config has one (Nemotron-H, MiniMax-M3,
        # dots3_note, Qwen2-MoE); the generic keys it equals (moe_intermediate_size, intermediate_size) are
        # the routed experts', padded with theirs to the same width
        return named[0], ""
    if len(keys) == 1:
        return fits[0], ""
    stated = {w.label: w.of(c) for w in WIDTH_CANDIDATES[group] if w.of(c) is not None}
    name, shape, _ = kinds[0]
    if keys:
        return None, (
            f"the {group} MLP ({name}, shape {list(shape)}) fits config.json's "
            f"{' and '.join(w.label for w in fits)} alike, so which one an engine sizes it by is not known"
        )
    misfit = next(
        ((n, s) for n, s, t in kinds if not any(width_axis(t, s, v, hidden) is not None for v in stated.values())),
        (name, shape),
    )
    return None, (
        f"no config.json key gives the {group} MLP's width: {misfit[0]} has shape {list(misfit[1])}, "
        f"candidates {stated or 'none'}"
    )


# The candidate keys that name a role (an engine sizes the role by one of them when config.json has it);
# the others are generic (intermediate_size sizes dense MLPs, or experts where no key names them)
_NAMES_ROLE = {"dense": (), "routed": ("moe", "expert"), "shared": ("share",)}


def _naming_keys(group: str, c: dict[str, Any], found: list[MlpRole]) -> list[tuple[Width, int]]:
    """The candidate keys config.json has that name the role, with their values. A routed role with no
    moe_/expert_ key is named by intermediate_size when no dense role is sized by it (Mixtral's convention:
    the experts' width, as in MiniMax-M3, whose dense layers have dense_intermediate_size)."""
    words = _NAMES_ROLE[group]
    stated = [(w, value) for w in WIDTH_CANDIDATES[group] if (value := w.of(c)) is not None]
    naming = [(w, value) for w, value in stated if not words or any(word in w.key for word in words)]
    if (
        group == "routed"
        and not naming
        and not any(r.group == "dense" and r.width.key == "intermediate_size" for r in found)
    ):
        naming = [(w, value) for w, value in stated if w.key == "intermediate_size"]
    return naming


def _misfit(
    group: str,
    tensors: dict[tuple[int, tuple[int, ...]], str],
    c: dict[str, Any],
    hidden: int | None,
    matched: Width | None,
    found: list[MlpRole],
) -> WidthMisfit | None:
    """The role's tensors against config.json when it has keys naming the role (_naming_keys: a dense MLP's
    are all its candidates, moe_/expert_ keys name the routed experts, share_ keys the shared ones) and the
    tensors fit none of them: no key fits (`matched` None), or only a generic one does. None when a key
    naming the role fits, or config.json has none (nothing an engine is known to size the role by, as the
    rules warn). `found`: the roles matched before this one."""
    naming = _naming_keys(group, c, found)
    if not naming or (matched is not None and matched in [w for w, _ in naming]):
        return None
    kinds = _kinds_of(group, tensors)
    for name, shape, tensor in kinds:
        widths = [value * layer_factor(c, group, name) for _, value in naming]
        if all(width_axis(tensor, shape, width, hidden) is None for width in widths):
            return WidthMisfit(group, name, shape, tuple((w.label, value) for w, value in naming))
    return None
