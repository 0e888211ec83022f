"""The records a run leaves (manifest, provenance, part records) and how every run ends."""
