"""`convert -j N`'s worker processes: how they are started and tied to their parent.

- Nothing from the working directory (often the checkpoint itself) or the environment's Python paths
  can be imported into a worker: each runs as `python -I -m fp8conv part-worker JOB` with the parent's
  absolute interpreter (-I: no working directory or script directory on sys.path, no PYTHON*
  variables, no user site; the installed fp8conv, editable or not, is found in site-packages).
- A worker dies with its parent: it asks the kernel for SIGKILL when the parent goes (PR_SET_PDEATHSIG)
  and checks that the parent is still the one that started it (the parent may have died first).
- The parent holds OUT's lock for the whole run and says so in HELD_BY_PARENT_ENV (see lock.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click

from ..errors import OutputError
from ..options import ConvertOptions, RunOptions
from ..run.prepare import check_locked_output, check_output_empty
from ..storage.lock import HELD_BY_PARENT_ENV, LOCK_DIR, OutputLock
from ..storage.out_dir import OutDir, check_output_path

WORKER_COMMAND = "part-worker"
_PR_SET_PDEATHSIG = 1


def start_worker(job: str) -> subprocess.Popen[str]:
    """One worker for `job` (the JSON the CLI writes), its stderr captured for the one-line report."""
    env = {**os.environ, HELD_BY_PARENT_ENV: str(os.getpid())}
    return subprocess.Popen(
        [os.path.abspath(sys.executable), "-I", "-m", "fp8conv", WORKER_COMMAND, job],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        close_fds=True,
    )


def bind_to_parent() -> None:
    """In a worker: die with the parent that started it (or refuse to start when it is gone)."""
    expected = os.environ.get(HELD_BY_PARENT_ENV)
    if sys.platform.startswith("linux"):
        import ctypes  # here: only a worker needs it
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if expected is None or str(os.getppid()) != expected:  # the parent died before the prctl
        raise OutputError(
            "this part worker's parent (fp8conv convert -j) is gone", fix="run fp8conv convert -j N --resume again"
        )


def failure_line(stderr: str, part: tuple[int, int], status: int) -> str:
    """A failed worker's report in one line: its own `error: ...` line, else what it last said."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    own = [line for line in lines if line.startswith("error: ")]
    if own:
        return own[0]
    how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
    last = f": {lines[-1].strip()}" if lines else ""
    return f"error: the worker for part {part[0]}/{part[1]} {how}{last}"


def run_workers(
    checkpoint: str, output: str, options: ConvertOptions, parts: list[RunOptions], threads: int, quiet: bool
) -> None:
    """-j N: N processes, one part each; the last to finish finalizes. One line for the first failure.

    Each is a fresh `python -I -m fp8conv part-worker JOB` (workers.py: nothing importable from the
    working directory, dies with this process), JOB the two values as JSON (the manifest's own record of
    ConvertOptions): an option added to either value reaches the workers with no code here. This
    process holds OUT's lock for the whole run; the workers lock only their own parts."""
    out = check_output_path(output)
    if not (parts[0].overwrite or parts[0].resume):
        check_output_empty(out)
    started = time.monotonic()
    made = not out.exists()
    with OutDir.open(out) as within, OutputLock.for_run(within, None, f"convert -j {len(parts)}"):
        check_locked_output(within, parts[0].overwrite or parts[0].resume)
        jobs = [(run.part, start_worker(worker_job(checkpoint, output, options, run, threads))) for run in parts]
        errors = []
        for part, proc in jobs:
            stderr = proc.communicate()[1]
            if proc.returncode != 0 and part is not None:
                errors.append(failure_line(stderr, part, proc.returncode))
    if errors:
        if made:  # refused before anything was written: leave no directory behind
            remove_if_empty(out)
        click.echo(errors[0], err=True)
        sys.exit(1)
    if not quiet:
        click.echo(f"wrote {output} with {len(parts)} worker processes in {time.monotonic() - started:.1f} s")


def remove_if_empty(out: Path) -> None:
    """OUT as -j's parent made it, with nothing in it but the (now removed) lock's directory: removed again."""
    lock_dir = out / LOCK_DIR
    if [p.name for p in out.iterdir()] == [LOCK_DIR.name] and not any(lock_dir.iterdir()):
        lock_dir.rmdir()
        out.rmdir()


def worker_job(checkpoint: str, output: str, options: ConvertOptions, run: RunOptions, threads: int) -> str:
    doc = {"source": checkpoint, "output": output, "options": options.to_dict(), "run": run.to_dict()}
    return json.dumps(doc | {"threads": threads})
