"""The checkpoint index: which shard holds each tensor, from the index file and the shard headers.

Reads headers only. The index file (when present) and the headers must agree exactly.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path

from ..errors import CheckpointError
from ..records import collector_paused
from ..storage.header import read_header
from ..storage.input_files import open_beneath, plain_relative
from ..storage.json_file import read_json_object
from ..storage.safetensors_file import ShardHeader, TensorEntry

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class Shard:
    name: str  # path relative to the checkpoint root, as the index names it
    header: ShardHeader


@dataclass
class CheckpointIndex:
    """tensor name -> (shard, entry); shards in a stable order."""

    root: Path
    shards: list[Shard]
    index_file: Path | None
    locations: dict[str, tuple[Shard, TensorEntry]] = field(default_factory=dict)

    def entry(self, name: str) -> TensorEntry:
        return self.locations[name][1]

    def shard_of(self, name: str) -> Shard:
        return self.locations[name][0]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for _, e in self.locations.values())


def load_index(
    root: Path,
    shard_names: list[str],
    index_file: Path | None,
    headers: dict[str, ShardHeader] | None = None,
) -> CheckpointIndex:
    """Read every shard's header (or take `headers` read remotely) and, when there is an index file,
    cross-check it against them."""
    with collector_paused():  # 200k entries and 600k JSON containers made, no cycle among them
        return _load_index(root, shard_names, index_file, headers)


def _load_index(
    root: Path, shard_names: list[str], index_file: Path | None, headers: dict[str, ShardHeader] | None
) -> CheckpointIndex:
    weight_map = read_weight_map(index_file) if index_file else None
    if weight_map is not None:
        shard_names = sorted(set(weight_map.values()))
    elif headers is not None:
        shard_names = sorted(headers)
    shards = []
    for name in shard_names:
        check_shard_name(name, index_file.name if index_file else None)
        if headers is not None:
            if name not in headers:
                raise CheckpointError(f"names shard {name!r}, which the repository does not hold", file=INDEX_NAME)
            shards.append(Shard(name, headers[name]))
            continue
        shards.append(Shard(name, read_shard_header(root, name, index_file.name if index_file else None)))
    index = CheckpointIndex(root=root, shards=shards, index_file=index_file)
    _add_locations(index.locations, shards)
    if weight_map is not None:
        _cross_check(index, weight_map, index_file.name if index_file else INDEX_NAME)
    if not index.locations:  # a run would write an output with no weights that looks complete
        raise CheckpointError(
            f"the shards ({', '.join(s.name for s in shards[:3]) or 'none'}) hold no tensor",
            fix="point at a checkpoint with weights; re-download it if its shards are damaged",
        )
    return index


def _add_locations(locations: dict[str, tuple[Shard, TensorEntry]], shards: list[Shard]) -> None:
    """Each shard's tensors, a shard at a time in C (a release has 200k). Fewer locations than tensors:
    a name is in two shards, which the loop then names as it meets it."""
    for shard in shards:
        tensors = shard.header.tensors
        locations.update(zip(tensors, zip(repeat(shard), tensors.values()), strict=True))
    if len(locations) == sum(len(shard.header.tensors) for shard in shards):
        return
    locations.clear()
    for shard in shards:
        for tname, entry in shard.header.tensors.items():
            if tname in locations:
                raise CheckpointError(
                    f"appears in both {locations[tname][0].name} and {shard.name}",
                    tensor=tname,
                    shard=shard.name,
                    fix="the checkpoint is inconsistent; re-download it",
                )
            locations[tname] = (shard, entry)


def read_weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor name -> shard map, read with no link followed out of its folder."""
    fix = "re-download the index file"
    doc = read_input_json(index_file, fix=fix)
    weight_map = doc.get("weight_map")
    # (the names need no test: JSON object keys are strings)
    if not isinstance(weight_map, dict) or not _all_str(weight_map.values()):
        raise CheckpointError("has no 'weight_map' object of tensor name -> shard file", file=index_file.name, fix=fix)
    if not weight_map:
        raise CheckpointError("has an empty 'weight_map': it lists no tensor to convert", file=index_file.name, fix=fix)
    bad = sorted(s for s in set(weight_map.values()) if not is_shard_name(s))  # per shard: 300k tensors, few shards
    if bad:
        check_shard_name(bad[0], index_file.name, tensor=next(t for t, s in weight_map.items() if s == bad[0]))
    return weight_map


def _all_str(values: Iterable[object]) -> bool:
    return all(map(isinstance, values, repeat(str)))  # in C: no Python step for each of 200k tensors


def read_input_json(path: Path, *, fix: str) -> dict:
    """A JSON object of the input (config.json, the index, params.json, hf_quant_config.json) opened
    with no link followed out of the checkpoint folder (path.parent), capped and guarded as every
    JSON file is (json_file)."""
    where = {"file": path.name}
    try:
        fd = open_beneath(path.parent, path.name, where=where)
    except OSError as exc:
        raise CheckpointError(f"cannot be read ({exc.strerror or exc})", **where, fix=fix) from exc
    return read_json_object(path, fix=fix, fd=fd)


def check_shard_name(name: object, where: str | None, tensor: str | None = None) -> None:
    """A shard name from an index (or a listing): a plain relative .safetensors path inside the root."""
    if not is_shard_name(name):
        shown = repr(name) if len(repr(name)) <= 120 else repr(name)[:117] + "..."
        raise CheckpointError(
            f"names shard {shown}, which is not a .safetensors file inside the checkpoint",
            tensor=tensor,
            file=where,
            fix="fix the index: shard names must be relative file names",
        )


def is_shard_name(name: object) -> bool:
    return plain_relative(name) and isinstance(name, str) and name.endswith(".safetensors")


def read_shard_header(root: Path, name: str, where: str | None = None) -> ShardHeader:
    """One shard's header, the file opened with no link followed out of the checkpoint."""
    check_shard_name(name, where)
    try:
        fd = open_beneath(root, name, where={"shard": name})
    except FileNotFoundError as exc:
        raise CheckpointError(
            f"names shard {name!r}, which does not exist", file=where, fix="download the missing shard"
        ) from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read: {exc.strerror or exc}", shard=name) from exc
    try:
        return read_header(root / name, display_name=name, fd=fd)
    finally:
        os.close(fd)


def _cross_check(index: CheckpointIndex, weight_map: dict[str, str], index_name: str) -> None:
    # as many names as the headers hold, and each header's names all listed under its shard: the index
    # holds nothing else. Compared a shard at a time in C (a release has 200k tensors); when they
    # differ, the loops below find the first tensor that does and name it
    if len(weight_map) == len(index.locations) and all(
        list(map(weight_map.get, shard.header.tensors)) == [shard.name] * len(shard.header.tensors)
        for shard in index.shards
    ):
        return
    for tname, shard_name in weight_map.items():
        found = index.locations.get(tname)
        if found is None or found[0].name != shard_name:
            raise CheckpointError(
                f"is listed in {index_name} under {shard_name} but that shard's header does not hold it",
                tensor=tname,
                shard=shard_name,
                fix="the index does not match the shards; re-download both",
            )
    for tname, (shard, _) in index.locations.items():
        if tname not in weight_map:
            raise CheckpointError(
                f"is in the shard but missing from {index_name}",
                tensor=tname,
                shard=shard.name,
                fix="the index does not match the shards; re-download both",
            )
