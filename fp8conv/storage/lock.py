"""One run per output directory: a lock on OUT/.fp8conv/lock, held for the whole run.

flock(2) locks, which the kernel drops when the holder dies, so a lock left by a killed run is stale by
construction: the file is still there (holding the dead run's record) but nobody holds it, and the next
run simply takes it.

- A whole run (`convert` without --part) and `finalize` hold it exclusively.
- A `--part I/N` run holds it shared (the parts of a fan-out run side by side into one OUT) and its own
  `.fp8conv/part-I-of-N.lock` exclusively (one process per part). A whole run and a part therefore
  never write into one OUT at once, nor two processes for one part.
- `convert -j N`: the parent holds it exclusively for the whole run, including finalize; its workers
  are told so (HELD_BY_PARENT_ENV names the parent's pid, checked against os.getppid()) and take only
  their part's lock.

The holder writes its pid, host and start time into the file it locks exclusively, so a refusal names
the holder; the last holder removes the file when it is done, so a finished output holds none.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import time
from pathlib import PurePosixPath

from ..errors import OutputError
from .out_dir import OutDir

LOCK_DIR = PurePosixPath(".fp8conv")
LOCK_NAME = LOCK_DIR / "lock"
HELD_BY_PARENT_ENV = "FP8CONV_LOCK_HELD_BY"  # set by `convert -j N` for its workers: the parent's pid
FINALIZE_LOCK = "finalize.lock"  # held by the part of a fan-out that finalizes, while it does
_PART_LOCK = re.compile(r"part-\d+-of-\d+\.lock")
_FLAGS = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class OutputLock:
    """The locks one process holds on OUT; release() (or the process's end) gives them back."""

    def __init__(self, out: OutDir) -> None:
        self.out = out
        self._held: list[tuple[int, int, str]] = []  # (lock directory fd, lock file fd, its name)

    @classmethod
    def for_run(cls, out: OutDir, part: tuple[int, int] | None, what: str) -> OutputLock:
        """The locks a run needs (see the module's docstring); refused in one line naming the holder."""
        lock = cls(out)
        try:
            if part is None:
                lock._take(LOCK_NAME.name, exclusive=True, what=what)
            else:
                if not held_by_parent():
                    lock._take(LOCK_NAME.name, exclusive=False, what=what)
                lock._take(part_lock_name(part), exclusive=True, what=what)
        except BaseException:
            lock.release()
            raise
        return lock

    @classmethod
    def finalizing(cls, out: OutDir) -> OutputLock:
        """A part's finalize, one at a time: the parts of a fan-out that finish together finalize in
        turn (each finalize writes the same bytes), waiting here; a part that starts meanwhile leaves the
        finalizer's temporaries alone while it is held (lock_held)."""
        lock = cls(out)
        lock._take(FINALIZE_LOCK, exclusive=True, what="finalize", wait=True)
        return lock

    def _take(self, name: str, *, exclusive: bool, what: str, wait: bool = False) -> None:
        dir_fd = self.out.open_dir(LOCK_DIR, create=True)
        try:
            fd = _open_locked(dir_fd, name, exclusive, wait)
        except BaseException:
            os.close(dir_fd)
            raise
        if fd is None:
            holder = _holder(dir_fd, name)
            os.close(dir_fd)
            raise OutputError(
                f"output directory {self.out.path} is in use by another fp8conv run ({holder})",
                fix="wait for it to finish, or write to another output directory",
            )
        if exclusive:
            import socket  # here: only a run that writes needs it

            record = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(), "run": what}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._held.append((dir_fd, fd, name))

    def release(self) -> None:
        """Remove each lock file this process is the last holder of (the output then holds none), then
        unlock by closing it. A run that opened the old file meanwhile sees it gone once it has the lock,
        and opens the new one (_open_locked)."""
        for dir_fd, fd, name in reversed(self._held):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # only when no other part holds it too
                os.unlink(name, dir_fd=dir_fd)
            except OSError:
                pass  # held by another part of the fan-out (or already gone): it stays for them
            os.close(fd)
            os.close(dir_fd)
        self._held.clear()

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_lock_name(name: str) -> bool:
    """A lock file of OUT's lock directory: the run's, a part's of a fan-out, or its finalize's."""
    return name in (LOCK_NAME.name, FINALIZE_LOCK) or _PART_LOCK.fullmatch(name) is not None


def part_lock_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]}-of-{part[1]}.lock"


def lock_held(out: OutDir, name: str) -> bool:
    """Another process holds the lock file `name` (a part's, or finalize's) now: what it writes is live.
    flock, not a pid: a part may run on another machine, and a pid there means nothing here. (Asked of
    a lock this process holds itself, the answer is also True.)"""
    try:
        dir_fd = out.open_dir(LOCK_DIR)
    except OutputError:
        return False  # no lock directory: nobody holds anything
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False  # not there (or not a file of ours): held by nobody
    finally:
        os.close(dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def drop_unheld_locks(out: OutDir) -> None:
    """Remove the part and finalize locks no process holds (a process killed before it let its lock go
    leaves its file): a finalized output holds no lock file. One still held (a part retried meanwhile,
    this process's own) stays; the run's own lock is let go, and removed, by its holder."""
    for name in out.names(LOCK_DIR):
        if name == LOCK_NAME.name or not is_lock_name(name):
            continue
        dir_fd = out.open_dir(LOCK_DIR)
        try:
            fd = _open_locked(dir_fd, name, exclusive=True)
            if fd is not None:
                os.unlink(name, dir_fd=dir_fd)  # under the lock: a part opening it now sees it gone
                os.close(fd)
        finally:
            os.close(dir_fd)


def held_by_parent() -> bool:
    """This process is a worker of `convert -j N`, whose parent holds OUT's lock for it."""
    return os.environ.get(HELD_BY_PARENT_ENV) == str(os.getppid())


def _open_locked(dir_fd: int, name: str, exclusive: bool, wait: bool = False) -> int | None:
    """`name` in the lock directory, locked; None when another process holds it (with `wait`, once it
    lets it go). The file is opened without following a link; a lock file removed and made again
    meanwhile is opened again."""
    while True:
        try:
            fd = os.open(name, _FLAGS, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise OutputError(
                f"cannot open the lock file .fp8conv/{name}: {exc.strerror or exc}"
                + ("; it is a link, which fp8conv does not follow" if exc.errno == errno.ELOOP else ""),
                fix="remove it, or choose another output directory",
            ) from exc
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _holder(dir_fd: int, name: str) -> str:
    """Who holds the lock, from its record (or from the part locks' when the parts of a fan-out hold it)."""
    names = [name, *sorted(n for n in os.listdir(dir_fd) if n.startswith("part-") and n.endswith(".lock"))]
    for candidate in names:
        try:
            fd = os.open(candidate, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0), dir_fd=dir_fd)
        except OSError:
            continue
        try:
            doc = json.loads(os.pread(fd, 4096, 0) or b"null")
        except ValueError:
            doc = None
        finally:
            os.close(fd)
        if isinstance(doc, dict):
            part = f" --part {candidate[5:-5].replace('-of-', '/')}" if candidate != name else ""
            who = f"pid {doc.get('pid')} on {doc.get('host')} since {doc.get('started')}"
            return f"{doc.get('run', 'convert')}{part}, {who}"
    return "its holder left no record"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
