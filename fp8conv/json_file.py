"""Read a JSON file that must hold one object: every reader refuses a broken one the same way, in one
line naming the file, what is wrong with it (unreadable, empty, truncated, not JSON, not an object) and
the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError, Fp8ConvError


def read_json_object(
    path: Path,
    *,
    fix: str,
    name: str | None = None,
    error: type[Fp8ConvError] = CheckpointError,
) -> dict[str, Any]:
    """The object in `path`. `name`: how the message names the file (default its file name); `error`:
    CheckpointError for the input's files, OutputError for those fp8conv wrote."""
    label = name or path.name
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot be read ({exc.strerror or exc})", file=label, fix=fix) from exc
    try:
        doc = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise error(f"is not valid JSON (not UTF-8 text: {exc.reason})", file=label, fix=fix) from exc
    except json.JSONDecodeError as exc:
        raise error(f"is not valid JSON ({exc}){_why(raw, exc)}", file=label, fix=fix) from exc
    if not isinstance(doc, dict):
        raise error(f"holds a JSON {_json_type(doc)}, not an object", file=label, fix=fix)
    return doc


def _why(raw: bytes, exc: json.JSONDecodeError) -> str:
    if not raw.strip():
        return ": the file is empty"
    # the text stops inside the document: it would parse with more text after it
    if exc.pos >= len(exc.doc.rstrip()) or exc.msg.startswith("Unterminated string"):
        return ": it ends early, as a truncated file does"
    return ""


def _json_type(doc: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(doc), "number")
