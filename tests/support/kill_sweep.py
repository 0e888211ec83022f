"""Kill a real fp8conv command at every moment it changes its output directory, then retry it.

Run as `python -m tests.support.kill_sweep SPEC` (SPEC: a JSON object, see `main`) from the checkout; it
prints one JSON line per moment. The sweeper imports fp8conv and torch once and forks each command from
that state: a forked child starts in milliseconds where a fresh interpreter takes seconds, so every
moment of a run fits in the suite's time. The sweeper itself converts nothing, so it forks from a
process whose torch has started no thread pool.

A moment is a call that changes OUT, seen by an audit hook (sys.addaudithook) before the call is made:
opening a file for writing or creating it, mkdir, rename/replace, unlink, rmdir, ftruncate, and the start
of a `-j` worker. The child counts them and is killed with SIGKILL just before the n-th, so the state left
is exactly the one after the (n-1)-th; n runs from 1 until the command finishes without reaching it.

`-j N` starts real worker processes (`python -I -m fp8conv part-worker`). The forked parent names
kill_worker.sh as its interpreter, which arms worker 1 the same way (KILL_AT_ENV): killed at its n-th
change, the worker takes its whole run down with it, as a scheduler's kill does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_CHANGES = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.truncate", "os.link", "os.symlink", "os.utime"}
_PR_SET_CHILD_SUBREAPER = 36
# "PART N KILL OUT REPORT": -j's worker of PART kills at its n-th change (kill_worker.sh, arm_worker)
KILL_AT_ENV = "KILL_SWEEP_AT"
WORKER_WRAPPER = Path(__file__).with_name("kill_worker.sh")


def describe_change(event: str, args: tuple[Any, ...], out: str) -> str | None:
    """The change an audit event makes to OUT, in words, or None when it changes nothing there."""
    if event == "subprocess.Popen":  # a -j worker's start (not a helper a library runs)
        argv = [str(a) for a in args[1]]
        return f"start a part-worker: {argv[-1][-80:]}" if "part-worker" in argv else None
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(flags, int) and flags & _WRITE_FLAGS) or (
            isinstance(mode, str) and any(c in mode for c in "wax+")
        )
        return f"open {path}" if writes and _in_out(path, out) else None
    if event not in _CHANGES:
        return None
    if isinstance(args[0], int):  # ftruncate of a file fp8conv has open: in OUT (the input is never written)
        return f"{event} fd {args[0]} to {args[1]}"
    paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
    return f"{event} {' -> '.join(map(str, paths))}" if all(_in_out(p, out) for p in paths) else None


def _in_out(path: object, out: str) -> bool:
    """Paths fp8conv writes: relative to a descriptor of OUT (every file in it), or OUT and its parents."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    if "__pycache__" in text or text.startswith("/proc/"):
        return False
    return not os.path.isabs(text) or text == out or text.startswith(out + os.sep) or out.startswith(text + os.sep)


def _note(report: str, line: str) -> None:
    fd = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # outside OUT: not a change
    os.write(fd, line.encode(errors="replace") + b"\n")
    os.close(fd)


def arm(out: str, at: int, report: str, kill: str = "self", parent: int | None = None) -> None:
    """Just before this process's `at`-th change to OUT, write what that change is into the file `report`
    and kill: "self" (this process), "group" (its process group: a scheduler's kill of the job) or
    "parent" (the -j parent alone, whose workers must die with it). At -1, every change is written and
    nothing killed. `parent`: a -j worker's parent; a change made once it is gone is written as an
    orphan's (a worker outliving its parent), and the worker stops there."""
    counter = itertools.count(1)
    part = os.environ.get(KILL_AT_ENV, "").split(" ", 1)[0]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in _CHANGES and event not in ("open", "subprocess.Popen"):
            return
        what = describe_change(event, args, out)
        if what is None:
            return
        if parent is not None and os.getppid() != parent:
            _note(report, f"orphan: the worker of part {part} changed OUT after its parent died: {what}")
            os._exit(1)
        if at == -1:
            _note(report, what)
        elif next(counter) == at:
            _note(report, what)
            if kill == "parent":
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(5)  # the kernel's SIGKILL for a dead parent's child (PR_SET_PDEATHSIG) ends this
                _note(report, f"orphan: the worker of part {part} outlived its parent by 5 s")
                os._exit(1)
            if kill == "group":
                os.killpg(0, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)


def _run_cli(args: list[str], log: Path) -> int:
    """fp8conv's CLI in this (forked) process, its output into `log`; the exit status."""
    from fp8conv.cli.commands import main

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        main.main(args=args, prog_name="fp8conv", standalone_mode=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def fork_cli(
    args: list[str], log: Path, out: str | None = None, at: int = 0, worker: int = 0, kill: str = "self"
) -> tuple[int, str]:
    """Run the CLI in a forked child of its own process group, killed before its `at`-th change to `out`
    (with `worker`, before that -j worker's, as `kill` says); its -j workers are watched for outliving
    it. Its status (-9 for SIGKILL) and what the report holds: the moment, then any orphan's line."""
    report = log.with_suffix(".moment")
    report.unlink(missing_ok=True)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.setpgid(0, 0)  # a kill of the group ends the workers too
        status = 1
        try:
            if out is not None:  # -j starts its workers through the wrapper, which arms them
                os.environ[KILL_AT_ENV] = f"{worker} {at if worker else 0} {kill} {out} {report}"
                os.environ["KILL_SWEEP_PYTHON"] = sys.executable
                os.environ["KILL_SWEEP_REPO"] = str(Path(__file__).resolve().parents[2])
                sys.executable = str(WORKER_WRAPPER)
            if at and not worker and out is not None:
                arm(out, at, str(report))
            status = _run_cli(args, log)
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    moment = report.read_text() if report.exists() else ""
    return (-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)), moment


def snapshot(path: Path) -> dict[str, str]:
    """Every file below `path` (links and special files included, by kind) -> its sha256."""
    found = {}
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(path).as_posix()
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            found[rel] = "not a regular file"
        elif p.is_file():
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def differences(got: dict[str, str], want: dict[str, str]) -> list[str]:
    missing = [f"missing {k}" for k in sorted(want) if k not in got]
    extra = [f"extra {k}" for k in sorted(got) if k not in want]
    changed = [f"differs {k}" for k in sorted(want) if k in got and got[k] != want[k]]
    return missing + extra + changed


def survivors() -> list[int]:
    """Processes whose parent is this sweeper (a child subreaper: a killed parent's workers come here)."""
    alive = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def wait_for_no_survivors(seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        reap()
        left = survivors()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _step(step: list[str] | dict[str, Any]) -> dict[str, Any]:
    return step if isinstance(step, dict) else {"args": step}


def _compare(out: Path, want: dict[str, str], ignore: re.Pattern[str]) -> list[str]:
    got = {k: v for k, v in snapshot(out).items() if not ignore.fullmatch(k)}
    return differences(got, {k: v for k, v in want.items() if not ignore.fullmatch(k)})


def _retry(spec: dict[str, Any], out: Path, work: Path, at: int, result: dict[str, Any]) -> None:
    """The retries in order, each compared with the uninterrupted output where it should finish it. A
    step may fail with the message it names ("may_fail"), e.g. finalize before the killed part is done."""
    want = json.loads(Path(spec["reference"]).read_text())
    ignore = re.compile(spec.get("ignore", "(?!)"))
    steps = [_step(s) for s in spec["retries"]]
    for n, step in enumerate(steps):
        log = work / f"retry-{at}-{n}.log"
        code, _ = fork_cli(step["args"], log)
        result["retries"].append(code)
        if code != 0:
            said = log.read_text()
            if step.get("may_fail") and step["may_fail"] in said:
                continue
            result["error"] = said[-2000:]
            return
        if step.get("compare") or n == len(steps) - 1:
            result["differences"] += [f"after retry {n}: {d}" for d in _compare(out, want, ignore)]


def _first_and_renames(spec: dict[str, Any], work: Path, out: Path, template: Path) -> list[int]:
    """The moments of an uninterrupted run at which a name first appears in OUT (a directory, a lock, a
    temporary of each file) or a file is renamed into place: the kills that leave a different kind of
    state, for commands whose moments cost seconds each (-j starts fresh interpreters)."""
    if template.exists():
        shutil.copytree(template, out, symlinks=True)
    code, changes = fork_cli(spec["command"], work / "record.log", str(out), -1, spec.get("worker", 0), "self")
    assert code == 0, (work / "record.log").read_text()
    shutil.rmtree(out)
    seen: set[str] = set()
    chosen = []
    for at, change in enumerate(changes.splitlines(), 1):
        kind = re.sub(r"\.\d+\.fp8conv-partial", ".PID.fp8conv-partial", change)
        if (kind.startswith(("open ", "os.mkdir ")) and kind not in seen) or kind.startswith("os.rename "):
            chosen.append(at)
        seen.add(kind)
    return chosen


def sweep(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """For n = 1, 2, ...: OUT as the prepared steps left it, the command killed before its n-th change
    (its own, or worker 1's under -j with "worker"), the retries, the comparison."""
    work = Path(spec["work"])
    out = work / "out"
    template = work / "prepared"
    for stale in (template, out):
        if stale.exists():
            shutil.rmtree(stale)
    for step in spec.get("prepare", []):  # once: each moment starts from a copy of what they leave
        if isinstance(step, dict):
            for rel in step["remove"]:
                (out / rel).unlink()
            continue
        code, _ = fork_cli(step, work / "prepare.log")
        assert code == 0, (step, (work / "prepare.log").read_text())
    if out.exists():
        out.rename(template)
    moments = spec.get("moments") or itertools.count(1)
    if moments == "first-and-renames":
        moments = _first_and_renames(spec, work, out, template)
    for at in moments:
        if out.exists():
            shutil.rmtree(out)
        if template.exists():
            shutil.copytree(template, out, symlinks=True)
        worker, kill = spec.get("worker", 0), spec.get("kill", "self")
        code, _ = fork_cli(spec["command"], work / f"kill-{at}.log", str(out), at, worker, kill)
        if code == 0:  # finished before its at-th change: every moment was swept
            yield {"at": at, "finished": True}
            return
        left = wait_for_no_survivors(spec.get("survivor_seconds", 30))
        report = work / f"kill-{at}.moment"  # read once the workers are gone: an orphan writes here too
        lines = report.read_text().splitlines() if report.exists() else []
        moment, orphans = (lines[0] if lines else ""), [line for line in lines if line.startswith("orphan: ")]
        result: dict[str, Any] = {
            "at": at,
            "moment": moment,
            "status": code,
            "survivors": len(left),
            "orphans": orphans,
        }
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        reap()
        result |= {"retries": [], "differences": []}
        _retry(spec, out, work, at, result)
        yield result
    if spec.get("moments") == "first-and-renames":  # its recording ran the command to the end
        yield {"at": None, "finished": True}


def main() -> None:
    """SPEC: {"work": a directory whose "out" the commands write, "reference": a JSON file of snapshot()
    of the uninterrupted output, "command": CLI args, "retries": CLI args (or {"args", "may_fail",
    "compare"}) run in order after the kill, "prepare": CLI args or {"remove": [paths in OUT]} run once
    before the sweep, "ignore": a regex of paths the comparison leaves out, "worker": under -j, the part
    whose worker kills, "kill": what it kills ("group" or "parent"; see arm), "moments": the moments
    to kill at (default: every one; "first-and-renames": those _first_and_renames picks)}."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # a worker a killed parent leaves becomes ours to see
    import torch  # noqa: F401  # loaded once here, before any fork

    import fp8conv.cli.commands
    import fp8conv.run.convert  # noqa: F401

    for result in sweep(json.loads(sys.argv[1])):
        print(json.dumps(result), flush=True)


def arm_worker() -> None:
    """In a -j worker started through kill_worker.sh: every worker is watched for outliving its parent;
    the one of the part KILL_AT_ENV names is armed to kill at its moment."""
    part, at, kill, out, report = os.environ[KILL_AT_ENV].split(" ", 4)
    mine = json.loads(sys.argv[-1])["run"]["part"][0] == int(part)
    arm(out, int(at) if mine else 0, report, kill, parent=os.getppid())


if __name__ == "__main__":
    main()
