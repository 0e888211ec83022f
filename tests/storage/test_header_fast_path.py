"""The fast paths of opening a checkpoint (a release has 200k tensors) decide exactly what the per-entry
checks decide: the same entries in the same order, or the same refusal word for word. Each fast path is
compared here with its slow path on headers, indexes and JSON made to sit on the boundaries."""

from __future__ import annotations

import dataclasses
import gc
import json
import math
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


# Two metadata strings of one length in JSON: the second is a surrogate pair (an emoji, valid text)
# whose \ud8.. escape sends the header the per-entry way, as a lone surrogate might hide in a name.
PLAIN, PAIR = "\u00e9\u00e9", "\U0001f600"
assert len(json.dumps(PLAIN)) == len(json.dumps(PAIR))


def _outcome(header: dict[str, Any], data_size: int | None, *, fast: bool) -> Any:
    """parse_header's entries and sizes, or its refusal's line; `fast=False`: the per-entry path, which
    a spy on the laid-out path's tensor_entries confirms was taken. `data_size` None: a remote header."""
    raw = json.dumps({"__metadata__": {"m": PLAIN if fast else PAIR}} | header).encode()
    calls: list[int] = []
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(header_module, "tensor_entries", lambda *columns: calls.append(1) or tensor_entries(*columns))
        try:
            parsed = parse_header(raw, None if data_size is None else 8 + len(raw) + data_size, "s.safetensors")
            found: Any = (list(parsed.tensors.items()), parsed.file_size, parsed.data_start)
        except CheckpointError as refused:
            found = refused.one_line()
    assert fast or not calls
    return found


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
    size = None if remote else data_size + trailing
    assert _outcome(header, size, fast=True) == _outcome(header, size, fast=False)


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
        for size in (None, 18):
            assert _outcome(header, size, fast=True) == _outcome(header, size, fast=False), header


def test_a_header_laid_out_as_safetensors_writes_it_takes_the_fast_path(monkeypatch):
    header = {
        "b": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
        "empty": {"dtype": "F32", "shape": [0, 5], "data_offsets": [12, 12]},
        "a": {"dtype": "F8_E4M3", "shape": [], "data_offsets": [12, 13]},
        "c": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [13, 25]},
    }
    calls: list[int] = []
    monkeypatch.setattr(header_module, "tensor_entries", lambda *columns: calls.append(1) or tensor_entries(*columns))
    tensors = parse_header(json.dumps(header).encode(), None, "s.safetensors").tensors
    assert calls == [1]
    assert list(tensors.values()) == [
        TensorEntry("b", "BF16", (2, 3), 0, 12),
        TensorEntry("empty", "F32", (0, 5), 12, 0),
        TensorEntry("a", "F8_E4M3", (), 12, 1),
        TensorEntry("c", "BF16", (2, 3), 13, 12),
    ]
    # one object per distinct shape and per dtype: a release's 200k entries share a few dozen
    assert tensors["b"].shape is tensors["c"].shape and tensors["b"].dtype is tensors["c"].dtype
    for name, offsets in (("a", [0, 1]), ("b", [1, 13]), ("empty", [13, 13])):  # listed out of offset order
        header[name]["data_offsets"] = offsets
    tensors = parse_header(json.dumps(header).encode(), None, "s.safetensors").tensors
    assert calls == [1] and list(tensors) == ["a", "b", "empty", "c"]  # sorted by the per-entry path


def test_an_index_entry_built_a_field_at_a_time_is_the_constructors():
    made = tensor_entries(["w", "b"], ["F32", "U8"], [(2, 2), (3,)], [8, 24], [16, 3])
    assert made == [TensorEntry("w", "F32", (2, 2), 8, 16), TensorEntry("b", "U8", (3,), 24, 3)]
    assert hash(made[0]) == hash(TensorEntry("w", "F32", (2, 2), 8, 16)) and made[0].numel == 4
    assert repr(made[1]) == "TensorEntry(name='b', dtype='U8', shape=(3,), start=24, nbytes=3)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].start = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="as many of each field"):
        tensor_entries(["w", "b"], ["F32"], [(2, 2), (3,)], [8, 24], [16, 3])


@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    in_text=st.lists(st.integers(1, 60), max_size=3),
    separator=st.sampled_from(["", "/", ":", "\u00b0"]),
)
def test_an_integer_of_more_than_24_digits_is_refused_and_digits_in_text_are_not(lengths, in_text, separator):
    doc = {"n": [int("9" * n) for n in lengths], "s": [separator.join(["7" * n, "8" * n]) for n in in_text]}
    raw = json.dumps(doc, ensure_ascii=False).encode()
    too_long = [n for n in lengths if n > json_file.MAX_INT_DIGITS]
    if not too_long:
        assert json_file.parse_json(raw, label="x.json", fix="f") == doc
        return
    with pytest.raises(CheckpointError, match=f"holds an integer of {too_long[0]} digits under key 'n'"):
        json_file.parse_json(raw, label="x.json", fix="f")


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ('{"weight_map": {"a": "x", "b": "y"}, "metadata": {"total_size": 3}}', None),
        ('{"weight_map": {"a": "x", "b\\ud800": "y"}}', "holds a key with a lone UTF-16 surrogate ('b\\ud800')"),
        ('{"weight_map": {"a": "x\\udfff"}}', "holds a string with a lone UTF-16 surrogate under key 'a'"),
        ('{"a": [[{"b": [1, "z"]}]], "c": []}', None),
        ("[" * 70 + "]" * 70, "nests arrays or objects more than 64 deep"),
        ('{"k": ' + "[" * 63 + "1" + "]" * 63 + "}", None),
        ('{"k": ' + "[" * 64 + "]" * 64 + "}", "nests arrays or objects more than 64 deep under key 'k'"),
    ],
)
def test_depth_and_surrogates_are_found_below_containers_of_plain_values(raw, problem):
    if problem is None:
        assert json_file.parse_json(raw.encode(), label="x.json", fix="f") == json.loads(raw)
        return
    with pytest.raises(CheckpointError) as refused:
        json_file.parse_json(raw.encode(), label="x.json", fix="f")
    assert refused.value.one_line().startswith(f"in x.json: {problem}")


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
        # none unfrozen (0) and none added; a frozen object that dies meanwhile (another test's thread ending)
        # leaves the count, so it may be a few lower
        assert 0.9 * frozen < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    index_file.write_text(index_file.read_text().replace('"b.weight"', '"ghost.weight"'))
    with pytest.raises(CheckpointError, match="ghost"):
        index_module.load_index(path, [], index_file)
    assert gc.isenabled()  # on again after a refusal
