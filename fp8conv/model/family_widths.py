"""Which family a checkpoint is (the table's, else its roles found by rule) and config.json's MLP widths
against its tensors. Above both families.py (the table) and roles.py (the rules), so neither imports the
other back. No torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import CheckpointError
from .families import NO_ROLE_TAILS, Family, layer_factor, model_type_of, role_of, table_family, text_config, width_axis
from .roles import rule_family


def family_of(config: dict[str, Any] | None, shapes: Mapping[str, tuple[int, ...]] | None = None) -> Family | None:
    """The family of the (text) config's model_type. For a model type the table does not know: with the
    checkpoint's tensor shapes, its roles found by rule (roles.py); without them, None."""
    if not config:
        return None
    family = table_family(config)
    if family is not None or shapes is None:
        return family
    return rule_family(config, shapes)


def width_settings(config: dict[str, Any] | None, family: Family) -> tuple[Any, ...]:
    """Every config.json value width_disagreements reads for this family: two configs with the same settings
    give every (name, shape) the same verdict."""
    c = text_config(config or {})
    keys = ("hidden_size", "use_double_wide_mlp", "num_kv_shared_layers", "num_hidden_layers")
    return (*(c.get(k) for k in keys), *(role.width.of(c) for role in family.roles))


def width_disagreements(
    config: dict[str, Any] | None,
    tensors: Iterable[tuple[str, tuple[int, ...], str]],
    fix: str,
    family: Family | None = None,
    unpacked: Mapping[str, str] | None = None,
) -> list[CheckpointError]:
    """Every (name, shape, shard) whose MLP width differs from the one the (text) config states for
    its role: transformers and vLLM build the layer from config.json and stop on the size mismatch.
    A family found by rule has each role's key matched to its tensors: this then checks the output
    (the padded widths written where the roles' keys are). `family`: the input's, for its output (the roles
    found on the input's names, checked against the widths written); else found here. `unpacked`: a packed
    4-bit weight's name -> the name it unpacks to (X.weight_packed -> X.weight), whose role it has (its
    shape given unpacked, as Classification.input_shapes gives it). A family found by rule adds each role
    whose tensors have none of the widths config.json states under keys naming it (Family.misfits)."""
    tensors = list(tensors)
    family = family or family_of(config, role_shapes(tensors, unpacked))
    if family is None:
        return []
    c = text_config(config or {})
    hidden = c.get("hidden_size") if isinstance(c.get("hidden_size"), int) else None
    double_wide = c.get("use_double_wide_mlp") is True  # else layer_factor is 1 for every name
    # (role tensor, shape, layer factor) -> the width when the shape does not have it, else None: a release's
    # 200k role tensors come in a few dozen of these
    misfits: dict[tuple[int, tuple[int, ...], int], int | None] = {}
    problems = []
    unpacked = unpacked or {}
    for name, shape, shard in tensors:
        role_name = unpacked.get(name, name)
        if role_name.endswith(NO_ROLE_TAILS):
            continue
        found = role_of(family, role_name)
        if found is None:
            continue
        role, tensor = found
        factor = layer_factor(c, role.group, role_name) if double_wide else 1
        key = (id(tensor), shape, factor)  # the family's own MlpTensors, alive as long as it is
        if key not in misfits:
            width = role.width.of(c)
            width = None if width is None else width * factor
            misfits[key] = None if width is None or width_axis(tensor, shape, width, hidden) is not None else width
        width = misfits[key]
        if width is None:
            continue
        what = f"{tensor.parts} x {width}" if tensor.parts > 1 else str(width)
        shown = f"{list(shape)} unpacked" if name in unpacked else str(list(shape))
        problems.append(
            CheckpointError(
                f"has shape {shown} but config.json's {role.width.label} says {what} along its "
                f"intermediate dimension ({role.group} MLP of {model_type_of(config)})",
                tensor=name,
                shard=shard,
                fix=fix,
            )
        )
    return problems + _misfit_problems(config, family, tensors, unpacked, fix)


def _misfit_problems(
    config: dict[str, Any] | None,
    family: Family,
    tensors: list[tuple[str, tuple[int, ...], str]],
    unpacked: Mapping[str, str],
    fix: str,
) -> list[CheckpointError]:
    """A role found by rule whose tensors have no width config.json states for it (Family.misfits): engines
    size the layer by config.json and stop on the mismatch, as for a family of the table. Named by the tensor
    the file holds (a packed weight's, read by the rules as the name it unpacks to)."""
    if not family.misfits:
        return []
    held = {unpacked.get(name, name): (name, shard) for name, _, shard in tensors}
    problems = []
    for misfit in family.misfits:
        name, shard = held.get(misfit.tensor, (misfit.tensor, None))
        stated = ", ".join(f"{label} {value}" for label, value in misfit.stated)
        shown = f"{list(misfit.shape)} unpacked" if name in unpacked else str(list(misfit.shape))
        problems.append(
            CheckpointError(
                f"has shape {shown}, but none of the widths config.json states for the {misfit.group} MLP is its "
                f"({stated}; {model_type_of(config)}, roles by rule)",
                tensor=name,
                shard=shard,
                fix=fix,
            )
        )
    return problems


def role_shapes(
    tensors: Iterable[tuple[str, tuple[int, ...], str]], unpacked: Mapping[str, str] | None = None
) -> dict[str, tuple[int, ...]]:
    """name -> shape of (name, shape, shard) tensors, a packed weight under the name it unpacks to: what the
    role rules read."""
    if not unpacked:
        return {name: shape for name, shape, _ in tensors}
    return {unpacked.get(name, name): shape for name, shape, _ in tensors}
