"""What an interrupted fp8conv process leaves in OUT of its own, told apart from everything else.

A run killed at any moment leaves, besides what it finished, only its bookkeeping: the lock files in
.fp8conv (the kernel dropped their locks with the process) and temporaries (`.NAME.PID.fp8conv-partial`,
beside the file they were to become, in OUT, .fp8conv or a copied file's folder). Before its manifest is
saved that is all it has written, so an OUT holding nothing else is an interrupted run's, which --resume
starts afresh; anything else there is not fp8conv's, and stays refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import PurePosixPath

from ..storage.lock import FINALIZE_LOCK, LOCK_DIR, is_lock_name, lock_held, part_lock_name
from ..storage.out_dir import TEMP_SUFFIX, OutDir, temp_target

_PART_RECORD = re.compile(r"part-(\d+)-of-(\d+)\.json")


def is_temporary(name: str) -> bool:
    """A file fp8conv was writing under a temporary name (out_dir.temp_name)."""
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def first_foreign_entry(within: OutDir) -> PurePosixPath | None:
    """The first entry of OUT that is not an interrupted run's bookkeeping (its lock directory with lock
    files and temporaries, temporaries at the top), or None when OUT holds nothing else."""
    for name in within.names():
        if name == LOCK_DIR.name:
            for inner in within.names(LOCK_DIR):
                if not (is_lock_name(inner) or is_temporary(inner)):
                    return LOCK_DIR / inner
        elif not is_temporary(name):
            return PurePosixPath(name)
    return None


def temp_part(rel: PurePosixPath, shard_parts: Mapping[str, int]) -> int | None:
    """The part of a fan-out a temporary is of, by what it was to become: that part's record, or one of
    its shards (`shard_parts`: shard name -> part); None for what a finalize writes (the copies, the
    manifest, the index and config)."""
    target = temp_target(rel.name)
    if rel.parent == LOCK_DIR and (m := _PART_RECORD.fullmatch(target)):
        return int(m.group(1))
    if rel.parent == PurePosixPath("."):
        return shard_parts.get(target)
    return None


def live_temporary(
    within: OutDir, rel: PurePosixPath, shard_parts: Mapping[str, int], part: tuple[int, int], finalizing: bool
) -> bool:
    """Whether a temporary may be being written now by another process of the fan-out that `part` is of:
    one of another part that holds its lock (one process per part: this part's own are a killed
    attempt's), or finalize's while another part finalizes (`finalizing`: this one does, alone).
    Locks, not pids: the parts may run on other machines, and a pid there means nothing here."""
    owner = temp_part(rel, shard_parts)
    if owner is None:
        return not finalizing and lock_held(within, FINALIZE_LOCK)
    return owner != part[0] and lock_held(within, part_lock_name((owner, part[1])))


def remove_temporaries(within: OutDir, removable: Callable[[PurePosixPath], bool]) -> None:
    """Remove every temporary anywhere in OUT for which `removable` says so (a part of a fan-out spares
    those of processes still writing them); each is removed itself, a link never followed."""
    for rel in list(within.tree()):
        if is_temporary(rel.name) and removable(rel):
            within.unlink(rel)
