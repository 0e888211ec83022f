"""One exception family. Every error says what is wrong, where (tensor, shard or file) and what to do."""

from __future__ import annotations

DEBUG_ENV = "FP8CONV_DEBUG"  # the CLI prints a traceback, and every problem of a refusal, when it is "1"


class Fp8ConvError(Exception):
    """Base of every error fp8conv raises on purpose; the CLI turns these into one line and exit 1.

    `shard` names a safetensors shard; `file` any other file (config.json, the index, a manifest), with
    `key` the section of it at fault (e.g. text_config, for a multimodal config's language model)."""

    def __init__(
        self,
        problem: str,
        *,
        tensor: str | None = None,
        shard: str | None = None,
        file: str | None = None,
        key: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.problem = problem
        self.tensor = tensor
        self.shard = shard
        self.file = file
        self.key = key
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = []
        if self.tensor:
            where.append(f"tensor '{self.tensor}'")
        if self.shard:
            where.append(f"in {self.shard}")
        if self.file:
            where.append(f"in {self.file}" + (f" under {self.key}" if self.key else ""))
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
    """Planning found problems; every one is listed so the user can fix them all in one go (`problems`).
    `listed_by` names the command that lists them all: plain `fp8conv inspect` lists the header problems,
    `--scales` adds the scale tensors'. A plan's problems depend on convert's options, which no other
    command takes: the CLI lists those under FP8CONV_DEBUG=1, keeping a refusal to one line otherwise."""

    def __init__(self, problems: list[CheckpointError], *, listed_by: str | None = None) -> None:
        self.problems = problems
        self.listed_by = listed_by
        first = problems[0]
        how = f"`{listed_by}` lists them all" if listed_by else f"set {DEBUG_ENV}=1 to list them all"
        super().__init__(
            first.problem,
            tensor=first.tensor,
            shard=first.shard,
            file=first.file,
            key=first.key,
            fix=(first.fix or "") + (f" (and {len(problems) - 1} more problem(s); {how})" if len(problems) > 1 else ""),
        )
