"""Whether an output folder is still what fp8conv wrote, or another tool's rewrite of a copy of it.

Tools that convert a folder copy every file they do not understand: compressed-tensors' converters carry
fp8conv's `.fp8conv/manifest.json` into their own output. A manifest whose shards no longer have the
sizes it records describes files another tool rewrote; verifying those against the manifest's options
would judge the wrong thing, so they are audited like any other tool's output.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from ...errors import Fp8ConvError
from ...output.manifest import MANIFEST, load_manifest


def rewritten_shards(output: str | os.PathLike[str]) -> list[str]:
    """The shards the manifest records that are regular files of another size now; [] when there is no
    manifest, it or its folder is a link, or it cannot be read: manifest verify refuses those by name,
    so nothing here reads through a link."""
    folder = Path(output)
    if not (_is(folder / MANIFEST.parent, stat.S_ISDIR) and _is(folder / MANIFEST, stat.S_ISREG)):
        return []
    try:
        manifest = load_manifest(folder)
    except Fp8ConvError:
        return []
    changed = []
    for name, entry in manifest.shards.items():
        if _is(folder / name, stat.S_ISREG) and os.lstat(folder / name).st_size != entry["size"]:
            changed.append(name)  # (links and missing shards: manifest verify's to refuse)
    return changed


def _is(path: Path, is_kind: Callable[[int], bool]) -> bool:
    """The path itself (never a link's target) is of that kind."""
    try:
        return bool(is_kind(os.lstat(path).st_mode))
    except OSError:
        return False
