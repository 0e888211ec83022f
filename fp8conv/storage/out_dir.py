"""The output directory, opened once: every file is created relative to its descriptor and no link is
followed, so a link planted in OUT (before or during a run) is replaced or refused, never written
through. A directory owner could otherwise make a root run write where the owner cannot.

Names are plain relative paths inside OUT (no "..", no absolute path, no empty part); temporaries
are created with O_EXCL and renamed with os.replace relative to the same directory descriptors.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath

from ..errors import OptionsError, OutputError

# A file being written has a hidden name of its own beside its final one until it is renamed over it
TEMP_SUFFIX = ".fp8conv-partial"


def temp_name(final_name: str) -> str:
    # the pid keeps processes apart (a part retried while another finalizes); which temporaries are live
    # is told by the locks their writers hold (output/leftovers.py), never by this pid
    return f".{final_name}.{os.getpid()}{TEMP_SUFFIX}"


def temp_path(final: Path) -> Path:
    return final.with_name(temp_name(final.name))


def temp_target(temp_name: str) -> str:
    """The final file name a temporary name stands for."""
    return temp_name.removeprefix(".").removesuffix(TEMP_SUFFIX).rsplit(".", 1)[0]


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW | _CLOEXEC


@dataclass
class TempFile:
    """A file being written under a temporary name in one of OUT's directories (dir_fd)."""

    dir_fd: int
    temp: str  # its name in that directory
    final: str  # the name it takes on commit
    fd: int


class OutDir:
    """OUT, held open by a directory descriptor for the whole run."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path  # as the user named it: for messages and for the readers
        self.fd = fd

    @classmethod
    def open(cls, path: Path, *, create: bool = True) -> OutDir:
        """Create OUT (and its parents) when missing, then open it; OUT itself may be a link to a directory
        the user chose, nothing below it may."""
        try:
            if create:
                path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
        except OSError as exc:
            raise _refusal(exc, path) from exc
        return cls(path, fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_dir(self, rel: str | PurePath, *, create: bool = False) -> int:
        """A descriptor of the directory `rel` below OUT ("." or "" for OUT itself), each part opened
        without following a link; created when missing with `create`. The caller closes it."""
        fd = os.dup(self.fd)
        for part in PurePosixPath(rel).parts:
            try:
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                raise self._error(exc, rel) from exc
            os.close(fd)
            fd = child
        return fd

    def create_temp(self, rel: str | PurePath) -> TempFile:
        """A new file beside `rel`'s final name, under a temporary name of this process: a stale one of the
        same name is removed first, the new one created exclusively, so no link is written through."""
        rel = PurePosixPath(rel)
        dir_fd = self.open_dir(rel.parent, create=True)
        temp = temp_name(rel.name)
        try:
            _unlink_at(temp, dir_fd)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
            fd = os.open(temp, flags, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            os.close(dir_fd)
            raise self._error(exc, rel) from exc
        return TempFile(dir_fd, temp, rel.name, fd)

    def commit(self, temp: TempFile) -> None:
        """fsync the temporary and rename it over its final name (a link there is replaced, not followed)."""
        try:
            os.fsync(temp.fd)
            os.close(temp.fd)
            temp.fd = -1
            os.replace(temp.temp, temp.final, src_dir_fd=temp.dir_fd, dst_dir_fd=temp.dir_fd)
            os.fsync(temp.dir_fd)
        except OSError as exc:
            self.abort(temp)
            raise self._error(exc, temp.final) from exc
        os.close(temp.dir_fd)
        temp.dir_fd = -1

    def abort(self, temp: TempFile) -> None:
        if temp.fd >= 0:
            os.close(temp.fd)
            temp.fd = -1
        if temp.dir_fd >= 0:
            _unlink_at(temp.temp, temp.dir_fd)
            os.close(temp.dir_fd)
            temp.dir_fd = -1

    def write_file(self, rel: str | PurePath, data: bytes) -> None:
        """`rel` written whole under a temporary name, fsynced, renamed: it appears complete or not at all."""
        temp = self.create_temp(rel)
        self.fill(temp, data)
        self.commit(temp)

    def fill(self, temp: TempFile, data: bytes) -> None:
        """Write `data` into a temporary (removed when that fails)."""
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(temp.fd, view) :]
        except OSError as exc:
            self.abort(temp)
            raise self._error(exc, temp.final) from exc

    def lstat(self, rel: str | PurePath) -> os.stat_result | None:
        """`rel`'s own status (a link is not followed), or None when it is not there."""
        rel = PurePosixPath(rel)
        try:
            dir_fd = self.open_dir(rel.parent)
        except OutputError as exc:
            if isinstance(exc.__cause__, (FileNotFoundError, NotADirectoryError)):
                return None
            raise
        try:
            return os.stat(rel.name, dir_fd=dir_fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(dir_fd)

    def unlink(self, rel: str | PurePath) -> None:
        """Remove `rel` (a link itself, never its target) when it is there."""
        rel = PurePosixPath(rel)
        try:
            dir_fd = self.open_dir(rel.parent)
        except OutputError:
            return
        try:
            _unlink_at(rel.name, dir_fd)
        finally:
            os.close(dir_fd)

    def names(self, rel: str | PurePath = ".") -> list[str]:
        """The entries of directory `rel` below OUT ([] when it is missing)."""
        try:
            dir_fd = self.open_dir(rel)
        except OutputError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return []
            raise
        try:
            return sorted(os.listdir(dir_fd))
        finally:
            os.close(dir_fd)

    def refuse_links(self) -> None:
        """Refuse, naming it, any entry of OUT that is not a regular file or a directory: a link would be
        kept in the output (and uploaded with it), a device or FIFO is no file fp8conv writes."""
        for rel in self.tree():
            st = self.lstat(rel)
            if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise OutputError(
                    f"output directory {self.path} holds {rel}, {kind}; fp8conv never writes through or keeps one",
                    fix="remove it, or choose an empty output directory",
                )

    def tree(self) -> Iterator[PurePosixPath]:
        """Every entry below OUT, each directory before what it holds (a link to a directory not entered)."""
        return self._walk(PurePosixPath("."))

    def _walk(self, rel: PurePosixPath) -> Iterator[PurePosixPath]:
        for name in self.names(rel):
            child = rel / name
            yield child
            st = self.lstat(child)
            if st is not None and stat.S_ISDIR(st.st_mode):
                yield from self._walk(child)

    def _error(self, exc: OSError, rel: str | PurePath) -> OutputError:
        where = str(rel)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            return OutputError(
                f"{where} in output directory {self.path} is a link or not a directory; fp8conv does not follow it",
                fix="remove it, or choose an empty output directory",
            )
        what = "shard" if where.endswith(".safetensors") else "file"
        return OutputError(f"writing failed: {exc.strerror or exc}", **{what: where}, fix=_fix(exc))


def _fix(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "make the output directory writable, or choose another"
    if exc.errno == errno.ENAMETOOLONG:
        return "choose a shorter output path"
    return "free disk space and retry"


def _refusal(exc: OSError, path: Path) -> OutputError:
    """OUT cannot be made or opened: one line saying why."""
    if os.path.islink(path) and not os.path.exists(path):
        return OutputError(f"output {path} is a dangling symbolic link", fix="remove it, or choose another output")
    return OutputError(f"cannot create the output directory {path}: {exc.strerror or exc}", fix=_fix(exc))


def _unlink_at(name: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def check_output_path(output: str | os.PathLike[str]) -> Path:
    """`-o` names a directory fp8conv can create or use: not empty, not a dangling link or a file, not a
    name too long for the filesystem, writable when it exists. Checked before the long run."""
    text = os.fspath(output)
    if not str(text).strip():
        raise OptionsError("the output directory is an empty name", fix="give -o a directory, e.g. -o ./out")
    path = Path(text)
    for part in path.parts:  # first: asking about a name too long raises instead of answering
        if len(os.fsencode(part)) > _name_max(path):
            raise OptionsError(
                f"output {path}: the name {part[:40]!r}... is too long for the filesystem",
                fix="choose a shorter output path",
            )
    try:
        dangling = path.is_symlink() and not path.exists()
        exists, is_dir = path.exists(), path.is_dir()
    except OSError as exc:
        raise OptionsError(f"output {path} cannot be used: {exc.strerror or exc}", fix="choose another path") from exc
    if dangling:
        raise OptionsError(f"output {path} is a dangling symbolic link", fix="remove it, or choose another output")
    if exists and not is_dir:
        raise OptionsError(f"output {path} exists and is not a directory", fix="choose another path")
    if is_dir and not os.access(path, os.W_OK | os.X_OK):
        raise OptionsError(f"output directory {path} is not writable", fix="make it writable, or choose another")
    return path


def _name_max(path: Path) -> int:
    probe = next((p for p in path.parents if p.exists()), Path("."))
    try:
        return os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
