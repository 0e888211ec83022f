"""No function in fp8conv/ over 60 lines without its reason written beside it: a `# over 60 lines: why`
comment on the line above its `def` (or above its decorators). A marked function that shrank loses its mark."""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 60
MARK = "# over 60 lines:"
PACKAGE = Path(__file__).resolve().parents[1] / "fp8conv"


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _reason(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """The reason written above the def or above its decorators, if any."""
    for line_no in {fn.lineno - 1, min([d.lineno for d in fn.decorator_list] + [fn.lineno]) - 1}:
        text = lines[line_no - 1].strip() if line_no >= 1 else ""
        if text.startswith(MARK):
            return text[len(MARK) :].strip()
    return None


def _survey() -> tuple[list[str], list[str]]:
    """(long functions with no reason, marked functions that are not long)."""
    unexplained, stale = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        for fn in _functions(ast.parse(source)):
            length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
            where = f"{path.relative_to(PACKAGE.parent)}:{fn.lineno} {fn.name} ({length} lines)"
            reason = _reason(lines, fn)
            if length > MAX_LINES and not reason:
                unexplained.append(where)
            elif reason is not None and length <= MAX_LINES:
                stale.append(where)
    return unexplained, stale


def test_every_long_function_says_why():
    unexplained, stale = _survey()
    assert not unexplained, f"no '{MARK} <why>' above the def: split them, or say why: {unexplained}"
    assert not stale, f"marked '{MARK}' but {MAX_LINES} lines or fewer: drop the mark: {stale}"
