"""The one validator of safetensors headers, pure (bytes in, a ShardHeader or one CheckpointError out),
for a shard's own header, one read remotely from the Hub and one an interrupted --stream run saved.

As strict as safetensors' own reader (safetensors/src/tensor.rs, read_metadata and Metadata::validate):
a header of at most 100,000,000 bytes; every entry a dtype name, a shape of sizes and two offsets;
sorted by offset the tensors are contiguous from 0 with no gap and no overlap, each spanning exactly
its shape times its element size, and the data region ends where the file does. Types are JSON's:
`true` is not a size. A tensor count cap refuses a header of a million empty tensors before it is
parsed (the largest real releases have ~200k tensors per checkpoint, far fewer per shard).

A header laid out as safetensors writes it is checked with whole-list operations (_laid_out_entries);
any other is checked entry by entry, which is what names the first thing wrong with it. read_header
reads a local shard's header bytes (and nothing past them) into it."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import struct
from collections.abc import Iterable
from itertools import chain
from operator import itemgetter, mul, sub
from pathlib import Path
from typing import Any

from ..dtypes import ELEMENT_BYTES
from ..errors import CheckpointError
from .json_file import SURROGATE_ESCAPE, parse_json
from .json_file import is_text as _is_text
from .safetensors_file import MAX_HEADER_BYTES, ShardHeader, TensorEntry, tensor_entries

MAX_TENSORS = 300_000
MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
MAX_SIZE = 2**64 - 1  # safetensors' usize: offsets, sizes and their products
FIX = "the shard is corrupt; re-download it"
_DTYPE_NAMES = {name: name for name in ELEMENT_BYTES}


def parse_header(
    raw: bytes, file_size: int | None, shard: str, *, path: Path | None = None, max_tensors: int = MAX_TENSORS
) -> ShardHeader:
    """`raw`: the header's JSON text (the bytes after the 8-byte length). `file_size`: the whole file's
    size, or None when only the header is known (read remotely, or saved by an interrupted run): the
    header then keeps offsets relative to the data (data_start 0) and the data ends with the last tensor.
    `max_tensors`: more tensors are refused (the default cap; a test's own is smaller)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(f"header is {len(raw)} bytes, more than safetensors' {MAX_HEADER_BYTES}", shard=shard)
    if raw.count(b'"data_offsets"') > max_tensors:  # one per tensor: a bound, counted before parsing
        raise _too_many(raw.count(b'"data_offsets"'), max_tensors, shard)
    doc = parse_json(
        raw,
        label=shard,
        fix="re-download this shard",
        field="shard",
        allow_constants=False,
        check_tree=False,
        bound_integers=False,  # every number is checked to be a size below 2^64
    )
    if not isinstance(doc, dict):
        raise CheckpointError("header is not a JSON object", shard=shard, fix="re-download this shard")
    metadata = _metadata(doc.pop("__metadata__", None), shard)
    if len(doc) > max_tensors:
        raise _too_many(len(doc), max_tensors, shard)
    data_start = 0 if file_size is None else 8 + len(raw)
    # a lone surrogate can only come from a \ud8xx escape: without one every name is text
    names_are_text = SURROGATE_ESCAPE.search(raw) is None
    laid_out = _laid_out_entries(doc, data_start) if names_are_text else None
    if laid_out is not None:
        tensors, end = laid_out
    else:  # anything else, one entry at a time: the first bad entry's reason, the overlap or the gap
        entries = [
            _plain_entry(name, spec, data_start, names_are_text) or _entry(name, spec, shard, data_start)
            for name, spec in doc.items()
        ]
        entries.sort(key=lambda e: (e.start, e.nbytes))
        end = _check_contiguous(entries, shard, data_start)
        tensors = {e.name: e for e in entries}
    if file_size is not None:
        _check_covers_file(next(reversed(tensors.values()), None), end, file_size, shard)
    return ShardHeader(
        path=path if path is not None else Path(shard),
        file_size=file_size if file_size is not None else end,
        data_start=data_start,
        tensors=tensors,
        metadata=metadata,
    )


def _too_many(count: int, cap: int, shard: str) -> CheckpointError:
    return CheckpointError(
        f"header lists {count} tensors, more than the {cap} fp8conv reads from one shard",
        shard=shard,
        fix="the shard is damaged or hostile; re-download it",
    )


def _metadata(value: Any, shard: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) and _is_text(v) for v in value.values()):
        raise CheckpointError("__metadata__ is not an object of strings", shard=shard, fix=FIX)
    if not all(_is_text(k) for k in value):
        raise CheckpointError("__metadata__ has a key that is not text", shard=shard, fix=FIX)
    return value


def _is_size(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_SIZE  # bool is an int subclass: refused


def _laid_out_entries(doc: dict[str, Any], data_start: int) -> tuple[dict[str, TensorEntry], int] | None:
    """The entries of a header whose specs are all well formed and listed in offset order, contiguous
    from 0 (as safetensors writes them), and the data's end; None for anything else, which the
    per-entry checks then refuse by name or sort. The checks are _plain_entry's and _check_contiguous's,
    made with whole-list operations that run in C: a release has 200k tensors, and per-entry Python was
    most of opening one. Listed contiguously, the file order is the sorted order (only empty tensors
    share a start, each before the tensor that follows it)."""
    columns = _spec_columns(list(doc.values()))
    if columns is None:
        return None
    dtypes, shapes, starts, ends = columns
    nbytes = list(map(mul, map(math.prod, shapes), map(ELEMENT_BYTES.__getitem__, dtypes)))
    # contiguous from 0 with every span its size (>= 0): the offsets rise to the last end, the largest
    if starts[0] != 0 or starts[1:] != ends[:-1] or list(map(sub, ends, starts)) != nbytes or ends[-1] > MAX_SIZE:
        return None
    names = list(doc)
    # one str per dtype and one tuple per distinct shape (experts share theirs), not one per tensor
    distinct_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    shape_tuples = list(map(tuple, shapes))
    entries = tensor_entries(
        names,
        list(map(_DTYPE_NAMES.__getitem__, dtypes)),
        list(map(distinct_shapes.setdefault, shape_tuples, shape_tuples)),
        list(map(data_start.__add__, starts)),
        nbytes,
    )
    return dict(zip(names, entries, strict=True)), data_start + ends[-1]


def _spec_columns(specs: list[Any]) -> tuple[list[str], list[list[int]], list[int], list[int]] | None:
    """The dtypes, shapes, start and end offsets of specs that are all objects with a known dtype, a
    shape of at most MAX_DIMS sizes and two integer offsets; None when any is not (or there is none)."""
    if not specs:
        return None
    try:
        dtypes, shapes, offsets = (list(map(itemgetter(key), specs)) for key in ("dtype", "shape", "data_offsets"))
        if not set(dtypes).issubset(_DTYPE_NAMES):
            return None
    except (KeyError, TypeError):  # a key missing, a spec that is not an object, an unhashable dtype
        return None
    if set(map(type, shapes)) != {list} or max(map(len, shapes)) > MAX_DIMS or not _sizes(chain.from_iterable(shapes)):
        return None
    if set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    starts, ends = list(map(itemgetter(0), offsets)), list(map(itemgetter(1), offsets))
    if set(map(type, starts)) != {int} or set(map(type, ends)) != {int}:  # their range: the caller's checks
        return None
    return dtypes, shapes, starts, ends


def _sizes(values: Iterable[Any]) -> bool:
    """Every value a size (_is_size): a JSON integer in [0, MAX_SIZE]; true when there is none."""
    values = list(values)
    return not values or (set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= MAX_SIZE)


def _plain_entry(name: str, spec: Any, data_start: int, names_are_text: bool) -> TensorEntry | None:
    """The entry of a well-formed spec, checked as _entry checks it but in one pass of cheap tests (a
    release has 200k); None for anything else, which _entry then refuses with its one-line reason."""
    if type(spec) is not dict or not names_are_text:
        return None
    try:
        size, shape, (start, end) = ELEMENT_BYTES.get(spec["dtype"]), spec["shape"], spec["data_offsets"]
    except (KeyError, TypeError, ValueError):  # a key missing, an unhashable dtype, not two offsets
        return None
    if size is None or type(shape) is not list or len(shape) > MAX_DIMS or type(spec["data_offsets"]) is not list:
        return None
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_SIZE:
            return None
        size *= d
    if type(start) is not int or type(end) is not int or not 0 <= start <= end <= MAX_SIZE or size > MAX_SIZE:
        return None
    if end - start != size:
        return None
    return TensorEntry(name, spec["dtype"], tuple(shape), data_start + start, size)


def _entry(name: str, spec: Any, shard: str, data_start: int) -> TensorEntry:
    if not _is_text(name):
        raise CheckpointError(f"a tensor name {name!r} holds a lone UTF-16 surrogate, which is not text", shard=shard)
    if not isinstance(spec, dict):
        raise CheckpointError("header entry is not an object", tensor=name, shard=shard)
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if not isinstance(dtype, str):
        raise CheckpointError(f"dtype {dtype!r} is not a dtype name", tensor=name, shard=shard, fix=FIX)
    if dtype not in ELEMENT_BYTES:
        raise CheckpointError(
            f"dtype {dtype!r} is not one fp8conv knows",
            tensor=name,
            shard=shard,
            fix="this tensor's format is unsupported",
        )
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_size(d) for d in shape):
        raise CheckpointError(f"shape {_short(shape)} is not a list of sizes", tensor=name, shard=shard, fix=FIX)
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_size, offsets)) or offsets[1] < offsets[0]:
        raise CheckpointError(f"data_offsets {_short(offsets)} are invalid", tensor=name, shard=shard, fix=FIX)
    nbytes = math.prod(shape) * ELEMENT_BYTES[dtype]
    if nbytes > MAX_SIZE:
        raise CheckpointError(f"{dtype}{shape} overflows 64 bits of bytes", tensor=name, shard=shard, fix=FIX)
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointError(
            f"data_offsets span {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {nbytes}",
            tensor=name,
            shard=shard,
            fix=FIX,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], nbytes)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_contiguous(entries: list[TensorEntry], shard: str, data_start: int) -> int:
    """The end of the data (absolute): each tensor starts where the one before it ends."""
    cursor = data_start
    for e in entries:
        if e.start < cursor:
            raise CheckpointError("its bytes overlap the previous tensor's", tensor=e.name, shard=shard, fix=FIX)
        if e.start > cursor:
            raise CheckpointError(
                f"its bytes start {e.start - cursor} bytes after the previous tensor's end (a gap safetensors refuses)",
                tensor=e.name,
                shard=shard,
                fix=FIX,
            )
        cursor = e.start + e.nbytes
    return cursor


def _check_covers_file(last: TensorEntry | None, end: int, file_size: int, shard: str) -> None:
    """`last`: the tensor whose data ends the file's (None: the shard holds none)."""
    where = {"tensor": last.name} if last is not None else {}
    if end > file_size:
        raise CheckpointError(
            f"data runs to byte {end} but the file has {file_size} (truncated)",
            **where,
            shard=shard,
            fix="re-download this shard",
        )
    if end < file_size:
        raise CheckpointError(
            f"the file has {file_size - end} bytes after the last tensor's data, which safetensors refuses",
            **where,
            shard=shard,
            fix="the file is damaged or not what the header describes; re-download it",
        )


def read_header(
    path: Path, display_name: str | None = None, *, fd: int | None = None, file_size: int | None = None
) -> ShardHeader:
    """Parse and validate one shard's header (header.parse_header). Reads only the header bytes, from
    `fd` when given (opened by input_files with no link followed out of the checkpoint; not closed
    here), else from `path`, which must be a regular file: a FIFO is refused, never waited on."""
    shard = display_name or path.name
    own = fd is None
    try:
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError("is not a regular file", shard=shard, fix="point at the checkpoint's real shards")
            size = st.st_size if file_size is None else file_size
            os.lseek(fd, 0, os.SEEK_SET)  # read(), not pread(): tests trace that only the header is read
            prefix = _read_exactly(fd, 8)
            if len(prefix) < 8:
                raise CheckpointError("file is too short to be safetensors", shard=shard, fix="re-download this shard")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:  # first: a file large enough to hold it is still refused
                raise CheckpointError(
                    f"header length {header_len} is over safetensors' limit of {MAX_HEADER_BYTES} bytes "
                    "(no safetensors reader loads it)",
                    shard=shard,
                    fix="the file is damaged or not safetensors; re-download it",
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"header length {header_len} runs past the end of the {size}-byte file",
                    shard=shard,
                    fix="the file is truncated or not safetensors; re-download it",
                )
            raw = _read_exactly(fd, header_len)
        finally:
            if own:
                os.close(fd)
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror}", shard=shard) from exc
    header = parse_header(raw, size, shard, path=path)
    return dataclasses.replace(header, identity=(st.st_dev, st.st_ino))


def _read_exactly(fd: int, n: int) -> bytes:
    parts, done = [], 0
    while done < n:
        chunk = os.read(fd, n - done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)
