"""Peak memory is one tensor (plus its scale and output), not a shard: it must not grow with size."""

from __future__ import annotations

import hashlib

import pytest
import torch

from tests.support.helpers import fp8_block_config, load_dir, peak_rss_kib, write_checkpoint


def _peak_rss_kib(tmp_path, n_weights: int, band_elements: int = 1 << 22) -> int:
    tensors = {}
    gen = torch.Generator().manual_seed(n_weights)
    for i in range(n_weights):  # 8 MiB of FP8 each, 16 MiB of bf16 out
        codes = torch.randint(0, 126, (2048, 4096), generator=gen, dtype=torch.uint8)
        tensors[f"layers.{i}.w.weight"] = codes.view(torch.float8_e4m3fn)
        tensors[f"layers.{i}.w.weight_scale_inv"] = torch.rand(16, 32, generator=gen)
    src = write_checkpoint(tmp_path / f"in{n_weights}", tensors, fp8_block_config(), shards=2)
    del tensors
    return peak_rss_kib(src, tmp_path / f"out{n_weights}", "bf16", band_elements=band_elements)


@pytest.mark.parametrize("band_elements", [1 << 22, 1 << 30], ids=["banded", "whole"])
def test_peak_memory_does_not_grow_with_checkpoint_size(tmp_path, band_elements):
    """Weights streamed in bands, and (bands larger than any weight) read and rewritten whole."""
    small = _peak_rss_kib(tmp_path, 2, band_elements)  # 16 MiB in
    # 192 MiB in, 384 MiB out: whole-shard buffering would add ~290 MiB
    large = _peak_rss_kib(tmp_path, 24, band_elements)
    assert large - small < 64 * 1024, f"peak RSS grew from {small} KiB to {large} KiB"


def test_max_memory_caps_peak_rss(tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i in range(3):  # 16M elements each: whole, one would need ~150 MB of temporaries
        tensors[f"layers.{i}.w.weight"] = torch.randint(0, 126, (4096, 4096), generator=gen, dtype=torch.uint8).view(
            torch.float8_e4m3fn
        )
        tensors[f"layers.{i}.w.weight_scale_inv"] = torch.rand(32, 32, generator=gen) + 0.1
    src = write_checkpoint(tmp_path / "in", tensors, fp8_block_config())
    from fp8conv.plan.bands import lowest_max_memory

    cap = lowest_max_memory()  # the lowest cap accepted: ~288 MiB
    peak = peak_rss_kib(src, tmp_path / "out", "channel", max_memory=cap)
    assert peak * 1024 <= cap, f"peak {peak} KiB over the {cap} byte cap"


def test_max_memory_refusals_come_before_any_work(tmp_path, make_tiny):
    import fp8conv
    from fp8conv import ConvertOptions, RunOptions
    from fp8conv.errors import OptionsError

    ckpt = make_tiny()
    with pytest.raises(OptionsError, match="below what a run needs"):
        fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=100 * 2**20))
    w = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    src = write_checkpoint(tmp_path / "bf16", {"model.layers.0.mlp.up_proj.weight": w}, None)
    with pytest.raises(OptionsError, match="rewritten whole and needs") as info:
        fp8conv.convert(src, tmp_path / "out2", ConvertOptions(to="block"), run=RunOptions(max_memory=300 * 2**20))
    assert "model.layers.0.mlp.up_proj.weight" in str(info.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


def test_the_cap_counts_what_the_write_side_holds(tmp_path, monkeypatch):
    """What --max-memory subtracts for the write thread (stream.write_limits(cap).nbytes, the dry run's
    figure) bounds what it really holds under the cap: a shard writer's segment buffers while a tensor
    arrives back to front (every segment completes ahead of the hash and is kept while there is room),
    the next shard's writer started before that one commits (as the scheduler overlaps them), and the
    scheduler's copy buffer. Counted from the buffers allocated and still alive, not from RSS."""
    import weakref
    from types import SimpleNamespace

    import fp8conv.storage.writer as writer_module
    from fp8conv.options import ConvertOptions, RunOptions
    from fp8conv.plan import bands as stream
    from fp8conv.run import scheduler
    from fp8conv.run.dry_run import dry_run
    from fp8conv.storage.writer import SEGMENT_BYTES, ShardWriter, TensorSpec

    cap = stream.lowest_max_memory()
    limits = stream.write_limits(cap)
    live, peak = [0], [0]

    def tracked(nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)  # aligned enough: no direct I/O here
        live[0] += nbytes
        peak[0] = max(peak[0], live[0])
        weakref.finalize(buffer, lambda: live.__setitem__(0, live[0] - nbytes))
        return buffer

    monkeypatch.setattr(writer_module, "aligned_empty", tracked)
    monkeypatch.setattr(scheduler, "aligned_empty", tracked)
    plan = SimpleNamespace(options=SimpleNamespace(quant_max=448.0))
    sched = scheduler.Scheduler(None, plan, None, None, False, None, cap)  # type: ignore[arg-type]
    parts = 12
    spec = TensorSpec("x", "U8", (parts * SEGMENT_BYTES,))
    data = torch.arange(parts * SEGMENT_BYTES, dtype=torch.int32).to(torch.uint8)
    first = ShardWriter(tmp_path / "a.safetensors", [spec], {}, False, max_segments=sched.limits.segments)
    for i in reversed(range(parts)):
        first.write_part("x", i * SEGMENT_BYTES, data[i * SEGMENT_BYTES : (i + 1) * SEGMENT_BYTES])
    second = ShardWriter(tmp_path / "b.safetensors", [spec], {}, False, max_segments=sched.limits.segments)
    first.commit()
    second.abort()
    assert peak[0] > sched.limits.segments * SEGMENT_BYTES  # the writer did fill its segments
    assert peak[0] <= limits.nbytes, f"{peak[0]} bytes held, {limits.nbytes} counted"
    assert hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest() == first.sha256
    # the dry run shows that figure, and the bands get what is left of the cap
    ckpt = write_checkpoint(tmp_path / "in", {"w.weight": torch.zeros(8, 8, dtype=torch.bfloat16)}, None)
    summary = dry_run(ckpt, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=cap))
    assert summary.writer_bytes == limits.nbytes
    banded = stream.band_elements_for(cap) * stream.BYTES_PER_BAND_ELEMENT
    assert stream.BASE_BYTES + limits.nbytes + banded <= cap


def test_bands_of_long_rows_count_whole_blocks_of_rows(tmp_path):
    """A band is at least one block of rows: 128 rows of an 18432-wide weight (DeepSeek's down_proj) are
    2.4 MB in and 4.7 MB of bf16 out, held IN_SLOTS and OUT_SLOTS times, over what the lowest cap leaves
    the bands. Refused before anything is written, naming the tensor and the cap that holds it; that
    cap converts it."""
    import fp8conv
    from fp8conv import ConvertOptions, RunOptions
    from fp8conv.errors import OptionsError
    from fp8conv.plan.bands import lowest_max_memory

    name = "model.layers.0.mlp.down_proj.weight"
    codes = torch.randint(0, 126, (256, 18432), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    tensors = {name: codes.view(torch.float8_e4m3fn), name + "_scale_inv": torch.rand(2, 144) + 0.1}
    src = write_checkpoint(tmp_path / "in", tensors, fp8_block_config())
    with pytest.raises(OptionsError, match=f"tensor {name} streams in bands that") as info:
        fp8conv.convert(
            src, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=lowest_max_memory())
        )
    assert not (tmp_path / "out").exists()
    cap = int(info.value.fix.removeprefix("raise --max-memory to ").removesuffix("M or more")) * 2**20
    fp8conv.convert(src, tmp_path / "out", ConvertOptions(to="bf16"), run=RunOptions(max_memory=cap))
    got = load_dir(tmp_path / "out")[name]
    assert got.dtype == torch.bfloat16 and got.shape == (256, 18432)
