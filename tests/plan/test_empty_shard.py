"""An input shard whose every tensor is dropped (one holding only scales, with --to bf16) gives no
output shard: the rest are renumbered 1..M of M, and the index, verify, resume and parts agree."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.output.manifest import MANIFEST
from tests.support.helpers import fp8, fp8_block_config, load_dir


def _scales_apart(path):
    """Three shards: the weights in the first two, every scale in the third."""
    path.mkdir()
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    shards: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    for i in range(4):
        w = f"model.layers.{i}.mlp.down_proj.weight"
        shards[i % 2][w] = fp8((200, 300), seed=i)
        shards[2][w + "_scale_inv"] = torch.rand(2, 3) + 0.5
    shards[0]["model.norm.weight"] = torch.ones(200, dtype=torch.bfloat16)
    weight_map = {}
    for name, tensors in zip(names, shards, strict=True):
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(fp8_block_config()))
    return path


def _shards(folder):
    return sorted(p.name for p in folder.glob("*.safetensors"))


def test_a_shard_of_scales_only_leaves_no_empty_output_shard(tmp_path):
    src = _scales_apart(tmp_path / "in")
    out = tmp_path / "out"
    result = fp8conv.convert(src, out, ConvertOptions(to="bf16"), run=RunOptions(verify_after=True))
    assert result.verified is not None and result.verified.ok, result.verified
    expected = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert _shards(out) == expected == result.shards
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == expected
    assert set(json.loads((out / MANIFEST).read_text())["shards"]) == set(expected)
    assert len(load_dir(out)) == 5
    # every output scale travels with its weight, so --to block leaves the third shard empty too
    fp8conv.convert(src, tmp_path / "block", ConvertOptions(to="block"))
    assert _shards(tmp_path / "block") == expected


def test_resume_and_parts_use_the_same_names(tmp_path):
    src = _scales_apart(tmp_path / "in")
    single = tmp_path / "single"
    fp8conv.convert(src, single, ConvertOptions(to="bf16"))
    fp8conv.convert(src, single, ConvertOptions(to="bf16"), run=RunOptions(resume=True))  # every shard kept, none stale
    assert _shards(single) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    parted = tmp_path / "parted"
    for i in (1, 2):
        fp8conv.convert(src, parted, ConvertOptions(to="bf16"), run=RunOptions(part=(i, 2)))
    assert _shards(parted) == _shards(single)
    for name in _shards(single):
        assert (parted / name).read_bytes() == (single / name).read_bytes()
    assert fp8conv.verify(src, parted).ok


def test_verify_fails_on_a_shard_the_index_does_not_list(tmp_path):
    src = _scales_apart(tmp_path / "in")
    out = tmp_path / "out"
    fp8conv.convert(src, out, ConvertOptions(to="bf16"))
    save_file({}, str(out / "model-00003-of-00003.safetensors"))  # what earlier versions left behind
    result = fp8conv.verify(src, out)
    assert not result.ok
    assert any("model-00003-of-00003.safetensors: a shard the plan does not write" in f for f in result.failures)
