"""inspect's size estimates plan the routed experts of a module once when they differ only by index
(plan.expert_fold); the estimate must be what the full plan says, and experts that differ are not folded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv.model.classify import classify
from fp8conv.model.family_widths import family_of, width_disagreements
from fp8conv.options import TARGETS, ConvertOptions
from fp8conv.plan.conversion import input_family, input_width_problems, plan_conversion, role_splits
from fp8conv.plan.expert_fold import expert_fold, shape_fold
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

EXPERTS, H, WIDTH = 6, 256, 128


def _moe(path: Path, not_converted: list[str], ragged_expert: int | None = None, bf16: bool = False) -> Path:
    """Two MoE layers of block-FP8 experts (one expert of another width when `ragged_expert`; bf16 experts
    when `bf16`), a bf16 gate, and an ignore list."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp."
        tensors[p + "gate.weight"] = torch.ones(EXPERTS, H, dtype=torch.bfloat16)
        for e in range(EXPERTS):
            width = WIDTH // 2 if e == ragged_expert else WIDTH
            for name, shape in (("gate_proj", (width, H)), ("up_proj", (width, H)), ("down_proj", (H, width))):
                if bf16:
                    tensors[f"{p}experts.{e}.{name}.weight"] = torch.ones(shape, dtype=torch.bfloat16)
                    continue
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


# experts.0 of both layers listed as not converted: a bf16 checkpoint's other experts are quantized
_EXPERT_0 = [f"model.layers.{layer}.mlp.experts.0.{p}_proj" for layer in range(2) for p in ("gate", "up", "down")]


@pytest.mark.parametrize(
    ("not_converted", "ragged", "bf16"),
    [
        ([], None, False),
        (["model.layers.1.mlp.experts.3.up_proj"], None, False),
        ([], 4, False),
        (_EXPERT_0, None, True),
    ],
)
@pytest.mark.parametrize("fold", ["shape", "expert"])
def test_roles_found_from_the_folds_are_the_full_scans(tmp_path, not_converted, ragged, bf16, fold) -> None:
    """The family (by rule here: a model_type the table does not name) and the width check are asked of the
    folded tensors (a plan's: shape_fold's; inspect's: expert_fold's), inspect's role splits of expert_fold's:
    each must be what every tensor gives (family_widths asked of all the shapes, role_splits of every name).
    A bf16 checkpoint whose experts.0 are listed folds by shape but not by listing, and the role splits must
    still see its other experts quantized."""
    path = _moe(tmp_path / "ckpt", not_converted, ragged, bf16)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "novel_moe"}))
    ckpt = open_checkpoint(path)
    folded_cls, full_cls = classify(ckpt.index, ckpt.config), classify(ckpt.index, ckpt.config)
    shapes = folded_cls.input_shapes(ckpt.index)
    among = None if fold == "shape" else expert_fold(ckpt, folded_cls)
    folded = input_family(ckpt, folded_cls, among)
    asked = shape_fold(ckpt, folded_cls) if among is None else among
    # nothing folds with an expert of another shape, nor by listing where every layer's experts.0 is listed
    weights = [name for name, _, _ in shapes if name.endswith(".weight")]
    assert (len([n for n in weights if n in asked]) < len(weights)) == (
        ragged is None and not (bf16 and fold == "expert")
    )
    full = family_of(ckpt.config, {name: shape for name, shape, _ in shapes})
    assert folded is not None and full is not None and folded.by_rule
    assert (folded.name, folded.roles, folded.refusals, folded.misfits, folded.mlp_mixers) == (
        full.name,
        full.roles,
        full.refusals,
        full.misfits,
        full.mlp_mixers,
    )
    assert role_splits(ckpt, folded_cls, among=expert_fold(ckpt, folded_cls)) == role_splits(ckpt, full_cls)
    assert any(s.block_fp8 for s in role_splits(ckpt, full_cls)) or ragged is not None
    fix = "correct config.json"
    assert [p.one_line() for p in input_width_problems(ckpt, folded_cls, fix, among)] == [
        p.one_line() for p in width_disagreements(ckpt.config, shapes, fix, folded)
    ]
    # the ragged expert's width is none config.json states (moe_intermediate_size is the others'): named
    assert bool(full.misfits) == (ragged is not None)


def test_a_width_the_fold_finds_wrong_is_named_for_every_expert(tmp_path) -> None:
    """The folded width check only says whether config.json and the tensors agree; where they do not, every
    tensor is checked, and inspect names each expert as convert does (not one per folded module)."""
    path = _moe(tmp_path / "ckpt", [])
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 2 * WIDTH}))
    problems = fp8conv.inspect(path).problems
    named = {p.split(":", 1)[0] for p in problems if "moe_intermediate_size says" in p}
    assert len(named) == 2 * EXPERTS * 3, problems[:3]  # two layers of gate, up and down for every expert
    ckpt = open_checkpoint(path)
    cls = classify(ckpt.index, ckpt.config)
    assert len(plan_conversion(ckpt, cls, ConvertOptions(to="bf16")).problems) >= len(named)


def test_the_output_widths_are_checked_unless_they_are_the_inputs(tmp_path, monkeypatch) -> None:
    """The plan checks its output's config.json against the output's tensors, and skips that check only
    when it is the input's (same widths stated, every tensor as it was). Two bugs it must still catch: a
    padding that left config.json's width as it was, and a config.json rewritten with another width."""
    import fp8conv.plan.conversion as conversion

    path = _moe(tmp_path / "ckpt", [])
    ckpt = open_checkpoint(path)
    bug = "the output's config.json would disagree with its tensors"
    padded = ConvertOptions(to="block", pad_for_tp=2)
    assert not [p for p in plan_conversion(ckpt, classify(ckpt.index, ckpt.config), padded).problems if bug in str(p)]
    monkeypatch.setattr(conversion, "updated_widths_config", lambda config, padding: None)
    problems = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), padded).problems
    assert any(bug in str(p) and "moe_intermediate_size says 128" in str(p) for p in problems)
    monkeypatch.undo()
    real_rewrite = conversion.rewrite_for_block

    def rewrite_with_another_width(config, block, ignore):
        return real_rewrite(config, block, ignore) | {"moe_intermediate_size": 2 * WIDTH}

    monkeypatch.setattr(conversion, "rewrite_for_block", rewrite_with_another_width)
    problems = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block")).problems
    assert any(bug in str(p) and "moe_intermediate_size says 256" in str(p) for p in problems)
