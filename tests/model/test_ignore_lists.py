"""Release ignore lists (modules_to_not_convert / ignore / exclude_modules): matched as the engines match
them, compiled once, stale entries reported, unsafe regexes refused in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch

from fp8conv.check.inspect_report import inspect
from fp8conv.model.classify import classify
from fp8conv.model.ignore_list import IgnoreList, unsafe_regex
from fp8conv.model.quant_config import module_matches
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import Action, plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import fp8, fp8_block_config, write_checkpoint


def reference_matches(module: str, patterns: list[str]) -> bool:
    """The matching fp8conv did before lists were compiled: one pass over the list per module."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif any(c in pattern for c in "*?["):
            if fnmatchcase(module, pattern) or fnmatchcase(module, pattern + ".*"):
                return True
        elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
            return True
    return False


@pytest.mark.parametrize(
    ("module", "entry", "listed"),
    [
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj", True),  # exact
        ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn", True),  # a parent: its subtree
        ("model.visual.blocks.0.attn.qkv.bias", "model.visual.blocks.0.attn.qkv", True),
        ("model.lm_head", "lm_head", True),  # a trailing name part
        ("model.layers.0.self_attn.q_proj", "self_attn.q_proj", True),
        ("model.layers.10.mlp.gate", "model.layers.1", False),  # dot boundaries only
        ("model.layers.0.mlp.gate_proj", "gate", False),
        ("model.layers.0.mlp.gate_proj", "mlp", False),  # a middle part is no suffix and no parent
        ("model.layers.0.mlp.gate", r"re:.*mlp\.gate$", True),  # re.match, as compressed-tensors
        ("model.layers.0.mlp.gate", r"re:mlp\.gate", False),  # anchored at the start
        ("model.layers.0.mlp.gate_proj", r"re:model\.layers\.\d+\.mlp", True),  # not at the end
        ("model.layers.3.mlp.down_proj", "model.layers.*.mlp*", True),  # ModelOpt wildcards
        ("model.layers.3.mlp", "model.layers.3.mlp*", True),
        ("model.layers.3.self_attn.o_proj", "model.layers.*.mlp*", False),
        ("model.layers.12.self_attn.q_proj", "model.layers.1?.self_attn.q_proj", True),
        ("model.layers.0.self_attn.q_proj", "model.layers.*.self_attn", True),  # a parent, by wildcard
        ("model.layers.0.self_attn.q_proj", "[m]odel.layers.0.self_attn.q_proj", True),
        ("model.layers.0.self_attn.indexer.weights_proj", "model.layers.0.self_attn.indexers_proj", False),
    ],
)
def test_entries_match_as_engines_match_them(module: str, entry: str, listed: bool) -> None:
    assert IgnoreList([entry]).matches(module) is listed
    assert module_matches(module, [entry]) is listed
    assert reference_matches(module, [entry]) is listed


def test_a_long_mixed_list_answers_as_one_pass_over_it_did() -> None:
    modules = [f"model.layers.{i}.{m}" for i in range(40) for m in ("mlp.gate", "mlp.experts.3.up_proj", "self_attn.o")]
    modules += ["lm_head", "model.embed_tokens", "model.visual.blocks.2.attn.qkv", "mtp.fc"]
    entries = [f"model.layers.{i}.mlp.gate" for i in range(0, 40, 3)] + ["lm_head", "visual", "o"]
    entries += ["model.layers.1?.self_attn*", "*.experts.3.*", "re:mtp\\.", "re:(?i)MODEL\\.EMBED", "model.layers.3"]
    compiled = IgnoreList(entries)
    answers = [compiled.matches(m) for m in modules]
    assert answers == [reference_matches(m, entries) for m in modules]
    assert 10 < sum(answers) < len(modules)  # the list decides both ways


def test_a_primed_list_answers_every_module_as_one_pass_over_it_did() -> None:
    """prime() answers a checkpoint's modules all at once from the entries' side (bisection in sorted
    lists); each answer must be the per-module one, edge entries included."""
    modules = [f"model.layers.{i}.{m}" for i in range(12) for m in ("mlp.gate", "mlp.experts.3.up_proj", "self_attn.o")]
    modules += ["lm_head", "model.lm_head", "lm_head.x", "model.layers.1", "model.layers.10.mlp", ".odd", "odd."]
    modules += ["model.visual.blocks.2.attn.qkv", "mtp.fc", "model.embed_tokens", "a.b/c.d"]
    entries = [f"model.layers.{i}.mlp.gate" for i in range(0, 12, 3)] + ["lm_head", "visual", "o", "", "zzz"]
    entries += ["model.layers.1", "up_proj", "experts.3.up_proj", "b/c.d", "model.layers.1?.self_attn*"]
    entries += ["*.experts.3.*", "re:mtp\\.", "re:(?i)MODEL\\.EMBED", "model.layers.*.mlp"]
    compiled = IgnoreList(entries)
    compiled.prime(modules)
    answers = [compiled.matches(m) for m in modules]
    assert answers == [reference_matches(m, entries) for m in modules]
    assert 10 < sum(answers) < len(modules)
    assert compiled.matches("model.layers.99.mlp.gate") is reference_matches("model.layers.99.mlp.gate", entries)


def test_entries_naming_no_tensor_are_listed_in_order() -> None:
    modules = ["model.layers.0.mlp.gate", "model.layers.0.self_attn.indexer.weights_proj", "lm_head"]
    entries = ["lm_head", "model.layers.0.self_attn.indexers_proj", "gate", "re:.*weights_proj$", "re:.*nothing"]
    entries += ["model.layers.*.mlp*", "model.layers.9.*", "model.layers.0", "layers.0.mlp.gate", "mlp"]
    assert IgnoreList(entries).unmatched(modules) == [
        "model.layers.0.self_attn.indexers_proj",
        "re:.*nothing",
        "model.layers.9.*",
        "mlp",
    ]


def _glm_like(tmp_path: Path, ignore: list[str], lm_head: bool = True) -> Path:
    """GLM-5's names: block FP8 attention, a bf16 indexer.weights_proj, and its list's stale entry."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn."
        for name in ("q_a_proj", "o_proj", "indexer.wk"):
            tensors[p + name + ".weight"] = fp8((128, 256), seed=layer)
            tensors[p + name + ".weight_scale_inv"] = torch.ones(1, 2)
        tensors[p + "indexer.weights_proj.weight"] = torch.ones(32, 256, dtype=torch.bfloat16)
    if lm_head:
        tensors["lm_head.weight"] = torch.ones(64, 256, dtype=torch.bfloat16)
    config = fp8_block_config() | {"model_type": "glm_moe_dsa", "num_hidden_layers": 2}
    config["quantization_config"]["modules_to_not_convert"] = ignore
    return write_checkpoint(tmp_path / "glm", tensors, config)


def test_glm5_stale_entry_is_reported_and_takes_no_tensor(tmp_path: Path) -> None:
    ignore = ["lm_head"] + [f"model.layers.{i}.self_attn.indexers_proj" for i in range(2)]
    root = _glm_like(tmp_path, ignore)
    report = inspect(root)
    assert report.not_converted_entries == 3
    assert report.not_converted_unmatched == ignore[1:]
    assert any("lists 2 module(s) as not converted that match no tensor" in w for w in report.warnings)
    ckpt = open_checkpoint(root)
    cls = classify(ckpt.index, ckpt.config)
    plan = plan_conversion(ckpt, cls, ConvertOptions(to="block"))
    jobs = {j.source: j for s in plan.shards for j in s.jobs}
    weights_proj = "model.layers.0.self_attn.indexer.weights_proj.weight"
    assert jobs[weights_proj].action is Action.COPY and jobs[weights_proj].spec.dtype == "BF16"
    assert not cls.settings.lists_as_not_converted(weights_proj.removesuffix(".weight"))
    listed = plan.config["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.self_attn.indexer.weights_proj" in listed  # what the output's loader must know
    assert sum("match no tensor" in w for w in plan.warnings) == 1  # convert warns once


def test_a_list_whose_entries_all_match_warns_nothing(tmp_path: Path) -> None:
    report = inspect(_glm_like(tmp_path, ["lm_head", "model.layers.0.self_attn.indexer.weights_proj"]))
    assert report.not_converted_unmatched == []
    assert not any("match no tensor" in w for w in report.warnings)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        ("(a+)+$", "repeats a group that itself repeats"),
        ("(a|a)*$", "repeats an alternation"),
        ("(?:x*)*y", "repeats a group that itself repeats"),
        (r"(a)\1", "uses a backreference"),
        (".*.*.*.*x", "repeats without bound 4 times"),
        ("(", "is not a valid regular expression"),
    ],
)
def test_unsafe_regexes_are_named(pattern: str, why: str) -> None:
    assert why in (unsafe_regex(pattern) or "")


@pytest.mark.parametrize("pattern", [r".*mlp\.gate$", r"model\.layers\.\d+\.mlp\..*", "(gate|up)_proj", "visual.*"])
def test_release_regexes_are_safe(pattern: str) -> None:
    assert unsafe_regex(pattern) is None


def _fp8conv(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # bounded: without the refusal, re:(a+)+$ against the 30-a name below backtracks for minutes
    return subprocess.run([sys.executable, "-m", "fp8conv", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("entry", "why"),
    [("re:(a+)+$", "repeats a group that itself repeats"), ("re:(", "is not a valid regular expression")],
)
def test_unsafe_or_broken_regex_is_one_line_refusal(tmp_path: Path, entry: str, why: str) -> None:
    name = "a" * 30 + "b"  # the module every regex is tried against
    tensors = {name + ".weight": torch.ones(4, 4, dtype=torch.bfloat16)}
    config = fp8_block_config() | {"model_type": "llama"}
    config["quantization_config"]["modules_to_not_convert"] = ["lm_head", entry]
    root = write_checkpoint(tmp_path / "ckpt", tensors, config)
    shown = _fp8conv("inspect", "--json", str(root), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    problems = json.loads(shown.stdout)["problems"]
    listed = f"quantization_config.modules_to_not_convert entry {entry!r}"
    expected = f"in config.json: {listed}: the regex after 're:' {why}"
    assert any(p.startswith(expected) for p in problems), problems
    refused = _fp8conv("convert", str(root), "--to", "block", "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert refused.returncode == 1
    first = refused.stderr.splitlines()[0]  # the CLI's one line (then only its FP8CONV_DEBUG hint)
    assert "Traceback (most recent call last)" not in refused.stderr
    assert first.startswith("error: " + expected)
    assert not (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_lm_head_is_no_stale_entry(tmp_path: Path, tied: bool) -> None:
    """Gemma-4's configs tie the word embeddings and list lm_head, which has no tensor of its own (it is the
    embedding): not reported as matching nothing. Untied, an lm_head with no tensor is reported."""
    root = _glm_like(tmp_path, ["lm_head", "model.layers.0.self_attn.indexer.weights_proj"], lm_head=False)
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": tied}))
    report = inspect(root)
    assert report.not_converted_unmatched == ([] if tied else ["lm_head"])
    assert any("match no tensor" in w for w in report.warnings) is not tied
