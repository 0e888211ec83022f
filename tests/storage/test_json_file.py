"""Every JSON file fp8conv reads is refused the same way when broken: one line naming the file, what is
wrong with it and the fix (fp8conv/json_file.py), whether the user supplied it or fp8conv wrote it."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv.errors import CheckpointError, OptionsError, OutputError
from fp8conv.storage.json_file import read_json_object
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

BROKEN = [
    (b'{"a": [1, 2', "is not valid JSON (", "it ends early, as a truncated file does"),
    (b'{"a": "unfinished', "is not valid JSON (Unterminated string", "it ends early, as a truncated file does"),
    (b"", "is not valid JSON (Expecting value", "the file is empty"),
    (b"{oops}", "is not valid JSON (Expecting property name", ""),
    (b'{"a": 1} trailing', "is not valid JSON (Extra data", ""),
    (b"\xff\xfe\x00garbage", "is not valid JSON (", ""),
    (b"[1, 2]", "holds a JSON array, not an object", ""),
    (b"null", "holds a JSON null, not an object", ""),
]


@pytest.mark.parametrize(("raw", "problem", "why"), BROKEN)
def test_each_way_a_json_file_breaks_is_one_named_line(tmp_path, raw, problem, why):
    path = tmp_path / "thing.json"
    path.write_bytes(raw)
    with pytest.raises(OutputError) as info:
        read_json_object(path, fix="write it again", error=OutputError)
    line = info.value.one_line()
    assert line.startswith(f"in thing.json: {problem}") and why in line and line.endswith(" — write it again")
    assert "\n" not in line and info.value.file == "thing.json" and info.value.shard is None


def test_a_truncation_is_told_apart_from_other_damage(tmp_path):
    path = tmp_path / "thing.json"
    path.write_bytes(b'{"a": 1,, "b": 2}')  # broken in the middle, not cut short
    with pytest.raises(CheckpointError) as info:
        read_json_object(path, fix="fix it")
    assert "ends early" not in str(info.value) and "is not valid JSON" in str(info.value)


def test_an_unreadable_file_is_named_with_the_reason(tmp_path):
    (tmp_path / "config.json").mkdir()  # a directory where the file should be
    with pytest.raises(CheckpointError, match=r"^in config\.json: cannot be read \(Is a directory\) — fix it$"):
        read_json_object(tmp_path / "config.json", fix="fix it")
    with pytest.raises(CheckpointError, match=r"^in the manifest: cannot be read \(No such file or directory\)"):
        read_json_object(tmp_path / "missing.json", fix="fix it", name="the manifest")
    assert read_json_object(_written(tmp_path / "ok.json", {"a": [1]}), fix="") == {"a": [1]}


def _written(path, doc):
    path.write_text(json.dumps(doc))
    return path


def _checkpoint(tmp_path):
    tensors = {"x.weight": fp8((256, 128)), "x.weight_scale_inv": torch.ones(2, 1), "y.weight": torch.ones(4, 4)}
    return write_checkpoint(tmp_path / "c", tensors, fp8_block_config())


@pytest.mark.parametrize(
    ("name", "fix"),
    [
        ("config.json", "fix or re-download config.json"),
        ("model.safetensors.index.json", "re-download the index file"),
        ("params.json", "fix or re-download params.json"),  # it once said config.json
    ],
)
def test_every_input_json_file_is_refused_alike(tmp_path, name, fix):
    path = _checkpoint(tmp_path)
    good = (path / name).read_bytes() if (path / name).exists() else b'{"dim": 8}'
    (path / name).write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError) as info:
        fp8conv.convert(path, tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    line = info.value.one_line()
    assert line.startswith(f"in {name}: is not valid JSON (") and "truncated" in line and line.endswith(fix), line
    assert not (tmp_path / "out").exists()


def test_verify_names_a_damaged_output_document_instead_of_crashing(tmp_path):
    """An output config.json or index that holds an array was an AttributeError in verify."""
    path = _checkpoint(tmp_path)
    out = tmp_path / "out"
    fp8conv.convert(path, out, fp8conv.ConvertOptions(to="channel"))
    assert fp8conv.verify(path, out).ok
    (out / "config.json").write_text("[]")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {')
    failures = fp8conv.verify(path, out).failures
    assert "config.json: holds a JSON array, not an object" in failures
    assert any(f.startswith("model.safetensors.index.json: is not valid JSON (") for f in failures), failures


def test_a_damaged_run_manifest_is_one_named_refusal(tmp_path):
    path = _checkpoint(tmp_path)
    out = tmp_path / "out"
    fp8conv.convert(path, out, fp8conv.ConvertOptions(to="bf16"))
    manifest = out / ".fp8conv" / "manifest.json"
    for raw, problem in [(b"{", "is not valid JSON"), (b"{}", "lacks fp8conv_version, options, input")]:
        manifest.write_bytes(raw)
        with pytest.raises(OptionsError) as info:
            fp8conv.verify(path, out)
        assert info.value.one_line().startswith(f"in {manifest}: {problem}")
        assert "pass the conversion options again" in info.value.one_line()
