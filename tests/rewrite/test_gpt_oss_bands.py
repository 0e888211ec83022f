"""gpt-oss's fused MXFP4 experts (*_blocks [E, N, K/32, 16] + *_scales [E, N, K/32]) streamed to bf16,
float16 and float32 in bands of their transposed output [E, K, N]: whole experts per band or slices of one
expert's output rows. The same files as written whole, the definition's values rounded once, on both
backends; and the lowest --max-memory converts an expert tensor larger than itself."""

from __future__ import annotations

import itertools

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.options import DEFAULT_TUNING, Tuning
from tests.support.gpt_oss_builders import GPT_OSS_CONFIG, GPT_OSS_SHAPES, build_gpt_oss
from tests.support.helpers import dir_snapshot, load_dir, peak_rss_kib, write_checkpoint
from tests.support.packing import e2m1_value, e8m0_value, group_scaled
from tests.support.reference import same_bits

# output rows per band, from the output's K: 32-row slices (3 per expert of K = 96), 64-row slices (the last
# one short), one expert, two experts (the last band short), or the plan's own choice (None)
LAYOUTS = {
    "slices": lambda k: 32,
    "uneven slices": lambda k: 64,
    "one expert": lambda k: k,
    "two experts": lambda k: 2 * k,
    "chosen": None,
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_gpt_oss_experts_stream_in_bands_with_identical_output(tmp_path, monkeypatch, dtype):
    import fp8conv.plan.bands as stream
    from fp8conv.rewrite.experts import ExpertBands

    truth = build_gpt_oss(tmp_path / "c", GPT_OSS_SHAPES)
    options = ConvertOptions(to="bf16", dtype=dtype)
    fp8conv.convert(tmp_path / "c", tmp_path / "whole", options)  # tiny tensors: written whole
    whole = dir_snapshot(tmp_path / "whole")
    got = load_dir(tmp_path / "whole")
    for name, value in truth.items():
        assert same_bits(got[name], value.to(torch.float32).to(getattr(torch, dtype))), name

    streamed: list[tuple[str, int]] = []
    real_init = ExpertBands.__init__
    monkeypatch.setattr(
        ExpertBands,
        "__init__",
        lambda self, job, b: streamed.append((job.spec.name, job.band_rows)) or real_init(self, job, b),
    )
    small = Tuning(convert_band_elements=700)
    real_rows = stream.expert_band_rows
    for layout, rows_of in LAYOUTS.items():
        forced = real_rows if rows_of is None else (lambda job, _, f=rows_of: f(job.spec.shape[1]))
        monkeypatch.setattr(stream, "expert_band_rows", forced)
        for device in ("cpu", "reference") if layout == "uneven slices" else ("cpu",):
            streamed.clear()
            out = tmp_path / f"{layout}-{device}"
            fp8conv.convert(tmp_path / "c", out, options, run=RunOptions(device=device, tuning=small))
            assert dir_snapshot(out) == whole, (layout, device)
            assert sorted(n for n, _ in streamed) == sorted(list(GPT_OSS_SHAPES)[:2]), layout  # the third is too small
            if rows_of is not None:
                assert all(rows == rows_of(GPT_OSS_SHAPES[n][2]) for n, rows in streamed), (layout, streamed)


def test_gpt_oss_experts_to_bf16_in_bands_are_transformers_values(tmp_path, monkeypatch):
    """Against transformers' own MXFP4 decoder, bands slicing each expert's output rows."""
    pytest.importorskip("transformers")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    import fp8conv.plan.bands as stream

    build_gpt_oss(tmp_path / "c", GPT_OSS_SHAPES)
    monkeypatch.setattr(stream, "expert_band_rows", lambda job, _: 32)
    small = RunOptions(tuning=Tuning(convert_band_elements=700))
    fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"), run=small)
    src, got = load_dir(tmp_path / "c"), load_dir(tmp_path / "out")
    for name in GPT_OSS_SHAPES:
        assert same_bits(got[name], convert_moe_packed_tensors(src[name + "_blocks"], src[name + "_scales"])), name


def test_gpt_oss_experts_larger_than_the_lowest_memory_cap_stream_under_it(tmp_path):
    """A [36, 1536, 2880] bf16 output (318 MB, over the ~288 MiB cap itself; rewritten whole it would need
    ~1 GB, and the cap refused it) converts under the lowest --max-memory accepted: each band is a slice
    of one expert's output rows, all decoded from one read of that expert."""

    from safetensors import safe_open

    from fp8conv.plan.bands import lowest_max_memory

    e, n, k = 36, 2880, 1536
    name = "model.layers.0.mlp.experts.down_proj"
    gen = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    src = write_checkpoint(tmp_path / "in", {name + "_blocks": blocks, name + "_scales": scales}, GPT_OSS_CONFIG)
    cap = lowest_max_memory()
    assert e * k * n * 2 > cap
    peak = peak_rss_kib(src, tmp_path / "out", "bf16", max_memory=cap)
    assert peak * 1024 <= cap, f"peak {peak} KiB over the {cap} byte cap"
    with safe_open(str(tmp_path / "out" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_slice(name).get_shape() == [e, k, n]
        for x in (0, 17, e - 1):  # the definition: low nibble first, times 2^(b - 127), transposed
            b = blocks[x].reshape(n, k // 2)
            codes = torch.stack((b & 0xF, b >> 4), dim=-1).reshape(n, k)
            value = group_scaled(e2m1_value(codes), e8m0_value(scales[x]), 32).T.to(torch.float32)
            assert same_bits(f.get_slice(name)[x], value.to(torch.bfloat16)), x


def test_gpt_oss_expert_over_the_memory_cap_is_refused_by_name(tmp_path):
    """One [2880, 2880] expert: five reads of it ahead and in hand (4.4 MB each) do not fit the lowest
    cap's bands. Refused before anything is written, naming the tensor."""
    from fp8conv.plan.bands import lowest_max_memory

    name = "model.layers.0.mlp.experts.down_proj"
    blocks = torch.zeros((1, 2880, 90, 16), dtype=torch.uint8)
    scales = torch.full((1, 2880, 90), 127, dtype=torch.uint8)
    src = write_checkpoint(tmp_path / "in", {name + "_blocks": blocks, name + "_scales": scales}, GPT_OSS_CONFIG)
    cap = lowest_max_memory()
    with pytest.raises(fp8conv.OptionsError, match=f"tensor {name}_blocks streams in reads of whole gpt-oss experts"):
        fp8conv.convert(src, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=cap))
    assert not (tmp_path / "out" / "config.json").exists()
    fp8conv.convert(src, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=cap + 8 * 2**20))
    assert load_dir(tmp_path / "out")[name].shape == (1, 2880, 2880)


@pytest.mark.parametrize("dtype", ["BF16", "F32"])
@pytest.mark.parametrize(
    ("e", "n", "k"),
    [(128, 5760, 2880), (128, 2880, 2880), (36, 2880, 1536), (3, 37, 96)],  # gpt-oss-120b's two, the tests'
)
def test_gpt_oss_bands_tile_the_output_and_read_each_expert_once(e, n, k, dtype):
    """The plan alone, at real sizes: under the default bands, the lowest cap's and tiny ones, the bands
    cover the output rows [0, E * K) once, in order, each inside one expert (slices, in whole groups) or
    made of whole experts; every expert's blocks and scales are read once, in file order; the bands hold
    what the budget allows, or the least there is (one group's rows: --max-memory then refuses)."""
    from fp8conv.model.weight_format import Kind, WeightFormat
    from fp8conv.plan import bands as stream
    from fp8conv.plan.conversion import Action, Job, RunJob, Strategy, TensorSpec
    from fp8conv.storage.safetensors_file import TensorEntry

    fmt = WeightFormat("x_blocks", Kind.MXFP4_GPT_OSS, scale="x_scales", group=32, shape=(e, n, k))
    entry = TensorEntry("x_blocks", "U8", (e, n, k // 32, 16), 1000, e * n * k // 2)
    for band_elements in (
        DEFAULT_TUNING.convert_band_elements,
        stream.band_elements_for(stream.lowest_max_memory()),
        700,
        5000,  # (3, 37, 96) in bf16: two experts a band, then one
    ):
        job = Job("x_blocks", Action.DEQUANTIZE, (TensorSpec("x", dtype, (e, k, n)),), fmt)
        job = RunJob.of(job, Strategy.BANDED, stream.band_rows(job, band_elements))
        fits = stream.expert_band_bytes(job, job.band_rows) <= band_elements * stream.BYTES_PER_BAND_ELEMENT
        assert fits or job.band_rows == 32, (band_elements, job.band_rows)
        bands = stream.bands(job, entry)
        assert [b.r0 for b in bands] == list(itertools.accumulate([0] + [b.rows for b in bands[:-1]]))
        assert bands[-1].r0 + bands[-1].rows == e * k
        reads = [b.read for b in bands if b.read is not None]
        assert [(r.offset, r.scale_offset) for r in reads] == list(
            zip(
                itertools.accumulate([0] + [r.nbytes for r in reads[:-1]]),
                itertools.accumulate([0] + [r.scale_nbytes for r in reads[:-1]]),
                strict=True,
            )
        )
        assert sum(r.nbytes for r in reads) == entry.nbytes and sum(r.scale_nbytes for r in reads) == e * n * k // 32
        for b in bands:
            whole_experts = b.r0 % k == 0 and b.rows % k == 0
            assert whole_experts or (b.r0 % 32 == 0 and b.r0 // k == (b.r0 + b.rows - 1) // k), b
            assert (b.read is not None) == (b.r0 % k == 0), b  # a slice decodes from its expert's read
            if b.read is not None:
                assert b.read.nbytes == max(1, b.rows // k) * n * k // 2


@pytest.mark.parametrize("cap_mib", [317, 350, 400, 600])
def test_gpt_oss_bands_of_both_expert_shapes_fit_the_cap_together(cap_mib):
    """gpt-oss-120b's two expert tensors in one run: the scheduler keeps each band buffer at the largest
    size a job asked of it, so gate_up_proj's reads (8.8 MB an expert) stay while down_proj's wider output
    bands come. Under a cap the bands are sized for that (measured before, experts of both shapes under
    320M: VmHWM 338 MiB), and what they hold together fits what the cap leaves them."""
    from types import SimpleNamespace

    from fp8conv.model.weight_format import Kind, WeightFormat
    from fp8conv.plan import bands as stream
    from fp8conv.plan.conversion import Action, Job, Strategy, TensorSpec
    from fp8conv.plan.strategy import choose_strategies
    from fp8conv.storage.safetensors_file import TensorEntry

    jobs, entries = [], {}
    for name, (e, n, k) in {"gate_up_proj": (128, 5760, 2880), "down_proj": (128, 2880, 2880)}.items():
        fmt = WeightFormat(name + "_blocks", Kind.MXFP4_GPT_OSS, scale=name + "_scales", group=32, shape=(e, n, k))
        jobs.append(Job(name + "_blocks", Action.DEQUANTIZE, (TensorSpec(name, "BF16", (e, k, n)),), fmt))
        entries[name + "_blocks"] = TensorEntry(name + "_blocks", "U8", (e, n, k // 32, 16), 0, e * n * k // 2)
    plan = SimpleNamespace(shards=[SimpleNamespace(name="s", jobs=jobs)])
    index = SimpleNamespace(entry=entries.__getitem__)
    cap = cap_mib * 2**20
    jobs = choose_strategies(plan, index, stream.band_elements_for(cap), capped=True).jobs()  # type: ignore[arg-type]
    assert all(job.strategy is Strategy.BANDED for job in jobs)
    held = stream.bands_held([(job, entries[job.source]) for job in jobs])
    assert held <= cap - stream.fixed_bytes(cap), (held, cap - stream.fixed_bytes(cap))
