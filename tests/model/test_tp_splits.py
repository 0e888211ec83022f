"""What inspect's tensor-parallel table and --pad-for-tp's warnings say a run needs, role by role: the block
rules for the roles a --to block output holds as FP8 (packed 4-bit experts included), an even split for those
it keeps unquantized, no check of a plain up projection on one rank, and only padding choices that help.
Header-only checkpoints: planning reads headers alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fp8conv
from fp8conv.cli.render import render_report
from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.plan_scale_bench import plan_scale

H, EXPERTS = 256, 4
BLOCK_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _moe(root: Path, dense: int, moe: int, shared: int, own_shared_key: bool, bf16: bool = False) -> Path:
    """Layer 0 dense, layer 1 routed + shared experts, block FP8 (`bf16`: a bf16 master). `own_shared_key`:
    Qwen2-MoE's names and its shared_expert_intermediate_size; else DeepSeek-V3's, its shared experts
    moe_intermediate_size wide."""
    bench = plan_scale()
    if bf16:
        bench.fp8 = lambda name, shape: bench.bf16(name + ".weight", shape)
    tensors = bench.bf16("model.embed_tokens.weight", (512, H))
    for proj, shape in (("gate_proj", (dense, H)), ("up_proj", (dense, H)), ("down_proj", (H, dense))):
        tensors += bench.fp8(f"model.layers.0.mlp.{proj}", shape)
    p = "model.layers.1.mlp."
    tensors += [(p + "gate.weight", "BF16", (EXPERTS, H))]
    for e in range(EXPERTS):
        for proj, shape in (("gate_proj", (moe, H)), ("up_proj", (moe, H)), ("down_proj", (H, moe))):
            tensors += bench.fp8(f"{p}experts.{e}.{proj}", shape)
    home = "shared_expert." if own_shared_key else "shared_experts."
    for proj, shape in (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared))):
        tensors += bench.fp8(p + home + proj, shape)
    config = {"hidden_size": H, "intermediate_size": dense, "moe_intermediate_size": moe, "num_hidden_layers": 2}
    if own_shared_key:
        config |= {"model_type": "qwen2_moe", "shared_expert_intermediate_size": shared, "num_experts": EXPERTS}
    else:
        assert shared == moe
        config |= {"model_type": "deepseek_v3", "n_shared_experts": 1, "n_routed_experts": EXPERTS}
    bench.write_header_only(root, tensors, config | ({} if bf16 else {"quantization_config": BLOCK_QC}), per_shard=30)
    return root


def _plan(root: Path, **options):
    ckpt = open_checkpoint(root, headers_only=True)
    return plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", **options))


@pytest.mark.parametrize("dense", [448, 512])
def test_the_expert_parallel_choice_is_offered_where_it_pads_what_experts_leave(tmp_path, dense):
    """Routed experts 192 wide (48 per rank at TP 4): padding all roles, or (expert parallelism does not split
    experts) the dense and shared MLPs alone, which have keys of their own: offered where the dense MLP needs
    it (448: 112 per rank), not where it is whole already (512), which would pad nothing."""
    report = fp8conv.inspect(_moe(tmp_path / "c", dense, 192, 512, own_shared_key=True))
    assert report.tp_indivisible["4"] == (["dense intermediate_size 448 -> 112/rank"] if dense == 448 else []) + [
        "routed moe_intermediate_size 192 -> 48/rank"
    ]
    offered = {"dense,shared,routed", "dense,shared"} if dense == 448 else {"dense,shared,routed"}
    assert set(report.padded_output_bytes["4"]) == offered


def test_a_bf16_master_is_checked_as_the_block_fp8_it_becomes(tmp_path):
    """A bf16 checkpoint's Linears are quantized by --to block: the block rules apply to their widths (dense
    448 is 112 rows per rank at TP 4), not only an even split."""
    report = fp8conv.inspect(_moe(tmp_path / "c", 448, 192, 512, own_shared_key=True, bf16=True))
    assert report.tp_indivisible["4"] == [
        "dense intermediate_size 448 -> 112/rank",
        "routed moe_intermediate_size 192 -> 48/rank",
    ]


def test_no_expert_parallel_choice_that_leaves_the_shared_experts_in_partial_blocks(tmp_path):
    """DeepSeek's shared experts share moe_intermediate_size with the routed ones: --pad-roles dense would leave
    them 48 rows per rank at TP 4, which engines refuse, so inspect offers padding all roles only; convert with
    --pad-roles dense pads the dense MLP and warns that the shared one is left so, naming the roles that pad it."""
    root = _moe(tmp_path / "c", 448, 192, 192, own_shared_key=False)
    report = fp8conv.inspect(root)
    assert "shared moe_intermediate_size * n_shared_experts 192 -> 48/rank" in report.tp_indivisible["4"]
    assert set(report.padded_output_bytes["4"]) == {"dense,shared,routed"}
    plan = _plan(root, pad_for_tp=4, pad_roles=("dense",))
    assert plan.problems == () and plan.config is not None and plan.config["intermediate_size"] == 512
    left = [w for w in plan.warnings if "leaves the shared MLP" in w]
    assert left == [
        "--pad-roles dense leaves the shared MLP (moe_intermediate_size * n_shared_experts 192 -> 48/rank, e.g. "
        "model.layers.1.mlp.shared_experts.gate_proj.weight) in partial 128x128 blocks at TP 4: engines splitting "
        "it over 4 ranks refuse it (--pad-roles dense,shared,routed pads it)"
    ]
    assert not [w for w in _plan(root, pad_for_tp=4).warnings if "--pad-roles" in w or "pads nothing" in w]


def test_a_pad_that_changes_nothing_says_so(tmp_path):
    """Every width already whole blocks on 2 ranks: the run pads nothing, and says it, rather than exit 0 as if
    it had padded; inspect offers nothing to pad at TP 2."""
    root = _moe(tmp_path / "c", 512, 256, 256, own_shared_key=False)
    assert fp8conv.inspect(root).tp_indivisible["2"] == []
    warnings = _plan(root, pad_for_tp=2).warnings
    assert (
        "--pad-for-tp 2 pads nothing: the dense, shared, routed MLP widths already split into whole 128x128 "
        "blocks on 2 ranks" in warnings
    )


def _packed_experts(root: Path, moe: int, dense: int) -> Path:
    """Kimi-K2.5's kind: INT4 routed experts (compressed-tensors weight_packed) that --to block writes as block
    FP8, beside a bf16 dense MLP the ignore list keeps bf16 in every output."""
    bench = plan_scale()
    tensors = bench.bf16("model.embed_tokens.weight", (512, H))
    for proj, shape in (("gate_proj", (dense, H)), ("up_proj", (dense, H)), ("down_proj", (H, dense))):
        tensors += bench.bf16(f"model.layers.0.mlp.{proj}.weight", shape)
    for e in range(EXPERTS):
        for proj, (n, k) in (("gate_proj", (moe, H)), ("up_proj", (moe, H)), ("down_proj", (H, moe))):
            x = f"model.layers.1.mlp.experts.{e}.{proj}."
            tensors += [(x + "weight_packed", "I32", (n, k // 8)), (x + "weight_scale", "BF16", (n, k // 32))]
            tensors += [(x + "weight_shape", "I64", (2,))]
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    group = {"targets": ["Linear"], "format": "pack-quantized", "weights": weights}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    quant["ignore"] = ["re:.*layers\\.0\\.mlp\\..*"]
    config = {"model_type": "kimi_k2", "hidden_size": H, "intermediate_size": dense, "moe_intermediate_size": moe}
    bench.write_header_only(root, tensors, config | {"num_hidden_layers": 2, "quantization_config": quant})
    return root


@pytest.mark.parametrize("moe", [256, 192])
def test_packed_experts_are_checked_as_the_block_fp8_a_block_run_writes(tmp_path, moe):
    """The INT4 experts play the routed role by the name they unpack to, and --to block writes them as block FP8:
    256 rows are 64 per rank at TP 4 (the table said ok at every TP, reading only `.weight` names). The bf16
    dense MLP stays bf16 in that output: 448 splits evenly over 8 ranks (56 rows each), no block rule applies."""
    report = fp8conv.inspect(_packed_experts(tmp_path / "c", moe, 448))
    assert report.tp_indivisible["1"] == ([] if moe == 256 else ["routed moe_intermediate_size 192 -> 192/rank"])
    assert report.tp_indivisible["4"] == [f"routed moe_intermediate_size {moe} -> {moe // 4}/rank"]
    assert report.tp_indivisible["8"] == [f"routed moe_intermediate_size {moe} -> {moe // 8}/rank"]


def test_a_plain_up_projection_is_not_checked_on_one_rank(tmp_path):
    """Nemotron-H's dense MLP is non-gated (mixer.up_proj, mixer.down_proj): on one rank vLLM checks only
    merged [gate; up] GEMMs and experts, so 200 rows are fine at TP 1, and 100 per rank at TP 2 are not."""
    bench = plan_scale()
    tensors = bench.bf16("backbone.embeddings.weight", (512, H))
    p = "backbone.layers.0.mixer."
    tensors += bench.fp8(p + "up_proj", (200, H)) + bench.fp8(p + "down_proj", (H, 200))
    config = {"model_type": "nemotron_h", "hidden_size": H, "intermediate_size": 200, "num_hidden_layers": 1}
    config |= {"hybrid_override_pattern": "-", "quantization_config": BLOCK_QC}
    bench.write_header_only(tmp_path / "c", tensors, config)
    report = fp8conv.inspect(tmp_path / "c")
    assert report.tp_indivisible["1"] == []
    assert report.tp_indivisible["2"] == ["dense intermediate_size 200 -> 100/rank"]


def test_without_config_json_no_tp_size_is_called_ok(tmp_path):
    """Mistral-native files (params.json alone): no MLP width is known, so the table is not checked, not `ok`."""
    bench = plan_scale()
    tensors = bench.bf16("tok_embeddings.weight", (512, H))
    for w, shape in (("w1", (200, H)), ("w2", (H, 200)), ("w3", (200, H))):
        tensors += [(f"layers.0.feed_forward.{w}.weight", "F8_E4M3", shape)]
        tensors += [(f"layers.0.feed_forward.{w}.qscale_weight", "F32", ())]
    bench.write_header_only(tmp_path / "c", tensors, {})
    (tmp_path / "c" / "model.safetensors.index.json").unlink()
    (tmp_path / "c" / "config.json").unlink()
    (tmp_path / "c" / "model-00001-of-00001.safetensors").rename(tmp_path / "c" / "consolidated.safetensors")
    params = {"dim": H, "n_layers": 1, "hidden_dim": 200, "n_heads": 2, "vocab_size": 512}
    (tmp_path / "c" / "params.json").write_text(json.dumps(params | {"quantization": {"qformat_weight": "fp8_e4m3"}}))
    report = fp8conv.inspect(tmp_path / "c")
    assert report.tp_indivisible == {}
    shown = render_report(report)
    assert "tensor parallel: not checked: no config.json states this checkpoint's MLP widths" in shown
    assert "TP=" not in shown
