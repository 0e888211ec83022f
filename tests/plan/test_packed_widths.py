"""A packed 4-bit expert (compressed-tensors X.weight_packed, INT4) plays the MLP role of the weight it
unpacks to: config.json's width is checked against its unpacked shape on the input, by inspect and by a
plan, named by the tensor the file holds, for a family of the table (kimi_k2) and one found by rule. A
config.json that disagrees with its packed experts used to pass inspect as "problems: none", and a plan
refused it only at the output's check, as a bug of fp8conv's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv.errors import PlanRefused
from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import input_family
from fp8conv.run.dry_run import dry_run
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import write_checkpoint
from tests.support.packed_builders import INT4_WEIGHTS, packed_builders_ct_config
from tests.support.packing import pack_int32, random_codes

H, WIDTH, EXPERTS = 64, 96, 3
ROLES = {"gate_proj": (WIDTH, H), "up_proj": (WIDTH, H), "down_proj": (H, WIDTH)}


def _packed_moe(path: Path, model_type: str, stated_width: int) -> Path:
    """One MoE layer of INT4 experts (group 32), a bf16 router and shared expert, attention in bf16;
    config.json states `stated_width` as moe_intermediate_size."""
    p = "model.layers.0."
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.ones(32, H, dtype=torch.bfloat16),
        "lm_head.weight": torch.ones(32, H, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": torch.ones(H, H, dtype=torch.bfloat16),
        p + "mlp.gate.weight": torch.ones(EXPERTS, H, dtype=torch.bfloat16),
    }
    for e in range(EXPERTS):
        for role, (n, k) in ROLES.items():
            base = f"{p}mlp.experts.{e}.{role}"
            tensors[base + ".weight_packed"] = pack_int32(random_codes((n, k), e))
            tensors[base + ".weight_scale"] = torch.ones(n, k // 32, dtype=torch.bfloat16)
            tensors[base + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int32)
    config = packed_builders_ct_config("pack-quantized", INT4_WEIGHTS) | {
        "model_type": model_type,
        "hidden_size": H,
        "intermediate_size": 2 * WIDTH,
        "moe_intermediate_size": stated_width,
        "num_hidden_layers": 1,
        "n_routed_experts": EXPERTS,
        "num_experts_per_tok": 2,
    }
    return write_checkpoint(path, tensors, config, shards=2)


@pytest.mark.parametrize("model_type", ["kimi_k2", "packedmoe_2026"])  # the table's, and one found by rule
def test_packed_experts_that_agree_with_config_json_convert(tmp_path: Path, model_type: str) -> None:
    agreeing = _packed_moe(tmp_path / "agree", model_type, WIDTH)
    assert fp8conv.inspect(agreeing).problems == []
    assert dry_run(agreeing, tmp_path / "out-agree", ConvertOptions(to="bf16")).tensors > 0


def test_a_packed_experts_width_is_checked_on_the_input(tmp_path: Path) -> None:
    wrong = _packed_moe(tmp_path / "wrong", "kimi_k2", WIDTH // 2)
    problems = fp8conv.inspect(wrong).problems
    said = f"config.json's moe_intermediate_size says {WIDTH // 2} along its intermediate dimension"
    named = sorted(p.split("'")[1] for p in problems if said in p)
    assert named == sorted(f"model.layers.0.mlp.experts.{e}.{r}.weight_packed" for e in range(EXPERTS) for r in ROLES)
    assert f"has shape [{WIDTH}, {H}] unpacked" in next(p for p in problems if "gate_proj" in p and said in p)
    for to in ("bf16", "block"):
        with pytest.raises(PlanRefused) as refused:
            dry_run(wrong, tmp_path / f"out-{to}", ConvertOptions(to=to))
        lines = [p.one_line() for p in refused.value.problems]
        assert any(said in line and "correct config.json" in line for line in lines), lines[:2]
        assert not any("a bug" in line for line in lines), lines[:2]


def test_a_family_found_by_rule_sees_its_packed_experts_roles(tmp_path: Path) -> None:
    """The rules read a packed expert by the name it unpacks to: the routed role is found, its width key
    matched to moe_intermediate_size by the unpacked shape."""
    path = _packed_moe(tmp_path / "ckpt", "packedmoe_2026", WIDTH)
    ckpt = open_checkpoint(path)
    family = input_family(ckpt, classify(ckpt.index, ckpt.config))
    assert family is not None and family.by_rule
    assert ("routed", "moe_intermediate_size") in [(role.group, role.width.label) for role in family.roles]


def test_a_packed_experts_output_width_is_still_checked(tmp_path: Path, monkeypatch) -> None:
    """The output's check is skipped only when it would read what the input's read (a packed weight unpacked
    to the name and shape the input's check gave it, config.json's widths as they were): a config.json
    rewritten with another width is still caught."""
    import fp8conv.plan.conversion as conversion
    from fp8conv.plan.conversion import plan_conversion

    path = _packed_moe(tmp_path / "ckpt", "kimi_k2", WIDTH)
    ckpt = open_checkpoint(path)
    bug = "the output's config.json would disagree with its tensors"
    assert plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="bf16")).problems == ()
    real_rewrite = conversion.rewrite_for_dequantized
    monkeypatch.setattr(
        conversion,
        "rewrite_for_dequantized",
        lambda config, dtype: real_rewrite(config, dtype) | {"moe_intermediate_size": 2 * WIDTH},
    )
    problems = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="bf16")).problems
    assert any(bug in str(p) and f"moe_intermediate_size says {2 * WIDTH}" in str(p) for p in problems), problems
