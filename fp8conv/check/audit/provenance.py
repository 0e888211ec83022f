"""Whether an output folder is still what fp8conv wrote, or another tool's rewrite of a copy of it.

Tools that convert a folder copy every file they do not understand: compressed-tensors' converters carry
fp8conv's `.fp8conv/manifest.json` into their own output. A manifest whose shards no longer have the
sizes it records describes files another tool rewrote; verifying those against the manifest's options
would judge the wrong thing, so they are audited like any other tool's output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ...output.manifest import MANIFEST


def rewritten_shards(output: str | os.PathLike[str]) -> list[str]:
    """The shards the manifest records that are regular files of another size now; [] when there is no
    manifest, it cannot be read (manifest verify refuses it by name) or every size still agrees."""
    folder = Path(output)
    try:
        doc = json.loads((folder / MANIFEST).read_text())
        shards = doc["shards"]
        recorded = {name: int(entry["size"]) for name, entry in shards.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    changed = []
    for name, size in recorded.items():
        path = folder / name
        if path.is_symlink() or not path.is_file():
            continue  # links and missing shards are manifest verify's to refuse
        if path.stat().st_size != size:
            changed.append(name)
    return changed
