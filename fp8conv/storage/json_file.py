"""Read a JSON file that must hold one object: every reader refuses a broken one the same way, in one
line naming the file, what is wrong with it (unreadable, empty, truncated, not JSON, not an object, too
large, nested too deeply, a number too long, a string that is not text) and the fix.

The guards come before the content is trusted: the size from fstat() of the opened file (a FIFO or a
device is refused, never read), the nesting depth and integer length during parsing (Python's json
would raise RecursionError or ValueError, a traceback), and lone surrogates (which no UTF-8 writer
can write back). `parse_json` is the same guard for bytes read elsewhere (safetensors headers)."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, Fp8ConvError

# The largest real index (300k tensors) is ~40 MB; a config.json is a few KB. Refused by fstat() first.
MAX_JSON_BYTES = 128 * 1024 * 1024
# Real configs nest 4 or 5 levels; Python's json recurses once per level.
MAX_JSON_DEPTH = 64
# An int64 has 19 digits; a longer integer is a damaged or hostile file (Python refuses > 4300 digits).
MAX_INT_DIGITS = 24
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]", re.ASCII)
# A digit run longer than MAX_INT_DIGITS, looked for in the bytes with every digit mapped to b"0" and
# every other byte to b" ": a substring search in C, where a regex took 0.25 s over a release's index.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_DIGITS = b"0" * (MAX_INT_DIGITS + 1)
# the containers json builds: the tree walk goes below nothing else
_CONTAINERS = frozenset({dict, list})
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"\s*(:)?|[\[{]|[\]}]', re.DOTALL)


class _LongInteger(Exception):
    def __init__(self, digits: str) -> None:
        self.digits = digits


def read_json_object(
    path: Path,
    *,
    fix: str,
    name: str | None = None,
    error: type[Fp8ConvError] = CheckpointError,
    max_bytes: int = MAX_JSON_BYTES,
    fd: int | None = None,
) -> dict[str, Any]:
    """The object in `path`. `name`: how the message names the file (default its file name); `error`:
    CheckpointError for the input's files, OutputError for those fp8conv wrote. `fd`: the file already
    opened (input_files.open_beneath, with no link followed out of the checkpoint); it is closed here."""
    label = name or path.name
    raw = read_capped(path, label=label, fix=fix, error=error, max_bytes=max_bytes, fd=fd)
    doc = parse_json(raw, label=label, fix=fix, error=error)
    if not isinstance(doc, dict):
        raise error(f"holds a JSON {_json_type(doc)}, not an object", file=label, fix=fix)
    return doc


def read_capped(
    path: Path, *, label: str, fix: str, error: type[Fp8ConvError], max_bytes: int, fd: int | None = None
) -> bytes:
    """The bytes of a regular file of at most `max_bytes`, refused by its fstat() size before reading."""
    try:
        if fd is None:  # O_NONBLOCK: opening a FIFO does not wait for a writer
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise error(f"is not a regular file ({file_kind(st.st_mode)})", file=label, fix=fix)
            if st.st_size > max_bytes:
                raise error(_too_large(st.st_size, max_bytes), file=label, fix=fix)
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise error(f"cannot be read ({exc.strerror or exc})", file=label, fix=fix) from exc
    if len(raw) > max_bytes:  # it grew while read
        raise error(_too_large(len(raw), max_bytes), file=label, fix=fix)
    return raw


def _too_large(size: int, cap: int) -> str:
    return f"is {size} bytes, more than the {cap} a JSON file of a checkpoint may hold"


def file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return kind
    return "not a regular file"


def parse_json(
    raw: bytes,
    *,
    label: str,
    fix: str,
    error: type[Fp8ConvError] = CheckpointError,
    field: str = "file",
    allow_constants: bool = True,
    check_tree: bool = True,
    bound_integers: bool = True,
) -> Any:
    """The JSON value in `raw` (UTF-8; a leading BOM is skipped), every failure one `error` naming
    `label` (as `field`: "file" or "shard") and, where it can, the key. `allow_constants`: NaN and
    Infinity, which Python writes but strict JSON (serde_json, safetensors) refuses. `check_tree`: the
    depth and the strings checked after parsing (a caller that validates a fixed schema does it itself).
    `bound_integers`: an integer over MAX_INT_DIGITS refused by name; a caller whose schema bounds every
    number (safetensors headers: sizes under 2^64) skips the scan for one, 0.6 s over a release's headers."""
    where = {field: label}
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"is not valid JSON (not UTF-8 text: {exc.reason})", **where, fix=fix) from exc
    try:
        # the hooks cost a Python call per number: only where a long digit run or a constant may be
        hooks: dict[str, Any] = {"parse_int": _bounded_int} if bound_integers and _has_long_digits(raw) else {}
        if not allow_constants:
            hooks["parse_constant"] = _no_constant
        doc = json.loads(text, **hooks)
    except _LongInteger as exc:
        key = _key_before(raw, raw.find(exc.digits.encode()))
        raise error(
            f"holds an integer of {len(exc.digits)} digits{_under(key)}; no checkpoint value needs more than "
            f"{MAX_INT_DIGITS}",
            **where,
            fix=fix,
        ) from None
    except RecursionError:
        raise error(_too_deep(raw), **where, fix=fix) from None
    except ValueError as exc:  # JSONDecodeError, and NaN/Infinity where refused
        if isinstance(exc, json.JSONDecodeError):
            raise error(f"is not valid JSON ({exc}){_why(raw, exc)}", **where, fix=fix) from exc
        raise error(f"is not valid JSON ({exc})", **where, fix=fix) from exc
    problem = _check_tree(doc, SURROGATE_ESCAPE.search(raw) is not None) if check_tree else None
    if problem:
        raise error(problem, **where, fix=fix)
    return doc


def _has_long_digits(raw: bytes) -> bool:
    return _LONG_DIGITS in raw.translate(_DIGITS_AS_ZEROS)


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _LongInteger(digits)
    return int(digits)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _under(key: str | None) -> str:
    return f" under key {key!r}" if key is not None else ""


def _key_before(raw: bytes, stop: int) -> str | None:
    """The last object key before byte `stop` (for a message; the document is known to be bad)."""
    key = None
    for m in _TOKEN.finditer(raw, 0, stop if stop >= 0 else len(raw)):
        if m.group(1):
            key = m.group(0)[: m.group(0).rindex(b'"') + 1].decode("utf-8", "replace")[1:-1]
    return key


def _too_deep(raw: bytes) -> str:
    depth, key = 0, None
    for m in _TOKEN.finditer(raw):
        token = m.group(0)
        if m.group(1):
            key = token[: token.rindex(b'"') + 1].decode("utf-8", "replace")[1:-1]
        elif token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                break
        elif token in (b"]", b"}"):
            depth -= 1
    return f"nests arrays or objects more than {MAX_JSON_DEPTH} deep{_under(key)}"


def _check_tree(doc: Any, may_hold_surrogates: bool) -> str | None:
    """The depth limit (json parses deeper than later code can recurse), and strings that are text."""
    stack: list[tuple[Any, int, str | None]] = [(doc, 1, None)]
    while stack:
        value, depth, key = stack.pop()
        if isinstance(value, dict):
            items, values = value.items(), value.values()
        elif isinstance(value, list):
            items, values = ((key, v) for v in value), value
        else:
            if may_hold_surrogates and isinstance(value, str) and not is_text(value):
                return f"holds a string with a lone UTF-16 surrogate{_under(key)}, which is not text"
            continue
        if depth > MAX_JSON_DEPTH:
            return f"nests arrays or objects more than {MAX_JSON_DEPTH} deep{_under(key)}"
        if not may_hold_surrogates and _CONTAINERS.isdisjoint(map(type, values)):
            continue  # nothing below to walk (an index's 200k names), found in C rather than item by item
        for k, v in items:
            if may_hold_surrogates and isinstance(k, str) and not is_text(k):
                return f"holds a key with a lone UTF-16 surrogate ({k!r}), which is not text"
            if isinstance(v, (dict, list)) or may_hold_surrogates:
                stack.append((v, depth + 1, k))
    return None


def is_text(s: str) -> bool:
    """False for a str holding a lone UTF-16 surrogate (JSON's \\ud800 escapes), which is not text."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _why(raw: bytes, exc: json.JSONDecodeError) -> str:
    if not raw.strip():
        return ": the file is empty"
    # the text stops inside the document: it would parse with more text after it
    if exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated string"):
        return ": it ends early, as a truncated file does"
    return ""


def _json_type(doc: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(doc), "number")
