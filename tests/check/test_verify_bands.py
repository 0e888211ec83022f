"""verify reads and checks each tensor in bands of whole 128-row blocks: a wrong value in the last (ragged)
band is still found, and verify never reads or computes more than a band at once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.backends.torch_device import TorchDeviceBackend
from fp8conv.check import verify_bands
from fp8conv.model.classify import classify
from fp8conv.options import Tuning
from fp8conv.output.manifest import load_manifest
from fp8conv.plan.conversion import Job, plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from fp8conv.storage.header import read_header
from tests.support.families import build_family
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

N, K = 1000, 320  # 7 whole 128-row blocks and a ragged eighth of 104 rows; 2.5 blocks wide
WEIGHT = "model.layers.0.mlp.down_proj.weight"
EMBED = "model.embed_tokens.weight"  # copied as it is
SMALL_BANDS = Tuning(verify_band_elements=1)  # the fewest rows a band holds: one block row
BAND_ROWS = 128  # what SMALL_BANDS gives
MESSAGES = {
    "bf16": "not one rounding of the float32 product",
    "channel": "differs from the reference backend's output",
    "block": "differs from the reference backend's output",
}


def _checkpoint(path: Path) -> Path:
    gen = torch.Generator().manual_seed(3)
    tensors = {
        WEIGHT: fp8((N, K), seed=1),
        WEIGHT + "_scale_inv": torch.rand(8, 3, generator=gen) * 1e-2 + 1e-3,
        EMBED: torch.randn(N, K, generator=gen).to(torch.bfloat16),
    }
    return write_checkpoint(path, tensors, fp8_block_config(), shards=2)


def _flip_last_byte(out: Path, name: str) -> None:
    """The top byte of the tensor's last element: the last row of its ragged last band."""
    (path,) = [p for p in out.glob("*.safetensors") if name in read_header(p).tensors]
    entry = read_header(path).tensors[name]
    raw = bytearray(path.read_bytes())
    raw[entry.start + entry.nbytes - 1] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_a_wrong_value_in_the_last_ragged_band_is_found(tmp_path, to):
    src = _checkpoint(tmp_path / "in")
    good = tmp_path / "good"
    fp8conv.convert(src, good, ConvertOptions(to=to))
    assert fp8conv.verify(src, good, tuning=SMALL_BANDS).ok
    job = _job(src, good, WEIGHT)
    job_pieces = verify_bands.pieces(job, (N, K), SMALL_BANDS.verify_band_elements)  # 8 bands, the last one ragged
    assert job_pieces is not None and [p.out_rows for p in job_pieces][-2:] == [(768, 896), (896, 1000)]
    for name in (WEIGHT, EMBED):
        out = tmp_path / f"bad-{name}"
        shutil.copytree(good, out)
        _flip_last_byte(out, name)
        result = fp8conv.verify(src, out, tuning=SMALL_BANDS)
        message = "not byte-identical to the input" if name == EMBED else MESSAGES[to]
        assert not result.ok and any(f"{name}: {message}" in f for f in result.failures), result.failures
        mine = [f for f in result.failures if name in f]
        assert len(mine) == len(set(mine))  # each message once per tensor, not once per band


def _job(src: Path, out: Path, name: str) -> Job:
    ckpt = open_checkpoint(src)
    options = load_manifest(out).convert_options()
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config, options.block_size), options)
    return next(j for s in plan.shards for j in s.jobs if j.source == name)


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_verify_reads_and_computes_a_band_at_a_time(tmp_path, monkeypatch, to):
    """Every read verify issues and every tensor the reference backend writes for it is at most a band:
    a verify that read or dequantized a tensor whole would read N rows at once."""
    src = _checkpoint(tmp_path / "in")
    out = tmp_path / "out"
    fp8conv.convert(src, out, ConvertOptions(to=to))
    reads: list[int] = []
    computed: list[int] = []
    preadv = os.preadv

    def counting_preadv(fd, buffers, offset, *flags):
        reads.append(sum(len(b) for b in buffers))
        return preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(os, "preadv", counting_preadv)
    for method in ("dequantize_blocks", "quantize_blocks", "requantize_blocks"):
        original = getattr(TorchDeviceBackend, method)

        def counting(self, *args, _original=original):
            computed.append(max(a.numel() for a in args if isinstance(a, torch.Tensor)))
            return _original(self, *args)

        monkeypatch.setattr(TorchDeviceBackend, method, counting)
    assert fp8conv.verify(src, out, tuning=SMALL_BANDS).ok
    band = BAND_ROWS * K
    assert computed and max(computed) <= band, max(computed)
    assert max(reads) <= band * 2, max(reads)  # 2: a bf16 band, the largest element read
    assert len(reads) >= 2 * 8  # each tensor's 8 bands: the input's and the output's rows


def test_an_output_of_another_shape_is_reported_not_read_past(tmp_path):
    """The plan's bands do not fit a tensor written in another shape: verify reports it, as it did when it
    read every tensor whole, instead of reading rows the file does not hold."""
    src = _checkpoint(tmp_path / "in")
    out = tmp_path / "out"
    fp8conv.convert(src, out, ConvertOptions(to="bf16"))
    (path,) = [p for p in out.glob("*.safetensors") if WEIGHT in read_header(p).tensors]
    assert list(read_header(path).tensors)[-1] == WEIGHT
    tensors = load_file(path)
    tensors[WEIGHT] = tensors[WEIGHT][:900].clone()  # its last 100 rows lost; the file's last tensor
    save_file(tensors, path, metadata={"format": "pt"})
    result = fp8conv.verify(src, out, tuning=SMALL_BANDS)
    assert not result.ok
    assert any(f"{WEIGHT}: expected ('BF16', ({N}, {K})), found ('BF16', (900, {K}))" in f for f in result.failures)
    assert any(f"{WEIGHT}: not one rounding of the float32 product" in f for f in result.failures)


def test_gpt_oss_experts_are_checked_one_expert_at_a_time(tmp_path):
    """gpt-oss's fused experts, written transposed [E, K, N]: read an expert at a time, and a wrong value
    in the last expert is found."""
    fx = build_family("gpt-oss", tmp_path / "gpt-oss")
    good = tmp_path / "good"
    fp8conv.convert(fx.path, good, ConvertOptions(to="bf16"))
    assert fp8conv.verify(fx.path, good, tuning=SMALL_BANDS).ok
    path, name = next(
        (p, n) for p in sorted(good.glob("*.safetensors")) for n in read_header(p).tensors if n.endswith("down_proj")
    )
    experts = read_header(path).tensors[name].shape[0]
    assert experts > 1
    job = _job(fx.path, good, name + "_blocks")
    assert verify_bands.pieces(job, job.fmt.shape, SMALL_BANDS.verify_band_elements) == [
        verify_bands.Piece(e, (0, job.fmt.shape[1]), (0, job.fmt.shape[1]), 1) for e in range(experts)
    ]
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    _flip_last_byte(out, name)
    result = fp8conv.verify(fx.path, out, tuning=SMALL_BANDS)
    assert not result.ok and any(f"{name}: not one rounding of the float32 product" in f for f in result.failures)
