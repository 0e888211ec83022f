"""The checkpoint index: which shard holds each tensor, from the index file and the shard headers.

Reads headers only. The index file (when present) and the headers must agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .errors import CheckpointError
from .json_file import read_json_object
from .safetensors_file import ShardHeader, TensorEntry, read_header

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
    weight_map = read_weight_map(index_file) if index_file else None
    if weight_map is not None:
        shard_names = sorted(set(weight_map.values()))
    elif headers is not None:
        shard_names = sorted(headers)
    shards = []
    for name in shard_names:
        if headers is not None:
            if name not in headers:
                raise CheckpointError(f"names shard {name!r}, which the repository does not hold", file=INDEX_NAME)
            shards.append(Shard(name, headers[name]))
            continue
        path = _shard_path(root, name, index_file)
        shards.append(Shard(name, read_header(path, display_name=name)))
    index = CheckpointIndex(root=root, shards=shards, index_file=index_file)
    for shard in shards:
        for tname, entry in shard.header.tensors.items():
            if tname in index.locations:
                other = index.locations[tname][0].name
                raise CheckpointError(
                    f"appears in both {other} and {shard.name}",
                    tensor=tname,
                    shard=shard.name,
                    fix="the checkpoint is inconsistent; re-download it",
                )
            index.locations[tname] = (shard, entry)
    if weight_map is not None:
        _cross_check(index, weight_map, index_file.name if index_file else INDEX_NAME)
    return index


def read_weight_map(index_file: Path) -> dict[str, str]:
    fix = "re-download the index file"
    doc = read_json_object(index_file, fix=fix)
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError("has no 'weight_map' object of tensor name -> shard file", file=index_file.name, fix=fix)
    return weight_map


def _shard_path(root: Path, name: str, index_file: Path | None) -> Path:
    where = index_file.name if index_file else None
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or "\\" in name or not name.endswith(".safetensors"):
        raise CheckpointError(
            f"names shard {name!r}, which is not a .safetensors file inside the checkpoint",
            file=where,
            fix="fix the index: shard names must be relative file names",
        )
    path = root / pure
    if not path.is_file():
        raise CheckpointError(
            f"names shard {name!r}, which does not exist", file=where, fix="download the missing shard"
        )
    return path


def _cross_check(index: CheckpointIndex, weight_map: dict[str, str], index_name: str) -> None:
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
