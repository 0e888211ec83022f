"""The fast paths of opening a checkpoint (a release has 200k tensors) decide exactly what the per-entry
checks decide: the same entries in the same order, or the same refusal word for word. Each fast path is
compared here with its slow path on headers, indexes and JSON made to sit on the boundaries."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8conv.errors import CheckpointError
from fp8conv.source import index as index_module
from fp8conv.storage import header as header_module
from fp8conv.storage import json_file
from fp8conv.storage.header import parse_header
from fp8conv.storage.safetensors_file import TensorEntry, tensor_entries
from tests.support.helpers import write_checkpoint

SPEC_KEYS = ("dtype", "shape", "data_offsets")
# what a JSON header may hold where a dtype name, a shape, a size or a spec belongs
ODD_VALUES: list[Any] = [
    True,
    False,
    -1,
    1.0,
    2**64,
    2**64 - 1,
    None,
    "4",
    [4],
    {"a": 1},
    {"a": 0, "b": 4},
    [],
    ["F32"],
]


def _outcome(raw: bytes, file_size: int | None, *, fast: bool) -> Any:
    """parse_header's result as comparable values, or its refusal's line; `fast=False`: the per-entry path."""
    with pytest.MonkeyPatch.context() as patched:
        if not fast:
            patched.setattr(header_module, "_laid_out_entries", lambda doc, data_start: None)
        try:
            header = parse_header(raw, file_size, "s.safetensors")
        except CheckpointError as refused:
            return refused.one_line()
    return list(header.tensors.items()), header.file_size, header.data_start


CHANGES = ["none", "reorder", "shift", "retype", "value", "drop key", "not a spec", "huge", "past 64 bits"]


@st.composite
def headers(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A header as safetensors lays it out (empty tensors included), then perhaps reordered, given a gap
    or an overlap, or with one value of one spec replaced by an odd one; and the data's size."""
    header: dict[str, Any] = {}
    cursor = 0
    for i in range(draw(st.integers(1, 6))):
        dtype = draw(st.sampled_from(["F32", "BF16", "F8_E4M3", "U8"]))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        nbytes = header_module.ELEMENT_BYTES[dtype] * math.prod(shape)
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    change = draw(st.sampled_from(CHANGES))
    if change == "reorder":
        return {name: header[name] for name in draw(st.permutations(list(header)))}, cursor
    if change == "not a spec":
        header[draw(st.sampled_from(list(header)))] = draw(st.sampled_from(ODD_VALUES))
    elif change == "past 64 bits":  # after a first tensor of 2^64 - 1 bytes, the next one ends past them
        for spec in header.values():
            spec["data_offsets"] = [o + 2**64 - 1 for o in spec["data_offsets"]]
        header = {"big": {"dtype": "U8", "shape": [2**64 - 1], "data_offsets": [0, 2**64 - 1]}} | header
        cursor += 2**64 - 1
    elif change != "none":
        _spoil(draw, header[draw(st.sampled_from(list(header)))], change)
    return header, cursor


def _spoil(draw: st.DrawFn, victim: dict[str, Any], change: str) -> None:
    if change == "shift":  # a gap, or an overlap when negative
        victim["data_offsets"] = [o + draw(st.sampled_from([-1, 1, 2])) for o in victim["data_offsets"]]
    elif change == "retype":  # a number equal to the size but not a JSON integer: 1.0, True
        key = draw(st.sampled_from(["shape", "data_offsets"]))
        if victim[key]:
            at = draw(st.integers(0, len(victim[key]) - 1))
            value = victim[key][at]
            victim[key][at] = draw(st.sampled_from([float(value), bool(value)] if value in (0, 1) else [float(value)]))
    elif change == "value":
        key = draw(st.sampled_from(SPEC_KEYS))
        odd = draw(st.sampled_from(ODD_VALUES))
        if key != "dtype" and victim[key] and draw(st.booleans()):
            victim[key][draw(st.integers(0, len(victim[key]) - 1))] = odd  # one item of the list
        else:
            victim[key] = odd
    elif change == "drop key":
        del victim[draw(st.sampled_from(SPEC_KEYS))]
    elif change == "huge":  # sizes at and past 64 bits, whose bytes overflow them; too many dimensions
        victim["shape"] = draw(st.sampled_from([[2**32, 2**32], [2**64 - 1], [1] * 64, [1] * 65]))


@settings(max_examples=400, deadline=None)
@given(case=headers(), trailing=st.sampled_from([0, 0, 1, -1]), remote=st.booleans())
def test_the_fast_header_path_decides_as_the_per_entry_one(case, trailing, remote):
    header, data_size = case
    raw = json.dumps(header).encode()
    file_size = None if remote else 8 + len(raw) + data_size + trailing
    assert _outcome(raw, file_size, fast=True) == _outcome(raw, file_size, fast=False)


LAID_OUT = {
    "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
    "z": {"dtype": "U8", "shape": [0, 3], "data_offsets": [16, 16]},
    "b": {"dtype": "BF16", "shape": [1], "data_offsets": [16, 18]},
}


def _each_odd_value() -> list[dict[str, Any]]:
    """LAID_OUT with one value, or one item of a shape or offsets, replaced by each odd value; and the
    sizes only a range check refuses: negative dimensions of a positive product, a huge one times 0."""
    cases = []
    for name, spec in LAID_OUT.items():
        for key in SPEC_KEYS:
            places = [None] + (list(range(len(spec[key]))) if isinstance(spec[key], list) else [])
            for at in places:
                for odd in ODD_VALUES:
                    case = json.loads(json.dumps(LAID_OUT))
                    if at is None:
                        case[name][key] = odd
                    else:
                        case[name][key][at] = odd
                    cases.append(case)
    for name, shape in (("a", [-2, -2]), ("z", [0, -1]), ("z", [0, 2**64]), ("z", [2**64 - 1, 0])):
        cases.append(json.loads(json.dumps(LAID_OUT)))
        cases[-1][name]["shape"] = shape
    return cases


def test_each_odd_value_is_decided_as_the_per_entry_path_decides():
    for header in _each_odd_value():
        raw = json.dumps(header).encode()
        for file_size in (None, 8 + len(raw) + 18):
            assert _outcome(raw, file_size, fast=True) == _outcome(raw, file_size, fast=False), header


def test_a_header_laid_out_as_safetensors_writes_it_takes_the_fast_path():
    header = {
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "empty": {"dtype": "F32", "shape": [0, 5], "data_offsets": [12, 12]},
        "a": {"dtype": "F8_E4M3", "shape": [], "data_offsets": [12, 13]},
        "c": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [13, 25]},
    }
    doc = json.loads(json.dumps(header))
    laid_out = header_module._laid_out_entries(doc, 100)
    assert laid_out is not None
    tensors, end = laid_out
    assert end == 125
    assert list(tensors.values()) == [
        TensorEntry("b", "BF16", (2, 3), 100, 12),
        TensorEntry("empty", "F32", (0, 5), 112, 0),
        TensorEntry("a", "F8_E4M3", (), 112, 1),
        TensorEntry("c", "BF16", (2, 3), 113, 12),
    ]
    # one object per distinct shape and per dtype: a release's 200k entries share a few dozen
    assert tensors["b"].shape is tensors["c"].shape and tensors["b"].dtype is tensors["c"].dtype
    header["a"]["data_offsets"], header["b"]["data_offsets"] = [0, 1], [1, 13]  # listed out of offset order
    assert header_module._laid_out_entries(json.loads(json.dumps(header)), 100) is None


def test_an_index_entry_built_a_field_at_a_time_is_the_constructors():
    made = tensor_entries(["w", "b"], ["F32", "U8"], [(2, 2), (3,)], [8, 24], [16, 3])
    assert made == [TensorEntry("w", "F32", (2, 2), 8, 16), TensorEntry("b", "U8", (3,), 24, 3)]
    assert hash(made[0]) == hash(TensorEntry("w", "F32", (2, 2), 8, 16)) and made[0].numel == 4
    assert repr(made[1]) == "TensorEntry(name='b', dtype='U8', shape=(3,), start=24, nbytes=3)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].start = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="as many of each field"):
        tensor_entries(["w", "b"], ["F32"], [(2, 2), (3,)], [8, 24], [16, 3])


LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (json_file.MAX_INT_DIGITS + 1))


@settings(max_examples=300, deadline=None)
@given(raw=st.lists(st.sampled_from([b"0", b"9", b"5" * 24, b"1" * 25, b"/", b":", b" ", b"\xb0", b"\x39"])))
def test_the_long_digit_test_finds_what_the_regex_finds(raw):
    joined = b"".join(raw)
    assert json_file._has_long_digits(joined) == (LONG_DIGITS.search(joined) is not None)


class _NeverDisjoint:
    def isdisjoint(self, other: object) -> bool:
        return False


@pytest.mark.parametrize(
    ("doc", "surrogates"),
    [
        ({"weight_map": {"a": "x", "b": "y"}, "metadata": {"total_size": 3}}, False),
        ({"weight_map": {"a": "x", "b\ud800": "y"}}, True),
        ({"weight_map": {"a": "x\udfff"}}, True),
        ({"a": [[{"b": [1, "z"]}]], "c": []}, False),
        (json.loads("[" * 70 + "]" * 70), False),
        ({"k": json.loads("[" * 63 + "1" + "]" * 63)}, False),
        ({"k": json.loads("[" * 64 + "]" * 64)}, True),
    ],
)
def test_the_tree_walk_skipping_leaf_containers_finds_what_the_full_walk_finds(doc, surrogates, monkeypatch):
    found = json_file._check_tree(doc, surrogates)
    monkeypatch.setattr(json_file, "_CONTAINERS", _NeverDisjoint())  # every container walked item by item
    assert found == json_file._check_tree(doc, surrogates)


def test_a_surrogate_in_an_index_name_is_still_refused(tmp_path):
    path = write_checkpoint(tmp_path / "c", {"a.weight": torch.ones(2)}, shards=1)
    index_path = path / "model.safetensors.index.json"
    index_path.write_text(index_path.read_text().replace('"a.weight"', '"a.weight\\udc00"'))
    with pytest.raises(CheckpointError, match="lone UTF-16 surrogate"):
        index_module.read_weight_map(index_path)


@pytest.mark.parametrize("weight_map", [{"a.weight": 5}, {"a.weight": ["x.safetensors"]}, ["a.weight"], "x"])
def test_a_weight_map_of_other_than_strings_is_refused(tmp_path, weight_map):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="has no 'weight_map' object of tensor name -> shard file"):
        index_module.read_weight_map(path)


def test_the_collector_is_paused_while_the_index_is_built_and_restored_after(tmp_path, monkeypatch):
    path = write_checkpoint(tmp_path / "c", {"a.weight": torch.ones(2), "b.weight": torch.ones(3)}, shards=2)
    seen = []
    read = index_module.read_shard_header

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return read(*args, **kwargs)

    monkeypatch.setattr(index_module, "read_shard_header", watched)
    index_file = path / "model.safetensors.index.json"
    assert gc.isenabled()
    assert len(index_module.load_index(path, [], index_file).locations) == 2
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        index_module.load_index(path, [], index_file)
        assert not gc.isenabled()  # a caller's own pause is left as it was
    finally:
        gc.enable()
    built = index_module.load_index(path, [], index_file)  # straight to the oldest generation
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(built.entry("a.weight")) in oldest and id(built.locations["a.weight"]) in oldest
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a caller's frozen objects stay frozen
    try:
        frozen = gc.get_freeze_count()
        index_module.load_index(path, [], index_file)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    index_file.write_text(index_file.read_text().replace('"b.weight"', '"ghost.weight"'))
    with pytest.raises(CheckpointError, match="ghost"):
        index_module.load_index(path, [], index_file)
    assert gc.isenabled()  # on again after a refusal
