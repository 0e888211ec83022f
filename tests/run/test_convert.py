"""End to end through the library: block FP8 -> bf16, exact, complete, and nothing else touched."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import CheckpointError, OptionsError
from fp8conv.options import Tuning
from fp8conv.storage.out_dir import TEMP_SUFFIX
from tests.support.helpers import dir_snapshot, load_dir
from tests.support.reference import dequant_block_reference, same_bits


def test_every_fp8_weight_is_one_rounding_of_the_float32_product(tiny, tmp_path):
    src = load_dir(tiny.path)
    index = json.loads((tiny.path / "model.safetensors.index.json").read_text())["weight_map"]
    moved = tiny.moved_scale
    assert index[moved] != index[moved.removesuffix("_scale_inv")]  # a scale in another shard
    out = tmp_path / "out"
    result = fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    got = load_dir(out)
    assert result.tensors_converted == len(tiny.fp8_weights) == 48
    for name in tiny.fp8_weights:
        expected = dequant_block_reference(src[name], src[name + "_scale_inv"], (128, 128))
        assert same_bits(got[name], expected), name
    # the awkward ones are really there and really exact
    assert got["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 320)
    assert got["model.layers.0.mlp.gate_proj.weight"].shape == (448, 320)
    assert "model.layers.2.self_attn.kv_a_proj_with_mqa.weight" in tiny.fp8_weights  # MTP layer


def test_everything_else_passes_through_byte_identical(tiny, tmp_path):
    src = load_dir(tiny.path)
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    plain = [n for n in src if n not in tiny.fp8_weights and not n.endswith("_scale_inv")]
    assert "model.layers.1.mlp.gate.weight" in plain and "model.layers.2.eh_proj.weight" in plain
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in plain and "lm_head.weight" in plain
    for name in plain:
        assert same_bits(got[name], src[name]), name
    assert set(got) == set(plain) | set(tiny.fp8_weights)  # scales dropped, nothing else lost


def test_shards_index_and_metadata(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    in_index = json.loads((tiny.path / "model.safetensors.index.json").read_text())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(p.name for p in out.glob("*.safetensors")) == tiny.shards
    weights_in = {n: f for n, f in in_index["weight_map"].items() if not n.endswith("_scale_inv")}
    assert index["weight_map"] == weights_in  # same names, same shard per tensor
    tensor_bytes = 0
    for shard in tiny.shards:
        with safe_open(out / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                t = f.get_tensor(name)
                tensor_bytes += t.numel() * t.element_size()
                assert index["weight_map"][name] == shard
    assert index["metadata"]["total_size"] == tensor_bytes


def test_config_rewrite_golden(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    before = json.loads((tiny.path / "config.json").read_text())
    after = json.loads((out / "config.json").read_text())
    expected = dict(before)
    del expected["quantization_config"]
    expected["torch_dtype"] = "bfloat16"
    assert after == expected
    assert list(after) == [k for k in before if k != "quantization_config"]  # key order kept


def test_nested_text_config_and_dtype_key(make_tiny, tmp_path):
    ckpt = make_tiny()
    config = json.loads((ckpt.path / "config.json").read_text())
    qc = config.pop("quantization_config")
    del config["torch_dtype"]
    config = {
        "model_type": "kimi_vl",
        "dtype": "bfloat16",
        "text_config": {**config, "dtype": "bfloat16", "quantization_config": qc},
    }
    (ckpt.path / "config.json").write_text(json.dumps(config))
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16", dtype="float16"))
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in after["text_config"] and "quantization_config" not in after
    assert after["dtype"] == "float16" and after["text_config"]["dtype"] == "float16"
    assert "torch_dtype" not in after


def test_other_files_copied_unchanged(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    src_files, out_files = dir_snapshot(tiny.path), dir_snapshot(out)
    for rel in [
        "tokenizer.json",
        "tokenizer_config.json",
        "tiktoken.model",
        "modeling_deepseek.py",
        "chat_template.jinja",
        "generation_config.json",
        "LICENSE",
        "figures/note.txt",
    ]:
        assert out_files[rel] == src_files[rel], rel
    # the model card keeps every byte and gains a note saying what the copy is (--keep-model-card: none)
    card = out_files["README.md"].decode()
    assert card.startswith(src_files["README.md"].decode().rstrip("\n") + "\n\n## Converted with fp8conv\n")
    assert not [p for p in out.rglob(f"*{TEMP_SUFFIX}")]


@pytest.mark.parametrize(("dtype", "torch_dtype"), [("float16", torch.float16), ("float32", torch.float32)])
def test_other_dtypes(tiny, tmp_path, dtype, torch_dtype):
    src = load_dir(tiny.path)
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16", dtype=dtype))
    got = load_dir(tmp_path / "out")
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert same_bits(got[name], dequant_block_reference(src[name], src[name + "_scale_inv"], (128, 128), torch_dtype))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == dtype


def test_odd_block_size_from_config(make_tiny, tmp_path):
    ckpt = make_tiny(block=(64, 96))
    src = load_dir(ckpt.path)
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    for name in ckpt.fp8_weights:
        assert same_bits(got[name], dequant_block_reference(src[name], src[name + "_scale_inv"], (64, 96))), name


def test_single_file_and_unindexed_directory(make_tiny, tmp_path):
    single = make_tiny(num_shards=1, with_index=False)
    src = load_dir(single.path)
    fp8conv.convert(single.path / "model.safetensors", tmp_path / "a", ConvertOptions(to="bf16"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [".fp8conv", "config.json", "model.safetensors"]
    name = single.fp8_weights[0]
    assert same_bits(
        load_dir(tmp_path / "a")[name],
        dequant_block_reference(src[name], src[name + "_scale_inv"], (128, 128)),
    )

    multi = make_tiny(num_shards=2, with_index=False)
    fp8conv.convert(multi.path, tmp_path / "b", ConvertOptions(to="bf16"))
    index = json.loads((tmp_path / "b" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(multi.shards)  # several shards need an index to load


def test_input_is_never_modified(tiny, tmp_path):
    before = dir_snapshot(tiny.path)
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert dir_snapshot(tiny.path) == before


def _fill_tensor_bytes(shard, byte: int) -> int:
    """Overwrite every tensor byte of a safetensors file, headers kept; returns where the data starts."""
    with open(shard, "r+b") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(0, 2)
        size = f.tell()
        f.seek(data_start)
        f.write(bytes([byte]) * (size - data_start))
    return data_start


def test_inspect_reads_headers_only_and_reports(tiny, tmp_path):
    r = fp8conv.inspect(tiny.path)
    assert r.format == "block-fp8" and r.block_size == [128, 128] and r.block_size_from == "config.json"
    assert r.formats == {"block-fp8": 48, "unquantized": 25}
    assert r.dtypes == {"BF16": 23, "F32": 50, "F8_E4M3": 48}
    assert r.shards == 3 and r.tensors == 121 and r.problems == []
    assert r.mtp_layers == [2] and r.num_hidden_layers == 2
    partial = {t.name: t.grid for t in r.partial_block_tensors}
    assert partial["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == [5, 3]
    assert partial["model.layers.0.mlp.gate_proj.weight"] == [4, 3]
    data_starts = []
    for shard in tiny.path.glob("*.safetensors"):
        # every tensor byte becomes 0xFF, a NaN in every float dtype (FP8 weights, scales, bf16 alike):
        # a report that used any tensor's values would change or list problems
        data_starts.append(_fill_tensor_bytes(shard, 0xFF))
    assert r.total_bytes == sum(p.stat().st_size for p in tiny.path.glob("*.safetensors")) - sum(data_starts)
    garbage = fp8conv.inspect(tiny.path)
    assert garbage.problems == [] and garbage.to_dict() == r.to_dict()
    for shard in tiny.path.glob("*.safetensors"):  # and zeros, the other value a reader of scales checks
        _fill_tensor_bytes(shard, 0x00)
    assert fp8conv.inspect(tiny.path).to_dict() == r.to_dict()


STRACED = re.compile(r"^(\w+)\((.*)\) += (-?\w+)(?:<([^<>]*)>)?")


def _tensor_reads(trace: list[str], data_start: dict[str, int]) -> tuple[list[str], dict[str, int]]:
    """From an strace -y log: every system call that read a shard's tensor bytes, and how many bytes of each
    shard plain read() returned. A header is read through a buffer, which may run one block past it."""
    problems, opened, read = [], dict.fromkeys(data_start, 0), dict.fromkeys(data_start, 0)
    for line in trace:
        m = STRACED.match(line)
        fd_path = m and re.search(r"\b\d+<([^<>]*)>", m.group(2))  # the first file descriptor (mmap's is 5th)
        path = m and (m.group(4) if m.group(1) == "openat" else fd_path and fd_path.group(1))
        if not m or path not in data_start or m.group(3).startswith("-"):
            continue
        call, args, returned = m.group(1), m.group(2), int(m.group(3), 0)
        start = data_start[path]
        if call == "openat":
            opened[path] += 1
        elif call in ("read", "readv"):
            read[path] += returned
        elif (
            (call == "pread64" and int(args.rsplit(",", 1)[1]) + returned > start)
            or (call.startswith("preadv") and int(args.rsplit("]", 1)[1].split(",")[2]) + returned > start)
            or (call == "lseek" and args.endswith("SEEK_SET") and int(args.split(",")[1]) >= start)
            or call == "mmap"
        ):
            problems.append(line)
    for path, n in read.items():
        if n > opened[path] * (data_start[path] + max(io.DEFAULT_BUFFER_SIZE, os.stat(path).st_blksize)):
            problems.append(f"{n} bytes of {path} read() in {opened[path]} open(s)")
    return problems, read


def test_inspect_reads_no_tensor_bytes_at_the_system_call_level(tiny, tmp_path):
    """What the process asks the kernel for, whichever Python name or module does the reading."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    shards = {str(p): 8 + int.from_bytes(p.read_bytes()[:8], "little") for p in tiny.path.glob("*.safetensors")}
    calls = "openat,read,readv,pread64,preadv,preadv2,lseek,mmap"
    paths = [arg for p in shards for arg in ("-P", p)]
    log = tmp_path / "trace"
    code = f"import fp8conv; fp8conv.inspect({str(tiny.path)!r})"
    strace = ["strace", "-ff", "-qq", "-y", "-s", "0", "-e", f"trace={calls}", *paths, "-o", str(log)]
    done = subprocess.run(
        [*strace, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0 and "ptrace" in done.stderr.lower():
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    trace = [line for f in tmp_path.glob("trace.*") for line in f.read_text().splitlines()]
    problems, read = _tensor_reads(trace, shards)
    assert all(read[p] >= start for p, start in shards.items()), read  # the trace saw every header read
    assert problems == []


def test_inspect_estimate_matches_the_real_bf16_output(tiny, tmp_path):
    estimate = fp8conv.inspect(tiny.path).estimated_output_bytes["bf16"]
    fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert estimate == index["metadata"]["total_size"]


# ---- refusals: exit-worthy errors that name the tensor and shard, with nothing written ----


def _refused(ckpt_path, out, match, **kwargs):
    kwargs.setdefault("to", "bf16")
    with pytest.raises((CheckpointError, OptionsError)) as info:
        fp8conv.convert(ckpt_path, out, ConvertOptions(**kwargs))
    assert match in str(info.value), str(info.value)
    return str(info.value)


def _drop_tensor(ckpt, name):
    """Rewrite the shard holding `name` without it (and the index without it)."""
    from safetensors.torch import load_file, save_file

    index_path = ckpt.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = ckpt.path / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_missing_scale_is_refused_by_name(tiny, tmp_path):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    _drop_tensor(tiny, name + "_scale_inv")
    msg = _refused(tiny.path, tmp_path / "out", name)
    assert "no scale" in msg and "model-00002-of-00003.safetensors" in msg
    assert not (tmp_path / "out").exists()


def test_scale_without_weight_is_refused_by_name(tiny, tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"
    _drop_tensor(tiny, name)
    msg = _refused(tiny.path, tmp_path / "out", name + "_scale_inv")
    assert "no FP8 weight" in msg
    assert not (tmp_path / "out").exists()


def test_grid_of_the_wrong_shape_is_refused(make_tiny, tmp_path):
    ckpt = make_tiny(block=(128, 128), config_block=(64, 128))  # grids say 128 rows, config says 64
    msg = _refused(ckpt.path, tmp_path / "out", "unverified")
    assert "need [" in msg and "weight_scale_inv" in msg and "model-0000" in msg
    assert not (tmp_path / "out").exists()
    # asserting a different block size than config.json is a conflict, not an override
    _refused(ckpt.path, tmp_path / "out", "--block-size asserts [128, 128]", block_size=(128, 128))


def test_block_size_never_guessed_without_config(make_tiny, tmp_path):
    ckpt = make_tiny(config_block=None)
    msg = _refused(ckpt.path, tmp_path / "out", "no weight_block_size confirms the block size")
    assert "--block-size 128,128" in msg
    assert fp8conv.inspect(ckpt.path).format == "unverified"
    # asserting the right block size makes it convertible, and exact
    fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16", block_size=(128, 128)))
    src, got = load_dir(ckpt.path), load_dir(tmp_path / "out")
    name = "model.layers.0.mlp.gate_proj.weight"
    assert same_bits(got[name], dequant_block_reference(src[name], src[name + "_scale_inv"], (128, 128)))


def test_no_config_at_all_is_unverified(make_tiny, tmp_path):
    ckpt = make_tiny(with_config=False)
    _refused(ckpt.path, tmp_path / "out", "no weight_block_size confirms")
    # a wrong assertion is caught by the grids
    _refused(ckpt.path, tmp_path / "out2", "need [", block_size=(112, 128))
    result = fp8conv.convert(ckpt.path, tmp_path / "out3", ConvertOptions(to="bf16", block_size=(128, 128)))
    assert any("no config.json" in w for w in result.warnings)


def test_output_inside_input_is_refused(tiny):
    _refused(tiny.path, tiny.path / "bf16", "inside the input")
    _refused(tiny.path, tiny.path, "inside the input")
    assert not (tiny.path / "bf16").exists()


def test_output_containing_input_is_refused(tiny):
    _refused(tiny.path, tiny.path.parent, "contains the input")


def test_non_empty_output_needs_overwrite(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    _refused(tiny.path, out, "--overwrite")
    (out / "model-00009-of-00009.safetensors").write_text("stale")
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(overwrite=True))
    assert not (out / "model-00009-of-00009.safetensors").exists()  # a stale shard would mislead loaders
    assert (out / "config.json").exists()


def _data_bytes(shard) -> int:
    """A safetensors file's tensor bytes: its size less the 8-byte length and the header."""
    raw = shard.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def test_interrupted_run_does_not_look_complete(tiny, tmp_path):
    # Where shard 2 starts and ends, in output bytes, from an uninterrupted run's files
    fp8conv.convert(tiny.path, tmp_path / "whole", ConvertOptions(to="bf16"))
    first, second = (_data_bytes(tmp_path / "whole" / name) for name in tiny.shards[:2])
    seen: list[int] = []

    def interrupt_inside_shard_two(done: int, total: int) -> None:
        seen.append(done)
        if done > first:  # the progress callback runs after each tensor: one of shard 2's is done
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(progress=interrupt_inside_shard_two))
    assert first in seen and first < seen[-1] < first + second, "the interrupt must land inside shard 2"
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob(f".*{TEMP_SUFFIX}"))  # the partial shard is removed
    assert (out / tiny.shards[0]).read_bytes() == (tmp_path / "whole" / tiny.shards[0]).read_bytes()
    assert not (out / tiny.shards[1]).exists()


def test_pickles_are_never_read(tmp_path):
    d = tmp_path / "pt"
    d.mkdir()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match="never unpickles"):
        fp8conv.convert(d, tmp_path / "out", ConvertOptions(to="bf16"))
    with pytest.raises(CheckpointError, match="never unpickles"):  # a pickle given as a file, too
        fp8conv.convert(d / "pytorch_model.bin", tmp_path / "out", ConvertOptions(to="bf16"))
    assert not (tmp_path / "out").exists()


def test_other_weight_files_are_not_copied(tiny, tmp_path):
    shutil.copy(tiny.path / tiny.shards[0], tiny.path / "consolidated.safetensors")
    (tiny.path / "pytorch_model.bin").write_bytes(b"old weights")
    (tiny.path / "training_args.bin").write_bytes(b"args")
    result = fp8conv.convert(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    skipped = dict(result.files_skipped)
    assert "consolidated.safetensors" in skipped and "pytorch_model.bin" in skipped
    assert not (tmp_path / "out" / "consolidated.safetensors").exists()
    assert (tmp_path / "out" / "training_args.bin").exists()


def test_options_that_do_not_fit_the_target_are_refused(tiny, tmp_path):
    _refused(tiny.path, tmp_path / "out", "--to fp4 is not one of", to="fp4")
    _refused(tiny.path, tmp_path / "out", "applies to --to channel only", to="block", fp8_max=240.0)
    _refused(tiny.path, tmp_path / "out", "applies to --to block only", to="channel", pad_for_tp=4)
    _refused(tiny.path, tmp_path / "out", "is not 448 (standard) or 240", to="channel", fp8_max=300.0)
    assert not (tmp_path / "out").exists()


def test_large_weights_stream_in_bands_with_identical_output(tiny, tmp_path, monkeypatch):
    from fp8conv.rewrite.banded import BandedJob

    fp8conv.convert(tiny.path, tmp_path / "whole", ConvertOptions(to="bf16"))
    streamed = []
    real_init = BandedJob.__init__  # one per job the plan streams in bands
    monkeypatch.setattr(BandedJob, "__init__", lambda self, job, *a: streamed.append(job) or real_init(self, job, *a))
    small = RunOptions(tuning=Tuning(convert_band_elements=3000))
    fp8conv.convert(tiny.path, tmp_path / "bands", ConvertOptions(to="bf16"), run=small)
    assert len(streamed) == len(tiny.fp8_weights)
    assert dir_snapshot(tmp_path / "whole") == dir_snapshot(tmp_path / "bands")


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_direct_and_buffered_io_write_the_same_checkpoint(tiny, tmp_path, monkeypatch, to):
    """Direct I/O (the default) against --buffered-io: the same files, byte for byte. Small bands,
    direct reads for every size and small segments, so the tiny checkpoint takes every path."""
    import fp8conv.storage.writer as writer

    small = {"convert_band_elements": 3000, "direct_min_bytes": 0, "segment_bytes": 8192}
    opened: list[bool] = []
    real_open = writer.open_direct
    monkeypatch.setattr(writer, "open_direct", lambda *a: opened.append(True) or real_open(*a))
    extra = ["--pad-for-tp", "8"] if to == "block" else []
    for name, flags in (("direct", []), ("buffered", ["--buffered-io"])):
        args = ["convert", str(tiny.path), "--to", to, "-o", str(tmp_path / name), "-q", *extra, *flags]
        args += ["--tuning", json.dumps(small)]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        if name == "direct":
            assert len(opened) == len(tiny.shards)
    assert len(opened) == len(tiny.shards)  # --buffered-io never opened a file for direct I/O
    assert dir_snapshot(tmp_path / "direct") == dir_snapshot(tmp_path / "buffered")


# block FP8 --to block keeps its blocks (no rewrite): a [0, K] weight is requantized from channel scales
@pytest.mark.parametrize("to, scale", [("channel", "block"), ("block", "channel"), ("bf16", "block")])
def test_weight_with_no_rows_converts(tmp_path, to, scale):
    """A [0, K] FP8 weight is written with no rows and its [0, 1] / [0, gk] scale, not a traceback from the
    [-1, 0, K] view the quantizing rewriters take (channel and block); bf16 guards the dequantizer's."""
    from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

    block = scale == "block"
    tensors = {
        "model.layers.0.mlp.down_proj.weight": fp8((96, 200)),
        "model.layers.0.mlp.down_proj.weight_scale_inv" if block else "model.layers.0.mlp.down_proj.weight_scale": (
            torch.full((1, 2), 0.01) if block else torch.full((96, 1), 0.01)
        ),
        "model.layers.0.self_attn.o_proj.weight": fp8((0, 200)),
        "model.layers.0.self_attn.o_proj.weight_scale_inv"
        if block
        else "model.layers.0.self_attn.o_proj.weight_scale": (torch.zeros((0, 2)) if block else torch.zeros((0, 1))),
    }
    write_checkpoint(tmp_path / "in", tensors, fp8_block_config((128, 128) if block else None))
    fp8conv.convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to=to))
    out = load_dir(tmp_path / "out")
    assert out["model.layers.0.self_attn.o_proj.weight"].shape == (0, 200)
    name = {"channel": "weight_scale", "block": "weight_scale_inv"}.get(to)
    if name is not None:
        assert out["model.layers.0.self_attn.o_proj." + name].shape == ((0, 1) if to == "channel" else (0, 2))
