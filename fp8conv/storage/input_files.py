"""Opening the input's files without following a link out of the checkpoint, and only regular ones.

A path is walked one component at a time from the containment root, each directory opened with
O_NOFOLLOW relative to the one before it; a symlink met on the way is read (readlink, never its target's
content) and its target resolved by this walk, so that `..` can never climb above the root. The Hub
cache's snapshot -> blob links stay inside the repo's cache folder (models--org--name), the root for a
snapshot; a link into another repo's cache, or anywhere else, is refused before anything is read.
The file itself is opened with O_NOFOLLOW | O_NONBLOCK (a FIFO does not block the open) by the path the
walk found, and kept only if fstat() on the descriptor finds the file the walk checked (same device and
inode): what is read is what was checked.

Later opens by path (the run's readers, another process) compare the opened file's (st_dev, st_ino)
with the one recorded here (`reopen`): a link swapped in since is refused, not followed."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from ..errors import CheckpointError
from .json_file import file_kind

MAX_LINKS = 40  # as the kernel's own limit on links followed in one lookup
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OUTSIDE_FIX = "fp8conv does not follow links out of a checkpoint; copy the file in"


class NotRegular(CheckpointError):
    """A FIFO, a device, a socket or a directory where a file was expected: never read or copied."""


class Outside(CheckpointError):
    """A link whose target lies outside the checkpoint (or is dangling, or loops)."""


def containment_root(root: Path) -> Path:
    """What symlinks may point into: the checkpoint folder, or for a Hugging Face cache snapshot
    (models--org--name/snapshots/<rev>) the repo's cache folder, whose blobs/ the snapshot links to."""
    resolved = root.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith(("models--", "datasets--")):
        return resolved.parent.parent
    return resolved


def plain_relative(name: object) -> bool:
    """A name an index may give: a relative POSIX path inside its root, with no `..`, `.`, empty part,
    backslash or NUL, and valid text."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return False
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def open_beneath(root: Path, rel: str, *, where: dict[str, str]) -> int:
    """A read-only descriptor of the regular file `root/rel`, reached with no link followed out of
    containment_root(root). `where`: how refusals name the file ({"shard": ...} or {"file": ...}).
    FileNotFoundError when it is not there; NotRegular, Outside (CheckpointErrors) otherwise."""
    boundary = containment_root(root)
    below = root.resolve().relative_to(boundary).parts
    return _walk(boundary, [*below, *PurePosixPath(rel).parts], where)


def _walk(boundary: Path, pending: list[str], where: dict[str, str]) -> int:
    stack = [os.open(boundary, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]
    names: list[str] = []  # the directories of `stack` below the boundary, for messages
    links = 0
    try:
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if not names:  # the target as the link spells it, resolved from where it climbs out
                    raise _outside(boundary, [], where, os.path.join("..", *pending))
                os.close(stack.pop())
                names.pop()
                continue
            st = os.stat(part, dir_fd=stack[-1], follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                target = os.readlink(part, dir_fd=stack[-1])
                if links > MAX_LINKS:
                    raise Outside("is a chain of more than 40 symlinks", **where, fix=OUTSIDE_FIX)
                pending[:0] = _link_parts(boundary, names, target, where, stack)
                continue
            if pending:
                stack.append(_open_dir(part, stack[-1], where))
                names.append(part)
                continue
            return _open_file(os.path.join(boundary, *names, part), st, where)
        raise NotRegular("is a directory, not a file", **where, fix="point at the checkpoint's files")
    finally:
        for fd in stack:
            os.close(fd)


def _link_parts(boundary: Path, names: list[str], target: str, where: dict[str, str], stack: list[int]) -> list[str]:
    """The components a link's target adds to the walk. An absolute target is allowed when it names
    a place inside the boundary: the walk then restarts from the boundary."""
    if not target.startswith("/"):
        return target.split("/")
    real = Path(os.path.realpath(target))
    if real != boundary and boundary not in real.parents:
        raise Outside(f"is a symlink to {target}, outside the checkpoint", **where, fix=OUTSIDE_FIX)
    while len(stack) > 1:  # back to the boundary
        os.close(stack.pop())
    names.clear()
    return list(real.relative_to(boundary).parts)


def _outside(boundary: Path, names: list[str], where: dict[str, str], rest: str) -> Outside:
    target = os.path.normpath(os.path.join(boundary, *names, rest))
    return Outside(f"is a symlink to {target}, outside the checkpoint", **where, fix=OUTSIDE_FIX)


def _open_dir(part: str, parent: int, where: dict[str, str]) -> int:
    try:
        return os.open(part, _DIR_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):  # a file, or a link swapped in since the stat
            raise NotRegular(f"has a path through {part!r}, which is not a directory", **where) from exc
        raise


def _open_file(path: str, st: os.stat_result, where: dict[str, str]) -> int:
    """The walk's last component, opened by the path the walk found (no link in it: every part was
    checked, relative to its directory) and kept only if it is the very file that was checked."""
    if not stat.S_ISREG(st.st_mode):  # never opened: opening a device can have effects of its own
        kind = file_kind(st.st_mode)
        raise NotRegular(f"is not a regular file ({kind})", **where, fix="remove it or copy the file in")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # became a link since the walk
            raise Outside("was replaced by a symlink while it was opened", **where, fix=OUTSIDE_FIX) from exc
        raise
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise Outside("changed while it was opened (a link or another file swapped in)", **where, fix=OUTSIDE_FIX)
    return fd


def reopen(path: Path, identity: tuple[int, int] | None, *, where: dict[str, str], flags: int = 0) -> int:
    """`path` opened again (by a reader of the run, or another process): O_NONBLOCK, a regular file, and
    when `identity` is known the very file that was checked (same st_dev and st_ino)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (identity is not None and (st.st_dev, st.st_ino) != identity):
        os.close(fd)
        raise CheckpointError(
            "is no longer the file the plan was made from (replaced while fp8conv ran)",
            **where,
            fix="leave the checkpoint unchanged while it is converted, then convert again",
        )
    return fd


def is_contained_file(root: Path, rel: str) -> str | None:
    """None when `root/rel` is a regular file reached inside the checkpoint, else why it is not (for
    the files copied unchanged, which are skipped with that reason rather than refused)."""
    try:
        os.close(open_beneath(root, rel, where={"file": rel}))
    except Outside:
        return "a symlink out of the checkpoint, not followed"
    except NotRegular as exc:
        return f"{exc.problem.removeprefix('is ')}, not copied"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    return None


def read_contained(root: Path, rel: str, max_bytes: int = 128 << 20) -> bytes:
    """The bytes of a small input file (config.json, to hash it), opened as open_beneath does."""
    from .json_file import read_capped

    where = {"file": rel}
    try:
        fd = open_beneath(root, rel, where=where)
    except OSError as exc:
        raise CheckpointError(f"cannot be read ({exc.strerror or exc})", **where) from exc
    return read_capped(root / rel, label=rel, fix="re-download it", error=CheckpointError, max_bytes=max_bytes, fd=fd)
