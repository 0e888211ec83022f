"""A release's ignore list (modules_to_not_convert / ignored_layers / ignore / exclude_modules), compiled once.

Releases list every module they leave unquantized: hundreds to thousands of entries. An entry is one of
- `re:<regex>` (compressed-tensors): the regex matched at the start of the module name (`re.match`, as
  compressed-tensors' `match_name` and vLLM's `_is_equal_or_regex_match` do);
- a shell wildcard (`*`, `?`, `[`: ModelOpt's exclude_modules): fnmatch over the whole module name, or
  over a parent module's (`pattern.*`), as vLLM's ModelOpt reader turns `module*` into both;
- a plain name: that module exactly, any module under it (`name.` prefix: the whole subtree, as
  transformers' `should_convert_module` does) or any module it ends (`.name` suffix: "lm_head" names
  "model.lm_head"), at dot boundaries only ("layers.1" never reaches "layers.10").

Plain names are looked up in a set by every dot-prefix and dot-suffix of the module (a dozen lookups,
whatever the list's length); wildcards are grouped by the parent module their literal prefix names, so a
module only tries the groups along its own path, each one compiled alternation; regexes are one
alternation. A regex that could backtrack without bound is refused instead (`unsafe_regex`).
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

try:  # the parser re compiles with: Python 3.11 names it re._parser, earlier ones sre_parse
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]

REGEX_PREFIX = "re:"
# A regex's literal run this long picks the modules it is tried on (a shorter one would pick most of them)
MIN_LITERAL = 3
WILDCARDS = "*?["
# More unbounded repeats than this make matching polynomial of that degree in the name's length
MAX_UNBOUNDED_REPEATS = 3
_REPEATS = ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
_BACKREFERENCES = ("GROUPREF", "GROUPREF_EXISTS")


def is_regex(entry: str) -> bool:
    return entry.startswith(REGEX_PREFIX)


def is_wildcard(entry: str) -> bool:
    return not is_regex(entry) and any(c in entry for c in WILDCARDS)


def unsafe_regex(pattern: str) -> str | None:
    """Why matching `pattern` could take time exponential (or of a high degree) in the name's length, or
    why it is not a regex at all; None when it is safe. Judged on the parsed pattern, never by running it."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError) as exc:
        return f"is not a valid regular expression ({exc})"
    unbounded: list[int] = []
    reason = _unsafe_in(list(parsed), inside_repeat=False, unbounded=unbounded)
    if reason is None and len(unbounded) > MAX_UNBOUNDED_REPEATS:
        reason = (
            f"repeats without bound {len(unbounded)} times (more than {MAX_UNBOUNDED_REPEATS} make matching "
            "slow as a power of the name's length)"
        )
    return reason


def _unsafe_in(items: list, inside_repeat: bool, unbounded: list[int]) -> str | None:
    """Walk the parsed pattern: a repeat inside a repeat, an alternation inside a repeat (both backtrack
    exponentially: `(a+)+$`, `(a|a)*$`) and backreferences are unsafe."""
    for op, av in items:
        name = str(op)
        if name in _BACKREFERENCES:
            return "uses a backreference, which no regex engine matches without backtracking"
        if name in _REPEATS:
            low, high, body = av
            repeats = high is sre_parse.MAXREPEAT or high > 1
            if repeats and inside_repeat:
                return "repeats a group that itself repeats (catastrophic backtracking, as in (a+)+)"
            if high is sre_parse.MAXREPEAT:
                unbounded.append(low)
            reason = _unsafe_in(list(body), inside_repeat or repeats, unbounded)
        elif name == "BRANCH":
            if inside_repeat:
                return "repeats an alternation (catastrophic backtracking, as in (a|a)*)"
            reason = _first(_unsafe_in(list(b), inside_repeat, unbounded) for b in av[1])
        elif name == "SUBPATTERN":
            reason = _unsafe_in(list(av[-1]), inside_repeat, unbounded)
        elif name in ("ASSERT", "ASSERT_NOT"):
            reason = _unsafe_in(list(av[1]), inside_repeat, unbounded)
        elif name == "ATOMIC_GROUP":
            reason = _unsafe_in(list(av), inside_repeat, unbounded)
        else:
            reason = None
        if reason is not None:
            return reason
    return None


def required_literal(pattern: str) -> str:
    """The longest run of literal characters at the top level of `pattern`: re.match meets the top level's
    items in order, so every name it matches holds that run ("" when there is none, or the pattern ignores
    case). prime() tries such a regex only on the modules holding its run."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return ""
    if parsed.state.flags & (re.IGNORECASE | re.LOCALE):
        return ""
    best = run = ""
    for op, av in parsed:
        run = run + chr(av) if str(op) == "LITERAL" else ""
        best = run if len(run) > len(best) else best
    return best


def _first(reasons: Iterable[str | None]) -> str | None:
    return next((r for r in reasons if r is not None), None)


def _literal_parent(pattern: str) -> str:
    """The parent module a wildcard's literal prefix names ("model.layers.0.mlp*" -> "model.layers.0"):
    every module it matches lies under it; "" when the prefix names none."""
    cut = min((i for i in (pattern.find(c) for c in WILDCARDS) if i >= 0), default=len(pattern))
    return pattern[:cut].rpartition(".")[0]


def _alternation(regexes: list[str]) -> list[re.Pattern[str]]:
    """One compiled alternation of `regexes` when they combine (fnmatch's named groups are numbered apart),
    else each compiled alone: the answer is the same, any() of re.match."""
    if not regexes:
        return []
    try:
        return [re.compile("|".join(f"(?:{r})" for r in regexes))]
    except re.error:
        return [re.compile(r) for r in regexes]


@dataclass
class IgnoreList:
    """An ignore list compiled once; `matches(module)` in time independent of the list's length."""

    entries: list[str]
    refused: dict[str, str] = field(default_factory=dict)  # `re:` entry -> why it is not matched
    _names: frozenset[str] = frozenset()
    _root: list[re.Pattern[str]] = field(default_factory=list)  # regexes and wildcards under no parent
    # prime()'s split of them: regexes with a literal run every match holds (run, regex), and the rest
    _literal: list[tuple[str, re.Pattern[str]]] = field(default_factory=list)
    _root_rest: list[re.Pattern[str]] = field(default_factory=list)
    _by_parent: dict[str, list[re.Pattern[str]]] = field(default_factory=dict)
    _memo: dict[str, bool] = field(default_factory=dict)
    _primed: _Modules | None = None  # the checkpoint's modules, answered all at once (prime)
    _hits: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        names, root, by_parent, rest = set(), [], {}, []
        for entry in self.entries:
            if is_regex(entry):
                pattern = entry[len(REGEX_PREFIX) :]
                reason = unsafe_regex(pattern)
                if reason is not None:
                    self.refused[entry] = reason
                    continue
                root.append(pattern)
                literal = required_literal(pattern)
                if len(literal) >= MIN_LITERAL:
                    self._literal.append((literal, re.compile(pattern)))
                else:
                    rest.append(pattern)
            elif is_wildcard(entry):
                group = root if not _literal_parent(entry) else by_parent.setdefault(_literal_parent(entry), [])
                group += [fnmatch.translate(entry), fnmatch.translate(entry + ".*")]
                rest += group[-2:] if group is root else []
            else:
                names.add(entry)
        self._names = frozenset(names)
        self._root = _alternation(root)
        self._root_rest = _alternation(rest)
        self._by_parent = {parent: _alternation(group) for parent, group in by_parent.items()}

    def prime(self, modules: Iterable[str]) -> None:
        """Answer `matches` for every one of `modules` (a checkpoint's: 200k) in one pass from the entries'
        side, by the rules matches() applies: each plain name's exact module, its subtree and the modules
        it ends found by bisection in sorted lists, each wildcard group tried on its parent's subtree only,
        a regex with a literal run (required_literal) on the modules holding it, the rest on every module.
        unmatched() then reuses the sorted lists."""
        found = _Modules(modules)
        hits: set[str] = set()
        for name in self._names:
            hits.update(found.named(name))
        for parent, group in self._by_parent.items():
            hits.update(_matching(group, found.under(parent)))
        hits.update(_matching(self._root_rest, found.forward))
        for literal, pattern in self._literal:  # 300 `re:` entries once cost 6 s over 95k modules
            hits.update(filter(pattern.match, found.containing(literal)))
        self._primed, self._hits = found, frozenset(hits)

    def matches(self, module: str) -> bool:
        if self._primed is not None and module in self._primed.exact:
            return module in self._hits
        found = self._memo.get(module)
        if found is None:
            found = self._memo[module] = self._plain(module) or self._patterned(module)
        return found

    def _plain(self, module: str) -> bool:
        """An entry equal to the module, to a parent of it (dot-prefix) or to a dot-suffix of it."""
        names = self._names
        if not names:
            return False
        if module in names:
            return True
        dot = module.find(".")
        while dot != -1:
            if module[:dot] in names or module[dot + 1 :] in names:
                return True
            dot = module.find(".", dot + 1)
        return False

    def _patterned(self, module: str) -> bool:
        if any(p.match(module) for p in self._root):
            return True
        if not self._by_parent:
            return False
        dot = module.find(".")
        while dot != -1:
            group = self._by_parent.get(module[:dot])
            if group and any(p.match(module) for p in group):
                return True
            dot = module.find(".", dot + 1)
        return False

    def matched(self) -> frozenset[str]:
        """The modules prime() found listed (none before it ran)."""
        return self._hits

    def unmatched(self, modules: Iterable[str]) -> list[str]:
        """The entries (refused ones aside) that match none of `modules`, in list order. Asked of the
        modules prime() had, each entry is tried on the ones it found listed only: every module an entry
        matches is among them, so a regex no longer scans 200k names to find it has no match."""
        primed = self._primed
        # the very set prime() had is not compared again
        if primed is None or not (primed.given is modules or primed.exact == _as_set(modules)):
            found = _Modules(modules)
        else:
            found = _Modules(self._hits)
        return [e for e in dict.fromkeys(self.entries) if e not in self.refused and not found.has_match(e)]


def _as_set(modules: Iterable[str]) -> set[str] | frozenset[str]:
    return modules if isinstance(modules, (set, frozenset)) else set(modules)


class _Modules:
    """Module names sorted forwards and reversed: "is there a module under X / ending in .X" by bisection."""

    def __init__(self, modules: Iterable[str]) -> None:
        self.given = modules
        self.exact = set(modules)
        self.forward = sorted(self.exact)
        self.backward = sorted(m[::-1] for m in self.exact)
        self._joined: str | None = None  # forward, one per line, searched for literals (containing)
        self._starts: list[int] = []

    def containing(self, literal: str) -> list[str]:
        """The modules holding `literal` (no newline in it), found by str.find over all of them joined."""
        if self._joined is None:
            self._joined = "\n".join(self.forward)
            self._starts = list(itertools.accumulate((len(m) + 1 for m in self.forward[:-1]), initial=0))
        joined, starts, found = self._joined, self._starts, []
        at = joined.find(literal)
        while at != -1:
            i = bisect.bisect_right(starts, at) - 1
            found.append(self.forward[i])
            at = joined.find(literal, starts[i] + len(self.forward[i]) + 1)  # on from the next module
        return found

    def has_match(self, entry: str) -> bool:
        if is_regex(entry):
            pattern = re.compile(entry[len(REGEX_PREFIX) :])
            return any(map(pattern.match, self.forward))
        if is_wildcard(entry):  # fnmatchcase(m, entry) or fnmatchcase(m, entry + ".*"), each run in C
            under = self.under(_literal_parent(entry))
            return any(any(map(re.compile(fnmatch.translate(p)).match, under)) for p in (entry, entry + ".*"))
        return (
            entry in self.exact
            or _has_prefix(self.forward, entry + ".")
            or _has_prefix(self.backward, ("." + entry)[::-1])
        )

    def named(self, entry: str) -> list[str]:
        """The modules a plain entry names: itself, every module under it, every module ending in .entry."""
        exact = [entry] if entry in self.exact else []
        below = self.under(entry) if entry else [m for m in self.forward if m.startswith(".")]
        tail = ("." + entry)[::-1]
        start = bisect.bisect_left(self.backward, tail)
        end = bisect.bisect_left(self.backward, tail[:-1] + "/")  # "/" sorts right after "."
        return exact + below + [m[::-1] for m in self.backward[start:end]]

    def under(self, parent: str) -> list[str]:
        """Every module below `parent` (all of them when it is "")."""
        if not parent:
            return self.forward
        start = bisect.bisect_left(self.forward, parent + ".")
        end = bisect.bisect_left(self.forward, parent + "/")  # "/" sorts right after "."
        return self.forward[start:end]


def _matching(patterns: list[re.Pattern[str]], modules: list[str]) -> list[str]:
    """The modules any of `patterns` matches at the start, each pattern run over the list in C."""
    found: list[str] = []
    for pattern in patterns:
        found += filter(pattern.match, modules)
    return found


def _has_prefix(ordered: list[str], prefix: str) -> bool:
    i = bisect.bisect_left(ordered, prefix)
    return i < len(ordered) and ordered[i].startswith(prefix)
