"""What tensor names mean, from the family table (families.py): quantizable Linears, fused groups,
and the MLP padding of --pad-for-tp."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError, OptionsError
from ..source.config import CONFIG_NAME
from .families import (
    _UNQUANTIZED_BASE,
    OUTPUT_BIAS,
    ROLE_GROUPS,
    Family,
    MlpRole,
    fused_group,
    is_language_mlp,
    layer_factor,
    model_type_of,
    role_of,
    text_config,
    width_axis,
)
from .family_widths import family_of

__all__ = ["fused_group", "text_config"]

FLOAT_DTYPES = ("BF16", "F16", "F32")
NEVER_QUANTIZED = re.compile("(" + _UNQUANTIZED_BASE + ")")  # families the table does not know


def is_quantizable_linear(name: str, dtype: str, ndim: int, family: Family | None = None) -> bool:
    unquantized = family.unquantized if family is not None else NEVER_QUANTIZED
    return name.endswith(".weight") and dtype in FLOAT_DTYPES and ndim in (2, 3) and not unquantized.search(name)


@dataclass(frozen=True)
class RoleSplit:
    """An MLP role as the checkpoint has it, with what decides how an engine may split its width across
    tensor-parallel ranks (vLLM validate_fp8_block_shape, and Fp8MoEMethod for experts)."""

    role: MlpRole
    example: str  # its first tensor in file order (a packed 4-bit weight by the name it unpacks to)
    block_fp8: bool = True  # some tensor of it is FP8 in a --to block output: the block rules apply
    gated: bool = True  # a gate projection beside the up one: engines merge [gate; up] into one GEMM

    def whole_per_rank(self, width: int, tp: int, block: tuple[int, int]) -> bool:
        """Whether `width` splits over `tp` ranks as engines need. Unquantized: evenly. Block FP8: each rank's
        gate/up rows whole block_n and its down columns whole block_k; on one rank only a merged [gate; up]
        (the gate's rows) and experts (Fp8MoEMethod) are checked, a plain up projection is not."""
        if not self.block_fp8:
            return width % tp == 0
        if tp == 1:
            return width % block[0] == 0 or not (self.gated or self.role.group == "routed")
        return width % tp == 0 and (width // tp) % block[0] == 0 and (width // tp) % block[1] == 0


@dataclass(frozen=True)
class Pad:
    """A padded output shape; `parts` > 1: the padded axis holds that many widths, each padded."""

    shape: tuple[int, ...]
    parts: int = 1


@dataclass(frozen=True)
class MlpPadding:
    """--pad-for-tp: the new value of each config key whose roles are padded."""

    family: Family
    config: dict[str, Any]  # the (text) config of the input
    groups: tuple[str, ...]  # the role groups padded
    padded: dict[str, int]  # config key -> new width
    warnings: list[str] = field(default_factory=list)

    def padded_shape(self, name: str, shape: tuple[int, ...], shard: str) -> Pad | None:
        found = role_of(self.family, name)
        if found is None:
            if self._in_mlp(name) and not (self.family.mlp_other.search(name) or OUTPUT_BIAS.search(name)):
                known = "the naming rules (fp8conv/roles.py) give" if self.family.by_rule else "the family table knows"
                raise CheckpointError(
                    f"is inside an MLP but plays no role {known} for {self.family.name}, "
                    "so --pad-for-tp cannot tell which width it has",
                    tensor=name,
                    shard=shard,
                    fix="convert without --pad-for-tp (or add the name to fp8conv/families.py)",
                )
            return None
        role, tensor = found
        if role.group not in self.groups:
            return None
        layer = layer_factor(self.config, role.group, name)  # Gemma-4's double-wide MLPs: 2 x the key
        width = role.width.of(self.config)
        width = None if width is None else width * layer
        hidden = self.config.get("hidden_size") if isinstance(self.config.get("hidden_size"), int) else None
        axis = None if width is None else width_axis(tensor, shape, width, hidden)
        if width is None or axis is None:
            raise CheckpointError(
                f"has shape {list(shape)} but config.json implies {role.width.label} = {width} along its "
                "intermediate dimension",
                tensor=name,
                shard=shard,
                fix="config.json and the tensors disagree; --pad-for-tp needs them to agree",
            )
        factor = self.config[role.width.times] if role.width.times else 1  # DeepSeek's n_shared_experts
        new_width = self.padded[role.width.key] * factor * layer
        if new_width == width:
            return None
        new = list(shape)
        new[axis] = new_width * tensor.parts
        return Pad(tuple(new), tensor.parts)

    def _in_mlp(self, name: str) -> bool:
        """In an MLP container; `mixer.` (Nemotron-H) only where that layer's mixer is an MLP."""
        i = name.find(".mixer.")
        return is_language_mlp(name) or (i >= 0 and name[: i + len(".mixer.")] in self.family.mlp_mixers)


def _paddable_family(config: dict[str, Any] | None, family: Family | None) -> Family:
    """The family whose roles --pad-for-tp pads, or the refusal saying why there is none."""
    if family is None and not config:  # Mistral-native releases: params.json alone
        raise OptionsError(
            f"--pad-for-tp reads the MLP widths it pads from {CONFIG_NAME}, which this checkpoint does not have",
            fix="convert without --pad-for-tp",
        )
    if family is None:
        raise OptionsError(
            f"--pad-for-tp does not know model_type {model_type_of(config)!r}: which tensors use which MLP "
            "width is in fp8conv's family table",
            fix="convert without --pad-for-tp",
        )
    if family.refusals:
        raise OptionsError(f"--pad-for-tp: {family.refusals[0]}", fix="convert without --pad-for-tp")
    return family


def plan_mlp_padding(
    config: dict[str, Any] | None,
    tp: int,
    block: tuple[int, int],
    splits: Sequence[RoleSplit],
    groups: tuple[str, ...] | None = None,
    family: Family | None = None,
) -> MlpPadding:
    """Pad each chosen role's width to a multiple of tp * lcm(bn, bk): every rank then holds whole blocks
    of gate/up rows (block_n) and of down columns (block_k). Roles no tensor plays are left alone; a
    config key two roles share is padded for both or neither. `splits`: the roles the checkpoint has
    (role_splits); `family`: one found by rule (roles.py). Warns where the run pads nothing, and where a
    role left out (but routed experts, which expert parallelism does not split) still splits into partial
    blocks at this TP."""
    family = _paddable_family(config, family or family_of(config))
    c = text_config(config or {})
    chosen = groups or ROLE_GROUPS
    roles = [(s.role, s.example) for s in splits]
    warnings = [
        f"--pad-roles {g}: no {g} MLP tensor in this {model_type_of(config)} checkpoint"
        for g in chosen
        if groups and all(r.group != g for r, _ in roles)
    ]
    selected = [(r, e) for r, e in roles if r.group in chosen]
    if not selected:
        raise OptionsError(
            f"--pad-for-tp: no MLP tensor of the roles {', '.join(chosen)} in this checkpoint",
            fix="convert without --pad-for-tp",
        )
    keys = {r.width.key for r, _ in selected}
    for role, example in roles:
        if role.group not in chosen and role.width.key in keys:
            partner = next(r for r, _ in selected if r.width.key == role.width.key)
            raise OptionsError(
                f"--pad-roles: the {partner.group} MLP ({partner.width.label}) and the {role.group} MLP "
                f"({role.width.label}, e.g. {example}) share config.json's {role.width.key}, so they are "
                "padded together or not at all",
                fix=f"add {role.group} to --pad-roles, or leave {partner.group} out",
            )
    unit = tp * math.lcm(*block)
    padded = {}
    for role, example in selected:
        width = c.get(role.width.key)
        if role.width.of(c) is None or not isinstance(width, int):
            raise OptionsError(
                f"--pad-for-tp needs {role.width.label} in config.json for the {role.group} MLP (e.g. {example})",
                fix="add it to config.json, or convert without --pad-for-tp",
            )
        padded[role.width.key] = -(-width // unit) * unit
    warnings += _padding_warnings(c, tp, block, splits, chosen, padded)
    return MlpPadding(family, c, tuple(chosen), padded, warnings)


def _padding_warnings(
    c: dict[str, Any],
    tp: int,
    block: tuple[int, int],
    splits: Sequence[RoleSplit],
    chosen: tuple[str, ...],
    padded: dict[str, int],
) -> list[str]:
    """A padding that changes no width; a dense or shared role left out that still splits into partial blocks
    at this TP (routed experts left out are expert-parallel's, which does not split them)."""
    warnings, blocks = [], f"{block[0]}x{block[1]}"
    if all(c[key] == width for key, width in padded.items()):
        padded_groups = {s.role.group for s in splits if s.role.group in chosen}
        warnings.append(
            f"--pad-for-tp {tp} pads nothing: the {', '.join(g for g in ROLE_GROUPS if g in padded_groups)} MLP "
            f"widths already split into whole {blocks} blocks on {tp} ranks"
        )
    for split in splits:
        width = split.role.width.of(c)
        left = split.role.group not in chosen and split.role.group != "routed"
        if left and width is not None and not split.whole_per_rank(width, tp, block):
            # the roles padded with it: those sharing its config key are padded together or not at all
            with_it = {split.role.group} | {s.role.group for s in splits if s.role.width.key == split.role.width.key}
            needed = ",".join(g for g in ROLE_GROUPS if g in chosen or g in with_it)
            warnings.append(
                f"--pad-roles {','.join(chosen)} leaves the {split.role.group} MLP ({split.role.width.label} "
                f"{width} -> {width / tp:g}/rank, e.g. {split.example}) in partial {blocks} blocks at TP {tp}: "
                f"engines splitting it over {tp} ranks refuse it (--pad-roles {needed} pads it)"
            )
    return warnings


def updated_widths_config(config: dict[str, Any], padding: MlpPadding) -> None:
    """Write the padded widths back into the (text) config, in place; the planner then checks every
    tensor of every role against them. A top-level copy of a text_config width (Qwen2.5-VL's configs
    repeat the text model's keys beside text_config) is updated too, or it would disagree with the tensors."""
    c = text_config(config)
    for key, value in padding.padded.items():
        if key in c:
            if c is not config and config.get(key) == c[key]:
                config[key] = value
            c[key] = value


TP_SIZES = (1, 2, 4, 8, 16, 32)


def tp_report(
    config: dict[str, Any] | None,
    block: tuple[int, int],
    splits: Sequence[RoleSplit],
    family: Family | None,
    tps: tuple[int, ...] = TP_SIZES,
) -> dict[str, list[str]]:
    """For each TP size, the MLP widths whose per-rank slice engines refuse (RoleSplit.whole_per_rank), a
    width label's roles together. `splits`: the roles the checkpoint has, so a known family's widths that no
    tensor uses are left out (an all-MoE Qwen3 states an intermediate_size no layer has). {} without a
    family, which a checkpoint with a config.json always has (the table's, else one by rule): no width is
    known, nothing is checked."""
    if not config or family is None:
        return {}
    c = text_config(config)
    by_label: dict[str, tuple[int, list[RoleSplit]]] = {}
    for split in splits:
        width = split.role.width.of(c)
        if width is not None:
            by_label.setdefault(split.role.width.label, (width, []))[1].append(split)
    report: dict[str, list[str]] = {}
    for tp in tps:
        bad = []
        for label, (w, found) in by_label.items():
            if not all(s.whole_per_rank(w, tp, block) for s in found):
                groups = ", ".join(dict.fromkeys(s.role.group for s in found))
                bad.append(f"{groups} {label} {w} -> {w / tp:g}/rank")
        report[str(tp)] = bad
    return report
