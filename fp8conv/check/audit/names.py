"""Which source tensors each tensor of another tool's output was made from, by name.

Engines and transformers rename as they load and save: a multimodal model's text layers move under
`model.language_model.` (or `language_model.model.`), transformers 5 fuses a MoE's per-expert Linears into
3-D `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I], and
Mistral's consolidated files name their layers `layers.N.attention.wq`. Each output tensor is matched to
rows of source tensors: one tensor under the same or a renamed name, the experts stacked into a fused
tensor, or one expert's rows of a fused source. Nothing is matched by shape alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...source.mistral_native import engine_module

# (pattern, replacement) making the spellings of one tensor equal; applied to both sides
_CANONICAL = [
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^language_model\.model\."), "model."),
    (re.compile(r"^language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.(visual|vision_tower|vision_model|multi_modal_projector)\."), r"\1."),
]
_NATIVE_LAYER = re.compile(r"^(layers\.\d+\.|output\.|tok_embeddings\.|norm\.)")
_NATIVE_OTHER = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_NATIVE_NORMS = [
    (re.compile(r"^layers\.(\d+)\.attention_norm\."), r"model.layers.\1.input_layernorm."),
    (re.compile(r"^layers\.(\d+)\.ffn_norm\."), r"model.layers.\1.post_attention_layernorm."),
]
FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$")
ONE_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class Segment:
    """Rows [rows) of matrix `matrix` of source tensor `source`."""

    source: str
    matrix: int
    rows: tuple[int, int]


@dataclass
class Match:
    other: str
    how: str  # "same name", "renamed from X", "fused from 8 experts", "expert 3 of X"
    layout: list[list[Segment]]  # per matrix of the output tensor: the segments its rows stack
    direct: str | None = None  # the one source tensor this output is row for row (same or renamed name)

    @property
    def sources(self) -> list[str]:
        return sorted({s.source for matrix in self.layout for s in matrix})


Shapes = dict[str, tuple[int, ...]]


def canonical(name: str, native: bool) -> str:
    if native:
        name = _native_to_hf(name)
    for pattern, repl in _CANONICAL:
        name = pattern.sub(repl, name)
    one = ONE_EXPERT.match(name)
    if one and one["proj"] in _EXPERT_PROJ:  # Mixtral's w1 / w3 / w2 are gate / up / down
        name = f"{one['prefix']}.{one['e']}.{_EXPERT_PROJ[one['proj']]}.weight"
    return name


def _native_to_hf(name: str) -> str:
    if name in _NATIVE_OTHER:
        return _NATIVE_OTHER[name]
    for pattern, repl in _NATIVE_NORMS:
        if pattern.match(name):
            return pattern.sub(repl, name)
    module, dot, param = name.rpartition(".")
    layout = "mla" if ".attention.wq_a" in name or ".attention.wkv" in name else "dense"
    return engine_module(module, layout, multimodal=False) + dot + param if module else name


def is_native(names: list[str]) -> bool:
    """Mistral's consolidated names: `layers.N.attention.wq.weight`, no `model.` anywhere."""
    return any(_NATIVE_LAYER.match(n) and ".attention.w" in n for n in names) and not any(
        n.startswith("model.") for n in names
    )


def match_names(source: Shapes, other: Shapes) -> tuple[list[Match], list[str], list[str]]:
    """(matches, output tensors matched to nothing, source tensors no output tensor was made from)."""
    native = is_native(list(source))
    by_canonical = {canonical(n, native): n for n in source}
    other_native = is_native(list(other))
    matches: list[Match] = []
    extra: list[str] = []
    for name in sorted(other):
        c = canonical(name, other_native)
        found = by_canonical.get(c)
        if found is not None:
            m = _matrices(source[found])
            how = "same name" if found == name else f"renamed from {found}"
            layout = [[Segment(found, i, (0, _rows(source[found])))] for i in range(m)]
            matches.append(Match(name, how, layout, direct=found))
            continue
        made = _fused_from_experts(name, c, other[name], by_canonical, source) or _expert_of_fused(
            c, name, by_canonical, source
        )
        if made is None:
            extra.append(name)
        else:
            matches.append(made)
    used = {s for m in matches for s in m.sources}
    missing = sorted(n for n in source if n not in used)
    return matches, extra, missing


def _rows(shape: tuple[int, ...]) -> int:
    return shape[-2] if len(shape) >= 2 else 1


def _matrices(shape: tuple[int, ...]) -> int:
    count = 1
    for d in shape[:-2]:
        count *= d
    return count


def _fused_from_experts(
    name: str, c: str, shape: tuple[int, ...], by_canonical: dict[str, str], source: Shapes
) -> Match | None:
    """transformers 5's [E, 2I, H] gate_up_proj / [E, H, I] down_proj made of per-expert source Linears."""
    fused = FUSED_EXPERTS.match(c)
    if fused is None or len(shape) != 3:
        return None
    parts = ("gate_proj", "up_proj") if fused["proj"] == "gate_up_proj" else ("down_proj",)
    layout: list[list[Segment]] = []
    for e in range(shape[0]):
        found = [by_canonical.get(f"{fused['prefix']}.{e}.{p}.weight") for p in parts]
        if any(f is None for f in found):
            return None
        layout.append([Segment(f, 0, (0, _rows(source[f]))) for f in found if f is not None])
    return Match(name, f"fused from {shape[0]} experts' {' and '.join(parts)}", layout)


def _expert_of_fused(c: str, name: str, by_canonical: dict[str, str], source: Shapes) -> Match | None:
    """One expert's Linear of an output made from a fused 3-D source tensor."""
    one = ONE_EXPERT.match(c)
    if one is None:
        return None
    proj, e = one["proj"], int(one["e"])
    fused_name = "gate_up_proj" if proj in ("gate_proj", "up_proj") else "down_proj"
    fused = by_canonical.get(f"{one['prefix']}.{fused_name}") or by_canonical.get(
        f"{one['prefix']}.{fused_name}.weight"
    )
    if fused is None or len(source[fused]) != 3 or e >= source[fused][0]:
        return None
    n = source[fused][1]
    rows = (0, n) if proj == "down_proj" else ((0, n // 2) if proj == "gate_proj" else (n // 2, n))
    return Match(name, f"expert {e} of {fused}", [[Segment(fused, e, rows)]])
