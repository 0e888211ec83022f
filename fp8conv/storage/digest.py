"""sha256 of files read 1 MiB at a time (not hashlib.file_digest: that needs Python 3.11, and 3.10 is
supported)."""

from __future__ import annotations

import hashlib
from typing import BinaryIO


def stream_sha256(*files: BinaryIO) -> str:
    """sha256 of the rest of each open file, one after the other."""
    digest = hashlib.sha256()
    for f in files:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
