"""The run manifest, OUT/.fp8conv/manifest.json: what shaped the output and what is finished.

It records the fp8conv version, the options that shape the output, the input's identity (shard names,
sizes and header hashes, config.json's hash) and, per finished shard, its size and sha256. `--resume`
keeps the shards whose size and hash still check out; `verify` re-plans from the options.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Fp8ConvError, OptionsError
from ..options import ConvertOptions
from ..source.checkpoint import Checkpoint
from ..storage.digest import stream_sha256
from ..storage.input_files import plain_relative, read_contained, reopen
from ..storage.json_file import read_json_object
from ..storage.out_dir import OutDir
from ..storage.writer import write_file_atomic
from .requant_report import errors_of_record

MANIFEST = Path(".fp8conv") / "manifest.json"


def file_sha256(path: Path) -> str | None:
    """The file's sha256, or None when it is not a regular file (a link at its name is not followed)."""
    fd = _open_regular(path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        return stream_sha256(f)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _open_regular(path: Path) -> int | None:
    """An output shard opened for reading only when it is a regular file: a link planted under a kept
    shard's name must never be kept (it would ship with the output)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def input_identity(ckpt: Checkpoint) -> dict[str, Any]:
    """Cheap and specific: every shard's name, size and header hash (the header names every tensor,
    dtype, shape and offset), and config.json's hash."""
    shards = []
    for shard in ckpt.index.shards:
        fd = reopen(shard.header.path, shard.header.identity, where={"shard": shard.name})
        with os.fdopen(fd, "rb") as f:
            header = f.read(shard.header.data_start)
        shards.append(
            {"name": shard.name, "size": shard.header.file_size, "header_sha256": hashlib.sha256(header).hexdigest()}
        )
    return {"shards": shards, "config_sha256": config_sha256(ckpt)}


def config_sha256(ckpt: Checkpoint) -> str | None:
    """config.json's hash, as every input identity records it (local or --stream); None without one."""
    if ckpt.config is None:
        return None
    return hashlib.sha256(read_contained(ckpt.root, "config.json")).hexdigest()


@dataclass
class Manifest:
    fp8conv_version: str
    options: dict[str, Any]
    input: dict[str, Any]
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)  # finished: name -> {size, sha256}
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @staticmethod
    def options_dict(options: ConvertOptions) -> dict[str, Any]:
        return options.to_dict()

    def convert_options(self) -> ConvertOptions:
        return ConvertOptions.from_dict(self.options)

    path: Path = MANIFEST  # relative to the output; a part of a fan-out writes its own
    extra: dict[str, Any] = field(default_factory=dict)  # a part's finalize payload
    # a part also records each shard's mtime and inode, so finalize need not re-read files that are
    # untouched since (the final manifest leaves them out: it is the same bytes however the run was split)
    record_stat: bool = False
    # the output directory, opened once by the run: then every save and stat follows no link (out_dir)
    within: OutDir | None = field(default=None, repr=False, compare=False)

    def save(self, out: Path) -> None:
        doc = {
            "fp8conv_version": self.fp8conv_version,
            "options": self.options,
            "input": self.input,
            "shards": dict(sorted(self.shards.items())),  # the same bytes whatever order shards finished in
            **self.extra,  # key order kept: it carries config.json for finalize
        }
        write_file_atomic(out / self.path, (json.dumps(doc, indent=2) + "\n").encode(), self.within)

    def record_shard(self, out: Path, name: str, sha256: str, extra: dict[str, Any] | None = None) -> None:
        """Called once a shard is fsynced and renamed: its size and hash (taken as it was written), saved at
        once; `extra`: keys of the record that change with it (the requantization reports), in the same save."""
        st = self.within.lstat(name) if self.within is not None else os.lstat(out / name)
        assert st is not None, f"{name} was committed"
        entry: dict[str, Any] = {"size": st.st_size, "sha256": sha256}
        if self.record_stat:
            entry |= {"mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        with self._lock:
            self.shards[name] = entry
            self.extra.update(extra or {})
            self.save(out)

    def shard_intact(self, out: Path, name: str, trust_unchanged: bool = False) -> bool:
        """The shard is there with its recorded size and sha256. With trust_unchanged, a file whose
        mtime and inode are still those recorded when it was written (a part's shards) is not read
        again: re-reading every shard doubled a -j 2 run (8 GiB --to bf16: 52 s against 19 s)."""
        entry = self.shards.get(name)
        st = self.within.lstat(name) if self.within is not None else _lstat(out / name)
        if not entry or st is None or not stat.S_ISREG(st.st_mode) or st.st_size != entry["size"]:
            return False  # a link under a shard's name is never kept: it would ship with the output
        if trust_unchanged and (entry.get("mtime_ns"), entry.get("inode")) == (st.st_mtime_ns, st.st_ino):
            return True
        return file_sha256(out / name) == entry["sha256"]

    def without_stat(self) -> Manifest:
        """The same manifest without the mtimes and inodes a part records."""
        shards = {n: {k: v for k, v in e.items() if k in ("size", "sha256")} for n, e in self.shards.items()}
        return Manifest(self.fp8conv_version, self.options, self.input, shards)


def load_manifest(out: Path, rel: Path = MANIFEST) -> Manifest:
    path = out / rel
    fix = "for verify, pass the conversion options again; to resume, start over with --overwrite"
    doc = read_json_object(path, fix=fix, name=str(path), error=OptionsError)
    missing = [k for k in ("fp8conv_version", "options", "input") if k not in doc]
    if missing:
        raise OptionsError(f"lacks {', '.join(missing)}", file=str(path), fix=fix)
    check_record(doc, str(path), fix, OptionsError)
    kept = {k: doc[k] for k in ("requantization",) if k in doc}  # the finished shards' reports, for --resume
    return Manifest(doc["fp8conv_version"], doc["options"], doc["input"], doc.get("shards", {}), extra=kept)


_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_record(doc: dict[str, Any], label: str, fix: str, error: type[Fp8ConvError]) -> None:
    """The keys a manifest and a part record share, checked against their schema (types included: `true`
    is not a size) before any is used; the first misfit is named by file and key."""

    def bad(key: str, what: str) -> Fp8ConvError:
        return error(f"is damaged: {key} is not {what}", file=label, key=key, fix=fix)

    if not isinstance(doc["fp8conv_version"], str):
        raise bad("fp8conv_version", "a string")
    if not isinstance(doc["options"], dict):
        raise bad("options", "an object")
    try:
        ConvertOptions.from_dict(doc["options"])
    except (Fp8ConvError, TypeError, ValueError) as exc:
        raise error(f"is damaged: its options are not fp8conv's ({exc})", file=label, key="options", fix=fix) from None
    if not isinstance(doc["input"], dict) or not isinstance(doc["input"].get("shards", []), list):
        raise bad("input", "an object with a list of shards")
    shards = doc.get("shards", {})
    if not isinstance(shards, dict):
        raise bad("shards", "an object")
    for name, entry in shards.items():
        key = f"shards.{name}"
        if not plain_relative(name):
            raise bad(key, "a shard name inside the output")
        if not isinstance(entry, dict) or not _is_size(entry.get("size")):
            raise bad(key, "an object with a size")
        if not isinstance(entry.get("sha256"), str) or not _SHA256.fullmatch(entry["sha256"]):
            raise bad(f"{key}.sha256", "a sha256 in hex")
        if any(k in entry and not _is_size(entry[k]) for k in ("mtime_ns", "inode")):
            raise bad(key, "an object whose mtime_ns and inode are integers")
    # the finished shards' requantization reports: --resume carries them, finalize merges them
    if "requantization" in doc and errors_of_record(doc["requantization"]) is None:
        raise bad("requantization", "a requantization record (tensors and their error reports)")


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def resume_mismatch(old: Manifest, new: Manifest) -> str | None:
    """Why an interrupted run cannot be resumed with these options and this input, or None."""
    for key in sorted(set(old.options) | set(new.options)):
        if old.options.get(key) != new.options.get(key):
            return f"option {key} was {old.options.get(key)!r}, now {new.options.get(key)!r}"
    if ("commit" in old.input) != ("commit" in new.input):  # a --stream run pins its input by commit
        how = "streamed" if "commit" in old.input else "did not stream"
        return f"the interrupted run {how} its input from the Hub (--stream); resume it the same way"
    if old.input != new.input:
        changed = [s["name"] for s in new.input["shards"] if s not in old.input.get("shards", [])] or ["config.json"]
        return f"the input changed since the interrupted run ({', '.join(changed[:3])})"
    return None
