"""Row-band streaming of large 2-D FP8 and packed 4-bit weights: read a band of rows, rewrite it, write
it, while the next band is read and the previous ones are written. Memory per job is a few bands, not a tensor, and
the band buffers are reused, so there are no page faults for fresh allocations."""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .backends import Backend
from .direct_io import aligned_empty
from .dtypes import ELEMENT_BYTES, torch_dtype
from .formats import CONVERTIBLE, PACKED, Kind
from .plan import Action, Job
from .rewrite.dequant import scale_grid
from .rewrite.unpack import band_decoder, band_quantizer
from .safetensors_file import TensorEntry
from .shard_reader import ShardReader, read_capacity
from .writer import ShardWriter

BAND_ELEMENTS = 1 << 22  # ~4M elements per band: 4 MB of FP8 in, 8 MB of bf16 out
OUT_SLOTS = 3  # bands that may wait for the writer
READ_AHEAD = 3  # band reads in flight ahead of the arithmetic, across tensors
BAND_WORKERS = 2  # bands computed at once, one torch thread each (a pool the pipeline sizes to the cores)
IN_SLOTS = READ_AHEAD + BAND_WORKERS  # input bands held: those read ahead and those being computed
# Bytes held per band element at once: IN_SLOTS input bands (1 B) and OUT_SLOTS output bands (up to
# 4 B); the float32 work happens in the backend's cache-sized chunks, counted in BASE_BYTES.
BYTES_PER_BAND_ELEMENT = IN_SLOTS * 1 + OUT_SLOTS * 4
# What a run holds besides the bands: Python, torch, the backend's cache-sized scratch (measured:
# VmHWM 255 MB converting a checkpoint too small to stream; ~290 MB with the default bands).
BASE_BYTES = 256 * 2**20
MIN_BAND_BYTES = 16 * 2**20


def band_elements_for(max_memory: int | None) -> int:
    """Elements per band under a memory cap (the default when there is none)."""
    if max_memory is None:
        return BAND_ELEMENTS
    return max(1, min(BAND_ELEMENTS, (max_memory - BASE_BYTES) // BYTES_PER_BAND_ELEMENT))


def whole_tensor_bytes(job: Job, entry: TensorEntry) -> int:
    """What rewriting a tensor whole holds at once: its input, its outputs and a float32 copy."""
    return entry.nbytes + job.nbytes + 4 * math.prod(job.spec.shape)


def streamable(job: Job, entry: TensorEntry, band_elements: int | None = None) -> bool:
    band_elements = BAND_ELEMENTS if band_elements is None else band_elements
    if job.fmt is not None and job.fmt.kind in PACKED:  # 2-D packed 4-bit weights
        return (
            job.action in (Action.DEQUANTIZE, Action.QUANTIZE)
            and job.fmt.kind is not Kind.MXFP4_GPT_OSS  # its experts are written transposed
            and len(entry.shape) == 2
            and job.spec.shape == job.fmt.shape
            and math.prod(job.spec.shape) > band_elements
        )
    return (
        job.action in (Action.DEQUANTIZE, Action.QUANTIZE)
        and job.fmt is not None
        and job.fmt.kind in CONVERTIBLE
        and len(entry.shape) == 2
        and job.spec.shape == entry.shape
        and entry.numel > band_elements
    )


class BandStreamer:
    def __init__(
        self,
        reader: ThreadPoolExecutor,
        writer: ThreadPoolExecutor,
        backend: Backend,
        fp8_max: float,
        band_elements: int | None = None,
        compute: ThreadPoolExecutor | None = None,
    ) -> None:
        """compute: a pool of at most BAND_WORKERS threads that compute bands side by side (None: on the
        calling thread); the backend must then be safe to call from several threads."""
        self.reader, self.writer, self.backend, self.fp8_max = reader, writer, backend, fp8_max
        self.compute = compute
        self.band_elements = BAND_ELEMENTS if band_elements is None else band_elements
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        # per output slot, the band's computation, which returns the band's write (see run()); kept across
        # jobs: a job's last bands are written while the next job starts (draining them at every job's
        # end left the main thread waiting ~13% of a channel run)
        self._pending: list[Future[Future[None]] | None] = [None] * OUT_SLOTS
        self._computing: deque[Future[Future[None]]] = deque()  # the last bands handed to compute, oldest first
        self._scales: list[Future[None]] = []
        # band reads run ahead of the arithmetic across tensors, so a tensor's first band is not waited
        # for (measured, 4 GiB --to channel: the main thread waited 1.7 s on reads with one band ahead
        # within a tensor)
        self._expected: deque[tuple[Job, TensorEntry, ShardReader]] = deque()  # streamed jobs to read
        self._next_band = 0  # of _expected[0]
        self._reads: deque[tuple[str, int, Future[torch.Tensor]]] = deque()  # (tensor, band, read)
        self._read_count = 0  # reads submitted; a read's input buffer is slot read_count % IN_SLOTS

    def expect(self, job: Job, entry: TensorEntry, source: ShardReader) -> None:
        """Announce a job run() will stream, in run() order, so its bands can be read ahead."""
        self._expected.append((job, entry, source))
        self._read_ahead()

    def flush(self) -> None:
        """Wait for every write this streamer has handed the writer, and drop reads ahead (after an error
        they are not needed); the first write failure is raised."""
        computes = [f for f in self._pending if f is not None]
        futures = [f.result() for f in computes if f.exception() is None] + self._scales
        errors = [e for e in (f.exception() for f in computes) if e is not None]
        self._pending, self._scales = [None] * OUT_SLOTS, []
        self._computing.clear()
        reads = [f for _, _, f in self._reads if not f.cancel()]
        self._reads.clear()
        self._expected.clear()
        self._next_band = 0
        for read in reads:  # still running into a buffer: let it finish
            read.exception()
        errors += [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise errors[0]

    def _band_rows(self, job: Job, entry: TensorEntry) -> int:
        """Rows per band: whole input blocks (and whole output blocks when quantizing), ~band_elements."""
        assert job.fmt is not None
        n, k = job.spec.shape  # the output's: a packed weight's input rows hold K/2 bytes
        out_rows_block = (job.out_block or (1, k))[0] if job.action is Action.QUANTIZE else 1
        unit = math.lcm(job.fmt.math_block((n, k))[0], out_rows_block)
        return max(unit, (self.band_elements // max(k, 1)) // unit * unit)

    def _read_ahead(self) -> None:
        """Keep READ_AHEAD band reads in flight. With the bands being computed that is IN_SLOTS buffers in
        use: a read takes the slot of the band BAND_WORKERS before the one just taken, which run() has
        waited for."""
        while len(self._reads) < READ_AHEAD and self._expected:
            job, entry, source = self._expected[0]
            n = entry.shape[0]
            row_bytes = entry.nbytes // n  # K for FP8, K/2 for packed 4-bit
            rows = self._band_rows(job, entry)
            r0 = self._next_band * rows
            r = min(rows, n - r0)
            buf = self._buffer("in", self._read_count % IN_SLOTS, read_capacity(r * row_bytes))
            read = self.reader.submit(source.read, entry, entry.start + r0 * row_bytes, r * row_bytes, buf)
            self._reads.append((entry.name, self._next_band, read))
            self._read_count += 1
            self._next_band += 1
            if r0 + r >= n:
                self._expected.popleft()
                self._next_band = 0

    def _band(self, entry: TensorEntry, index: int, rows: int) -> torch.Tensor:
        """Band `index` of `entry`, read ahead, as its bytes, [1, rows, bytes per row]."""
        if not self._reads or self._reads[0][:2] != (entry.name, index):
            raise RuntimeError(f"{entry.name}: band {index} was not read ahead (streamed out of expect() order)")
        read = self._reads.popleft()[2]
        self._read_ahead()
        return read.result().view(1, rows, entry.nbytes // entry.shape[0])

    def _buffer(self, key: str, slot: int, nbytes: int) -> torch.Tensor:
        """A reused uint8 buffer, aligned for direct reads."""
        buf = self._buffers.get((key, slot))
        if buf is None or buf.numel() < nbytes:
            buf = aligned_empty(nbytes)
            self._buffers[(key, slot)] = buf
        return buf[:nbytes]

    def run(
        self,
        job: Job,
        entry: TensorEntry,
        source: ShardReader,
        scale: torch.Tensor,
        out: ShardWriter,
        global_scale: torch.Tensor | None = None,
        exactness: list[int] | None = None,
    ) -> torch.Tensor | None:
        """Stream one job, announced with expect(); returns the new scale tensor for a QUANTIZE job
        (written too). The writes may still be in flight when this returns: flush() before the shard is
        committed. global_scale: a packed NVFP4 weight's; exactness: [exact, total] output blocks, added
        to for a packed weight quantized to FP8."""
        assert job.fmt is not None
        n, k = job.spec.shape
        quantize = job.action is Action.QUANTIZE
        packed, decode, requant = job.fmt.kind in PACKED, None, None
        if packed and quantize:
            ob = job.out_block or (1, k)
            requant = band_quantizer(job.fmt, scale, global_scale, self.backend, ob, self.fp8_max)
        elif packed:
            decode = band_decoder(job.fmt, scale, global_scale, self.backend)
        grid = scale if packed else scale_grid(scale, job.fmt, (n, k))[0]
        in_block = job.fmt.math_block((n, k))
        counts: list[tuple[int, int]] = []  # packed to FP8: exact and all output blocks, per band
        rows = self._band_rows(job, entry)
        starts = list(range(0, n, rows))
        out_dtype = torch_dtype(job.spec.dtype)
        out_size = ELEMENT_BYTES[job.spec.dtype]
        new_scale = torch.ones(job.outputs[1].shape, dtype=torch.float32) if quantize else None

        def compute(w: torch.Tensor, band: torch.Tensor, r0: int) -> Future[None]:
            """One band's arithmetic; hands its write to the writer and returns that."""
            fp8 = w.view(torch.float8_e4m3fn)  # packed: the bytes, read by the decoder
            g0, g1 = r0 // in_block[0], -(-(r0 + w.shape[1]) // in_block[0])
            if quantize:
                assert new_scale is not None
                ob = job.out_block or (1, k)
                o0, o1 = r0 // ob[0], -(-(r0 + w.shape[1]) // ob[0])
                band_scale = torch.empty((1, o1 - o0, new_scale.shape[-1]), dtype=torch.float32)
                if requant is not None:
                    counts.append(requant(w, r0, band, band_scale))
                else:
                    self.backend.requantize_blocks(fp8, grid[g0:g1][None], in_block, ob, self.fp8_max, band, band_scale)
                new_scale.view(-1, new_scale.shape[-1])[o0:o1] = band_scale[0]  # rows of its own
            elif decode is not None:
                decode(w, r0, band)
            else:
                self.backend.dequantize_blocks(fp8, grid[g0:g1][None], in_block, band)
            return self.writer.submit(out.write_part, job.spec.name, r0 * k * out_size, band)

        pending = self._pending  # on an error the caller's flush() waits for these
        workers = BAND_WORKERS if self.compute is not None else 1
        for i, r0 in enumerate(starts):
            r = min(rows, n - r0)
            while len(self._computing) >= workers:  # frees the input slot the next read takes
                self._computing.popleft().result()
            w = self._band(entry, i, r)
            slot = i % OUT_SLOTS
            if pending[slot] is not None:
                pending[slot].result().result()  # the band that last used this buffer: computed and written
            band = self._buffer("out", slot, r * k * out_size).view(out_dtype).view(1, r, k)
            if self.compute is None:
                done: Future[Future[None]] = Future()
                done.set_result(compute(w, band, r0))
            else:
                done = self.compute.submit(compute, w, band, r0)
            pending[slot] = done
            self._computing.append(done)
        while self._computing:  # every band's arithmetic, before the new scale is read
            self._computing.popleft().result()
        if exactness is not None and counts:
            exactness[0] += sum(e for e, _ in counts)
            exactness[1] += sum(t for _, t in counts)
        if new_scale is not None:  # after the bands, in the writer's order
            self._scales.append(self.writer.submit(out.write_tensor, job.outputs[1].name, new_scale))
        return new_scale
