"""verify: a good output passes; a flipped byte, a wrong index, a changed config or a missing shard fail."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv.cli import main
from fp8conv.errors import OptionsError
from fp8conv.safetensors_file import read_header


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
    result = fp8conv.convert(tiny.path, tmp_path / "out", verify_after=True, **options)
    assert result.verified is not None and result.verified.ok, result.verified.failures
    assert result.verified.tensors_sampled == result.verified.tensors_checked == 73


def _flip_byte_of(path, tensor: str) -> None:
    entry = read_header(path).tensors[tensor]
    raw = bytearray(path.read_bytes())
    raw[entry.start + entry.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_a_flipped_byte_is_found(tiny, tmp_path, to):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, to=to)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    _flip_byte_of(out / index["weight_map"][name], name)
    result = fp8conv.verify(tiny.path, out)
    assert not result.ok and any(name in f for f in result.failures)


def test_structure_index_and_config_are_checked(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, to="bf16")
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
    fp8conv.convert(tiny.path, out, to="bf16")
    (out / ".fp8conv" / "manifest.json").unlink()
    with pytest.raises(OptionsError, match="pass the conversion options again"):
        fp8conv.verify(tiny.path, out)
    assert fp8conv.verify(tiny.path, out, options=fp8conv.ConvertOptions(to="bf16")).ok
