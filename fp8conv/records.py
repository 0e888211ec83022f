"""The many small frozen records of a release's plan (200k tensors: as many entries, formats, jobs and
specs), made cheaply: copied without __init__, and built with the cyclic collector paused."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

_Record = TypeVar("_Record")
_new = object.__new__


def like(proto: _Record, **changes: Any) -> _Record:
    """`proto` with `changes` (fields it already has), as dataclasses.replace() gives it, for records
    without __post_init__ (nothing there to re-run) whose fields live in __dict__: a frozen dataclass's
    __init__ (one object.__setattr__ per field) costs ten times this copy."""
    kind = type(proto)
    if hasattr(kind, "__post_init__"):  # ShardPlan, ConversionPlan: their __post_init__ must run
        raise TypeError(f"{kind.__name__} has a __post_init__; use dataclasses.replace")
    record = _new(kind)
    fields = record.__dict__
    fields.update(proto.__dict__)
    fields.update(changes)
    return record


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a plan is built, as it was before on the way out. Planning
    makes a million small acyclic records, and each of the collector's full passes walks every one made
    so far: at 200k tensors that was a third of the planning time, freeing nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
