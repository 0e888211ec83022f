"""The family table: what tensor names mean in each model family fp8conv knows.

Per family (keyed by config.json's model_type, or text_config's): which tensors play which MLP role
(gate/up rows or down columns; dense, shared or routed; fused 3-D experts), which config key sets each
role's width, which modules engines fuse into one layer, which modules the FP8 releases leave
unquantized. Checked against transformers' modeling files (5.x): adding a family is one entry here and
one test. No torch.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

ROLE_GROUPS = ("dense", "shared", "routed")

# The language model's decoder layers (also DeepSeek/GLM MTP layers and Qwen3-Next's mtp.layers);
# vision towers have MLPs of their own width (Pixtral's vision feed_forward.gate_proj, ...).
_LAYER = r"(?:^|\.)layers\.\d+\."
# vision towers and multimodal projectors: any *projector, towers of other media (Video-LLaVA's image_tower),
# connectors and aligners (Idefics2's connector holds a perceiver resampler with layers and MLPs of its own)
VISION = re.compile(r"(?:^|\.)(?:vision\w*|visual|\w*projector|\w*_tower|connector|\w*aligner)\.")


def in_vision(name: str) -> bool:
    """VISION.search(name), the substring every match holds tested first: 200k names, a handful vision's."""
    return (
        "vis" in name or "projector" in name or "_tower" in name or "connector" in name or "aligner" in name
    ) and VISION.search(name) is not None


# Containers whose tensors may carry an MLP width: a name in one that no role claims is refused
# by --pad-for-tp rather than left at the old width. Gemma-4 keeps its routed experts directly under the
# layer (`layers.L.experts.*`).
MLP_CONTAINER = re.compile(_LAYER + r"(?:mlp|feed_forward|block_sparse_moe|moe|ffn|experts)\.")
# Fused 3-D expert parameters (transformers 5, Llama-4): group(1) is the module an engine builds from them.
FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(?:gate_up_proj|gate_proj|up_proj|down_proj)$")
# The bias of an MLP's down projection is hidden-sized: no width, never padded.
OUTPUT_BIAS = re.compile(r"\.(?:down_proj|w2)\.bias$")

# Unquantized in every FP8 release of these families (and by DeepSeek's own recipe).
# Multimodal projectors (Mistral-3's multi_modal_projector with its patch merger) stay bf16 in every release, and
# so do those by other names: any *projector (VideoLLaMA3's model.projector), towers (Video-LLaVA's image_tower),
# Idefics3 / SmolVLM's model.connector, DeepSeek-VL / Janus's model.aligner, around a Llama text model.
# `_gate.weight` is a router's or a gate's of one value (Qwen2-MoE's shared_expert_gate); Hy-V4's linear_gate is
# its gate projection, quantized with its up_proj.
_UNQUANTIZED_BASE = (
    r"embed|norm|lm_head|shared_head\.head|eh_proj|\.mlp\.gate\.weight$|(?<!linear)_gate\.weight$|vision|visual|projector"
    r"|_tower\.|(?:^|\.)(?:connector|\w*aligner)\."
)


@dataclass(frozen=True)
class Width:
    """A role's width: config[key], times config[times] when set (DeepSeek's shared experts)."""

    key: str
    times: str | None = None

    @property
    def label(self) -> str:
        return self.key if self.times is None else f"{self.key} * {self.times}"

    def of(self, c: dict[str, Any]) -> int | None:
        value = c.get(self.key)
        factor = 1 if self.times is None else c.get(self.times)
        if isinstance(value, int) and isinstance(factor, int) and value > 0 and factor > 0:
            return value * factor
        return None


@dataclass(frozen=True)
class MlpTensor:
    """Tensors whose `axis` (from the end) is the role's width; `parts` > 1: a fused [gate; up] whose
    axis holds `parts` widths, each padded on its own; `alt_axis`: the same tensor saved transposed
    (fused 3-D experts: [E, 2I, H] by transformers 5, [E, H, 2I] by earlier versions and Llama-4)."""

    pattern: re.Pattern[str]  # matched at the start of the name's part after 'layers.N.'
    axis: int
    parts: int = 1
    alt_axis: int | None = None


@dataclass(frozen=True)
class MlpRole:
    group: str  # dense / shared / routed: what --pad-roles selects
    width: Width
    tensors: tuple[MlpTensor, ...]


@dataclass(frozen=True)
class WidthMisfit:
    """A role found by rule whose tensors have a width that config.json states under none of the keys an
    engine may size that role by, though it states some: config.json and the tensors disagree."""

    group: str  # dense / shared / routed
    tensor: str  # one of them (as the rules read it: a packed weight by the name it unpacks to)
    shape: tuple[int, ...]
    stated: tuple[tuple[str, int], ...]  # each candidate key config.json states, with its value


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    roles: tuple[MlpRole, ...]
    fused: tuple[re.Pattern[str], ...]  # each match's group(1): one layer an engine builds from them
    unquantized: re.Pattern[str]  # modules the FP8 releases leave in bf16/f32
    mlp_other: re.Pattern[str]  # tensors inside an MLP that carry no width (routers, biases)
    # False: transformers builds this family's experts one Linear per expert under compressed-tensors
    # (SequentialLlama4TextExperts), so fused 3-D experts cannot stay fused beside a channel FP8 config
    fused_experts_beside_channel: bool = True
    # True: a bf16 -> block FP8 run quantizes fused 3-D experts (experts.gate_up_proj [E, 2I, H]) in place,
    # scales [E, 2I/bn, H/bk] as transformers' FP8Experts saves them, because the engine's loader reads
    # that layout (vLLM qwen3_5.py: gate_up_proj_scale_inv split in halves like the weight)
    block_fused_experts: bool = False
    # A family the table does not name, its roles found by rule (roles.py): why --pad-for-tp cannot pad it
    # (widths no config key matches, or two keys match), and the `mixer.` modules that are MLPs
    refusals: tuple[str, ...] = ()
    misfits: tuple[WidthMisfit, ...] = ()  # roles whose width config.json states wrong (roles._misfit)
    mlp_mixers: frozenset[str] = frozenset()
    by_rule: bool = False


def _gate_up_down(container: str, gate_up: str = r"(?:gate_proj|up_proj)", down: str = "down_proj"):
    prefix = container
    return (
        MlpTensor(re.compile(prefix + gate_up + r"\.weight$"), -2),
        MlpTensor(re.compile(prefix + down + r"\.weight$"), -1),
        # mlp_bias (Llama, ...): gate/up biases have the width; down's bias has the hidden size (OUTPUT_BIAS)
        MlpTensor(re.compile(prefix + gate_up + r"\.bias$"), -1),
    )


def _fused_experts(container: str, gate_up_axis: int) -> tuple[MlpTensor, ...]:
    """3-D [E, 2I, H] / [E, H, I] (gate_up_axis -2) or [E, H, 2I] / [E, I, H] (-1); either is accepted."""
    other = -1 if gate_up_axis == -2 else -2
    prefix = container + r"experts\."
    return (
        MlpTensor(re.compile(prefix + r"gate_up_proj$"), gate_up_axis, parts=2, alt_axis=other),
        MlpTensor(re.compile(prefix + r"down_proj$"), other, alt_axis=gate_up_axis),
    )


def _unquantized(*extra: str) -> re.Pattern[str]:
    return re.compile("(" + "|".join((_UNQUANTIZED_BASE, *extra)) + ")")


_QKV = re.compile(r"^(.*\.self_attn\.)(?:q_proj|k_proj|v_proj)\.weight$")
_MLA = re.compile(r"^(.*\.self_attn\.)(?:q_a_proj|kv_a_proj_with_mqa)\.weight$")
_GATE_UP = re.compile(r"^(.*\.mlp\.(?:shared_experts?\.)?)(?:gate_proj|up_proj)\.weight$")
_EXPERTS = re.compile(r"^(.*\.mlp\.experts\.)\d+\.(?:gate_proj|up_proj|down_proj)\.weight$")
_MLP_ROUTERS = re.compile(r"\.mlp\.(?:gate\.weight|gate\.e_score_correction_bias|shared_expert_gate\.weight)$")

DENSE = MlpRole("dense", Width("intermediate_size"), _gate_up_down(r"mlp\."))
ROUTED = MlpRole(
    "routed",
    Width("moe_intermediate_size"),
    _gate_up_down(r"mlp\.experts\.\d+\.") + _fused_experts(r"mlp\.", -2),
)
SHARED_DEEPSEEK = MlpRole(
    "shared", Width("moe_intermediate_size", "n_shared_experts"), _gate_up_down(r"mlp\.shared_experts\.")
)
SHARED_QWEN = MlpRole("shared", Width("shared_expert_intermediate_size"), _gate_up_down(r"mlp\.shared_expert\."))

_DENSE_ONLY = dict(roles=(DENSE,), fused=(_QKV, _GATE_UP), unquantized=_unquantized(), mlp_other=_MLP_ROUTERS)

FAMILIES: tuple[Family, ...] = (
    Family(
        "DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2",
        ("deepseek_v3", "deepseek_v32", "deepseek_v2", "kimi_k2"),
        (DENSE, ROUTED, SHARED_DEEPSEEK),
        (_MLA, _QKV, _GATE_UP, _EXPERTS),
        _unquantized(r"\.indexer\.weights_proj\."),  # V3.2's indexer: wq_b / wk are FP8
        _MLP_ROUTERS,
    ),
    Family(
        "GLM-4.5/4.6, GLM-4.5V",
        ("glm4_moe", "glm4v_moe_text", "glm4v_moe"),
        (DENSE, ROUTED, SHARED_DEEPSEEK),
        (_QKV, _GATE_UP, _EXPERTS),
        _unquantized(),
        _MLP_ROUTERS,
    ),
    Family(
        "Qwen3-MoE / Qwen3-VL-MoE",
        ("qwen3_moe", "qwen3_vl_moe_text"),
        (DENSE, ROUTED),
        (_QKV, _GATE_UP, _EXPERTS),
        _unquantized(),
        _MLP_ROUTERS,
    ),
    Family(
        "Qwen2-MoE style",
        ("qwen2_moe",),
        (DENSE, ROUTED, SHARED_QWEN),
        (_QKV, _GATE_UP, _EXPERTS),
        _unquantized(),
        _MLP_ROUTERS,
    ),
    Family(
        "Qwen3-Next",
        ("qwen3_next",),
        (DENSE, ROUTED, SHARED_QWEN),
        # in_proj_qkvz is one tensor engines split four ways (q, k, v, z): a fused layer of its own
        (_QKV, _GATE_UP, _EXPERTS, re.compile(r"^(.*\.linear_attn\.in_proj_qkvz)\.weight$")),
        _unquantized(r"\.linear_attn\.in_proj_ba\.", r"\.linear_attn\.conv1d\."),
        _MLP_ROUTERS,
    ),
    Family(
        "Mixtral / MiniMax-M2",
        ("mixtral", "minimax_m2", "minimax"),
        (
            MlpRole(
                "routed",
                Width("intermediate_size"),
                _gate_up_down(r"block_sparse_moe\.experts\.\d+\.", r"(?:w1|w3)", "w2"),
            ),
        ),
        (_QKV, re.compile(r"^(.*\.block_sparse_moe\.experts\.)\d+\.(?:w1|w2|w3)\.weight$")),
        _unquantized(r"\.block_sparse_moe\.gate\."),
        re.compile(r"\.block_sparse_moe\.(?:gate\.weight|e_score_correction_bias|gate\.e_score_correction_bias)$"),
    ),
    Family(
        "Llama-4",
        ("llama4_text",),
        (
            MlpRole("dense", Width("intermediate_size_mlp"), _gate_up_down(r"feed_forward\.")),
            MlpRole(
                "routed",
                Width("intermediate_size"),
                _gate_up_down(r"feed_forward\.experts\.\d+\.") + _fused_experts(r"feed_forward\.", -1),
            ),
            MlpRole("shared", Width("intermediate_size"), _gate_up_down(r"feed_forward\.shared_expert\.")),
        ),
        (
            _QKV,
            re.compile(r"^(.*\.feed_forward\.(?:shared_expert\.)?)(?:gate_proj|up_proj)\.weight$"),
            re.compile(r"^(.*\.feed_forward\.experts\.)\d+\.(?:gate_proj|up_proj|down_proj)\.weight$"),
        ),
        _unquantized(r"\.feed_forward\.router\.", r"multi_modal_projector"),
        re.compile(r"\.feed_forward\.router\.weight$"),
        fused_experts_beside_channel=False,
    ),
    Family(
        "Qwen3 / Qwen2 dense, Qwen2-VL / Qwen2.5-VL / Qwen3-VL",
        ("qwen3", "qwen2", "qwen3_vl_text", "qwen2_5_vl_text", "qwen2_vl_text", "qwen2_5_vl", "qwen2_vl"),
        **_DENSE_ONLY,
    ),
    Family("Llama-3.x", ("llama",), **_DENSE_ONLY),
    Family("Mistral / Ministral", ("mistral", "ministral", "ministral3"), **_DENSE_ONLY),
)
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_NAME = {f.name: f for f in FAMILIES}
_ALL_FUSED = tuple(dict.fromkeys(p for f in FAMILIES for p in f.fused))


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) and "hidden_size" in nested else config


def table_family(config: dict[str, Any] | None) -> Family | None:
    """The table's family for the (text) config's model_type, or None (family_widths.family_of then finds
    one by rule)."""
    if not config:
        return None
    c = text_config(config)
    for section in (c, config):
        family = _BY_MODEL_TYPE.get(str(section.get("model_type")))
        if family is not None:
            return family
    return None


def register(family: Family) -> None:
    """A family found by rule: its roles are then matched by name like the table's. Its name states each
    role's width key, and a role's tensors are fixed by rule, so one name always means the same roles."""
    _BY_NAME[family.name] = family


def model_type_of(config: dict[str, Any] | None) -> str:
    c = text_config(config or {})
    return str(c.get("model_type") or (config or {}).get("model_type") or "none")


def is_language_mlp(name: str) -> bool:
    return bool(MLP_CONTAINER.search(name)) and not VISION.search(name)


_MATCHERS: dict[str, tuple[re.Pattern[str], list[tuple[MlpRole, MlpTensor]]]] = {}


def _matcher(family: Family) -> tuple[re.Pattern[str], list[tuple[MlpRole, MlpTensor]]]:
    """One anchored regex for every role tensor of a family: R1 has 92k names, planned several times."""
    if family.name not in _MATCHERS:
        pairs = [(role, tensor) for role in family.roles for tensor in role.tensors]
        combined = "|".join(f"(?P<t{i}>{t.pattern.pattern})" for i, (_, t) in enumerate(pairs))
        _MATCHERS[family.name] = (re.compile(combined), pairs)
    return _MATCHERS[family.name]


_LAYER_PREFIX = re.compile(_LAYER)


_INDEX_DOT = re.compile(r"\d+\.")


def _in_layer(name: str) -> str | None:
    """The part of a name after its (first) decoder layer's 'layers.N.', or None: _LAYER_PREFIX.search,
    its literal 'layers.' found by str.find first (a third of the regex's time, over 200k names)."""
    at = name.find("layers.")
    while at != -1:
        if at == 0 or name[at - 1] == ".":
            index = _INDEX_DOT.match(name, at + len("layers."))
            if index is not None:
                return name[index.end() :]
        at = name.find("layers.", at + 1)
    return None


def layer_factor(c: dict[str, Any], group: str, name: str) -> int:
    """How many times its config width a dense MLP is in this layer: Gemma-4's E-models
    (use_double_wide_mlp) build the MLPs of their KV-sharing layers, the last num_kv_shared_layers,
    intermediate_size * 2 wide (transformers gemma4 Gemma4TextMLP / kv_sharing_modes); else 1."""
    if group != "dense" or c.get("use_double_wide_mlp") is not True:
        return 1
    shared, layers = c.get("num_kv_shared_layers"), c.get("num_hidden_layers")
    m = _LAYER_PREFIX.search(name)
    if not (isinstance(shared, int) and isinstance(layers, int) and shared > 0 and m):
        return 1
    index = re.search(r"(\d+)\.$", m.group(0))
    return 2 if index is not None and int(index.group(1)) >= layers - shared else 1


_UNSEEN = object()  # a memo's "not asked yet" (None is an answer)
# family name -> layer key -> the role tensor it is (None: none): a few dozen keys per family
_ROLES_IN_LAYER: dict[str, dict[str, tuple[MlpRole, MlpTensor] | None]] = {}


# Every role tensor's pattern ends `\.weight$`, `\.bias$` or `_proj$` (a test holds them to it), so no name
# ending in a scale's suffix is a role's, nor a packed 4-bit weight's own or its shape's (a packed weight
# plays its role under the name it unpacks to): the passes over a release's names skip them (half its names;
# two thirds of Kimi-K2.5's)
NO_ROLE_TAILS = ("_scale_inv", "_scale", ".scale", ".qscale_weight", ".qscale_act", ".weight_packed", ".weight_shape")
NO_ROLE_TAILS += ("_blocks", "_scales")  # gpt-oss's MXFP4 experts

# family name -> tensor name -> role_of's answer: planning asks it of every name five or six times
_ROLES_BY_NAME: dict[str, dict[str, tuple[MlpRole, MlpTensor] | None]] = {}


def role_of(family: Family, name: str) -> tuple[MlpRole, MlpTensor] | None:
    by_name = _ROLES_BY_NAME.get(family.name)
    if by_name is None:
        by_name = _ROLES_BY_NAME[family.name] = {}
    found = by_name.get(name, _UNSEEN)
    if found is _UNSEEN:
        found = _role_of(family, name)
        if len(by_name) >= _LAYER_KEYS_BOUND:
            by_name.clear()
        by_name[name] = found
    return found  # type: ignore[return-value]


def _role_of(family: Family, name: str) -> tuple[MlpRole, MlpTensor] | None:
    key = layer_key(name)
    if key is None or in_vision(name):
        return None
    known = _ROLES_IN_LAYER.setdefault(family.name, {})
    found = known.get(key, _UNSEEN)
    if found is _UNSEEN:
        pattern, pairs = _matcher(family)
        m = pattern.match(key)
        found = known[key] = None if m is None or m.lastgroup is None else pairs[int(m.lastgroup[1:])]
    return found  # type: ignore[return-value]


_EXPERT_INDEX = re.compile(r"experts\.\d+\.")


def one_expert(rest: str) -> str:
    """The name with its (first) expert index made 0 (`mlp.experts.17.up_proj` -> `mlp.experts.0.up_proj`):
    every role pattern takes any index (`experts\\.\\d+\\.`, a test holds them to it), so the 512 experts of a
    layer are matched once."""
    return _EXPERT_INDEX.sub("experts.0.", rest, count=1) if "experts." in rest else rest


# name -> layer_key(name), shared by the table's role matching and the rules' (each pass over a release's
# 200k names found them again); the keys interned, a few dozen strings. Emptied when it grows past the bound.
_LAYER_KEYS: dict[str, str | None] = {}
_LAYER_KEYS_BOUND = 1 << 20
_REST_KEYS: dict[str, str] = {}  # what follows `layers.N.` -> its layer key, emptied with _LAYER_KEYS


def layer_key(name: str) -> str | None:
    """What role matching reads of a name: the part after its decoder layer's 'layers.N.', with the expert
    index made 0; None outside decoder layers."""
    key = _LAYER_KEYS.get(name, _UNSEEN)
    if key is _UNSEEN:
        rest = _in_layer(name)
        if rest is not None:  # a release's 200k names have a few thousand rests: one_expert once each
            key = _REST_KEYS.get(rest)
            if key is None:
                key = _REST_KEYS[rest] = sys.intern(one_expert(rest))
        else:
            key = None
        if len(_LAYER_KEYS) >= _LAYER_KEYS_BOUND:
            _LAYER_KEYS.clear()
            _REST_KEYS.clear()
        _LAYER_KEYS[name] = key
    return key  # type: ignore[return-value]


def width_axis(tensor: MlpTensor, shape: tuple[int, ...], width: int, hidden: int | None) -> int | None:
    """The axis holding the role's width (times parts), or None when the shape does not have it."""
    if len(shape) < max(-tensor.axis, -(tensor.alt_axis or -1)):
        return None
    want = width * tensor.parts
    if shape[tensor.axis] == want:
        return tensor.axis
    if tensor.alt_axis is not None and shape[tensor.alt_axis] == want and hidden in (None, shape[tensor.axis]):
        return tensor.alt_axis
    return None


def fused_group(name: str, family: Family | None = None) -> str | None:
    found = fused_module(name, family)
    return None if found is None else f"{found[0]}<{found[1]}>"


def fused_module(name: str, family: Family | None = None) -> tuple[str, str] | None:
    """(the module an engine fuses this tensor into, the fused pattern's text); the module is the name's
    start: every fused pattern begins `^(`, a test holds them to it."""
    for pattern in family.fused if family is not None else _ALL_FUSED:
        m = pattern.match(name)
        if m:
            return m.group(1), pattern.pattern
    return None
