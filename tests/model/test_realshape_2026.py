"""What the real-shape sweep of 2026's releases (bench/realshape_2026.py: header-only checkpoints at the
releases' shapes, through inspect and every --dry-run) found, each as the smallest header-only checkpoint
that shows it. Header-only: planning reads headers alone, so no tensor data is written."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

import fp8conv
from fp8conv.cli.render import render_report
from fp8conv.model.classify import classify
from fp8conv.model.ignore_list import IgnoreList
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.plan_scale_bench import plan_scale

H, INTER, MOE, EXPERTS = 256, 384, 176, 4  # MOE: not whole 128-blocks even at TP 1 (Gemma-4 26B-A4B: 704)


def _gemma4_moe(root: Path, fused: bool, bias: bool = False) -> None:
    """Gemma-4 26B-A4B's layout (transformers gemma4 Gemma4TextDecoderLayer): a dense `mlp` and routed
    experts directly under the layer, `layers.L.experts.*`, routed by `layers.L.router.proj`; the experts
    fused 3-D (a transformers-5 FP8 save) or one Linear per expert (how LLM-Compressor saves MoE)."""
    bench = plan_scale()
    fp8, bf16 = bench.fp8, bench.bf16
    lm = "model.language_model."
    tensors = bf16(lm + "embed_tokens.weight", (512, H))
    for layer in range(2):
        p = f"{lm}layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors += fp8(p + "self_attn." + proj, (H, H))
        for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            tensors += fp8(p + "mlp." + proj, shape)
        tensors += bf16(p + "router.proj.weight", (EXPERTS, H)) + bf16(p + "router.scale", (H,))
        tensors += bf16(p + "router.per_expert_scale", (EXPERTS,))
        if fused:
            for proj, (n, k) in (("gate_up_proj", (2 * MOE, H)), ("down_proj", (H, MOE))):
                grid = (EXPERTS, math.ceil(n / 128), math.ceil(k / 128))
                tensors += [(f"{p}experts.{proj}", "F8_E4M3", (EXPERTS, n, k))]
                tensors += [(f"{p}experts.{proj}_scale_inv", "F32", grid)]
            if bias:  # gpt-oss style: a bias per expert along the fused gate/up width
                tensors += bf16(f"{p}experts.gate_up_proj_bias", (EXPERTS, 2 * MOE))
        else:
            for e in range(EXPERTS):
                for proj, shape in (("gate_proj", (MOE, H)), ("up_proj", (MOE, H)), ("down_proj", (H, MOE))):
                    tensors += fp8(f"{p}experts.{e}.{proj}", shape)
        tensors += bf16(p + "input_layernorm.weight", (H,))
    text = {"model_type": "gemma4_text", "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 2}
    text |= {"moe_intermediate_size": MOE, "num_experts": EXPERTS, "top_k_experts": 2, "enable_moe_block": True}
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    quant["modules_to_not_convert"] = [f"{lm}layers.{i}.router.proj" for i in range(2)]
    config = {"model_type": "gemma4", "text_config": text, "quantization_config": quant}
    bench.write_header_only(root, tensors, config, per_shard=40)


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused-3d"])
def test_experts_directly_under_the_layer_are_routed_experts(tmp_path, fused):
    """Gemma-4's experts sit at `layers.L.experts.`, in no `mlp.` container: inspect must report their width
    at every TP (176 is no whole number of blocks), and --pad-for-tp must pad them and moe_intermediate_size,
    not only the dense MLP (else the output's experts still split into partial blocks per rank)."""
    _gemma4_moe(tmp_path / "c", fused)
    report = fp8conv.inspect(tmp_path / "c")
    assert report.problems == []
    assert "routed moe_intermediate_size" in (report.family or "")
    assert any("routed moe_intermediate_size 176" in line for line in report.tp_indivisible["8"])
    ckpt = open_checkpoint(tmp_path / "c", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", pad_for_tp=8))
    assert plan.problems == ()
    assert plan.config is not None
    text = plan.config["text_config"]
    assert (text["moe_intermediate_size"], text["intermediate_size"]) == (1024, 1024)
    shapes = {o.name: o.shape for shard in plan.shards for job in shard.jobs for o in job.outputs}
    p = "model.language_model.layers.1.experts."
    if fused:
        assert shapes[p + "gate_up_proj"] == (EXPERTS, 2 * 1024, H)
        assert shapes[p + "down_proj"] == (EXPERTS, H, 1024)
    else:
        assert shapes[p + "3.up_proj.weight"] == (1024, H)
        assert shapes[p + "3.down_proj.weight"] == (H, 1024)
        assert shapes[p + "3.down_proj.weight_scale_inv"] == (2, 8)


def test_a_tensor_under_the_experts_that_plays_no_role_is_refused_by_name(tmp_path):
    """Beside the fused experts directly under the layer, a per-expert gate/up bias [E, 2I] has their width
    too but no role: --pad-for-tp refuses it by name, rather than pad the weights and leave it at 2 x 176."""
    _gemma4_moe(tmp_path / "c", fused=True, bias=True)
    ckpt = open_checkpoint(tmp_path / "c", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", pad_for_tp=8))
    problems = [p.one_line() for p in plan.problems]
    assert len(problems) == 2, problems
    assert "model.language_model.layers.0.experts.gate_up_proj_bias" in problems[0]
    assert "inside an MLP but plays no role" in problems[0] and "convert without --pad-for-tp" in problems[0]


M3_MOE = 160  # MXFP8 needs K in whole 32-groups; no whole number of 128-blocks


def _minimax_m3(root: Path, shared: int, model_type: str = "minimax_m3_vl") -> None:
    """MiniMax-M3's text layout as transformers' minimax_m3_vl reads it from disk: dense layers' `mlp.*` sized by
    dense_intermediate_size, routed `block_sparse_moe.experts.E.w1/w2/w3` by intermediate_size, the shared
    expert `block_sparse_moe.shared_experts.*` by shared_intermediate_size (MiniMaxM3VLSparseMoeBlock); MXFP8."""
    bench = plan_scale()

    def mx(name: str, shape: tuple[int, int]) -> list:
        return [(name + ".weight", "F8_E4M3", shape), (name + ".weight_scale_inv", "U8", (shape[0], shape[1] // 32))]

    lm = "language_model.model."
    tensors = bench.bf16(lm + "embed_tokens.weight", (512, H))
    for layer in range(2):
        p = f"{lm}layers.{layer}."
        tensors += mx(p + "self_attn.q_proj", (H, H)) + mx(p + "self_attn.o_proj", (H, H))
        if layer == 0:
            for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
                tensors += mx(p + "mlp." + proj, shape)
            continue
        m = p + "block_sparse_moe."
        tensors += [(m + "gate.weight", "F32", (EXPERTS, H)), (m + "e_score_correction_bias", "F32", (EXPERTS,))]
        for e in range(EXPERTS):
            for w, shape in (("w1", (M3_MOE, H)), ("w2", (H, M3_MOE)), ("w3", (M3_MOE, H))):
                tensors += mx(f"{m}experts.{e}.{w}", shape)
        for proj, shape in (("gate_proj", (shared, H)), ("up_proj", (shared, H)), ("down_proj", (H, shared))):
            tensors += mx(m + "shared_experts." + proj, shape)
    tensors += bench.bf16("language_model.lm_head.weight", (512, H))
    text = {"hidden_size": H, "intermediate_size": M3_MOE, "dense_intermediate_size": INTER, "num_hidden_layers": 2}
    text |= {"shared_intermediate_size": shared, "num_local_experts": EXPERTS, "mlp_layer_types": ["dense", "sparse"]}
    ignored = ["language_model.lm_head", f"{lm}layers.1.block_sparse_moe.gate"]
    config = {"model_type": model_type, "text_config": text}
    bench.write_header_only(
        root, tensors, config | {"quantization_config": {"quant_method": "mxfp8", "ignored_layers": ignored}}
    )


@pytest.mark.parametrize("shared", [M3_MOE, 2 * M3_MOE], ids=["shared-as-wide-as-routed", "shared-wider"])
def test_minimax_m3_shared_expert_is_sized_by_shared_intermediate_size(tmp_path, shared):
    """--pad-for-tp pads shared_intermediate_size for the shared expert: taken for intermediate_size (the
    routed experts' key, equal in the release), the shared tensors were padded while config.json kept
    shared_intermediate_size, which transformers sizes the shared expert by; a wider shared expert was refused."""
    _minimax_m3(tmp_path / "c", shared)
    report = fp8conv.inspect(tmp_path / "c")
    assert "shared shared_intermediate_size" in (report.family or ""), report.family
    ckpt = open_checkpoint(tmp_path / "c", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", pad_for_tp=8))
    assert [p.one_line() for p in plan.problems] == []
    assert plan.config is not None
    text = plan.config["text_config"]
    widths = [text[k] for k in ("intermediate_size", "shared_intermediate_size", "dense_intermediate_size")]
    assert widths == [1024, 1024, 1024]
    shapes = {o.name: o.shape for shard in plan.shards for job in shard.jobs for o in job.outputs}
    m = "language_model.model.layers.1.block_sparse_moe."
    assert shapes[m + "shared_experts.up_proj.weight"] == (1024, H)
    assert shapes[m + "shared_experts.down_proj.weight"] == (H, 1024)
    assert shapes[m + "experts.3.w2.weight"] == (H, 1024)


def test_shared_intermediate_size_of_a_model_type_not_named_is_never_taken_for_intermediate_size(tmp_path):
    """Another model_type with MiniMax-M3's keys: a shared expert wider than the routed ones is padded by
    shared_intermediate_size; one as wide fits intermediate_size as well, and the key naming the shared
    experts is theirs (roles.py), so both keys are padded (it padded the tensors under intermediate_size and
    left shared_intermediate_size, silently)."""
    _minimax_m3(tmp_path / "wide", 2 * M3_MOE, model_type="new_moe_vl")
    ckpt = open_checkpoint(tmp_path / "wide", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", pad_for_tp=8))
    assert plan.problems == () and plan.config is not None
    assert plan.config["text_config"]["shared_intermediate_size"] == 1024
    _minimax_m3(tmp_path / "same", M3_MOE, model_type="new_moe_vl")
    ckpt = open_checkpoint(tmp_path / "same", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="block", pad_for_tp=8))
    assert plan.problems == () and plan.config is not None
    text = plan.config["text_config"]
    assert (text["shared_intermediate_size"], text["intermediate_size"]) == (1024, 1024)


def _int4_experts(root: Path) -> None:
    """Kimi-K2.5's kind: compressed-tensors INT4 routed experts (weight_packed), a bf16 dense layer 448 wide."""
    bench = plan_scale()
    tensors = bench.bf16("model.embed_tokens.weight", (512, H))
    for proj, shape in (("gate_proj", (448, H)), ("up_proj", (448, H)), ("down_proj", (H, 448))):
        tensors += bench.bf16(f"model.layers.0.mlp.{proj}.weight", shape)
    for e in range(EXPERTS):
        for proj, (n, k) in (("gate_proj", (256, H)), ("up_proj", (256, H)), ("down_proj", (H, 256))):
            x = f"model.layers.1.mlp.experts.{e}.{proj}."
            tensors += [(x + "weight_packed", "I32", (n, k // 8)), (x + "weight_scale", "BF16", (n, k // 32))]
            tensors += [(x + "weight_shape", "I64", (2,))]
    tensors += bench.bf16("lm_head.weight", (512, H))
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    group = {"targets": ["Linear"], "format": "pack-quantized", "weights": weights}
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": group}}
    quant["ignore"] = ["lm_head", "re:.*layers\\.0\\.mlp\\..*"]
    config = {"model_type": "kimi_k2", "hidden_size": H, "intermediate_size": 448, "moe_intermediate_size": 256}
    bench.write_header_only(root, tensors, config | {"num_hidden_layers": 2, "quantization_config": quant})


def test_inspect_does_not_offer_padding_that_convert_refuses(tmp_path):
    """Packed 4-bit experts (and DeepSeek-V4): convert refuses --pad-for-tp, so inspect's TP report must not
    tell the user that --pad-for-tp fixes the widths it lists."""
    _int4_experts(tmp_path / "c")
    report = fp8conv.inspect(tmp_path / "c")
    assert report.tp_indivisible["4"] and report.padded_output_bytes == {}
    shown = render_report(report)
    assert "zero-pads the MLP widths to fix this" not in shown
    assert "--pad-for-tp cannot pad this checkpoint" in shown
    with pytest.raises(fp8conv.Fp8ConvError, match="--pad-for-tp does not know the MLP layout") as refused:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4))
    # the refusal names a tensor it is about, and its shard
    assert "tensor 'model.layers.1.mlp.experts.0.gate_proj.weight_packed' in model-00001" in refused.value.one_line()


def test_tp_report_names_every_role_a_width_key_sizes(tmp_path):
    """Routed and shared experts sized by one key (here intermediate_size, no shared_intermediate_size in
    config.json): the TP report named only the shared expert, though the routed experts are the bulk."""
    _minimax_m3(tmp_path / "c", M3_MOE, model_type="new_moe_vl")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    del config["text_config"]["shared_intermediate_size"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(config))
    report = fp8conv.inspect(tmp_path / "c")
    assert "routed intermediate_size, shared intermediate_size" in (report.family or ""), report.family
    assert "routed, shared intermediate_size 160 -> 20/rank" in report.tp_indivisible["8"]


def test_vision_and_audio_layers_past_num_hidden_layers_are_no_mtp_layers(tmp_path):
    """Step-3.7's vision tower has 47 layers beside 45 decoder layers (transformers step3p7's defaults), and
    transformers names its layers `model.vision_model.layers.N`: inspect took vision layers 2 and 3 here for
    multi-token-prediction layers. The decoder's own layer past num_hidden_layers (DeepSeek-style MTP) stays."""
    bench = plan_scale()
    tensors = bench.bf16("model.language_model.embed_tokens.weight", (512, H))
    for layer in range(3):  # layer 2 = num_hidden_layers: the MTP layer
        tensors += bench.fp8(f"model.language_model.layers.{layer}.self_attn.q_proj", (H, H))
    for layer in range(4):
        tensors += bench.bf16(f"model.vision_model.layers.{layer}.mlp.fc1.weight", (H, H))
        tensors += bench.bf16(f"model.audio_tower.layers.{layer}.feed_forward1.linear.weight", (H, H))
    text = {"model_type": "step3p5", "hidden_size": H, "num_hidden_layers": 2, "num_nextn_predict_layers": 1}
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    config = {"model_type": "step3p7", "text_config": text, "quantization_config": quant}
    bench.write_header_only(tmp_path / "c", tensors, config)
    report = fp8conv.inspect(tmp_path / "c")
    assert (report.mtp_layers, report.mtp_modules) == ([2], [])


def test_pad_for_tp_of_a_checkpoint_without_config_json_names_the_missing_file(tmp_path):
    """Mistral-Large-3 ships consolidated-*.safetensors and params.json alone: --pad-for-tp said it did not
    know "model_type 'none'"; it names config.json, where the widths it pads are read from."""
    bench = plan_scale()
    tensors = bench.bf16("tok_embeddings.weight", (512, H))
    for w, shape in (("w1", (INTER, H)), ("w2", (H, INTER)), ("w3", (INTER, H))):
        name = f"layers.0.feed_forward.{w}"
        tensors += [(name + ".weight", "F8_E4M3", shape), (name + ".qscale_weight", "F32", ())]
    bench.write_header_only(tmp_path / "c", tensors, {})
    (tmp_path / "c" / "model.safetensors.index.json").unlink()
    (tmp_path / "c" / "config.json").unlink()
    (tmp_path / "c" / "model-00001-of-00001.safetensors").rename(tmp_path / "c" / "consolidated.safetensors")
    params = {"dim": H, "n_layers": 1, "hidden_dim": INTER, "n_heads": 2, "vocab_size": 512}
    (tmp_path / "c" / "params.json").write_text(json.dumps(params | {"quantization": {"qformat_weight": "fp8_e4m3"}}))
    with pytest.raises(fp8conv.OptionsError) as refused:
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    assert "config.json" in refused.value.one_line() and "model_type 'none'" not in refused.value.one_line()
    assert "convert without --pad-for-tp" in refused.value.one_line()


def _modules(layers: int, experts: int) -> list[str]:
    lm = "model.language_model.layers."
    out = [f"{lm}{i}.linear_attn.{m}" for i in range(layers) for m in ("in_proj_a", "in_proj_b", "conv1d", "out_proj")]
    out += [
        f"{lm}{i}.mlp.experts.{e}.{p}" for i in range(layers) for e in range(experts) for p in ("up_proj", "gate_proj")
    ]
    return out + [f"{lm}{i}.mlp.gate" for i in range(layers)] + ["lm_head", "model.visual.blocks.0.attn.qkv"]


def _regex_list(layers: int) -> list[str]:
    kinds = ("linear_attn\\.in_proj_a", "linear_attn\\.conv1d", "mlp\\.gate")
    entries = [f"re:.*layers\\.{i}\\.{k}$" for i in range(layers) for k in kinds]
    # no literal run of 3 (tried on every module), case-insensitive, alternations, a wildcard, plain names
    entries += ["re:.*\\.[0-9]\\.up_proj$", "re:(?i).*VISUAL.*", "re:.*(in_proj_b|foo)$", "model.*.gate", "lm_head"]
    entries += ["re:^mtp\\..*", "re:model\\.language_model\\.layers\\.1\\.mlp\\.experts\\.1[0-9]\\.gate_proj"]
    # consecutive modules holding one literal run, all matching: none may be skipped on to the next
    return [*entries, "re:model\\.language_model\\.layers\\.2\\.mlp\\.experts\\.1[0-9]\\..*"]


def test_primed_regex_entries_answer_as_the_entries_do(tmp_path):
    """prime() tries a regex only on the modules holding its literal run: the answers are the ones matching
    each module against the entries gives, for every kind of entry."""
    modules = _modules(6, 24)
    ignore = IgnoreList(_regex_list(6))
    unprimed = {m: IgnoreList(_regex_list(6)).matches(m) for m in modules}
    ignore.prime(modules)
    assert {m: ignore.matches(m) for m in modules} == unprimed
    # in_proj_a, conv1d, gate, in_proj_b per layer; experts 0-9 up_proj per layer; visual; lm_head; layer 1's
    # gate_proj 10-19; layer 2's up_proj and gate_proj 10-19
    assert sum(unprimed.values()) == 6 * 4 + 6 * 10 + 1 + 1 + 10 + 20


def test_regex_entries_cost_the_modules_holding_their_literal(tmp_path):
    """300 `re:` entries, one per layer and module kind, over Qwen3.5-397B's 95k modules took 6 s (every
    regex tried on every module): tried where their literal run is, ten times the entries cost far less
    than ten times as much."""
    modules = _modules(60, 256)
    best = {}
    for layers in (6, 60):
        best[layers] = float("inf")
        for _ in range(3):
            ignore = IgnoreList(_regex_list(layers))
            start = time.process_time()
            ignore.prime(modules)
            best[layers] = min(best[layers], time.process_time() - start)
    assert best[60] / best[6] < 3, best


def test_mtp_modules_are_named_as_in_the_checkpoint(tmp_path):
    """MiMo-V2-Flash's MTP layers are model.mtp.layers.N (vLLM mimo_v2_mtp.py): inspect listed them as
    mtp.layers.N, a module the checkpoint does not have."""
    bench = plan_scale()
    tensors = bench.bf16("model.embed_tokens.weight", (512, H))
    for prefix in ("model.layers.0.", "model.mtp.layers.0.", "model.mtp.layers.1."):
        tensors += bench.fp8(prefix + "self_attn.q_proj", (H, H))
    config = {"model_type": "mimo_v2_flash", "hidden_size": H, "num_hidden_layers": 1}
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    bench.write_header_only(tmp_path / "c", tensors, config | {"quantization_config": quant})
    report = fp8conv.inspect(tmp_path / "c")
    assert (report.mtp_layers, report.mtp_modules) == ([], ["model.mtp.layers.0", "model.mtp.layers.1"])


@pytest.mark.parametrize("native", [True, False])
def test_no_config_json_is_warned_where_nothing_else_describes_the_output(tmp_path, native):
    """Mistral-native files carry params.json, which the output gets rewritten: no warning that the output
    has no config.json. Plain shards without either do get it."""
    bench = plan_scale()
    tensors = bench.bf16("tok_embeddings.weight", (512, H))
    tensors += [
        ("layers.0.feed_forward.w1.weight", "F8_E4M3", (INTER, H)),
        ("layers.0.feed_forward.w1.qscale_weight", "F32", ()),
    ]
    bench.write_header_only(tmp_path / "c", tensors, {})
    (tmp_path / "c" / "config.json").unlink()
    if native:
        (tmp_path / "c" / "model.safetensors.index.json").unlink()
        (tmp_path / "c" / "model-00001-of-00001.safetensors").rename(tmp_path / "c" / "consolidated.safetensors")
        params = {"dim": H, "n_layers": 1, "hidden_dim": INTER, "n_heads": 2, "vocab_size": 512}
        (tmp_path / "c" / "params.json").write_text(
            json.dumps(params | {"quantization": {"qformat_weight": "fp8_e4m3"}})
        )
    ckpt = open_checkpoint(tmp_path / "c", headers_only=True)
    plan = plan_conversion(ckpt, classify(ckpt.index, ckpt.config), ConvertOptions(to="bf16"))
    assert plan.problems == ()
    warned = "the input has no config.json, so the output has none either" in plan.warnings
    assert warned is not native
