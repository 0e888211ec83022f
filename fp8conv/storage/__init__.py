"""Bytes on disk: safetensors headers and tensors, JSON files, direct I/O, the output folder, locks."""
