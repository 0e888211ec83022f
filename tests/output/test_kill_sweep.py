"""Killed at any moment, finished by the retry a scheduler makes: every command that writes OUT is killed
with SIGKILL just before each change it makes there (tests/support/kill_sweep.py: every file created,
written, renamed or removed, every directory made, every -j worker started), then retried as the fan-out
examples retry it (`--resume`, `--part I/N --resume`, `finalize`), and must give the bytes of an
uninterrupted run: no error, no left-over lock or temporary, and no worker outliving a killed parent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.kill_sweep import snapshot
from tests.support.synthetic import SIDE_FILES, build_tiny_deepseek

REPO = Path(__file__).resolve().parents[2]
PART_RECORDS = r"\.fp8conv/part-\d+-of-\d+\.json"  # a fan-out's own record, kept for later retries


def _sweep(
    shared: Path, name: str, to: list[str], command: list[str], retries: list[Any], **spec: Any
) -> list[dict[str, Any]]:
    """The kill sweep's results, one per moment, in shared/name, of `command` (CLI args; those starting with
    an option are convert's with `to`, the input and OUT), against the uninterrupted run's bytes."""
    ckpt, work = shared / "ckpt", shared / name
    work.mkdir()
    base = ["convert", str(ckpt), *to, "-o", str(work / "out"), "-q"]
    reference = shared / f"reference{'-'.join(to)}.json"
    if not reference.exists():  # the single run's bytes (the input's path is recorded, OUT's is not)
        single = shared / f"single{'-'.join(to)}"
        done = subprocess.run([sys.executable, "-m", "fp8conv", "convert", str(ckpt), *to, "-o", str(single), "-q"])
        assert done.returncode == 0
        reference.write_text(json.dumps(snapshot(single)))

    def expand(args: list[str]) -> list[str]:
        return [*base, *args] if not args or args[0].startswith("-") else args

    spec = {
        "work": str(work),
        "reference": str(reference),
        "command": expand(command),
        "retries": [expand(r) if isinstance(r, list) else r | {"args": expand(r["args"])} for r in retries],
        "prepare": [expand(p) if isinstance(p, list) else p for p in spec.pop("prepare", [])],
        "ignore": PART_RECORDS,
        **spec,
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.kill_sweep", json.dumps(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def _failures(results: list[dict[str, Any]]) -> list[str]:
    """The moments whose kill was not finished by the retries, each with what went wrong."""
    return [
        f"{r['at']}: {r['moment']!r}: status {r['status']}, {r['survivors']} worker(s) left, {r['orphans']}, "
        f"retries {r['retries']}"
        f"{', ' + r['error'].strip() if r.get('error') else ''}; {'; '.join(r['differences'][:4])}"
        for r in results
        if not r.get("finished")
        and (r["status"] != -9 or r["survivors"] or r["orphans"] or r.get("error") or r["differences"])
    ]


def _moments(results: list[dict[str, Any]]) -> list[str]:
    assert results[-1].get("finished"), "the sweep stopped before the command could finish"
    return [r["moment"] for r in results[:-1]]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny checkpoint for every sweep: two shards (one holding a scale of the other's), config.json,
    and two side files for fewer moments: the model card (rewritten) and a file in a folder of its own."""
    path = tmp_path_factory.mktemp("sweep")
    ckpt = build_tiny_deepseek(path / "ckpt", num_shards=2).path
    for rel in set(SIDE_FILES) - {"README.md", "figures/note.txt"}:
        (ckpt / rel).unlink()
    return path


def test_a_whole_run_killed_at_any_moment_is_finished_by_resume(shared):
    results = _sweep(shared, "whole", ["--to", "bf16"], [], [["--resume"]])
    moments = _moments(results)
    # every kind of moment was hit: the first appearance of OUT and of the lock, the first manifest save
    # (before it --resume found no manifest), every shard's rename, the copies (one in a folder of its
    # own), the index and config renames
    assert moments[0].startswith("os.mkdir") and moments[0].endswith("/out")
    assert moments[1:3] == ["os.mkdir .fp8conv", "open lock"]
    assert sum(m.endswith("-> manifest.json") for m in moments) == 4  # the first, one per shard, the last
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "note.txt", "README.md"):
        assert any(m.endswith(f"-> {name}") for m in moments), name
    assert "os.mkdir figures" in moments
    assert any(m.endswith("-> model.safetensors.index.json") for m in moments)
    assert any(m.endswith("-> config.json") for m in moments)
    assert _failures(results) == []


def test_parts_killed_at_any_moment_are_finished_by_part_resume_and_finalize(shared):
    # part 1 killed while part 2 has not run, then retried; part 2 then runs and finalizes
    first = _sweep(
        shared, "part-first", ["--to", "bf16"], ["--part", "1/2"], [["--part", "1/2", "--resume"], ["--part", "2/2"]]
    )
    # part 1 killed after part 2 finished, so at every moment of its finalize too; the finalize job a
    # scheduler runs next may find part 1 unfinished (then the part's retry finalizes), and must leave
    # exactly the single run's files when it does finish (no part's lock file)
    finalize = {
        "args": ["finalize", str(shared / "part-last" / "out")],
        "may_fail": "have not finished",
        "compare": True,
    }
    last = _sweep(
        shared,
        "part-last",
        ["--to", "bf16"],
        ["--part", "1/2"],
        [finalize, ["--part", "1/2", "--resume"], finalize],
        prepare=[["--part", "2/2"]],
    )
    assert any(m.endswith("-> part-1-of-2.json") for m in _moments(first))
    assert any(m.endswith("-> config.json") for m in _moments(last))  # part 1 finalized, killed throughout
    assert _failures(first) == [] and _failures(last) == []


def test_finalize_killed_at_any_moment_is_finished_by_finalize(shared):
    # both parts done, neither finalized (as when the last part was killed between its record and finalize)
    unfinalized = {"remove": ["config.json", "model.safetensors.index.json", ".fp8conv/manifest.json"]}
    finalize = ["finalize", str(shared / "finalize" / "out")]
    results = _sweep(
        shared,
        "finalize",
        ["--to", "bf16"],
        finalize,
        [finalize],
        prepare=[["--part", "1/2"], ["--part", "2/2"], unfinalized],
    )
    moments = _moments(results)
    assert moments[0] == "os.mkdir .fp8conv" and any(m.endswith("-> config.json") for m in moments)
    assert _failures(results) == []


def test_jobs_killed_at_any_moment_of_the_parent_leave_no_worker_and_resume(shared):
    """-j 2's parent killed alone before each of its own changes and each worker's start, then `-j 2
    --resume`; a worker it had started must not change OUT once it is gone (it checks its parent as it
    starts: the worker sweep below kills the parent under a worker that is past that check)."""
    results = _sweep(shared, "jobs", ["--to", "bf16"], ["-j", "2"], [["-j", "2", "--resume"]])
    assert sum(m.startswith("start a part-worker") for m in _moments(results)) == 2
    assert _failures(results) == []


def test_jobs_parent_killed_at_each_kind_of_moment_of_a_worker_leaves_no_worker_and_resumes(shared):
    """-j 2's parent SIGKILLed alone when its worker for part 1 first creates each name in OUT and at
    each rename the worker makes: both workers must die with it (a worker that changes OUT once its
    parent is gone, or lives 5 s on, is reported), then `-j 2 --resume` finishes. (Every moment of a
    part is swept in-process above; each moment here starts fresh interpreters.)"""
    results = _sweep(
        shared,
        "jobs-worker",
        ["--to", "bf16"],
        ["-j", "2"],
        [["-j", "2", "--resume"]],
        worker=1,
        kill="parent",
        moments="first-and-renames",
    )
    moments = _moments(results)
    assert "open part-1-of-2.lock" in moments
    assert sum(m.endswith("-> part-1-of-2.json") for m in moments) >= 3  # the first save, the shard's, the last
    assert any(m.endswith("-> model-00001-of-00002.safetensors") for m in moments)
    assert _failures(results) == []
