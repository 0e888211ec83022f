"""One exception family. Every error says what is wrong, where (tensor, shard) and what to do."""

from __future__ import annotations


class Fp8ConvError(Exception):
    """Base of every error fp8conv raises on purpose; the CLI turns these into one line and exit 1."""

    def __init__(
        self, problem: str, *, tensor: str | None = None, shard: str | None = None, fix: str | None = None
    ) -> None:
        self.problem = problem
        self.tensor = tensor
        self.shard = shard
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.tensor:
            where.append(f"tensor '{self.tensor}'")
        if self.shard:
            where.append(f"in {self.shard}")
        text = f"{' '.join(where)}: {self.problem}" if where else self.problem
        if self.fix:
            text += f" — {self.fix}"
        return text


class CheckpointError(Fp8ConvError):
    """The input checkpoint is malformed, inconsistent or in a format fp8conv refuses."""


class OptionsError(Fp8ConvError):
    """The options asked for something impossible or unsafe (e.g. output inside the input)."""


class OutputError(Fp8ConvError):
    """Writing the output failed."""


class PlanRefused(CheckpointError):
    """Planning found problems; every one is listed so the user can fix them all in one go."""

    def __init__(self, problems: list[CheckpointError]) -> None:
        self.problems = problems
        first = problems[0]
        more = f" (and {len(problems) - 1} more problem(s); `fp8conv inspect` lists them all)"
        super().__init__(
            first.problem,
            tensor=first.tensor,
            shard=first.shard,
            fix=(first.fix or "") + (more if len(problems) > 1 else ""),
        )
