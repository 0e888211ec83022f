"""Block geometry per tensor. weight_block_size declares a default, not a law: every scale grid is confirmed
against it axis by axis, and an axis whose grid can only mean one block confirms that one instead. A grid of
as many rows as the weight (ceil(rows / bn) = rows forces bn = 1) is one scale per row, whatever was
declared: DeepSeek-V4.1-Flash's Engram tables, [384006168, 256] with an E8M0 scale [384006168, 8] under a
declared [32, 32], are (1, 32) blocks. An axis that fits neither is refused by name (the classifier), never
guessed from a division.

Some families' loaders read a tensor in a geometry of its own, hard-coded rather than taken from the
config; an FP8 output keeps such a tensor as stored (its bytes and its scale's), since that is what those
loaders read. DeepSeek-V4.1's Engram embedding: DeepSeek's inference/model.py ParallelEngramEmbedding
("Stays fp8: rows are dequantized on lookup", scale [rows, dim // 32]), vLLM common/engram.py
(ParallelEngramEmbedding block_size 32, uint8 scale), sglang layers/engram.py (FP8_BLOCK_SIZE), transformers
DeepseekV41EngramEmbedding (block_size 32; a float table is a plain embedding, so --to bf16 dequantizes it).
"""

from __future__ import annotations

import math
import re
from typing import Any

from .families import model_type_of

# model_type -> (tensor name pattern, the geometry its loaders hard-code)
STATED_GEOMETRIES: dict[str, tuple[tuple[re.Pattern[str], tuple[int, int]], ...]] = {
    "deepseek_v41": ((re.compile(r"(?:^|\.)engram\.embed\.weight$"), (1, 32)),),
}


def forced_block(weight: tuple[int, ...], scale: tuple[int, ...], declared: tuple[int, int]) -> tuple[int, int] | None:
    """The one block a 2-D grid can mean when it is not the declared one on every axis: per axis the
    declared block where the grid fits it, else 1 where the grid has one scale per element of the axis;
    None when an axis fits neither (or the grid is the declared one: nothing forced)."""
    if len(weight) != len(scale) or len(weight) < 2 or weight[:-2] != scale[:-2]:
        return None
    block = []
    for size, grid, want in zip(weight[-2:], scale[-2:], declared, strict=True):
        if grid == math.ceil(size / want):
            block.append(want)
        elif grid == size and size > 1:
            block.append(1)
        else:
            return None
    forced = (block[0], block[1])
    return None if forced == declared else forced


def stated_geometry(config: dict[str, Any] | None, name: str) -> tuple[int, int] | None:
    """The geometry the family's loaders hard-code for this tensor, if they do."""
    for section_type in {model_type_of(config), str((config or {}).get("model_type"))}:
        for pattern, block in STATED_GEOMETRIES.get(section_type.removesuffix("_text"), ()):
            if pattern.search(name):
                return block
    return None
