"""inspect's size estimates plan the routed experts of a module once when they differ only by index
(plan.expert_fold); the estimate must be what the full plan says, and experts that differ are not folded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv.model.classify import classify
from fp8conv.options import TARGETS, ConvertOptions
from fp8conv.plan.conversion import plan_conversion
from fp8conv.plan.expert_fold import expert_fold
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

EXPERTS, H, WIDTH = 6, 256, 128


def _moe(path: Path, not_converted: list[str], ragged_expert: int | None = None) -> Path:
    """Two MoE layers of block-FP8 experts (one expert of another width when `ragged_expert`), a bf16
    gate, and an ignore list."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        tensors[p + "gate.weight"] = torch.ones(EXPERTS, H, dtype=torch.bfloat16)
        for e in range(EXPERTS):
            width = WIDTH // 2 if e == ragged_expert else WIDTH
            for name, shape in (("gate_proj", (width, H)), ("up_proj", (width, H)), ("down_proj", (H, width))):
                tensors[f"{p}experts.{e}.{name}.weight"] = fp8(shape, seed=e)
                tensors[f"{p}experts.{e}.{name}.weight_scale_inv"] = torch.ones(
                    -(-shape[0] // 128), -(-shape[1] // 128)
                )
    config = fp8_block_config() | {"hidden_size": H, "moe_intermediate_size": WIDTH, "num_hidden_layers": 2}
    config["quantization_config"]["modules_to_not_convert"] = not_converted
    return write_checkpoint(path, tensors, config, shards=3)


@pytest.mark.parametrize(
    ("not_converted", "ragged", "folded_modules"),
    [
        ([], None, 2),  # every expert alike: each layer's experts planned once
        (["model.layers.1.mlp.experts.3.up_proj"], None, 1),  # one expert listed: layer 1 is planned whole
        ([], 4, 0),  # one expert of another shape in each layer: no layer folds
    ],
)
def test_the_folded_estimate_is_the_full_plan(tmp_path, not_converted, ragged, folded_modules) -> None:
    path = _moe(tmp_path / "ckpt", not_converted, ragged)
    ckpt = open_checkpoint(path)
    cls = classify(ckpt.index, ckpt.config)
    fold = expert_fold(ckpt, cls)
    assert sum(1 for n, count in fold.items() if count == EXPERTS and n.endswith("gate_proj.weight")) == folded_modules
    assert sum(fold.values()) == len(cls.weights) + len(cls.plain)  # every planned tensor stood for once
    estimates = fp8conv.inspect(path).estimated_output_bytes
    for to in TARGETS:
        assert estimates[to] == plan_conversion(ckpt, cls, ConvertOptions(to=to)).output_bytes, to
