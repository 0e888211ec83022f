"""verify: a good output passes; a flipped byte, a wrong index, a changed config or a missing shard fail."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import OptionsError
from fp8conv.storage.header import read_header
from tests.support.helpers import load_dir
from tests.support.reference import expected_output, same_bits

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize(
    "options",
    [
        {"to": "bf16"},
        {"to": "bf16", "dtype": "float16"},
        {"to": "channel"},
        {"to": "channel", "fp8_max": 240.0},
        {"to": "block", "pad_for_tp": 4},
    ],
)
def test_good_outputs_verify(tiny, tmp_path, options):
    out = tmp_path / "out"
    result = fp8conv.convert(tiny.path, out, ConvertOptions(**options), run=RunOptions(verify_after=True))
    # the output is right by the test's own definitions, not by the plan and code verify shares with convert
    ref = dict(options, dtype=DTYPES[options.get("dtype", "bfloat16")])
    expected = expected_output(load_dir(tiny.path), tiny.fp8_weights, **ref)
    got = load_dir(out)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert same_bits(got[name], tensor), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    held = {n: p.name for p in out.glob("*.safetensors") for n in read_header(p).tensors}
    assert index["weight_map"] == held
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    config = json.loads((out / "config.json").read_text())
    gate = "model.layers.0.mlp.gate_proj.weight"
    expert_gate = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert config["intermediate_size"] == expected[gate].shape[0]
    assert config["moe_intermediate_size"] == expected[expert_gate].shape[0]
    method = {"bf16": None, "channel": "compressed-tensors", "block": "fp8"}[options["to"]]
    assert config.get("quantization_config", {}).get("quant_method") == method
    # and verify, run on that output, passes it whole
    assert result.verified is not None and result.verified.ok, result.verified.failures
    assert result.verified.tensors_sampled == result.verified.tensors_checked == 73


def _corruptions(out: Path) -> dict[str, tuple[Callable[[Path], None], str]]:
    """What to break in a copy of a good --to channel output, and what verify's report must then say."""
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    weight = "model.layers.1.mlp.experts.2.up_proj.weight"
    scaled = "model.layers.0.self_attn.kv_b_proj.weight"
    dropped = "model.layers.0.mlp.down_proj.weight_scale"

    def flip_fp8_byte(o: Path) -> None:
        _flip_byte_of(o / index[weight], weight)

    def change_one_scale(o: Path) -> None:
        path = o / index[scaled + "_scale"]
        entry = read_header(path).tensors[scaled + "_scale"]
        raw = bytearray(path.read_bytes())
        value = struct.unpack_from("<f", raw, entry.start + 4)[0]
        struct.pack_into("<f", raw, entry.start + 4, value * 1.5)  # the second row's scale
        path.write_bytes(bytes(raw))

    def drop_tensor(o: Path) -> None:
        path = o / index[dropped]
        tensors = load_file(path)
        del tensors[dropped]
        save_file(tensors, path, metadata={"format": "pt"})

    def change_config_width(o: Path) -> None:
        config = json.loads((o / "config.json").read_text())
        config["intermediate_size"] += 64
        (o / "config.json").write_text(json.dumps(config))

    def wrong_total_size(o: Path) -> None:
        path = o / "model.safetensors.index.json"
        doc = json.loads(path.read_text())
        doc["metadata"]["total_size"] -= 2
        path.write_text(json.dumps(doc))

    return {
        "flip_fp8_byte": (flip_fp8_byte, f"{index[weight]}: {weight}: differs from the reference backend"),
        "change_one_scale": (change_one_scale, f"{index[scaled]}: {scaled}: differs from the reference backend"),
        "drop_tensor": (drop_tensor, f"{index[dropped]}: {dropped}: expected ('F32', (320, 1)), found None"),
        "change_config_width": (change_config_width, "intermediate_size"),
        "wrong_total_size": (wrong_total_size, "model.safetensors.index.json: total_size is not"),
    }


def test_each_corruption_of_a_good_output_is_reported(tiny, tmp_path):
    good = tmp_path / "good"
    fp8conv.convert(tiny.path, good, ConvertOptions(to="channel"))
    assert fp8conv.verify(tiny.path, good).ok
    for what, (corrupt, message) in _corruptions(good).items():
        out = tmp_path / what
        shutil.copytree(good, out)
        corrupt(out)
        result = fp8conv.verify(tiny.path, out)
        assert not result.ok and any(message in f for f in result.failures), (what, result.failures)


def _flip_byte_of(path, tensor: str) -> None:
    entry = read_header(path).tensors[tensor]
    raw = bytearray(path.read_bytes())
    raw[entry.start + entry.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_a_flipped_byte_is_found(tiny, tmp_path, to):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to=to))
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    _flip_byte_of(out / index["weight_map"][name], name)
    result = fp8conv.verify(tiny.path, out)
    assert not result.ok and any(name in f for f in result.failures)


def test_structure_index_and_config_are_checked(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["metadata"]["total_size"] += 1
    index_path.write_text(json.dumps(index))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (out / "config.json").write_text(json.dumps(config))
    (out / tiny.shards[2]).unlink()
    result = fp8conv.verify(tiny.path, out, sample=0.5)
    joined = "\n".join(result.failures)
    assert "total_size" in joined and "config.json" in joined and f"{tiny.shards[2]}: missing" in joined


def test_cli_verify_exit_codes(tiny, tmp_path):
    out = tmp_path / "out"
    runner = CliRunner()
    assert (
        runner.invoke(main, ["convert", str(tiny.path), "--to", "channel", "-o", str(out), "--verify"]).exit_code == 0
    )
    good = runner.invoke(main, ["verify", str(tiny.path), str(out), "--sample", "0.25"])
    assert good.exit_code == 0 and "verify ok" in good.stdout
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    _flip_byte_of(out / index["weight_map"][name], name)
    bad = runner.invoke(main, ["verify", str(tiny.path), str(out)])
    assert bad.exit_code == 1 and name in bad.stderr and "verify FAILED" in bad.stdout


def test_verify_without_manifest_says_what_to_do(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"))
    (out / ".fp8conv" / "manifest.json").unlink()
    with pytest.raises(OptionsError, match="pass the conversion options again"):
        fp8conv.verify(tiny.path, out)
    assert fp8conv.verify(tiny.path, out, options=fp8conv.ConvertOptions(to="bf16")).ok
