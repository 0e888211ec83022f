"""The input side of safety: nothing read through a link out of the checkpoint (the Hub cache's own
snapshot -> blob links aside), only regular files read or copied, index names plain relative paths,
every JSON document capped and guarded, every header validated by one validator on every path (local,
Hub, saved by --stream), no run with nothing to write, and no scale that overflows the output."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import time

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.errors import CheckpointError, OutputError
from fp8conv.storage.header import MAX_TENSORS, parse_header
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint, write_raw_safetensors
from tests.support.hf_cache import COMMIT, lay_out_hf_cache

REPO = "acme/tiny-fp8"
INDEX = "model.safetensors.index.json"


def _convert(src, out, to="bf16", **run):
    return fp8conv.convert(src, out, ConvertOptions(to=to), run=RunOptions(**run) if run else None)


def _outside(tmp_path, name, data: bytes):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    (elsewhere / name).write_bytes(data)
    return elsewhere / name


def _replace_by_link(path, target):
    path.unlink()
    path.symlink_to(target)


@pytest.fixture
def read_names(monkeypatch):
    """The names whose content fp8conv read (headers and JSON files): a refusal must come first."""
    from fp8conv.source import index
    from fp8conv.storage import json_file

    seen: list[str] = []
    real_header, real_capped = index.read_header, json_file.read_capped

    def header(path, display_name=None, **kw):
        seen.append(display_name or path.name)
        return real_header(path, display_name, **kw)

    def capped(path, **kw):
        seen.append(path.name)
        return real_capped(path, **kw)

    monkeypatch.setattr(index, "read_header", header)
    monkeypatch.setattr(json_file, "read_capped", capped)
    return seen


@pytest.mark.parametrize("name", [INDEX, "config.json", "model-00002-of-00003.safetensors"])
def test_a_link_out_of_the_checkpoint_is_refused_before_it_is_read(tiny, tmp_path, name, read_names):
    target = _outside(tmp_path, name, (tiny.path / name).read_bytes())
    _replace_by_link(tiny.path / name, target)
    with pytest.raises(CheckpointError, match=f"is a symlink to {target}, outside the checkpoint") as refused:
        _convert(tiny.path, tmp_path / "out")
    assert name in refused.value.one_line()
    assert name not in read_names
    assert not (tmp_path / "out").exists()


def test_hf_quant_config_and_a_single_files_config_stay_inside(tmp_path, read_names):
    path = write_checkpoint(tmp_path / "c", {"w": torch.ones(4)}, config={"model_type": "llama"})
    (path / INDEX).unlink()
    os.rename(path / "model-00001-of-00001.safetensors", path / "model.safetensors")
    sidecar = _outside(tmp_path, "hf_quant_config.json", b'{"quantization": {"quant_algo": "FP8"}}')
    (path / "hf_quant_config.json").symlink_to(sidecar)
    with pytest.raises(CheckpointError, match=r"hf_quant_config.json: is a symlink to .*, outside the checkpoint"):
        _convert(path, tmp_path / "out")
    assert "hf_quant_config.json" not in read_names
    (path / "hf_quant_config.json").unlink()
    read_names.clear()
    _replace_by_link(path / "config.json", _outside(tmp_path, "config.json", b'{"model_type": "llama"}'))
    with pytest.raises(CheckpointError, match=r"config.json: is a symlink to .*, outside the checkpoint"):
        _convert(path / "model.safetensors", tmp_path / "out")  # a single-file checkpoint
    assert "config.json" not in read_names


def test_a_directory_link_out_and_dot_dot_through_a_link_are_refused(tiny, tmp_path):
    """The walk resolves each link itself: `sub -> ../elsewhere` and `x -> sub/../../y` both leave."""
    name = tiny.shards[0]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(tiny.path / name, elsewhere / name)
    (tiny.path / "sub").symlink_to("../elsewhere")
    (tiny.path / name).symlink_to(f"sub/{name}")
    with pytest.raises(CheckpointError, match="outside the checkpoint") as refused:
        _convert(tiny.path, tmp_path / "out")
    assert name in refused.value.one_line()
    (tiny.path / name).unlink()
    os.mkdir(tiny.path / "inner")
    os.rename(elsewhere / name, tiny.path / "inner" / name)
    (tiny.path / name).symlink_to(f"inner/../inner/{name}")  # a link that stays inside is followed
    _convert(tiny.path, tmp_path / "ok")
    assert (tmp_path / "ok" / "config.json").is_file()


@pytest.mark.parametrize(
    "shard", ["../x.safetensors", "/etc/x.safetensors", "a//b.safetensors", "./m.safetensors", "a\\b.safetensors"]
)
def test_index_names_are_plain_relative_paths(tiny, tmp_path, shard):
    index = json.loads((tiny.path / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (tiny.path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"not a \.safetensors file inside the checkpoint") as refused:
        _convert(tiny.path, tmp_path / "out")
    assert first in refused.value.one_line() and INDEX in refused.value.one_line()


def test_a_fifo_is_skipped_and_a_device_never_copied(tiny, tmp_path):
    os.remove(tiny.path / "tiktoken.model")
    os.mkfifo(tiny.path / "tiktoken.model")  # opening it for reading would wait for a writer forever
    has_device = os.geteuid() == 0
    if has_device:
        os.mknod(tiny.path / "tokenizer.bin", 0o600 | 0o020000, os.makedev(1, 5))  # /dev/zero's numbers
    started = time.monotonic()
    result = _convert(tiny.path, tmp_path / "out")
    assert time.monotonic() - started < 120
    assert ("tiktoken.model", "not a regular file (a FIFO), not copied") in result.files_skipped
    assert not os.path.lexists(tmp_path / "out" / "tiktoken.model")
    if has_device:
        assert ("tokenizer.bin", "not a regular file (a character device), not copied") in result.files_skipped
        assert not os.path.lexists(tmp_path / "out" / "tokenizer.bin")


def test_a_fifo_where_a_json_file_or_shard_is_expected_is_refused(tiny, tmp_path):
    os.remove(tiny.path / "config.json")
    os.mkfifo(tiny.path / "config.json")
    with pytest.raises(CheckpointError, match=r"config.json: is not a regular file \(a FIFO\)"):
        _convert(tiny.path, tmp_path / "out")


def _cli(args, cache, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent / "home")}
    return subprocess.run(
        [sys.executable, "-m", "fp8conv", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_a_snapshot_link_into_another_repos_blobs_is_refused(tiny, tmp_path):
    """Through a real huggingface_hub cache (offline): same-repo blob links are followed, another
    repo's are not, both for a plain Hub run and for --stream, and for a shard and config.json."""
    cache = tmp_path / "hub-cache"
    snap = lay_out_hf_cache(tiny.path, cache, REPO)
    other = lay_out_hf_cache(tiny.path, cache, "evil/other")
    shard = tiny.shards[1]
    own = os.readlink(snap / shard)
    theirs = os.path.relpath((other / shard).resolve(), snap)
    _replace_by_link(snap / shard, theirs)
    for stream in ([], ["--stream"]):
        done = _cli(["convert", REPO, "--revision", COMMIT, "--to", "bf16", "-o", str(tmp_path / "o"), *stream], cache)
        assert done.returncode == 1, done.stderr
        assert f"in {shard}: is a symlink to {(other / shard).resolve()}, outside the checkpoint" in done.stderr
        assert len(done.stderr.splitlines()) == 2 and not (tmp_path / "o").exists()
    _replace_by_link(snap / shard, own)  # its own blob again
    _replace_by_link(snap / "config.json", os.path.relpath((other / "config.json").resolve(), snap))
    done = _cli(["convert", REPO, "--to", "bf16", "-o", str(tmp_path / "o"), "--stream"], cache)
    assert done.returncode == 1 and "config.json: is a symlink to" in done.stderr, done.stderr


def test_stream_index_names_stay_inside_the_snapshot(tiny, tmp_path):
    """An index naming ../../x in --stream: refused by name, that file's header never read or saved."""
    cache = tmp_path / "hub-cache"
    snap = lay_out_hf_cache(tiny.path, cache, REPO)
    index = json.loads((snap / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "../../blobs/x.safetensors"
    (snap / INDEX).unlink()
    (snap / INDEX).write_text(json.dumps(index))
    done = _cli(["convert", REPO, "--to", "bf16", "-o", str(tmp_path / "o"), "--stream"], cache)
    assert done.returncode == 1 and "not a .safetensors file inside the checkpoint" in done.stderr, done.stderr
    assert first in done.stderr and not (tmp_path / "o").exists()


# --- JSON documents: capped, guarded, validated, one line ---------------------------------------------


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests arrays or objects more than 64 deep under key 'a'"),
        ('{"a": ' + "[" * 100 + "]" * 100 + "}", "nests arrays or objects more than 64 deep under key 'a'"),
        ('{"hidden_size": ' + "9" * 5000 + "}", "holds an integer of 5000 digits under key 'hidden_size'"),
        ('{"name": "\\udc80"}', "holds a string with a lone UTF-16 surrogate under key 'name'"),
    ],
)
def test_hostile_config_json_is_one_line(tiny, tmp_path, text, match):
    (tiny.path / "config.json").write_text(text)
    done = _cli(["convert", str(tiny.path), "--to", "bf16", "-o", str(tmp_path / "o")], tmp_path / "cache")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: in config.json: {match}"), done.stderr
    assert len(done.stderr.splitlines()) == 2


def test_index_with_a_huge_integer_or_deep_nesting_is_refused_by_name(tiny, tmp_path):
    index = (tiny.path / INDEX).read_text()
    (tiny.path / INDEX).write_text(index.replace('"metadata": {', '"metadata": {"total_size": ' + "1" * 5000 + ", "))
    with pytest.raises(CheckpointError, match=f"{INDEX}: holds an integer of 5000 digits under key 'total_size'"):
        _convert(tiny.path, tmp_path / "out")


def test_a_sparse_1gib_config_json_is_refused_by_size_before_it_is_read(tiny, tmp_path):
    with open(tiny.path / "config.json", "r+b") as f:
        f.truncate(1 << 30)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"config\.json: is 1073741824 bytes, more than the"):
        fp8conv.inspect(tiny.path)
    assert time.monotonic() - started < 30  # loose: a loaded CI machine; the message is the real check


# --- headers: one validator, every path ---------------------------------------------------------------

GOOD = {"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}
LIES = [
    (
        {"w": {"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}},
        16,
        re.escape("shape [True, 4] is not a list"),
    ),
    (
        {"w": {"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}},
        16,
        re.escape("dtype ['F32'] is not a dtype name"),
    ),
    ({"w": {"dtype": {"a": 1}, "shape": [4], "data_offsets": [0, 16]}}, 16, "is not a dtype name"),
    ({"w\udc80": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 16, "lone UTF-16 surrogate"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [False, 16]}}, 16, "data_offsets .* are invalid"),
    (
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
        },
        20,
        "tensor 'b' in model.safetensors: its bytes start 4 bytes after the previous tensor's end",
    ),
    ({"w": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}}, 16, "overflows 64 bits"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "__metadata__": {"a": 1}}, 16, "__metadata__"),
]


@pytest.mark.parametrize(("header", "size", "match"), LIES)
def test_every_lie_is_refused_on_the_local_path(tmp_path, header, size, match):
    d = tmp_path / "c"
    d.mkdir()
    write_raw_safetensors(d / "model.safetensors", header, b"\0" * size)
    with pytest.raises(CheckpointError, match=match) as refused:
        _convert(d, tmp_path / "out")
    assert "model.safetensors" in refused.value.one_line()


def test_trailing_bytes_and_a_truncated_file_are_refused(tmp_path):
    raw = json.dumps(GOOD).encode()
    with pytest.raises(CheckpointError, match="tensor 'w' in s: the file has 3 bytes after the last tensor's data"):
        parse_header(raw, 8 + len(raw) + 19, "s")
    with pytest.raises(CheckpointError, match="data runs to byte"):
        parse_header(raw, 8 + len(raw) + 15, "s")
    assert parse_header(raw, 8 + len(raw) + 16, "s").tensors["w"].shape == (2, 2)
    with pytest.raises(CheckpointError, match="NaN is not a JSON number"):
        parse_header(b'{"__metadata__": {"x": NaN}}', None, "s")


def test_a_million_empty_tensors_are_refused_fast(monkeypatch):
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(1_000_000)}
    raw = json.dumps(header).encode()
    from fp8conv.storage import header as header_module

    def no_parse(*args, **kwargs):
        raise AssertionError("the header was parsed before its tensors were counted")

    started = time.monotonic()
    with monkeypatch.context() as patched:
        patched.setattr(header_module, "parse_json", no_parse)
        with pytest.raises(CheckpointError, match=f"lists 1000000 tensors, more than the {MAX_TENSORS}"):
            parse_header(raw, 8 + len(raw), "big.safetensors")
    assert time.monotonic() - started < 20  # it took over 60 s (and 2 GB) to accept before

    for count, ok in ((1000, True), (1001, False)):  # a cap of 1000: the cap itself is allowed, one more is not
        raw = json.dumps({f"t{i}": header[f"t{i}"] for i in range(count)}).encode()
        if ok:
            assert len(parse_header(raw, 8 + len(raw), "cap.safetensors", max_tensors=1000).tensors) == count
        else:
            with pytest.raises(CheckpointError, match="lists 1001 tensors, more than the 1000"):
                parse_header(raw, 8 + len(raw), "cap.safetensors", max_tensors=1000)
    entries = json.dumps({f"t{i}": {} for i in range(1001)}).encode()  # no data_offsets to count: counted parsed
    with pytest.raises(CheckpointError, match="lists 1001 tensors, more than the 1000"):
        parse_header(entries, 8 + len(entries), "cap.safetensors", max_tensors=1000)


@pytest.mark.parametrize(("header", "size", "match"), LIES[:5])
def test_every_lie_is_refused_on_the_hub_path(tmp_path, monkeypatch, header, size, match):
    """huggingface_hub's remote metadata goes through the same validator."""
    from types import SimpleNamespace

    import huggingface_hub

    from fp8conv.source import hub

    tensors = {
        n: SimpleNamespace(dtype=s["dtype"], shape=s["shape"], data_offsets=tuple(s["data_offsets"]))
        for n, s in header.items()
    }
    files = {"model.safetensors": SimpleNamespace(tensors=tensors, metadata=None)}
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "get_safetensors_metadata",
        lambda self, r, revision=None: SimpleNamespace(files_metadata=files),
    )
    with pytest.raises(CheckpointError, match=match):
        hub.remote_headers("acme/x", None)


@pytest.mark.parametrize(("header", "size", "match"), LIES[:5])
def test_every_lie_is_refused_on_the_saved_path(tmp_path, header, size, match):
    """--stream --resume's saved headers: validated as a shard's own, refused in one line naming the file."""
    from types import SimpleNamespace

    from fp8conv.run.streaming import HEADERS_FILE, saved_headers

    out = tmp_path / "out"
    (out / HEADERS_FILE).parent.mkdir(parents=True)
    doc = {"repo_id": REPO, "commit": COMMIT, "headers": {"model.safetensors": header}}
    (out / HEADERS_FILE).write_text(json.dumps(doc))
    source = SimpleNamespace(repo_id=REPO, commit=COMMIT)
    with pytest.raises(OutputError, match=match) as refused:
        saved_headers(out, source)
    line = refused.value.one_line()
    assert "input-headers.json: holds a" in line and len(line.splitlines()) == 1
    assert "damaged saved header (tensor 'w' in model.safetensors" in line or "surrogate" in line  # JSON-level
    doc["headers"] = {"../x.safetensors": GOOD}
    (out / HEADERS_FILE).write_text(json.dumps(doc))
    with pytest.raises(OutputError, match=r"not a \.safetensors file inside the checkpoint"):
        saved_headers(out, source)
    doc["headers"] = {"model.safetensors": GOOD}
    (out / HEADERS_FILE).write_text(json.dumps(doc))
    assert saved_headers(out, source)["model.safetensors"].tensors["w"].nbytes == 16


# --- nothing to write; scales that overflow -----------------------------------------------------------


def test_no_tensor_at_all_is_refused(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    write_raw_safetensors(d / "model.safetensors", {"__metadata__": {"format": "pt"}}, b"")
    with pytest.raises(CheckpointError, match=r"the shards \(model.safetensors\) hold no tensor"):
        _convert(d, tmp_path / "out")
    (d / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match=f"in {INDEX}: has an empty 'weight_map'"):
        _convert(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_finite_scale_that_overflows_the_output_is_refused_before_the_run(tmp_path):
    w = "model.layers.0.mlp.down_proj.weight"
    scale = torch.full((1, 2), 0.01)
    scale[0, 1] = 1e37  # finite, but 448 * 1e37 is not a bfloat16 (nor a float32)
    tensors = {w: fp8((128, 256)), w + "_scale_inv": scale, "model.norm.weight": torch.ones(128)}
    path = write_checkpoint(tmp_path / "c", tensors, config=fp8_block_config())
    for to in ("channel", "bf16"):
        with pytest.raises(CheckpointError, match="has a value of 1e\\+37: times the largest F8_E4M3 code") as info:
            _convert(path, tmp_path / "out", to=to)
        assert f"{w}_scale_inv" in info.value.one_line()
        assert not (tmp_path / "out").exists()
    scale[0, 1] = 1e35  # 4.5e37: large, still in range
    write_checkpoint(tmp_path / "c", tensors | {w + "_scale_inv": scale}, config=fp8_block_config())
    _convert(path, tmp_path / "out", to="channel")


def test_header_length_prefix_over_safetensors_cap_or_past_the_end(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    shard = d / "model.safetensors"
    # a 100 MiB header in a file large enough to hold it (sparse): over the cap, whatever the file's size
    shard.write_bytes(struct.pack("<Q", 104_857_600) + b"{}")
    os.truncate(shard, 105_251_400)
    with pytest.raises(CheckpointError) as info:
        _convert(d, tmp_path / "out")
    line = info.value.one_line()
    assert "header length 104857600 is over safetensors' limit of 100000000 bytes" in line
    assert "model.safetensors" in line and "re-download it" in line
    # a length under the cap that the file cannot hold: truncated
    shard.write_bytes(struct.pack("<Q", 5000) + b"{}" + b" " * 100)
    with pytest.raises(CheckpointError, match="header length 5000 runs past the end of the 110-byte file"):
        _convert(d, tmp_path / "out")
