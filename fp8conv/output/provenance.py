"""Where an output came from: the `source` record of .fp8conv/manifest.json, and the note appended to
the copied model card (README.md), which otherwise still describes the FP8 release it was copied from."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..dtypes import FP8_MAX_GAUDI2
from ..options import DEFAULT_BLOCK
from ..plan.conversion import ConversionPlan
from ..storage.out_dir import OutDir
from ..storage.writer import open_input_file, write_file_atomic
from ..version import __version__

MODEL_CARD = "README.md"
NOTE_HEADING = "## Converted with fp8conv"


def hub_snapshot_of(root: Path) -> tuple[str, str] | None:
    """(repo id, commit) when `root` is a huggingface_hub cache snapshot (models--org--name/snapshots/<commit>)."""
    resolved = root.resolve()
    repo = resolved.parent.parent.name
    if resolved.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/", 1), resolved.name


def source_record(
    location: str | os.PathLike[str], root: Path, revision: str | None, is_hub_id: bool
) -> dict[str, Any]:
    """Hub IDs and cache snapshots: repo id, the revision asked for and the commit it resolved to.
    A plain folder: its absolute path."""
    snap = hub_snapshot_of(root)
    if is_hub_id and snap is not None:
        return {"repo_id": str(location), "revision": revision, "commit": snap[1]}
    record: dict[str, Any] = {"path": str(Path(location).resolve())}
    if snap is not None:
        record |= {"repo_id": snap[0], "commit": snap[1]}
    return record


def describe_target(plan: ConversionPlan) -> str:
    opts = plan.options
    if opts.to == "bf16":
        return f"{opts.dtype} (dequantized; no quantization_config)"
    if opts.to == "channel":
        gaudi = ", pre-scaled to the Gaudi2 range of +-240" if opts.fp8_max == FP8_MAX_GAUDI2 else ""
        return (
            "channel-wise FP8 (compressed-tensors FP8_DYNAMIC: float8_e4m3fn weights, one float32 scale "
            f"per output row, dynamic per-token activations{gaudi})"
        )
    if opts.to == "int8":
        return (
            "INT8 W8A8 (compressed-tensors int-quantized: symmetric int8 weights, one float32 scale per output "
            "row, dynamic per-token INT8 activations)"
        )
    quant = (plan.config or {}).get("quantization_config") or {}
    block = quant.get("weight_block_size") or list(opts.block_size or DEFAULT_BLOCK)
    pad = f", MLP widths zero-padded for tensor parallel {opts.pad_for_tp}" if opts.pad_for_tp else ""
    return f"block FP8 ({block[0]}x{block[1]} blocks, float32 weight_scale_inv{pad})"


def model_card_note(record: dict[str, Any], plan: ConversionPlan) -> str:
    if "repo_id" in record:
        origin = f"[`{record['repo_id']}`](https://huggingface.co/{record['repo_id']})"
        origin += f" at revision `{record['commit']}`"
    else:  # a local path may be private: only the folder's name goes into a card meant for upload
        origin = f"a local copy (folder `{Path(record['path']).name}`, revision unknown)"
    return (
        f"\n\n{NOTE_HEADING}\n\n"
        f"This is not the FP8 release described above: fp8conv {__version__} converted {origin} to "
        f"{describe_target(plan)}. The weights, `config.json` and `model.safetensors.index.json` here are "
        "the converted ones; `.fp8conv/manifest.json` records the options and every shard's sha256.\n"
    )


def write_model_card(src: Path, dst: Path, note: str, within: OutDir | None = None) -> None:
    """The model card with the note appended (once: a card that already has one keeps only the new one).
    `within`: the output directory, opened once (see out_dir)."""
    with open_input_file(src) as f:  # a regular file only, as every copied file
        text = f.read().decode("utf-8", errors="surrogateescape")
    if NOTE_HEADING in text:  # converted again from an fp8conv output: the old note is stale
        text = text[: text.index(NOTE_HEADING)].rstrip("\n")
    write_file_atomic(dst, (text.rstrip("\n") + note).encode("utf-8", errors="surrogateescape"), within)
