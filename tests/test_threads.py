"""The run's threads: one module starts them (threads.py), one cancel() stops them, none outlives a run."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv.cli.commands import main
from fp8conv.errors import OutputError
from fp8conv.options import ConvertOptions, RunOptions
from fp8conv.run import prepare
from fp8conv.storage.out_dir import TEMP_SUFFIX
from fp8conv.storage.preread import Preread
from fp8conv.storage.writer import ShardWriter
from fp8conv.threads import RunThreads

PACKAGE = Path(fp8conv.__file__).parent
STARTS_THREADS = {"threads.py"}
STARTS_PROCESSES = {"cli/commands.py", "cli/workers.py"}  # -j: the CLI's worker processes
# what a module may use of threading and concurrent.futures: primitives to wait on, nothing that runs
THREADING_ALLOWED = {"Lock", "RLock", "Event", "Condition", "Semaphore", "BoundedSemaphore", "Barrier", "local"}
THREADING_ALLOWED |= {"enumerate", "current_thread", "main_thread", "get_ident"}
FUTURES_ALLOWED = {"Future", "Executor", "CancelledError", "wait", "as_completed", "FIRST_COMPLETED", "ALL_COMPLETED"}
STARTERS = {"Thread", "Timer", "ThreadPoolExecutor", "ProcessPoolExecutor", "ThreadPool", "start_new_thread"}
PROCESS_MODULES = {"subprocess", "multiprocessing", "_thread", "asyncio"}
PROCESS_CALLS = {"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve", "spawnv"}


def _annotations(tree: ast.AST) -> set[int]:
    """ids of every node inside a type annotation: naming threading.Thread as a type starts nothing."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            roots += [a.annotation for a in [*node.args.args, *node.args.kwonlyargs] if a.annotation]
            roots += [node.returns] if node.returns else []
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
    return {id(n) for root in roots for n in ast.walk(root)}


def _uses(path: Path) -> list[str]:
    """What `path` uses that starts a thread or a process, as `line: what`."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _annotations(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        what = None
        if isinstance(node, ast.Import):
            what = ", ".join(a.name for a in node.names if a.name.split(".")[0] in PROCESS_MODULES) or None
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = {a.name for a in node.names}
            if node.module == "threading":
                what = ", ".join(sorted(names - THREADING_ALLOWED)) or None
            elif node.module == "concurrent.futures":
                what = ", ".join(sorted(names - FUTURES_ALLOWED)) or None
            elif node.module.split(".")[0] in PROCESS_MODULES:
                what = node.module
        elif isinstance(node, ast.Attribute) and node.attr in STARTERS:  # concurrent.futures.X, a.Thread
            what = node.attr
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner, attr = node.value.id, node.attr
            if owner == "threading" and attr not in THREADING_ALLOWED:
                what = f"threading.{attr}"
            elif owner == "futures" and attr not in FUTURES_ALLOWED:
                what = f"futures.{attr}"
            elif owner == "os" and (attr in PROCESS_CALLS or attr.startswith("spawn")):
                what = f"os.{attr}"
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


def test_only_threads_py_starts_threads_and_only_the_cli_starts_processes():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30 and PACKAGE / "threads.py" in modules
    offenders = {}
    for path in modules:
        name = path.relative_to(PACKAGE).as_posix()
        uses = _uses(path)
        if name in STARTS_THREADS:
            uses = [u for u in uses if u.split(": ")[1] not in {"threading.Thread", "Thread", "ThreadPoolExecutor"}]
        if name in STARTS_PROCESSES:
            uses = [u for u in uses if "subprocess" not in u]
        if uses:
            offenders[name] = uses
    assert not offenders, f"threads or processes started outside threads.py / the CLI: {offenders}"
    # the rule sees what it is meant to: threads.py and workers.py do start them
    assert any("Thread" in u for u in _uses(PACKAGE / "threads.py"))
    assert any("subprocess" in u for u in _uses(PACKAGE / "cli" / "workers.py"))


def _fp8conv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fp8conv-") and t.is_alive()]


def test_cancel_drops_the_queued_work_of_every_pool_and_waits_for_the_running():
    threads = RunThreads()
    started, release, ran = threading.Event(), threading.Event(), []

    def slow() -> str:
        started.set()
        release.wait(10)
        ran.append("slow")
        return "done"

    running = threads.pool("read").submit(slow)
    assert started.wait(10)
    queued = [threads.pool("read").submit(ran.append, "read"), threads.pool("band", 2).submit(release.wait, 10)]
    queued.append(threads.pool("band", 2).submit(release.wait, 10))
    queued.append(threads.pool("band", 2).submit(ran.append, "band"))  # behind two running waits
    kept = threads.pool("write").submit_always(time.sleep, 0)
    threading.Timer(0.5, release.set).start()  # the running tasks end on their own, after cancel() began
    threads.cancel()
    assert running.done() and not running.cancelled() and running.result() == "done"  # waited for, not dropped
    assert queued[0].cancelled() and queued[3].cancelled() and "read" not in ran and "band" not in ran
    assert all(f.done() for f in queued)
    assert threads.pool("read").submit(ran.append, "late").cancelled()  # once cancelled, new work is dropped
    threads.close()
    assert kept.done() and not kept.cancelled()
    assert not _fp8conv_threads()


def test_the_first_error_is_the_runs_and_close_joins_every_thread():
    threads = RunThreads()
    first, second = OSError("first"), OSError("second")

    def fail(exc: BaseException) -> None:
        raise exc

    threads.start("one", fail, first).join()
    threads.start("two", fail, second).join()
    with pytest.raises(OSError) as info:
        threads.check()
    assert info.value is first
    threads.start("waits", threads.cancelled.wait, 30)  # ends only when cancelled
    began = time.monotonic()
    threads.close()
    assert time.monotonic() - began < 10 and not _fp8conv_threads()
    with pytest.raises(RuntimeError, match="after the run's threads were closed"):
        threads.pool("read")


def test_a_failed_write_is_raised_once_and_no_thread_of_the_run_is_left(make_tiny, tmp_path, monkeypatch):
    """A write fails on the write thread with more queued behind it: the run raises that error, once;
    the shard's queued writes are dropped and the running ones end before its file is removed."""
    tiny = make_tiny()
    failure = OutputError("writing failed: No space left on device", shard=tiny.shards[1], fix="free disk space")
    real_write, real_abort = ShardWriter.write_tensor, ShardWriter.abort
    events: list[str] = []

    def write_tensor(self, name, tensor):
        if self.final_path.name != tiny.shards[1]:
            return real_write(self, name, tensor)
        events.append("start")
        if events.count("start") == 2:
            events.append("failed")
            raise failure
        time.sleep(0.1 if "failed" in events else 0)  # the writes after the failure keep the thread busy
        real_write(self, name, tensor)
        events.append("end")

    def abort(self):
        events.append("abort")
        real_abort(self)

    hooked: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)  # a thread's error raised again is seen here
    monkeypatch.setattr(ShardWriter, "write_tensor", write_tensor)
    monkeypatch.setattr(ShardWriter, "abort", abort)
    out = tmp_path / "out"
    with pytest.raises(OutputError) as info:
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    assert info.value is failure and not hooked
    assert not _fp8conv_threads()
    assert events.count("abort") == 1
    after = events[events.index("abort") :]
    assert after == ["abort"], f"the shard's writes went on while it was aborted: {events}"
    assert (out / tiny.shards[0]).is_file() and not (out / tiny.shards[1]).exists()
    assert not list(out.glob(f".*{TEMP_SUFFIX}")) and not (out / "config.json").exists()


@pytest.mark.parametrize("refused", [False, True])
def test_warm_start_is_cancelled_and_joined_when_the_run_ends(make_tiny, tmp_path, monkeypatch, refused):
    """The CLI's read-ahead still running when the run ends (here it would wait 30 s): stopped, not left.
    The run opens its input only once the read-ahead is reading: a refusal is otherwise quick enough, on a
    loaded host, to cancel the read-ahead before it began (and then there is nothing running to stop)."""
    tiny = make_tiny()
    waiting = threading.Event()
    real_open = prepare.open_checkpoint

    def read(self, path, ranges, direct, cancelled=None):
        waiting.set()
        assert cancelled is not None
        cancelled.wait(30)

    def open_when_reading(*args, **kwargs):
        waiting.wait(20)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(Preread, "read", read)
    monkeypatch.setattr(prepare, "open_checkpoint", open_when_reading)
    out = tmp_path / "out"
    if refused:  # refused before anything is written
        out.mkdir()
        (out / "stale.txt").write_text("x")
    began = time.monotonic()
    r = CliRunner().invoke(main, ["convert", str(tiny.path), "--to", "bf16", "-o", str(out), "-q"])
    assert (r.exit_code == 1 and "--overwrite" in r.output) if refused else r.exit_code == 0, r.output
    assert waiting.is_set(), "warm start never began"
    assert not _fp8conv_threads(), [t.name for t in _fp8conv_threads()]
    assert time.monotonic() - began < 25


def test_an_error_in_a_shard_leaves_the_shard_before_it_to_commit(make_tiny, tmp_path, monkeypatch):
    """Shard 1 is interrupted while shard 0's commit still waits for its segments on the io thread: those
    are shard 0's, not dropped by the cancel, and shard 0 is committed whole."""
    from fp8conv.options import Tuning
    from fp8conv.storage.writer import ShardFile

    tiny = make_tiny()
    fp8conv.convert(tiny.path, tmp_path / "whole", ConvertOptions(to="bf16"))
    raw = (tmp_path / "whole" / tiny.shards[0]).read_bytes()
    first = len(raw) - 8 - int.from_bytes(raw[:8], "little")  # shard 0's tensor bytes
    real_segment = ShardFile.write_segment
    slow = threading.Event()

    def write_segment(self, *args):
        if slow.is_set():
            time.sleep(0.05)  # shard 0's last segments still queued when shard 1 is interrupted
        real_segment(self, *args)

    def progress(done: int, total: int) -> None:
        if done == first:
            slow.set()
        if done > first:
            raise KeyboardInterrupt

    monkeypatch.setattr(ShardFile, "write_segment", write_segment)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run = RunOptions(progress=progress, tuning=Tuning(segment_bytes=8192))  # shard 0 in several segments
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=run)
    assert (out / tiny.shards[0]).read_bytes() == raw
    assert not (out / tiny.shards[1]).exists() and not _fp8conv_threads()
