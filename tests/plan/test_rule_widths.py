"""A family found by rule (a model_type the table does not name) has each MLP role's width matched to the
config key whose value its tensors have. When config.json states widths for a role and none is the
tensors' (or shared experts fit only a generic key while config.json has one naming them, which engines
size them by), config.json and the tensors disagree: inspect lists it as a problem and a plan refuses it,
as for a family of the table. It used to be a warning, and every target converted with exit 0 to an
output no engine loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv.errors import PlanRefused
from fp8conv.options import ConvertOptions
from fp8conv.run.dry_run import dry_run
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

H, DENSE, ROUTED, EXPERTS = 256, 384, 128, 4
CONFIG = {
    "model_type": "rulemoe_2026",
    "hidden_size": H,
    "intermediate_size": DENSE,
    "moe_intermediate_size": ROUTED,
    "shared_expert_intermediate_size": ROUTED,
    "n_shared_experts": 1,
    "num_hidden_layers": 2,
    "num_experts": EXPERTS,
}


def _fp8_linear(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, int], seed: int) -> None:
    tensors[name + ".weight"] = fp8(shape, seed)
    tensors[name + ".weight_scale_inv"] = torch.ones(-(-shape[0] // 128), -(-shape[1] // 128))


def _rule_moe(path: Path, mixtral: bool = False, **config: int) -> Path:
    """Layer 0 dense, layer 1 routed experts and a shared expert, all block FP8; config.json CONFIG with
    `config`'s values instead. `mixtral`: routed experts alone, sized by intermediate_size (no moe_ key)."""
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.ones(32, H, dtype=torch.bfloat16)}
    mlps = {"model.layers.0.mlp.": DENSE, "model.layers.1.mlp.shared_expert.": ROUTED} if not mixtral else {}
    mlps |= {f"model.layers.1.mlp.experts.{e}.": ROUTED for e in range(EXPERTS)}
    for seed, (prefix, width) in enumerate(mlps.items()):
        _fp8_linear(tensors, prefix + "gate_proj", (width, H), seed)
        _fp8_linear(tensors, prefix + "up_proj", (width, H), seed)
        _fp8_linear(tensors, prefix + "down_proj", (H, width), seed)
    tensors["model.layers.1.mlp.gate.weight"] = torch.ones(EXPERTS, H, dtype=torch.bfloat16)
    stated = CONFIG | config
    if mixtral:  # Mixtral's keys: the experts' width is intermediate_size
        stated = {k: v for k, v in stated.items() if "moe" not in k and "shared" not in k}
        stated["intermediate_size"] = config.get("intermediate_size", ROUTED)
    return write_checkpoint(path, tensors, fp8_block_config() | stated, shards=2)


def test_widths_that_agree_convert(tmp_path: Path) -> None:
    path = _rule_moe(tmp_path / "ckpt")
    report = fp8conv.inspect(path)
    assert report.problems == [] and "roles by rule" in (report.family or "")
    assert not [w for w in report.warnings if "width" in w], report.warnings
    assert dry_run(path, tmp_path / "out", ConvertOptions(to="bf16")).tensors > 0


@pytest.mark.parametrize(
    ("key", "group", "module"),
    [
        ("moe_intermediate_size", "routed", "model.layers.1.mlp.experts.0."),
        ("intermediate_size", "dense", "model.layers.0.mlp."),
        # the shared expert still fits moe_intermediate_size * n_shared_experts; engines read the key naming it
        ("shared_expert_intermediate_size", "shared", "model.layers.1.mlp.shared_expert."),
    ],
)
def test_a_width_config_json_gets_wrong_is_refused(tmp_path: Path, key: str, group: str, module: str) -> None:
    wrong = CONFIG[key] // 2
    path = _rule_moe(tmp_path / "ckpt", **{key: wrong})
    said = f"none of the widths config.json states for the {group} MLP is its ("
    found = [p for p in fp8conv.inspect(path).problems if said in p]
    assert len(found) == 1 and f"{key} {wrong}" in found[0] and "correct config.json" in found[0], found
    assert found[0].startswith(f"tensor '{module}"), found
    for to in ("bf16", "channel", "block"):
        with pytest.raises(PlanRefused) as refused:
            dry_run(path, tmp_path / f"out-{to}", ConvertOptions(to=to))
        assert any(said in p.one_line() for p in refused.value.problems), [p.one_line() for p in refused.value.problems]


def test_a_role_config_json_states_no_width_for_is_not_a_disagreement(tmp_path: Path) -> None:
    """Without any key an engine may size the routed experts by, there is nothing to hold them to: the
    rules say so (and --pad-for-tp is refused), the conversion goes on."""
    path = _rule_moe(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    del config["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(config))
    report = fp8conv.inspect(path)
    assert report.problems == []
    assert any("no config.json key gives the routed MLP's width" in w for w in report.warnings), report.warnings
    assert dry_run(path, tmp_path / "out", ConvertOptions(to="bf16")).tensors > 0


def test_experts_sized_by_intermediate_size_are_held_to_it(tmp_path: Path) -> None:
    """With no moe_/expert_ key and no dense MLP that intermediate_size sizes, it is the experts' width
    (Mixtral's keys, MiniMax's): held to it as a key naming them."""
    agreeing = _rule_moe(tmp_path / "agree", mixtral=True)
    assert fp8conv.inspect(agreeing).problems == []
    wrong = _rule_moe(tmp_path / "wrong", mixtral=True, intermediate_size=ROUTED // 2)
    said = f"none of the widths config.json states for the routed MLP is its (intermediate_size {ROUTED // 2};"
    assert [p for p in fp8conv.inspect(wrong).problems if said in p], fp8conv.inspect(wrong).problems


def test_verify_holds_an_output_to_the_widths_config_json_states(tmp_path: Path) -> None:
    """verify checks the output's config.json against its tensors on its own, a family by rule included."""
    path = _rule_moe(tmp_path / "ckpt")
    out = tmp_path / "out"
    fp8conv.convert(path, out, ConvertOptions(to="bf16"))
    assert fp8conv.verify(path, out).failures == []
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": ROUTED // 2}))
    said = f"none of the widths config.json states for the routed MLP is its (moe_intermediate_size {ROUTED // 2};"
    failures = fp8conv.verify(path, out).failures
    assert any(said in f for f in failures), failures
