"""Every thread of a run, in one object: the pools (read, write, band, io, hash, after-commit), the single
threads (--stream's fetch, warm start's), one cancel token and the run's first error. The only module
of the package that starts threads (tests/test_threads.py checks it), so that one cancel() stops them
all and close() leaves none running when the run returns.

cancel() drops what is queued and waits for what runs: nothing writes into a buffer or a file that is
going away. Work submitted with submit_always (a shard's commit, the steps after it) is never dropped:
its shard is complete, and close() waits for it. Nor is a pool's made with cancellable=False: the io and
hash pools hold the segments of a shard being committed as well as of the one that failed, whose
writer drops its own (ShardWriter.abort, with settle()). A thread whose work cannot be interrupted (a Hub
download in flight) is a daemon, waited for JOIN_TIMEOUT_S at most; every other one is joined.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

JOIN_TIMEOUT_S = 10.0  # an uninterruptible thread (a download) is waited for this long, then left to die


def settle(futures: Iterable[Future[Any]]) -> None:
    """Cancel those not started and wait for the others; their errors are not raised (the caller has one)."""
    futures = list(futures)
    for future in futures:
        future.cancel()
    for future in futures:
        if not future.cancelled():
            future.exception()


class RunPool(Executor):
    """A named thread pool of a run; remembers the futures not done yet, so RunThreads.cancel() can drop them."""

    def __init__(self, name: str, workers: int, cancelled: threading.Event, cancellable: bool = True) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"fp8conv-{name}")
        self._cancelled = cancelled
        self.cancellable = cancellable
        self._lock = threading.Lock()
        self._pending: set[Future[Any]] = set()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Work cancel() may drop; once cancelled, whatever is submitted is dropped at once."""
        if not self.cancellable:
            return self._executor.submit(fn, *args, **kwargs)
        future = self._executor.submit(fn, *args, **kwargs)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        if self._cancelled.is_set():  # a band computing during cancel() hands its write on: dropped
            future.cancel()
        return future

    def submit_always(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        """Work cancel() leaves alone: it runs, and close() waits for it."""
        return self._executor.submit(fn, *args)

    def pending(self) -> list[Future[Any]]:
        with self._lock:  # a future done but not yet discarded (its callback runs just after) is not
            return [f for f in self._pending if not f.done()]

    def _done(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._executor.shutdown(wait, cancel_futures=cancel_futures)


class RunThreads:
    def __init__(self) -> None:
        self.cancelled = threading.Event()  # the token: threads that loop check it between steps
        self.error: BaseException | None = None  # the first error any thread recorded
        self._lock = threading.Lock()
        self._pools: dict[str, RunPool] = {}
        self._threads: list[tuple[threading.Thread, bool]] = []  # (thread, interruptible)
        self._on_cancel: list[Callable[[], None]] = []
        self._closed = False

    def pool(self, name: str, workers: int = 1, *, cancellable: bool = True) -> RunPool:
        """The pool `name` (threads fp8conv-<name>_<i>), started when first asked for. cancellable=False:
        cancel() leaves its work alone (its submitter drops its own), close() waits for it."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"pool {name!r} asked for after the run's threads were closed")
            if name not in self._pools:
                self._pools[name] = RunPool(name, workers, self.cancelled, cancellable)
            return self._pools[name]

    def start(self, name: str, fn: Callable[..., None], *args: Any, interruptible: bool = True) -> threading.Thread:
        """A thread of its own running fn(*args); an error it raises becomes the run's (failed()).
        interruptible=False: it may not notice cancel() (a download); a daemon, not waited for past
        JOIN_TIMEOUT_S."""

        def body() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                self.failed(exc)

        thread = threading.Thread(target=body, name=f"fp8conv-{name}", daemon=not interruptible)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"thread {name!r} started after the run's threads were closed")
            self._threads.append((thread, interruptible))
        thread.start()
        return thread

    def on_cancel(self, wake: Callable[[], None]) -> None:
        """Called by cancel(): wakes a thread waiting on a condition of its own."""
        self._on_cancel.append(wake)

    def failed(self, exc: BaseException) -> None:
        """Record an error; the first one recorded is the run's."""
        with self._lock:
            if self.error is None:
                self.error = exc

    def check(self) -> None:
        """Raise the run's first error, if any thread recorded one."""
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        """Set the token, drop every queued task and wait for the running ones; until none is left, as a
        task that runs may submit another (a band hands its write on)."""
        self.cancelled.set()
        for wake in self._on_cancel:
            wake()
        while pending := [f for pool in list(self._pools.values()) for f in pool.pending()]:
            settle(pending)

    def close(self) -> None:
        """The run is over: cancel what is left (warm start's reads), let submit_always work finish, join
        every thread. Idempotent."""
        self.cancel()
        with self._lock:
            self._closed = True
            pools, threads = list(self._pools.values()), list(self._threads)
        for pool in pools:
            pool.shutdown(wait=True)
        for thread, interruptible in threads:
            if thread is not threading.current_thread():
                thread.join(None if interruptible else JOIN_TIMEOUT_S)

    def __enter__(self) -> RunThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
