"""`fp8conv verify`: read an output back and check it against its input and the plan that made it.

Structure (always, every tensor): the shard files, tensor names, dtypes and shapes the plan expects,
the index (weight map and total_size) and config.json. Numbers (every tensor, or a deterministic
`sample` fraction): copies byte-identical; bf16 bit-identical to one rounding of the float32 product;
channel and block FP8 within the FP8 rounding bound |q*s - w| <= 2^-4 |w| + amax * 2^-9 of the
dequantized input (amax per row, or per block), and bit-identical to the reference backend; E8M0 scales
(ue8m0 blocks, MXFP8) within |q*s - w| <= 2^-4 |w| + s * 2^-9 + max(|w| - 448 s, 0), saturating
only where requantizing FP8 chose to, and bit-identical to the reference backend. The numbers
are read and checked in row bands of whole blocks (fp8conv.check.verify_bands): a few bands in memory at once.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ..backends.scales import scale_to_float32
from ..backends.torch_device import TorchDeviceBackend
from ..dtypes import FP8_MAX_STANDARD
from ..errors import OutputError
from ..model.classify import PACKED, classify
from ..model.family_widths import width_disagreements
from ..options import DEFAULT_TUNING, ConvertOptions, Tuning
from ..output.manifest import MANIFEST, Manifest, load_manifest
from ..plan.conversion import Action, ConversionPlan, Job, ShardPlan, plan_conversion
from ..plan.lora_merge import merge_options, with_lora_merge
from ..records import collector_paused
from ..rewrite.chunks import in_chunks
from ..rewrite.dequant import dequantize, stored_scale
from ..rewrite.jobs import run_job
from ..rewrite.lora_merge import AdapterTensors
from ..rewrite.pad import pad_to
from ..rewrite.unpack import unpack_to_float32
from ..source.checkpoint import open_checkpoint
from ..source.config import CONFIG_NAME, MISTRAL_PARAMS_NAME
from ..source.index import INDEX_NAME, CheckpointIndex
from ..storage.header import read_header
from ..storage.json_file import read_json_object
from ..storage.out_dir import OutDir
from ..storage.safetensors_file import ShardHeader, read_tensor
from .engine_layouts import engine_layout_problems
from .sampling import sampled
from .verify_bands import JobBands, pieces


@dataclass
class VerifyResult:
    ok: bool
    tensors_checked: int
    tensors_sampled: int
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0


def verify(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: ConvertOptions | None = None,
    *,
    sample: float = 1.0,
    max_failures: int = 20,
    tuning: Tuning = DEFAULT_TUNING,
) -> VerifyResult:
    """`tuning`: its verify_band_elements size the bands the numbers are checked in (never the verdict)."""
    started = time.monotonic()
    out = Path(output)
    if out.is_dir():  # a link in OUT would be read (and uploaded) as if it were the output's own file
        with OutDir.open(out, create=False) as within:
            within.refuse_links()
    manifest = load_manifest(out) if options is None or (out / MANIFEST).is_file() else None
    options, adapter = merge_options(options or manifest.convert_options())  # --merge-lora: the same adapter
    with collector_paused():
        ckpt = open_checkpoint(source)
        plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.classification_config(), options.block_size), options)
        if adapter is not None:
            plan, adapter = with_lora_merge(plan, adapter, ckpt, str(source))
    tensors = None if adapter is None else AdapterTensors(adapter)
    check = OutputCheck(ckpt.index, plan, out, sample, max_failures, tuning.verify_band_elements, tensors)
    try:
        check.documents()
        for shard in plan.shards:
            check.shard(shard, manifest)
        check.engine_layouts()
    finally:
        if tensors is not None:
            tensors.close()
    return check.result(time.monotonic() - started)


class OutputCheck:
    """verify, one output shard at a time: `convert --stream --verify` checks each shard as soon as it is
    committed, while the input shards it was made from are still on disk."""

    def __init__(
        self,
        index: CheckpointIndex,
        plan: ConversionPlan,
        out: Path,
        sample: float,
        max_failures: int,
        band_elements: int,  # verify's bands: ~this many elements (Tuning.verify_band_elements)
        adapter: AdapterTensors | None = None,  # --merge-lora's tensors, for the merged weights
    ):
        self.index, self.plan, self.out, self.sample = index, plan, out, sample
        self.adapter = adapter
        self.max_failures, self.band_elements = max_failures, band_elements
        self.failures: list[str] = []
        self.checked = self.sampled = 0
        self.reference = TorchDeviceBackend("cpu")
        self.seconds = 0.0  # spent checking shards

    def fail(self, message: str) -> None:
        if len(self.failures) < self.max_failures:
            self.failures.append(message)

    def documents(self) -> None:
        """What only the whole output can show: index, config, widths, stray shards."""
        _check_documents(self.out, self.plan, self.fail)
        _check_widths(self.out, self.fail)
        planned = {s.name for s in self.plan.shards}
        for stray in sorted(p.name for p in self.out.glob("*.safetensors") if p.name not in planned):
            self.fail(f"{stray}: a shard the plan does not write (the index does not list it)")

    def engine_layouts(self) -> None:
        """The layouts engines read specially, read from the output's own config.json and tensors as the
        engines read them (engine_layouts.py), against the input's exact decode: not against the plan."""
        config = _read_output_json(self.out, CONFIG_NAME, lambda _: None)  # reported by documents()
        headers = {p.name: read_header(p) for p in sorted(self.out.glob("*.safetensors"))}
        where = {name: shard for shard, h in headers.items() for name in h.tensors}
        tensors = {name: (e.dtype, e.shape) for h in headers.values() for name, e in h.tensors.items()}
        sources = {job.spec.name: job for shard in self.plan.shards for job in shard.jobs}

        def read_out(name: str) -> torch.Tensor:
            header = headers[where[name]]
            fd = os.open(header.path, os.O_RDONLY)
            try:
                return read_tensor(fd, header.tensors[name], header.path.name)
            finally:
                os.close(fd)

        def truth(name: str) -> torch.Tensor | None:
            job = sources.get(name)
            if job is None or job.fmt is None or job.fmt.scale is None or job.fmt.kind in PACKED:
                return None
            read = self._read_in
            return dequantize(read(job.source), stored_scale(read, job.fmt), job.fmt, torch.float32, self.reference)

        for problem in engine_layout_problems(config, tensors, read_out, truth):
            self.fail(problem)

    def _read_in(self, name: str) -> torch.Tensor:
        src = self.index.shard_of(name)
        fd = os.open(self.index.root / src.name, os.O_RDONLY)
        try:
            return read_tensor(fd, self.index.entry(name), src.name)
        finally:
            os.close(fd)

    def result(self, seconds: float) -> VerifyResult:
        return VerifyResult(not self.failures, self.checked, self.sampled, list(self.failures), seconds)

    def shard(self, shard: ShardPlan, manifest: Manifest | None) -> None:
        """Its hash against the manifest, its structure against the plan, and its numbers."""
        started = time.monotonic()
        try:
            self._shard(shard, manifest)
        finally:
            self.seconds += time.monotonic() - started

    def _shard(self, shard: ShardPlan, manifest: Manifest | None) -> None:
        out = self.out
        path = out / shard.name
        recorded = manifest is not None and shard.name in manifest.shards and path.is_file()
        if recorded and manifest is not None and not manifest.shard_intact(out, shard.name):
            self.fail(f"{shard.name}: size or sha256 differs from the manifest")
        if not path.is_file():
            self.fail(f"{shard.name}: missing")
            return
        header = read_header(path)
        expected = {s.name: (s.dtype, s.shape) for s in shard.specs}
        got = {n: (e.dtype, e.shape) for n, e in header.tensors.items()}
        for name in sorted(set(expected) | set(got)):
            if expected.get(name) != got.get(name):
                self.fail(f"{shard.name}: {name}: expected {expected.get(name)}, found {got.get(name)}")
        read_in = self._read_in
        fd_out = os.open(path, os.O_RDONLY)
        try:
            for job in shard.jobs:
                self.checked += 1
                if not sampled(job.source, self.sample) or any(o.name not in header.tensors for o in job.outputs):
                    continue
                self.sampled += 1
                for message in self._numbers(job, header, fd_out, read_in):
                    self.fail(f"{shard.name}: {message}")
        finally:
            os.close(fd_out)

    def _numbers(self, job: Job, header: ShardHeader, fd_out: int, read_in) -> list[str]:
        """_check_job's findings, band by band (verify_bands): a few bands in memory, never a large tensor
        whole; the first band that fails stands for the tensor."""
        fp8_max = self.plan.options.quant_max
        if job.action is Action.COPY and len(job.outputs) > 1:  # a weight kept as stored, with its scale:
            # each a copy of its own, checked band by band (a 91 GiB Engram table never whole)
            copies = [replace(job, source=o.name, outputs=(o,), fmt=None) for o in job.outputs]
            return [p for one in copies for p in self._numbers(one, header, fd_out, read_in)]
        bands = JobBands(job, self.index, header, header.path.name, read_in)
        as_planned = all(
            (header.tensors[o.name].dtype, header.tensors[o.name].shape) == (o.dtype, o.shape) for o in job.outputs
        )
        piece_list = pieces(job, bands.shape, self.band_elements) if as_planned and job.merge is None else None
        if piece_list is None:  # a norm, a bias, a merged weight; or an output not as planned: whole
            got = [read_tensor(fd_out, header.tensors[o.name], header.path.name) for o in job.outputs]
            if job.merge is not None:
                return _check_merged(job, got, read_in, self.reference, fp8_max, self.adapter)
            return _check_job(job, got, read_in, self.reference, fp8_max)
        for band_job, got, read_band in bands.bands(piece_list):
            problems = _check_job(band_job, got, read_band, self.reference, fp8_max)
            if problems:
                return problems
        return []


def _read_output_json(out: Path, rel: str, fail) -> dict[str, Any] | None:
    """A JSON file of the output, or None once `fail` has been told why it cannot be used."""
    try:
        return read_json_object(out / rel, fix="convert again", error=OutputError)
    except OutputError as exc:
        fail(f"{rel}: {exc.problem}")
        return None


def _check_documents(out: Path, plan: ConversionPlan, fail) -> None:
    if plan.write_index:
        index = _read_output_json(out, INDEX_NAME, fail)
        if index is not None:
            expected = plan.index_document()
            if index.get("weight_map") != expected["weight_map"]:
                fail(f"{INDEX_NAME}: weight_map differs from the plan")
            metadata = index.get("metadata")
            if not isinstance(metadata, dict) or metadata.get("total_size") != expected["metadata"]["total_size"]:
                fail(f"{INDEX_NAME}: total_size is not {expected['metadata']['total_size']}")
    if plan.config is not None:
        config = _read_output_json(out, CONFIG_NAME, fail)
        if config is None:
            return
        if plan.options.scale_fmt is not None and (config.get("quantization_config") or {}).get("scale_fmt") != (
            plan.options.scale_fmt
        ):
            fail(f"{CONFIG_NAME}: quantization_config does not say scale_fmt {plan.options.scale_fmt}")
        if _without_scale_fmt(config) != _without_scale_fmt(plan.config):
            fail(f"{CONFIG_NAME}: differs from what the plan writes")
    for rel, doc in plan.json_files.items():  # params.json: its quantization entry must match the output
        written = _read_output_json(out, rel, fail)
        if written is not None and written != doc:
            fail(f"{rel}: differs from what the plan writes")
    for rel, _ in plan.skipped_files:
        if rel == MISTRAL_PARAMS_NAME and (out / rel).exists():
            fail(f"{rel}: present, but it cannot describe this output")


def _without_scale_fmt(config: dict[str, Any]) -> dict[str, Any]:
    """scale_fmt is decided from the written scales (or written by --scale-fmt, checked on its own)."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return config
    return {**config, "quantization_config": {k: v for k, v in quant.items() if k != "scale_fmt"}}


def _check_widths(out: Path, fail) -> None:
    """Independently of the plan: the output's config.json and its tensors agree on every MLP width, as
    transformers and vLLM need to build the model."""
    config = _read_output_json(out, CONFIG_NAME, lambda _: None)  # reported by _check_documents
    if config is None:
        return
    tensors = [
        (name, entry.shape, path.name)
        for path in sorted(out.glob("*.safetensors"))
        for name, entry in read_header(path).tensors.items()
    ]
    for problem in width_disagreements(config, tensors, "config.json and the tensors disagree"):
        fail(problem.one_line())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _check_merged(
    job: Job, got: list[torch.Tensor], read_in, reference, fp8_max: float, adapter: AdapterTensors | None
) -> list[str]:
    """A merged weight: the input's float32 values plus the adapter's delta, rounded once as the job says,
    recomputed on the reference backend (rewrite.lora_merge: the same bytes on every backend)."""
    expected = run_job(job, read_in, reference, fp8_max, adapter=adapter)
    if all(_same_bits(g, e) for g, e in zip(got, expected, strict=True)):
        return []
    return [f"{job.spec.name}: not the merged weight (input + the adapter's delta) rounded once as planned"]


def _check_job(job: Job, got: list[torch.Tensor], read_in, reference, fp8_max: float) -> list[str]:
    name = job.spec.name
    if job.action is Action.COPY:  # (with its scale, when kept as stored)
        expected = run_job(job, read_in, reference, fp8_max)
        same = all(_same_bits(g, e) for g, e in zip(got, expected, strict=True))
        return [] if same else [f"{name}: not byte-identical to the input"]
    if job.action is Action.DEQUANTIZE:
        expected = run_job(job, read_in, reference, fp8_max)[0]
        return [] if _same_bits(got[0], expected) else [f"{name}: not one rounding of the float32 product"]
    problems = []
    expected = run_job(job, read_in, reference, fp8_max)
    if not all(_same_bits(g, e) for g, e in zip(got, expected, strict=True)):
        problems.append(f"{name}: differs from the reference backend's output")
    # independent of any backend: the FP8 rounding bound against the dequantized input
    if job.fmt is not None and job.fmt.kind in PACKED:
        truth = unpack_to_float32(read_in, job.fmt, reference)
    elif job.fmt is not None:
        truth = dequantize(read_in(job.source), stored_scale(read_in, job.fmt), job.fmt, torch.float32, reference)
    else:
        truth = read_in(job.source).to(torch.float32)
    q, scale = got[0].to(torch.float32), scale_to_float32(got[1])
    if job.out_chunks > 1:  # rows in chunks, each on its own grid: the chunks as experts of a 3-D weight
        q, scale, truth = (in_chunks(t, job.out_chunks) for t in (q, scale, truth))
    n, k = q.shape[-2], q.shape[-1]
    bn, bk = job.out_block or (1, k)
    full_scale = scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    truth = pad_to(truth, tuple(q.shape), 0.0, job.pad_parts)
    if job.action is Action.QUANTIZE_POW2:
        return problems + _pow2_problems(job, q, full_scale, truth)
    if got[0].dtype == torch.int8:  # integer steps of the row's scale: half a step, and float32's own rounding
        if not bool(((q * full_scale - truth).abs() <= full_scale * (0.5 + 2**-12) + truth.abs() * 2**-22).all()):
            problems.append(f"{name}: outside the INT8 rounding bound of the input (half a step of its row's scale)")
        return problems
    amax = full_scale * fp8_max
    if not bool(((q * full_scale - truth).abs() <= truth.abs() * 2**-4 + amax * 2**-9).all()):
        problems.append(f"{name}: outside the FP8 rounding bound of the input")
    return problems


def _pow2_problems(job: Job, q: torch.Tensor, scale: torch.Tensor, truth: torch.Tensor) -> list[str]:
    """E8M0 scales: every one a finite power of two; each value within e4m3's rounding at its scale, or
    clamped to 448 x it; clamped only when the input was FP8 (float inputs take the ceiling exponent)."""
    name = job.spec.name
    mantissa, _ = torch.frexp(scale)
    if not bool((mantissa == 0.5).all()):
        return [f"{name}: a scale is not a finite power of two (E8M0 byte 0xFF?)"]
    excess = (truth.abs() - FP8_MAX_STANDARD * scale).clamp_(min=0)
    if job.fmt is None and bool((excess > 0).any()):
        return [f"{name}: values saturate, but a float input's scale is the ceiling power of two"]
    if not bool(((q * scale - truth).abs() <= truth.abs() * 2**-4 + scale * 2**-9 + excess).all()):
        return [f"{name}: outside the FP8 rounding bound of the input at its power-of-two scale"]
    return []
