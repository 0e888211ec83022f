"""The many small frozen records of a release's plan (200k tensors: as many entries, formats, jobs and
specs), made cheaply: copied without __init__, and built with the cyclic collector paused."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

_Record = TypeVar("_Record")
_new = object.__new__
_CHECKED: set[type] = set()  # classes copied_as() found without a __post_init__


def like(proto: _Record, **changes: Any) -> _Record:
    """`proto` with `changes` (fields it already has), as dataclasses.replace() gives it (copied_as)."""
    return _copied(type(proto), proto, changes)


def copied_as(kind: type[_Record], proto: Any, **changes: Any) -> _Record:
    """A `kind` holding `proto`'s fields and `changes` (kind: proto's class, or a subclass whose extra
    fields `changes` gives), made without __init__: a frozen dataclass's __init__ (one object.__setattr__
    per field) costs ten times this copy. For records without __post_init__ (nothing there to re-run) whose
    fields live in __dict__."""
    return _copied(kind, proto, changes)


def _copied(kind: type[_Record], proto: Any, changes: dict[str, Any]) -> _Record:
    """Both copies' one body, the changes handed on as the dict they came in (not unpacked again)."""
    if kind not in _CHECKED:
        _check(kind)
    record = _new(kind)
    fields = record.__dict__
    fields.update(proto.__dict__)
    fields.update(changes)
    return record


def _check(kind: type) -> None:
    """Once per class (hasattr() on a class without the attribute raises and catches, a microsecond)."""
    if hasattr(kind, "__post_init__"):  # ShardPlan, ConversionPlan: their __post_init__ must run
        raise TypeError(f"{kind.__name__} has a __post_init__; use dataclasses.replace")
    _CHECKED.add(kind)


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a release's index and plan are built, back on (when it
    was on) on the way out, a failure's too. Planning makes a million small records and JSON containers
    with no reference cycle among them, and each of the collector's full passes walks every one made so
    far: at 200k tensors that was a third of opening the index and of choosing the strategies, freeing
    nothing. Nested pauses are one pause: the inner one finds the collector off and leaves it so.

    What was built lives on: freeze() then unfreeze() moves it straight to the oldest generation (two
    list splices), where the young collections that follow would walk all of it twice (0.06 s at 200k
    tensors). Not when a caller has frozen objects of its own: unfreeze() would thaw them too."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()
            gc.unfreeze()
        gc.enable()
