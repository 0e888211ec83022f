"""Rows stored in chunks (model.weight_format.ChunkedRows: MiMo-V2.5's fused qkv_proj), each chunk on its own
scale grid: seen as [chunks, rows, K] the backends' per-expert grids are the per-chunk ones, and a float output
takes the plain order engines read."""

from __future__ import annotations

import torch

from ..model.weight_format import ChunkedRows


def in_chunks(w: torch.Tensor, chunks: int) -> torch.Tensor:
    """A 2-D tensor whose rows are `chunks` equal chunks, as [chunks, rows, K] (a view); itself for one."""
    return w.reshape(in_chunks_shape(tuple(w.shape), chunks))


def in_chunks_shape(shape: tuple[int, ...], chunks: int) -> tuple[int, ...]:
    return shape if chunks == 1 else (chunks, shape[-2] // chunks, shape[-1])


def plain_rows(w: torch.Tensor, chunked: ChunkedRows) -> torch.Tensor:
    """Rows stored in chunks ([q_0; k_0; v_0; q_1; ...]) in the plain order ([q_0; q_1; ...; k_0; ...])."""
    return w.index_select(-2, torch.tensor(chunked.plain_order(), dtype=torch.long))


def per_chunk_grid(scale_shape: tuple[int, ...], shape: tuple[int, ...], chunks: int, block: tuple[int, int]) -> bool:
    """The stored scale is the per-chunk grid (each chunk's ceil(rows / bn) rows, stacked)."""
    rows = shape[-2] // chunks
    return scale_shape == (chunks * -(-rows // block[0]), -(-shape[-1] // block[1]))
