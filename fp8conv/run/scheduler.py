"""Runs a planned conversion, shard after shard, on the strategy the plan chose for each job. Its threads
are pools of the run's RunThreads (threads.py); this object sets the limits on what may wait between them:

  read      1 thread: each job's inputs and a BANDED job's bands, in the order the jobs use them, a
            bounded window ahead (READ_AHEAD bands, one whole job's tensors)
  compute   the calling thread (whole jobs) and BAND_WORKERS threads (bands, side by side)
  write     1 thread: outputs placed into their shard, file-to-file copies, commits (a shard's fsync
            and rename overlap the next shard)
  io, hash  1 thread each: a shard's complete segments written (direct I/O) and hashed in file order

At most a few tensors or bands are in memory at once, whatever the checkpoint's size. The first error
cancels what is queued for the shard, waits for what is running (nothing writes into a buffer or file
that is going away; RunThreads.cancel), removes the partial shard and is raised. An earlier shard's commit,
ahead of this shard's writes on the write thread, is not cancelled: that shard is complete.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..backends import Backend
from ..backends.scales import all_powers_of_two
from ..options import DEFAULT_TUNING, ProgressCallback, Tuning
from ..plan.bands import (
    BAND_WORKERS,
    IN_SLOTS,
    OUT_SLOTS,
    READ_AHEAD,
    Band,
    BandRead,
    bands,
    expert_banded,
    write_limits,
)
from ..plan.conversion import SAFETENSORS_METADATA, Action, Job, ShardPlan, Strategy
from ..plan.strategy import RunPlan
from ..rewrite.banded import BandedJob
from ..rewrite.dequant import stored_scale
from ..rewrite.experts import ExpertBands
from ..rewrite.jobs import kept_scale, run_job
from ..rewrite.lora_merge import AdapterTensors
from ..rewrite.pow2 import stored_exponents
from ..source.index import CheckpointIndex
from ..storage.direct_io import aligned_empty, round_up
from ..storage.out_dir import OutDir
from ..storage.preread import Preread
from ..storage.shard_reader import DIRECT_MIN_BYTES, ShardReader, read_capacity
from ..storage.writer import ShardWriter
from ..threads import RunPool, RunThreads

WRITE_BEHIND = 2  # jobs whose output may wait for the write thread
WHOLE_AHEAD = 1  # jobs whose whole tensors may be read ahead of the one being computed


@dataclass
class RunTotals:
    converted: int = 0
    copied: int = 0
    all_scales_pow2: bool = True  # every output scale a power of two (ue8m0 can stay declared)
    exactness: list[int] = field(default_factory=lambda: [0, 0])  # packed 4-bit to FP8: exact blocks, all
    requant_errors: dict[str, Any] = field(default_factory=dict)  # E8M0 targets: requant_report.TensorError by weight

    def count(self, job: Job, new_scale: torch.Tensor | None) -> None:
        """Every job once, whatever its strategy; new_scale: the scale it wrote, if any."""
        self.converted += job.action is not Action.COPY
        self.copied += job.action is Action.COPY
        # E8M0 scales are powers of two by construction: no pass over an MXFP8 scale (a byte per 32 values)
        if new_scale is not None and self.all_scales_pow2 and job.action is not Action.QUANTIZE_POW2:
            self.all_scales_pow2 = all_powers_of_two(new_scale)


class InputReaders:
    """A reader per input shard, opened when first needed; closed one by one (--stream evicts) or all."""

    def __init__(
        self,
        index: CheckpointIndex,
        direct: bool,
        preread: Preread | None = None,
        direct_min_bytes: int = DIRECT_MIN_BYTES,
    ) -> None:
        """`preread`: bytes warm start read ahead for this run (warm_start.py), handed to every reader.
        `direct_min_bytes`: smaller reads go through the page cache (Tuning.direct_min_bytes)."""
        self.index, self.direct, self.preread = index, direct, preread
        self.direct_min_bytes = direct_min_bytes
        self._open: dict[str, ShardReader] = {}
        self._lock = threading.Lock()  # the read and write threads both open shards

    def of(self, tensor: str) -> ShardReader:
        shard_name = self.index.shard_of(tensor).name
        with self._lock:
            if shard_name not in self._open:
                identity = self.index.shard_of(tensor).header.identity  # the file the plan read
                path = self.index.root / shard_name
                self._open[shard_name] = ShardReader(path, self.direct, identity, self.preread, self.direct_min_bytes)
            return self._open[shard_name]

    def close(self, shard_name: str) -> None:
        """Before an input shard is evicted: an open descriptor would keep its blocks allocated."""
        with self._lock:
            reader = self._open.pop(shard_name, None)
        if reader is not None:
            reader.close()

    def close_all(self) -> None:
        for name in list(self._open):
            self.close(name)


@dataclass
class _Read:
    job: Job
    r0: int | None  # a band's first row; None: the job's whole tensors
    future: Future[Any]
    whole: bool  # holds a weight read whole (counts against WHOLE_AHEAD)


@dataclass
class _OutSlot:
    """A reused output band buffer: free again once the band in it is computed and written."""

    compute: Future[None] | None = None
    write: Future[None] | None = None  # set by the compute, before it returns

    def wait(self) -> None:
        if self.compute is not None:
            self.compute.result()
        if self.write is not None:
            self.write.result()


class Scheduler:
    def __init__(
        self,
        index: CheckpointIndex,
        plan: RunPlan,
        backend: Backend,
        readers: InputReaders,
        direct_io: bool,
        progress: ProgressCallback | None = None,
        max_memory: int | None = None,
        threads: RunThreads | None = None,
        tuning: Tuning = DEFAULT_TUNING,
        adapter: AdapterTensors | None = None,
    ) -> None:
        """`threads`: the run's (its owner closes them); None: run() starts its own and closes them.
        `tuning`: the size and number of the writer's segments."""
        self.index, self.plan, self.backend, self.readers = index, plan, backend, readers
        self.threads = threads
        self.direct_io, self.progress = direct_io, progress
        self.packed_chunk = tuning.packed_chunk_elements  # packed bands quantized to FP8, decoded this much at once
        self.limits = write_limits(max_memory, tuning)  # the writer's segments and copy chunk, counted under a cap
        self.fp8_max = plan.options.quant_max  # (127 for INT8)
        self.adapter = adapter  # --merge-lora's tensors, for the jobs that merge them
        self.totals = RunTotals()
        self.done = 0  # bytes of output done, for progress
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # reused band buffers, by (kind, slot)
        self._copy_buffer = aligned_empty(read_capacity(self.limits.copy_bytes))  # the write thread's
        self._out_slots = [_OutSlot() for _ in range(OUT_SLOTS)]
        self._bands_computed = 0  # bands handed to compute; a band's output buffer is that % OUT_SLOTS
        self._bands_read = 0  # band reads submitted; a read's input buffer is that % IN_SLOTS
        # the shard being converted: reads to submit and submitted, writes waiting
        self._to_read: deque[tuple[Job, Band | None]] = deque()
        self._reads: deque[_Read] = deque()
        self._writes: deque[Future[None]] = deque()
        self._scale_writes: list[Future[None]] = []
        self._read_pool: RunPool  # the pools, while run() runs
        self._write_pool: RunPool
        self._compute_pool: RunPool

    def run(
        self,
        out: Path,
        skip: set[str],
        before_shard: Callable[[str], None] | None = None,
        committed: Callable[[str, str], None] | None = None,
        within: OutDir | None = None,
    ) -> RunTotals:
        """Convert every planned shard not in `skip` into `out` (`within`: out opened once, see out_dir).
        before_shard(name): called before a shard starts (--stream waits for its inputs);
        committed(name, sha256): on the write thread, once a shard has its final name."""
        threads = self.threads or RunThreads()
        try:
            self._read_pool, self._write_pool = threads.pool("read"), threads.pool("write")
            self._compute_pool = threads.pool("band", BAND_WORKERS)
            # a shard's segments: its writer drops its own on abort, the one being committed keeps its own
            self._io_pool = threads.pool("io", cancellable=False)
            self._hash_pool = threads.pool("hash", cancellable=False)
            commits: deque[Future[None]] = deque()  # at most one shard's commit overlaps the next shard
            for shard in self.plan.shards:
                if shard.name in skip:  # finished by an interrupted run, size and hash checked
                    self.done += shard.nbytes
                    continue
                if before_shard is not None:
                    before_shard(shard.name)
                writer = ShardWriter(
                    out / shard.name,
                    shard.specs,
                    SAFETENSORS_METADATA,
                    self.direct_io,
                    self._io_pool,
                    self._hash_pool,
                    self.limits.segments,
                    within,
                    self.limits.segment_bytes,
                )
                try:
                    self._shard(shard, writer)
                    commits.append(self._write_pool.submit_always(self._commit, writer, shard.name, committed))
                except BaseException as exc:
                    threads.failed(exc)
                    threads.cancel()
                    self._forget_shard()
                    writer.abort()
                    raise
                finally:
                    while len(commits) > 1 or (commits and commits[0].done()):
                        commits.popleft().result()
            while commits:
                commits.popleft().result()
        finally:
            if self.threads is None:
                threads.close()
        return self.totals

    @staticmethod
    def _commit(writer: ShardWriter, name: str, committed: Callable[[str, str], None] | None) -> None:
        writer.commit()
        if committed is not None:
            committed(name, writer.sha256)

    def _shard(self, shard: ShardPlan, writer: ShardWriter) -> None:
        self._to_read = deque(self._reads_of(shard.jobs))
        self._read_ahead()
        for job in shard.jobs:
            inputs = self._take(job, None)
            self.totals.count(job, self._execute(job, inputs, writer))
            del inputs  # a whole job's tensors: not held while the next job runs
            self.done += job.nbytes
            if self.progress:
                self.progress(self.done, self.plan.output_bytes)
        for slot in self._out_slots:
            slot.wait()
        for future in [*self._writes, *self._scale_writes]:
            future.result()
        self._writes.clear()
        self._scale_writes.clear()

    def _execute(self, job: Job, inputs: dict[str, torch.Tensor], writer: ShardWriter) -> torch.Tensor | None:
        """Run one job on its strategy; the scale it writes, if any."""
        if job.strategy is Strategy.COPY_FILE:
            self._write_behind(self._copy_weight, writer, job, None)
            return None
        if job.strategy is Strategy.KEEP_WEIGHT_BYTES:
            assert job.fmt is not None and job.fmt.scale is not None
            grid = kept_scale(inputs[job.fmt.scale], job, self.index.entry(job.source).shape)
            self._write_behind(self._copy_weight, writer, job, grid)
            return grid
        if job.strategy is Strategy.BANDED:
            return self._banded(job, inputs, writer)
        if job.strategy is Strategy.WHOLE:  # one call: the rewrite is rewrite.jobs' alone
            read, totals = inputs.__getitem__, self.totals
            tensors = run_job(
                job, read, self.backend, self.fp8_max, totals.exactness, totals.requant_errors, self.adapter
            )
            self._write_behind(self._write_outputs, writer, job, tensors)
            return tensors[1] if len(tensors) > 1 else None
        raise RuntimeError(f"{job.source}: no execution strategy chosen (fp8conv.plan.strategy.choose_strategies)")

    def _copy_weight(self, writer: ShardWriter, job: Job, scale: torch.Tensor | None) -> None:
        """On the write thread: the weight's bytes file to file, then its scale, if any."""
        writer.copy_range(job.spec.name, self.readers.of(job.source), self.index.entry(job.source), self._copy_buffer)
        if scale is not None:
            writer.write_tensor(job.outputs[1].name, scale)
        elif job.action is Action.COPY:  # a weight kept as stored: its scale's bytes too (plan._stored_copies)
            for spec in job.outputs[1:]:
                writer.copy_range(spec.name, self.readers.of(spec.name), self.index.entry(spec.name), self._copy_buffer)

    @staticmethod
    def _write_outputs(writer: ShardWriter, job: Job, tensors: list[torch.Tensor]) -> None:
        for spec, tensor in zip(job.outputs, tensors, strict=True):
            writer.write_tensor(spec.name, tensor)

    def _write_behind(self, fn: Callable[..., None], *args: Any) -> None:
        self._writes.append(self._write_pool.submit(fn, *args))
        while len(self._writes) > WRITE_BEHIND:
            self._writes.popleft().result()

    def _banded(self, job: Job, inputs: dict[str, torch.Tensor], writer: ShardWriter) -> torch.Tensor | None:
        """Hand each band to the compute threads as its read arrives (bands of one gpt-oss expert share
        its read); each band's write follows on the write thread. Returns once every band is computed
        (the new scale is whole), not written."""
        assert job.fmt is not None and job.fmt.scale is not None
        banded: BandedJob | ExpertBands
        if expert_banded(job):  # its scales come with each band's read
            banded = ExpertBands(job, self.backend)
        else:
            global_scale = inputs[job.fmt.global_scale] if job.fmt.global_scale else None
            scale = stored_scale(inputs.__getitem__, job.fmt)
            banded = BandedJob(job, scale, global_scale, self.backend, self.fp8_max, self.packed_chunk)
        k = banded.row_elements
        computing: deque[Future[None]] = deque()
        w: Any = None
        for band in bands(job, self.index.entry(job.source)):
            r0, rows = band.r0, band.rows
            while len(computing) >= BAND_WORKERS:  # frees the input buffer the next read takes
                computing.popleft().result()
            if band.read is not None:  # else the slice of a gpt-oss expert whose read the band before took
                w = self._take(job, r0)
            index = self._bands_computed % OUT_SLOTS
            self._bands_computed += 1
            slot = self._out_slots[index]
            slot.wait()  # the band that last used this buffer: computed and written
            out = self._buffer("out", index, rows * k * banded.out_size).view(banded.out_dtype).view(1, rows, k)
            slot.write = None
            slot.compute = self._compute_pool.submit(self._band, banded, w, r0, out, writer, slot)
            computing.append(slot.compute)
        while computing:  # every band's arithmetic, before the new scale is read
            computing.popleft().result()
        banded.add_exactness(self.totals.exactness)
        new_scale = banded.new_scale
        if isinstance(banded, BandedJob) and banded.pow2:  # E8M0 bytes as the job stores them
            new_scale = stored_exponents(new_scale, job)
        if isinstance(banded, BandedJob) and banded.reports:
            self.totals.requant_errors[job.spec.name] = banded.report()
        if new_scale is not None:  # after the bands, in the write thread's order
            scale_name = job.outputs[1].name
            self._scale_writes.append(self._write_pool.submit(writer.write_tensor, scale_name, new_scale))
        return new_scale

    def _band(
        self, banded: BandedJob | ExpertBands, w: Any, r0: int, out: torch.Tensor, writer: ShardWriter, slot: _OutSlot
    ) -> None:
        """On a compute thread: one band's arithmetic, then its write handed to the write thread."""
        banded.compute(w, r0, out)
        offset = r0 * banded.row_elements * banded.out_size
        slot.write = self._write_pool.submit(writer.write_part, banded.job.spec.name, offset, out)

    def _reads_of(self, jobs: list[Job]) -> Iterator[tuple[Job, Band | None]]:
        """Every read of a shard, in the order the jobs use them."""
        for job in jobs:
            yield job, None
            if job.strategy is Strategy.BANDED:
                yield from ((job, band) for band in bands(job, self.index.entry(job.source)) if band.read)

    def _read_ahead(self) -> None:
        """Submit reads in order while the window allows: READ_AHEAD band reads and WHOLE_AHEAD whole
        weights not yet taken. With the bands being computed that is IN_SLOTS input band buffers in use:
        a read takes the buffer of the read BAND_WORKERS before the one just taken, whose bands (one, or
        the slices of one gpt-oss expert) are computed."""
        while self._to_read:
            job, band = self._to_read[0]
            whole = band is None and job.strategy is Strategy.WHOLE
            if band is not None and sum(r.r0 is not None for r in self._reads) >= READ_AHEAD:
                return
            if whole and sum(r.whole for r in self._reads) >= WHOLE_AHEAD:
                return
            self._to_read.popleft()
            if band is None:
                future = self._read_pool.submit(self._read_inputs, job)
            else:
                assert band.read is not None
                room = round_up(read_capacity(band.read.nbytes))
                buffer = self._buffer("in", self._bands_read % IN_SLOTS, room + read_capacity(band.read.scale_nbytes))
                self._bands_read += 1
                future = self._read_pool.submit(self._read_band, job, band.read, buffer, room)
            self._reads.append(_Read(job, None if band is None else band.r0, future, whole))

    def _take(self, job: Job, r0: int | None) -> Any:
        """The next read's result, which must be (job, r0)'s; the window moves on."""
        read = self._reads.popleft()
        if read.job is not job or read.r0 != r0:  # both come from _reads_of: a bug if they differ
            raise RuntimeError(f"{job.source}: read {read.job.source}/{read.r0} arrived for {r0}")
        self._read_ahead()
        return read.future.result()

    def _read_band(self, job: Job, read: BandRead, buffer: torch.Tensor, room: int) -> Any:
        """On the read thread: a band's bytes of the weight (into buffer[:room]) and, when the band reads
        its scales too (gpt-oss's experts), their bytes after them: then the pair."""
        entry = self.index.entry(job.source)
        weight = self.readers.of(job.source).read(entry, entry.start + read.offset, read.nbytes, buffer[:room])
        if not read.scale_nbytes:
            return weight
        assert job.fmt is not None and job.fmt.scale is not None
        scale = self.index.entry(job.fmt.scale)
        source = self.readers.of(job.fmt.scale)
        return weight, source.read(scale, scale.start + read.scale_offset, read.scale_nbytes, buffer[room:])

    def _read_inputs(self, job: Job) -> dict[str, torch.Tensor]:
        """On the read thread: the tensors a job reads whole (a BANDED or KEEP_WEIGHT_BYTES job: its
        scales only, none for gpt-oss's experts, read with each band; COPY_FILE: none, its bytes go file
        to file on the write thread)."""
        if job.strategy is Strategy.COPY_FILE or (job.strategy is Strategy.BANDED and expert_banded(job)):
            return {}
        names = [job.source] if job.strategy is Strategy.WHOLE else []
        if job.fmt is not None:
            peer = job.fmt.row_scales.peer if job.fmt.row_scales else None
            names += [n for n in (job.fmt.scale, job.fmt.global_scale, peer) if n]
        return {n: self.readers.of(n).read_tensor(self.index.entry(n)) for n in names}

    def _buffer(self, kind: str, slot: int, nbytes: int) -> torch.Tensor:
        """A reused uint8 buffer, aligned for direct reads."""
        buf = self._buffers.get((kind, slot))
        if buf is None or buf.numel() < nbytes:
            buf = aligned_empty(nbytes)
            self._buffers[(kind, slot)] = buf
        return buf[:nbytes]

    def _forget_shard(self) -> None:
        """After an error, once RunThreads.cancel() has dropped or waited for every task: the shard's state."""
        self._to_read.clear()
        self._reads.clear()
        self._writes.clear()
        self._scale_writes.clear()
        self._out_slots = [_OutSlot() for _ in range(OUT_SLOTS)]
