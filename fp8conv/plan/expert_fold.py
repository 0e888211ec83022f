"""Routed experts folded: a release has 100k+ expert tensors that differ only by their index, and the
questions asked of a checkpoint as a whole are asked once of one expert standing for the others of its
module when they agree in everything the question reads. Any disagreement (one expert listed in an
ignore list, one shape off) leaves that module's experts unfolded.

- `expert_fold`, for inspect (its eight estimate plans: four targets, padded TP choices; its role and width
  questions): experts that agree in everything a plan reads (names past the index, dtypes, shapes, formats,
  ignore-list listing) are planned once, by the lowest index. Only sizes and whether a plan has problems are
  read from a folded plan (a problem of one expert is one of each); a run plans every tensor.
- `shape_fold`, for the MLP role rules of a model_type the table does not name (and the width check after
  them), which read a tensor's name past the expert index and its shape: the names to ask.
"""

from __future__ import annotations

from typing import Any

from ..model.classify import Classification, WeightFormat, module_of
from ..source.checkpoint import Checkpoint

_EXPERTS = ".experts."


def expert_fold(ckpt: Checkpoint, cls: Classification) -> dict[str, int]:
    """Each tensor a folded plan keeps -> how many tensors it stands for (1 outside folded experts)."""
    if "expert_fold" in cls.memo:
        return cls.memo["expert_fold"]
    weights, plain = cls.weights, set(cls.plain)
    listed = cls.settings.lists_as_not_converted
    keep: dict[str, int] = {}
    # experts module prefix -> expert index -> [(name past the index, what a plan reads of it)]
    modules: dict[str, dict[str, list[tuple[str, Any]]]] = {}
    for name, (_, entry) in ckpt.index.locations.items():
        at, dot, index = _split(name)
        if not index.isdigit():
            if name in weights or name in plain:
                keep[name] = 1
            continue
        # what a plan reads of the tensor, its own name left out
        fmt = weights.get(name)
        if fmt is None and name not in plain:  # a scale or companion (half the names): planned with its weight
            reads: tuple[Any, ...] = (entry.dtype, entry.shape, False, None, None)
        elif fmt is not None:
            reads = (entry.dtype, entry.shape, True, listed(module_of(name)), _format(fmt, name))
        else:
            reads = (entry.dtype, entry.shape, True, listed(module_of(name)), None)
        prefix = name[: at + len(_EXPERTS)]
        experts = modules.get(prefix)
        if experts is None:
            experts = modules[prefix] = {}
        tensors = experts.get(index)
        if tensors is None:
            experts[index] = [(name[dot:], reads)]
        else:
            tensors.append((name[dot:], reads))
    for prefix, experts in modules.items():
        first = _agreeing(experts)
        for index, tensors in experts.items():
            if first is not None and index != first:
                continue
            for rest, (_, _, planned, _, _) in tensors:
                if planned:
                    keep[f"{prefix}{index}{rest}"] = len(experts) if first is not None else 1
    cls.memo["expert_fold"] = keep
    return keep


def shape_fold(ckpt: Checkpoint, cls: Classification) -> set[str]:
    """The names the role rules and width checks need ask: every name outside experts modules; of a module
    whose experts agree in their names past the index and their shapes (a packed weight's unpacked, as
    Classification.input_shapes gives them), the lowest index's; every expert of a module that does not."""
    if "shape_fold" in cls.memo:
        return cls.memo["shape_fold"]
    asked: set[str] = set()
    # experts module prefix -> expert index -> [(name past the index, shape)]
    modules: dict[str, dict[str, list[tuple[str, tuple[int, ...]]]]] = {}
    for name, shape, _ in cls.input_shapes(ckpt.index):
        at, dot, index = _split(name)
        if not index.isdigit():
            asked.add(name)
            continue
        modules.setdefault(name[: at + len(_EXPERTS)], {}).setdefault(index, []).append((name[dot:], shape))
    for prefix, experts in modules.items():
        first = _agreeing(experts)
        asked.update(
            f"{prefix}{index}{rest}" for index in (experts if first is None else [first]) for rest, _ in experts[index]
        )
    cls.memo["shape_fold"] = asked
    return asked


def _split(name: str) -> tuple[int, int, str]:
    """Where a name's last `.experts.` starts, the dot after its index, and the index ("" for none, or
    something not an index when not digits)."""
    at = name.rfind(_EXPERTS)
    dot = name.find(".", at + len(_EXPERTS)) if at >= 0 else -1
    return at, dot, name[at + len(_EXPERTS) : dot] if dot > 0 else ""


def _agreeing(experts: dict[str, list[tuple[str, Any]]]) -> str | None:
    """The lowest expert index when every expert's (name past the index, what is read) list is its, in
    any order; else None."""
    first = min(experts, key=int)
    signature, ordered = experts[first], sorted(experts[first])
    # each expert's tensors mostly come in its first's order: compared as they are before sorted
    same = all(len(t) == len(signature) and (t == signature or sorted(t) == ordered) for t in experts.values())
    return first if same else None


def _format(fmt: WeightFormat, name: str) -> tuple[Any, ...]:
    """A weight's format with its own module's names made relative (scales, companions, outputs)."""
    module = name[: name.rfind(".") + 1]
    return (
        fmt.kind,
        fmt.block,
        fmt.group,
        fmt.shape,
        fmt.row_scales,
        fmt.reason,
        fmt.fix,
        _relative(fmt.scale, module),
        tuple(_relative(c, module) for c in fmt.companions) if fmt.companions else (),
        _relative(fmt.global_scale, module),
        _relative(fmt.shape_tensor, module),
        _relative(fmt.out_name, module),
    )


def _relative(other: str | None, module: str) -> str | None:
    """A name under `module` by the rest of it; any other kept whole (it then differs between experts)."""
    return other[len(module) :] if other is not None and module and other.startswith(module) else other
