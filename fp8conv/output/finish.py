"""Fan-out: `convert --part I/N` converts the I-th of N deterministic parts of the output shards
(balanced by bytes); `finalize` (or the last part to finish) writes the index and config once every
part's shards are present and hashed. For Slurm job arrays, Kubernetes Indexed Jobs or CI matrices
sharing one output filesystem."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import OptionsError, OutputError
from ..plan.conversion import ShardPlan
from ..source.config import CONFIG_NAME, dump_json
from ..source.index import INDEX_NAME
from ..storage.json_file import read_json_object
from ..storage.lock import OutputLock, drop_unheld_locks
from ..storage.out_dir import OutDir
from ..storage.writer import copy_file_atomic, fsync_dir, write_file_atomic
from ..version import __version__
from .leftovers import live_temporary, remove_temporaries
from .manifest import MANIFEST, Manifest, resume_mismatch
from .part_record import check_copy_source, check_part_record
from .provenance import MODEL_CARD, write_model_card
from .requant_report import TensorError, errors_of_record, requant_record

PART_FILE = re.compile(r"^part-(\d+)-of-(\d+)\.json$")


def parse_part(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise OptionsError(f"--part {text!r} is not I/N with 1 <= I <= N", fix="e.g. --part 2/8")
    return int(m.group(1)), int(m.group(2))


def assign_parts(shards: list[ShardPlan], count: int) -> list[list[str]]:
    """Greedy by bytes, largest first, ties by name: the same answer on every machine."""
    parts: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for shard in sorted(shards, key=lambda s: (-s.nbytes, s.name)):
        i = min(range(count), key=lambda j: (loads[j], j))
        parts[i].append(shard.name)
        loads[i] += shard.nbytes
    return [sorted(p) for p in parts]


def shard_parts(shards: list[ShardPlan], count: int) -> dict[str, int]:
    """Each shard's part (1-based) in a split into `count` parts."""
    return {name: i for i, names in enumerate(assign_parts(shards, count), 1) for name in names}


def part_path(out: Path, part: tuple[int, int]) -> Path:
    return out / MANIFEST.parent / f"part-{part[0]}-of-{part[1]}.json"


def part_files(out: Path) -> dict[tuple[int, int], Path]:
    """Every part manifest file in OUT, by (I, N), unread."""
    files = {}
    for path in sorted((out / MANIFEST.parent).glob("part-*-of-*.json")):
        m = PART_FILE.match(path.name)
        if m and not path.is_symlink():  # a link planted there is no record of ours (refused before a run)
            files[(int(m.group(1)), int(m.group(2)))] = path
    return files


def part_docs(out: Path) -> dict[tuple[int, int], dict[str, Any]]:
    """Every part manifest in OUT, by (I, N)."""
    docs = {}
    for part, path in part_files(out).items():
        try:
            docs[part] = _read_part(path, part)
        except OutputError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):  # dropped by a part started with --overwrite
                continue  # since the glob
            raise
    return docs


_PART_KEYS = ("fp8conv_version", "options", "input", "shards")
_FINALIZE_KEYS = ("planned_shards", "config", "claims_ue8m0", "copy_from", "copy_files", "index")


def _read_part(path: Path, part: tuple[int, int]) -> dict[str, Any]:
    """One part manifest; a damaged one (a crash mid-copy, a full disk, a hand edit) is named with the way out."""
    fix = f"run part {part[0]}/{part[1]} again with --overwrite"
    label = f"part manifest {path}"
    doc = read_json_object(path, fix=fix, name=label, error=OutputError)
    missing = [k for k in _PART_KEYS if k not in doc]
    if not missing and doc.get("complete"):
        fin = doc.get("finalize")
        missing = [f"finalize.{k}" for k in _FINALIZE_KEYS if not isinstance(fin, dict) or k not in fin]
    if missing:
        raise OutputError(f"lacks {', '.join(missing)}", file=label, fix=fix)
    check_part_record(doc, label, fix)
    return doc


def check_part(out: Path, part: tuple[int, int], manifest: Manifest, *, overwrite: bool) -> None:
    """Before a part writes anything: refuse, by name, an OUT that is not an fp8conv output, holds a split
    into another N, or parts run with other options, input or version. Never the mere presence of other
    parts: they run, retry and finish in any order. --overwrite lets this part replace what is there."""
    i, n = part
    if overwrite:
        return
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST.parent).is_dir():
        raise OptionsError(
            f"output directory {out} is not empty and holds no fp8conv output",
            fix="choose an empty directory, or pass --overwrite to write into it",
        )
    for (j, m), doc in part_docs(out).items():
        if m != n:
            raise OptionsError(
                f"{out} holds part {j}/{m} of a split into {m} parts; this is --part {i}/{n}",
                fix=f"run every part with the same N (--part I/{m}), or pass --overwrite to every part to start over",
            )
        if j == i:
            continue  # this part's own record: replaced, or checked by --resume
        why = _doc_mismatch(doc, manifest)
        if why:
            raise OptionsError(
                f"cannot run --part {i}/{n} in {out}: part {j}/{n} there differs: {why}",
                fix="run every part with the same options, input and fp8conv, or pass --overwrite to every part",
            )


def _doc_mismatch(doc: dict[str, Any], manifest: Manifest) -> str | None:
    if doc.get("fp8conv_version") != manifest.fp8conv_version:
        return f"it was written by fp8conv {doc.get('fp8conv_version')}, this is {manifest.fp8conv_version}"
    return resume_mismatch(Manifest(doc["fp8conv_version"], doc["options"], doc["input"]), manifest)


def drop_other_splits(out: Path, count: int, within: OutDir | None = None) -> None:
    """--overwrite: the manifests of a split into another N would keep finalize from ever finishing."""
    for i, m in part_files(out):  # by name only: a damaged manifest of another split goes too
        if m != count:
            if within is not None:
                within.unlink(part_path(out, (i, m)).relative_to(out))
            else:
                part_path(out, (i, m)).unlink(missing_ok=True)


@dataclass
class FinalizeResult:
    output: Path
    parts: int
    shards: int


def finalize(
    output: str | Path,
    *,
    require_all: bool = True,
    within: OutDir | None = None,
    part: tuple[int, int] | None = None,
) -> FinalizeResult | None:
    """Check every part's shards (present, size, sha256; a shard whose mtime and inode are still those
    its part recorded is not read again), then copy the other files and write the manifest, index and
    config. With require_all=False, return None while parts are unfinished. `within`: OUT opened and
    locked by `part`, which calls this; without it, finalize opens OUT and holds its lock itself."""
    if within is None:
        out = Path(output)
        if not out.is_dir():
            raise OptionsError(f"{out} is not a directory", fix="give finalize the output of convert --part I/N")
        with OutDir.open(out, create=False) as opened, OutputLock.for_run(opened, None, "finalize"):
            opened.refuse_links()
            return _finalize(out, require_all, opened, None)
    assert part is not None, "a part finalizes within the OUT it holds"
    with OutputLock.finalizing(within):  # parts that finish together finalize one after another
        return _finalize(Path(output), require_all, within, part)


def drop_leftovers(within: OutDir, docs: dict[tuple[int, int], dict[str, Any]], part: tuple[int, int] | None) -> None:
    """What killed processes left that a finished output must not hold: their temporaries anywhere in
    OUT (all of them when finalize holds OUT alone; else all but those a part retried meanwhile is
    writing) and the lock files of parts that are gone."""
    if part is None:
        remove_temporaries(within, lambda rel: True)
    else:
        parts = {name: i for (i, _), doc in docs.items() for name in doc["shards"]}
        remove_temporaries(within, lambda rel: not live_temporary(within, rel, parts, part, finalizing=True))
    drop_unheld_locks(within)


def _finalize(out: Path, require_all: bool, within: OutDir, part: tuple[int, int] | None) -> FinalizeResult | None:
    docs = part_docs(out)
    if not docs:
        raise OptionsError(f"{out} holds no part manifests", fix="run convert --part I/N first")
    counts = {n for _, n in docs}
    if len(counts) != 1:
        raise OptionsError(f"{out} mixes part counts {sorted(counts)}", fix="convert again with one N")
    n = counts.pop()
    done = [i for i in range(1, n + 1) if (i, n) in docs and docs[(i, n)].get("complete")]
    if len(done) < n:
        if not require_all:
            return None
        missing = [f"{i}/{n}" for i in range(1, n + 1) if i not in done]
        raise OptionsError(f"parts {', '.join(missing)} have not finished", fix="run them, then finalize again")
    first = docs[(1, n)]
    for key in ("fp8conv_version", "options", "input", "finalize"):
        for (i, _), doc in docs.items():
            if doc[key] != first[key]:
                raise OptionsError(f"part {i}/{n} was run with a different {key}", fix="convert all parts again")
    if first["fp8conv_version"] != __version__:  # its finalize payload is that version's to interpret
        raise OptionsError(
            f"the parts in {out} were converted by fp8conv {first['fp8conv_version']}; this is {__version__}",
            fix=f"finalize with fp8conv {first['fp8conv_version']}, or convert every part again with --overwrite",
        )
    shards: dict[str, Any] = {}
    for doc in docs.values():
        shards.update(doc["shards"])
    fin = first["finalize"]
    drop_leftovers(within, docs, part)
    check_copy_source(Path(fin["copy_from"]), first["input"], fin["copy_files"], str(part_path(out, (1, n))))
    merged = Manifest(first["fp8conv_version"], first["options"], first["input"], shards, within=within)
    for name in fin["planned_shards"]:
        if not merged.shard_intact(out, name, trust_unchanged=True):
            raise OutputError("is missing or does not match its part's hash", shard=name, fix="run its part again")
    all_pow2 = all(doc.get("all_scales_pow2", True) for doc in docs.values())
    with_scale_fmt(fin["config"], fin["claims_ue8m0"], all_pow2)
    final = merged.without_stat()
    final.within = within
    if "source" in first:  # provenance, as a single run records it
        final.extra = {"source": first["source"]}
    requantization = _merged_requantization(docs)
    if requantization is not None:  # every part's tensors, summarised as a single run summarises them
        final.extra["requantization"] = requantization
    finish(
        out,
        final,
        Path(fin["copy_from"]),
        fin["copy_files"],
        fin["index"],
        fin["config"],
        fin.get("json_files"),
        fin.get("model_card_note"),
        within,
    )
    return FinalizeResult(out, n, len(shards))


def _merged_requantization(docs: dict[tuple[int, int], dict[str, Any]]) -> dict[str, Any] | None:
    """The parts' requantization records as one (check_part_record has checked each): each tensor is one
    part's, since a tensor lies in one shard and a shard in one part."""
    errors: dict[str, TensorError] = {}
    for doc in docs.values():
        errors.update(errors_of_record(doc.get("requantization")) or {})
    return requant_record(errors)


def with_scale_fmt(config: dict[str, Any] | None, claims_ue8m0: bool, all_pow2: bool) -> bool:
    """Write scale_fmt ue8m0 only where the input claimed it and every written scale is a power of two;
    False when the claim had to be dropped."""
    if config is None or not claims_ue8m0:
        return True
    if all_pow2:
        config["quantization_config"]["scale_fmt"] = "ue8m0"
    return all_pow2


def finish(
    out: Path,
    manifest: Manifest,
    copy_from: Path,
    copy_files: list[str],
    index: dict[str, Any] | None,
    config: dict[str, Any] | None,
    json_files: dict[str, dict[str, Any]] | None = None,
    model_card_note: str | None = None,
    within: OutDir | None = None,
) -> None:
    """The end of every run: the other files (the model card with `model_card_note` appended), the
    manifest, then the index and config, last: both written under temporary names first and renamed
    one right after the other, so a run killed before then leaves neither. `within`: OUT opened once;
    a link found in it now (planted during the run) is refused before the output is made complete."""
    for rel in copy_files:
        if rel == MODEL_CARD and model_card_note is not None:
            write_model_card(copy_from / rel, out / rel, model_card_note, within)
        else:
            copy_file_atomic(copy_from / rel, out / rel, within)
    for rel, doc in (json_files or {}).items():
        write_file_atomic(out / rel, dump_json(doc), within)
    manifest.save(out)
    last = [(name, doc) for name, doc in ((INDEX_NAME, index), (CONFIG_NAME, config)) if doc is not None]
    if within is None:
        for name, doc in last:
            write_file_atomic(out / name, dump_json(doc))
        fsync_dir(out)
        return
    within.refuse_links()  # a kept shard swapped for a link, a link planted mid-run: never shipped
    temps = [within.create_temp(name) for name, _ in last]
    try:
        for temp, (_, doc) in zip(temps, last, strict=True):
            within.fill(temp, dump_json(doc))
        for temp in temps:
            within.commit(temp)
    finally:
        for temp in temps:
            within.abort(temp)  # those not committed
