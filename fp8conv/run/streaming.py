"""`convert --stream`: input shards fetched a bounded number ahead of the conversion, each output shard
converted once the input shards it reads (its own, and those holding its companions) are present,
and with --evict-input each input shard removed once every output that reads it is committed.

The plan is made from headers before any shard is fetched (remote headers for a Hub repo), so every
refusal the headers allow still comes first. Scales are data: an output shard's are checked once the
input shards holding them are there, before it is written; a bad one stops the run with no index or config.json
written, so the output never looks complete.

The schedule is a pure function of the plan: the order shards are fetched in, when each may be
fetched (`ahead` outputs ahead of the last committed one) and when each may go, so the peak disk the
input takes is computed, and checked against the free space, before anything is fetched."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, OptionsError, OutputError
from ..output.manifest import config_sha256, input_identity
from ..plan.conversion import ConversionPlan
from ..source import hub
from ..source.checkpoint import Checkpoint, open_checkpoint, open_with_headers
from ..source.config import present
from ..source.index import INDEX_NAME, CheckpointIndex, Shard, check_shard_name, read_shard_header, read_weight_map
from ..source.shard_fetch import HubShardSource, ShardSource
from ..storage.header import parse_header
from ..storage.json_file import read_json_object
from ..storage.out_dir import OutDir
from ..storage.safetensors_file import ShardHeader
from ..storage.writer import write_file_atomic
from ..threads import RunThreads

HEADERS_FILE = Path(".fp8conv") / "input-headers.json"
SINGLE_FILE = "model.safetensors"


def open_stream(
    location: str | os.PathLike[str], revision: str | None, stream: bool | ShardSource, resume_from: Path | None
):
    """(checkpoint planned from headers, the source its shards come from). A Hub ID downloads only
    its small files (config, index, tokenizer, model card) here; shards not in the cache get their
    headers from the interrupted run being resumed (`resume_from`, the output), else remotely.
    A ShardSource given by the caller (tests, bench) serves `location`'s shards."""
    if not isinstance(stream, bool):
        ckpt = open_checkpoint(location)
        ckpt.index.root = stream.root  # shards are read where the source delivers them
        return ckpt, stream
    if not (isinstance(location, str) and hub.looks_like_repo_id(location)):
        raise OptionsError(
            f"--stream fetches shards from the Hugging Face Hub; {location} is a local checkpoint",
            fix="drop --stream (a local checkpoint is already on disk), or give a Hub repo ID",
        )
    root = hub.snapshot(location, revision, weights=False)
    source = HubShardSource(location, revision, root)
    saved = saved_headers(resume_from, source) if resume_from is not None else {}
    return open_with_headers(root, _hub_headers(location, root, source, saved)), source


def save_input_headers(out: Path, ckpt: Checkpoint, source: ShardSource, within: OutDir | None = None) -> None:
    """The headers the plan was made from, for --resume: an evicted shard is then never needed again,
    not even its header (an offline resume plans without the network). Removed once the run is done."""
    prov = source.provenance()
    if "commit" not in prov:
        return
    headers = {}
    for shard in ckpt.index.shards:
        headers[shard.name] = header_document(shard.header)
    doc = {"repo_id": prov["repo_id"], "commit": prov["commit"], "headers": headers}
    write_file_atomic(out / HEADERS_FILE, json.dumps(doc).encode(), within)


def header_document(h: ShardHeader) -> dict[str, Any]:
    """A header as its shard holds it (offsets relative to the data), for header.parse_header."""
    doc: dict[str, Any] = {"__metadata__": h.metadata} if h.metadata else {}
    for t, e in h.tensors.items():
        begin = e.start - h.data_start
        doc[t] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [begin, begin + e.nbytes]}
    return doc


def saved_headers(out: Path, source: HubShardSource) -> dict[str, ShardHeader]:
    """Headers an interrupted run of the same repo and commit saved, validated as a shard's own are
    (header.parse_header); every fetched shard is still checked against them. Missing, or of another
    repo, commit or fp8conv version: read again. A damaged one (fp8conv wrote it) is refused by name."""
    path = out / HEADERS_FILE
    fix = "delete it (the headers are then read again), or convert again without --resume"
    try:  # O_NOFOLLOW: never read through a link planted in the output
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise OutputError(f"cannot be read ({exc.strerror or exc})", file=str(path), fix=fix) from exc
    doc = read_json_object(path, fix=fix, name=str(path), error=OutputError, fd=fd)
    saved = doc.get("headers")
    if (doc.get("repo_id"), doc.get("commit")) != (source.repo_id, source.commit) or not isinstance(saved, dict):
        return {}
    headers = {}
    for name, header in saved.items():
        try:
            check_shard_name(name, HEADERS_FILE.as_posix())
            if not isinstance(header, dict):
                raise CheckpointError("header is not a JSON object", shard=name)
            headers[name] = parse_header(json.dumps(header).encode(), None, name)
        except CheckpointError as exc:
            inner = CheckpointError(exc.problem, tensor=exc.tensor, shard=exc.shard).one_line()
            raise OutputError(f"holds a damaged saved header ({inner})", file=str(path), fix=fix) from exc
    return headers


def _hub_headers(
    repo_id: str, root: Path, source: HubShardSource, saved: dict[str, ShardHeader]
) -> dict[str, ShardHeader]:
    """Cached shards' headers read locally, then those an interrupted run saved; the others' remotely
    (a few KB each), never the weights."""
    index_file = root / INDEX_NAME
    names: list[str] | None = None
    if present(index_file):
        names = sorted(set(read_weight_map(index_file).values()))  # validated as the local index is
    elif source.present(SINGLE_FILE):  # no index: one model.safetensors, cached
        names = [SINGLE_FILE]
    elif saved:
        names = sorted(saved)
    missing = [n for n in names or [] if not source.present(n) and n not in saved]
    try:
        remote = hub.remote_headers(repo_id, source.commit) if names is None or missing else {}
    except CheckpointError as exc:
        if not missing:
            raise
        raise CheckpointError(
            f"{len(missing)} shard(s) are not in the cache ({', '.join(missing[:3])}) and their headers cannot be "
            f"read remotely: {exc.problem}",
            fix="connect to the Hub (HF_HUB_OFFLINE unset): the plan reads a few KB of header per shard",
        ) from exc
    headers = {}
    for name in names if names is not None else sorted(remote):
        if source.present(name):  # opened inside the repo's cache folder: never another repo's blobs
            headers[name] = read_shard_header(root, name, INDEX_NAME)
        else:
            headers[name] = saved.get(name) or remote.get(name)
        if headers[name] is None:
            raise CheckpointError(f"names shard {name!r}, which the repository does not hold", file=INDEX_NAME)
    return headers


def stream_identity(ckpt: Checkpoint, source: ShardSource) -> dict[str, Any]:
    """A Hub input is pinned by its commit (git content addressing); the shards' names and config.json's
    hash are kept so a mismatch can be named. A local source has headers on disk: the usual identity."""
    prov = source.provenance()
    if "commit" not in prov:
        return input_identity(ckpt)
    return {
        "repo_id": prov["repo_id"],
        "commit": prov["commit"],
        "shards": [{"name": s.name} for s in ckpt.index.shards],
        "config_sha256": config_sha256(ckpt),
    }


@dataclass
class Schedule:
    order: list[str]  # output shards still to write, in plan order
    needs: dict[str, list[str]]  # output shard -> the input shards its jobs read
    fetches: list[tuple[str, int]]  # input shard, position in `order` of the first output that reads it
    last_use: dict[str, int]  # input shard -> position of the last output that reads it
    unused: list[str]  # input shards only finished outputs read: never fetched

    def peak_input(self, sizes: dict[str, int], ahead: int, evict: bool, present: set[str]) -> tuple[int, int]:
        """(bytes, shards) of input held on disk at once that are not there yet. While `r` outputs are
        committed, shards first read by outputs up to r + ahead may be fetched; with evict, a shard
        goes once its last reader is committed (before r moves on)."""
        peak_bytes = peak_count = 0
        for r in range(len(self.order) + 1):
            held = [
                name
                for name, first in self.fetches
                if first <= r + ahead and (not evict or self.last_use[name] >= r) and name not in present
            ]
            peak_bytes = max(peak_bytes, sum(sizes[n] for n in held))
            peak_count = max(peak_count, len(held))
        return peak_bytes, peak_count


def make_schedule(index: CheckpointIndex, plan: ConversionPlan, skip: set[str]) -> Schedule:
    order = [s.name for s in plan.shards if s.name not in skip]
    position = {s.name: i for i, s in enumerate(index.shards)}
    needs: dict[str, list[str]] = {}
    for shard in plan.shards:
        if shard.name in skip:
            continue
        read = set()
        for job in shard.jobs:
            read.add(index.shard_of(job.source).name)
            for companion in job.fmt.consumed if job.fmt is not None else ():  # scales, global scales...
                if companion in index.locations:
                    read.add(index.shard_of(companion).name)
        needs[shard.name] = sorted(read, key=position.__getitem__)
    fetches: list[tuple[str, int]] = []
    last_use: dict[str, int] = {}
    for i, name in enumerate(order):
        for inp in needs[name]:
            if inp not in last_use:
                fetches.append((inp, i))
            last_use[inp] = i
    unused = [s.name for s in index.shards if s.name not in last_use]
    return Schedule(order, needs, fetches, last_use, unused)


def adopt_local_header(index: CheckpointIndex, name: str, path: Path) -> None:
    """A fetched shard's own header replaces the one the plan was made from (remote headers carry
    offsets relative to the data); every tensor must be where the plan expects it."""
    local = read_shard_header(index.root, name)  # index.root is where the source delivers (`path`)
    position = next(i for i, s in enumerate(index.shards) if s.name == name)
    planned = index.shards[position].header

    def layout(h: ShardHeader) -> dict[str, tuple]:
        return {t: (e.dtype, e.shape, e.start - h.data_start, e.nbytes) for t, e in h.tensors.items()}

    if layout(local) != layout(planned):
        raise CheckpointError(
            "differs from the header the plan was made from",
            shard=name,
            fix="the repository changed under the run: convert again (pin --revision to a commit)",
        )
    shard = Shard(name, local)
    index.shards[position] = shard
    for tname, entry in local.tensors.items():
        index.locations[tname] = (shard, entry)


class StreamFeed:
    """The prefetch thread, and the after-commit thread (verify a shard, then evict what no output
    still needs), both the run's (`threads`: its cancel token stops the fetching, its first error is
    the feed's). The conversion calls wait_for(output) before a shard and committed(output) after it."""

    def __init__(
        self,
        source: ShardSource,
        schedule: Schedule,
        threads: RunThreads,
        *,
        ahead: int,
        evict: bool,
        arrived: Callable[[str, Path], None],
        before_evict: Callable[[str], None],
        after_commit: Callable[[str], None] | None = None,
        ready: Callable[[str], None] | None = None,
    ) -> None:
        self.source, self.schedule, self.ahead, self.evict = source, schedule, ahead, evict
        self.arrived, self.before_evict, self.after_commit = arrived, before_evict, after_commit
        self.ready = ready  # called with an output shard once its inputs are present, before it is converted
        self.cond = threading.Condition()
        self.present: set[str] = set()
        self.released = 0  # outputs of schedule.order committed (and released) so far, in order
        self.readers_left = {name: 0 for name, _ in schedule.fetches}
        for inputs in schedule.needs.values():
            for name in inputs:
                self.readers_left[name] += 1
        self.threads = threads
        threads.on_cancel(self._wake)
        self.fetched: list[str] = []  # shards actually fetched (not on disk when asked for)
        self.evicted: list[str] = []
        self.waited_s = 0.0  # time the conversion spent waiting for shards
        self.thread: threading.Thread | None = None
        self.posted: list[Future[None]] = []

    def start(self) -> None:
        if self.evict:  # read only by outputs an interrupted run finished: never needed again
            for name in self.schedule.unused:
                if self.source.present(name):
                    self.source.evict(name)
                    self.evicted.append(name)
        # a Hub download in flight cannot be interrupted: not waited for past threads.JOIN_TIMEOUT_S
        self.thread = self.threads.start("fetch", self._prefetch, interruptible=False)

    def _prefetch(self) -> None:
        cancel = self.threads.cancelled
        try:
            for name, first in self.schedule.fetches:
                with self.cond:
                    self.cond.wait_for(lambda f=first: self.released >= f - self.ahead or cancel.is_set())
                if cancel.is_set():
                    return
                was_there = self.source.present(name)
                path = self.source.fetch(name, cancel)
                if not was_there:
                    self.fetched.append(name)
                self.arrived(name, path)
                with self.cond:
                    self.present.add(name)
                    self.cond.notify_all()
        except BaseException as exc:
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.threads.failed(exc)
        self._wake()

    def _wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, output: str) -> None:
        """Block until every input shard `output` reads is present; raise the first fetch error."""
        started = time.monotonic()
        needed = self.schedule.needs[output]
        with self.cond:
            self.cond.wait_for(lambda: self.threads.error is not None or all(n in self.present for n in needed))
            self.waited_s += time.monotonic() - started
            self.threads.check()
        if self.ready is not None:
            self.ready(output)

    def committed(self, output: str) -> None:
        """The output shard is fsynced, renamed and in the manifest (called on the writer thread)."""
        # never cancelled: the shard is complete, its verify and evictions follow (close() waits for them)
        self.posted.append(self.threads.pool("after-commit").submit_always(self._release, output))

    def _release(self, output: str) -> None:
        try:
            if self.after_commit is not None:
                self.after_commit(output)
            for name in self.schedule.needs[output]:
                self.readers_left[name] -= 1
                if self.evict and self.readers_left[name] == 0:
                    self.before_evict(name)
                    self.source.evict(name)
                    self.evicted.append(name)
            with self.cond:
                self.released += 1
                self.cond.notify_all()
        except BaseException as exc:
            self._failed(exc)
            raise

    def finish(self) -> None:
        """Every after-commit step done; raises the run's first error (either thread's)."""
        for future in self.posted:
            future.result()
        if self.thread is not None:
            self.thread.join()
        self.threads.check()
