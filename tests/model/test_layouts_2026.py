"""Issue 24's special layouts, converted to every target and checked against tests/support/layouts_2026.py's own
decode (MiMo's per-head K/V and per-KV-head qkv_proj scales; transformers-5 per-tensor fused experts
with a scale per gate/up half; FP8 embeddings). The naive grid is shown to give another answer."""

from __future__ import annotations

import json
import re

import pytest
import torch

import fp8conv
from fp8conv.errors import PlanRefused
from fp8conv.options import Tuning
from tests.support.helpers import load_dir
from tests.support.layouts_2026 import (
    MIMO_CKPT_TP,
    MIMO_FUSED_LAYERS,
    MIMO_LAYERS,
    build_mimo_flash,
    build_mimo_fused_qkv,
    build_mimo_transformers,
    build_mistral4,
    build_mistral_native,
    decode_block_plain,
    mistral_large3_params,
)
from tests.support.reference import e8m0_bytes, plain_pow2, quantize_reference, same_bits

TARGETS = ["bf16", "channel", "block"]


def _refusals(src, out, to: str) -> str:
    """Every refusal of a conversion, one per line (nothing written that looks complete)."""
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(src, out, fp8conv.ConvertOptions(to=to))
    assert not (out / "config.json").exists()
    return "\n".join(str(p) for p in refused.value.problems)


def _convert(src, out, to: str, run: fp8conv.RunOptions | None = None, **options) -> dict[str, torch.Tensor]:
    fp8conv.convert(src, out, fp8conv.ConvertOptions(to=to, **options), run=run)
    return load_dir(out)


def _expected_2d(truth: torch.Tensor, to: str) -> list[torch.Tensor]:
    """What each target writes for a weight whose exact float32 decode is `truth` (one rounding)."""
    if to == "bf16":
        return [truth.to(torch.bfloat16)]
    q, scale = quantize_reference(truth, None if to == "channel" else (128, 128))
    return [q, scale.reshape(-1, 1) if to == "channel" else scale]


def _outputs(out: dict[str, torch.Tensor], name: str, to: str) -> list[torch.Tensor]:
    if to == "bf16":
        return [out[name]]
    return [out[name], out[name + ("_scale" if to == "channel" else "_scale_inv")]]


@pytest.mark.parametrize("to", TARGETS)
def test_mimo_per_head_kv_every_target(tmp_path, to):
    truth = build_mimo_flash(tmp_path / "in")
    out = _convert(tmp_path / "in", tmp_path / "out", to)
    for name, value in truth.items():
        got, want = _outputs(out, name, to), _expected_2d(value, to)
        assert all(same_bits(g, w) for g, w in zip(got, want, strict=True)), (name, to)
    if to == "bf16":
        assert not [n for n in out if "scale" in n]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert ("quantization_config" in config) == (to != "bf16")


def test_mimo_naive_grid_is_wrong_for_v(tmp_path):
    """v_proj's own grid has a valid row count, but reading it as one decodes V wrong."""
    truth = build_mimo_flash(tmp_path / "in", shards=1)
    tensors = load_dir(tmp_path / "in")
    for prefix, (_, fused) in MIMO_LAYERS.items():
        name = prefix + "v_proj.weight"
        naive = decode_block_plain(tensors[name], tensors[name + "_scale_inv"])
        assert torch.equal(naive, truth[name]) is not fused, prefix
    out = _convert(tmp_path / "in", tmp_path / "out", "bf16")
    name = "model.layers.0.self_attn.v_proj.weight"
    naive = decode_block_plain(tensors[name], tensors[name + "_scale_inv"]).to(torch.bfloat16)
    assert not torch.equal(out[name], naive)


def test_mimo_inspect_and_verify(tmp_path):
    build_mimo_flash(tmp_path / "in")
    report = fp8conv.inspect(tmp_path / "in")
    assert report.format == "block-fp8", report.format
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="channel"))
    result = fp8conv.verify(tmp_path / "in", tmp_path / "out")
    assert result.ok, result.failures


def test_mimo_k_grid_of_no_known_layout_is_refused(tmp_path):
    build_mimo_flash(tmp_path / "in", shards=1)
    from safetensors.torch import load_file, save_file

    shard = next((tmp_path / "in").glob("*.safetensors"))
    tensors = load_file(shard)
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    tensors[name] = torch.cat([tensors[name], tensors[name][:1]])  # 5 rows: neither 4 (per head) nor 3
    save_file(tensors, shard)
    message = _refusals(tmp_path / "in", tmp_path / "out", "bf16")
    assert re.search(r"model\.layers\.0\.self_attn\.k_proj\.weight.*unverified", message), message


def _engine_chunks(out: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A block-FP8 qkv_proj read as the engines read it (sglang _resolve_deferred_qkv_scale_inv, vLLM
    _shard_fp8_qkv_proj): ckpt_tp chunks of the weight, each decoded on its own chunk of the scale rows;
    a scale of any other row count is refused as they refuse it."""
    w, s = out[name], out[name + "_scale_inv"].to(torch.float32)
    rows = w.shape[0] // MIMO_CKPT_TP
    per_chunk = -(-rows // 128)
    assert s.shape[0] == MIMO_CKPT_TP * per_chunk, (
        f"{name}: {s.shape[0]} scale rows, the engines read {per_chunk} per chunk"
    )
    return torch.cat(
        [
            decode_block_plain(w[c * rows : (c + 1) * rows], s[c * per_chunk : (c + 1) * per_chunk])
            for c in range(MIMO_CKPT_TP)
        ]
    )


def test_mimo_fused_qkv_to_block_keeps_its_chunks_and_their_grids(tmp_path):
    stored, _ = build_mimo_fused_qkv(tmp_path / "in")
    out = _convert(tmp_path / "in", tmp_path / "out", "block")
    from safetensors.torch import load_file

    tensors_in = load_file(next((tmp_path / "in").glob("*.safetensors")))
    for name, value in stored.items():
        assert same_bits(out[name], tensors_in[name]), name  # the release's bytes, chunks and all
        assert torch.equal(out[name + "_scale_inv"], tensors_in[name + "_scale_inv"].to(torch.float32)), name
        assert same_bits(_engine_chunks(out, name), value), name
    # the full-attention layer's chunks are 5.5 blocks: 12 scale rows where a plain grid has 11
    assert out["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (12, 2)


def test_mimo_fused_qkv_to_ue8m0_quantizes_each_chunk_on_its_own_grid(tmp_path):
    stored, _ = build_mimo_fused_qkv(tmp_path / "in")
    out = _convert(tmp_path / "in", tmp_path / "out", "block", scale_fmt="ue8m0")
    for name, value in stored.items():
        rows = value.shape[0] // MIMO_CKPT_TP
        want = [plain_pow2(value[c * rows : (c + 1) * rows], (128, 128), True) for c in range(MIMO_CKPT_TP)]
        assert same_bits(out[name], torch.cat([q for q, _ in want])), name
        assert torch.equal(e8m0_bytes(out[name + "_scale_inv"]), torch.cat([e for _, e in want])), name


def test_mimo_fused_qkv_to_bf16_in_the_plain_order_engines_read(tmp_path):
    _, plain = build_mimo_fused_qkv(tmp_path / "in")
    out = _convert(tmp_path / "in", tmp_path / "out", "bf16")
    for name, value in plain.items():
        assert same_bits(out[name], value.to(torch.bfloat16)), name


@pytest.mark.parametrize("to", ["channel", "mxfp8", "int8"])
def test_mimo_fused_qkv_refused_where_no_engine_reads_it(tmp_path, to):
    build_mimo_fused_qkv(tmp_path / "in")
    message = _refusals(tmp_path / "in", tmp_path / "out", to)
    for prefix in MIMO_FUSED_LAYERS:
        assert re.search(
            rf"{re.escape(prefix)}qkv_proj\.weight.*2 chunks of \[Q; K; V\].*_try_load_fp8_qkv_proj", message
        )
        assert "--to block" in message and "--to bf16" in message


def _expected_experts(truth: torch.Tensor, to: str) -> list[torch.Tensor]:
    if to == "bf16":
        return [truth.to(torch.bfloat16)]
    per_expert = [quantize_reference(truth[e], (128, 128)) for e in range(truth.shape[0])]
    return [torch.stack([q for q, _ in per_expert]), torch.stack([s for _, s in per_expert])]


@pytest.mark.parametrize("to", ["bf16", "block"])
def test_fused_per_tensor_experts_scale_per_half(tmp_path, to):
    truth = build_mistral4(tmp_path / "in")
    out = _convert(tmp_path / "in", tmp_path / "out", to)
    for name, value in truth.items():
        if "embed_tokens" in name:
            assert same_bits(out[name], value.to(torch.bfloat16)), to  # dequantized for every target
            assert name + "_scale" not in out and name + "_scale_inv" not in out
        elif value.dim() == 3:
            got = [out[name]] if to == "bf16" else [out[name], out[name + "_scale_inv"]]
            assert all(same_bits(g, w) for g, w in zip(got, _expected_experts(value, to), strict=True)), name
        else:
            assert same_bits(out[name], value.to(torch.bfloat16)) if to == "bf16" else name in out
    assert not [n for n in out if n.endswith("_activation_scale")], "activation scales left behind"


def test_fused_per_tensor_experts_one_scale_for_both_halves_is_wrong(tmp_path):
    """The trap a reader of [E, 2, 1] as [E] would fall in: the up half scaled by the gate's scale."""
    truth = build_mistral4(tmp_path / "in")
    tensors = load_dir(tmp_path / "in")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    one_scale = tensors[name].to(torch.float32) * tensors[name + "_scale_inv"][:, :1, :]
    assert not torch.equal(one_scale, truth[name])


def test_fused_per_tensor_experts_to_channel_refused_by_name(tmp_path):
    build_mistral4(tmp_path / "in")
    message = _refusals(tmp_path / "in", tmp_path / "out", "channel")
    assert re.search(r"mlp\.experts\.gate_up_proj\b.*no engine reads channel FP8", message), message


@pytest.mark.parametrize("to", TARGETS)
def test_mimo_per_head_kv_in_row_bands(tmp_path, to):
    """Bands of a few math blocks (64 rows here) give the same bytes as whole tensors, and verify agrees."""
    build_mimo_flash(tmp_path / "in")
    whole = _convert(tmp_path / "in", tmp_path / "whole", to)
    small = Tuning(convert_band_elements=3 * 64 * 200, verify_band_elements=2 * 64 * 200)
    banded = _convert(tmp_path / "in", tmp_path / "banded", to, fp8conv.RunOptions(tuning=small))
    assert all(same_bits(whole[n], banded[n]) for n in whole) and whole.keys() == banded.keys()
    result = fp8conv.verify(tmp_path / "in", tmp_path / "banded", tuning=small)
    assert result.ok, result.failures


def test_fused_per_tensor_experts_verify(tmp_path):
    build_mistral4(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="block"))
    result = fp8conv.verify(tmp_path / "in", tmp_path / "out")
    assert result.ok, result.failures


def test_mistral_native_only_to_bf16(tmp_path):
    """A release of consolidated files only: converted in its own names, params.json without quantization,
    for vLLM --load-format mistral --config-format mistral."""
    truth = build_mistral_native(tmp_path / "in")
    result = fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    out = load_dir(tmp_path / "out")
    for name, value in truth.items():
        assert same_bits(out[name], value.to(torch.bfloat16)), name
    assert not [n for n in out if "qscale" in n], "scales (and the fake quantizer's) left behind"
    assert out["layers.1.gate.weight"].dtype == torch.bfloat16 and "tok_embeddings.weight" in out
    files = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith("."))
    assert {"consolidated-00001-of-00002.safetensors", "params.json", "tekken.json"} <= set(files)
    assert "config.json" not in files
    params = json.loads((tmp_path / "out" / "params.json").read_text())
    assert "quantization" not in params and params["moe"] == mistral_large3_params()["moe"]
    assert any("fake-quantizer" in w for w in result.warnings)


# The names vLLM's MistralLarge3ForCausalLM accepts (mistral_large_3.py: any other raises "Cannot remap"),
# each module with the parameter suffixes a compressed-tensors FP8 layer reads (qscale_weight -> weight_scale)
_LARGE3_MODULES = re.compile(
    r"layers\.\d+\.(?:attention\.(?:wq_a|wq_b|wkv_a_with_mqa|wkv_b|wo)|feed_forward\.w[123]|gate|"
    r"shared_experts\.w[123]|experts\.\d+\.w[123])|output"
)
_LARGE3_NORMS = re.compile(
    r"(?:layers\.\d+\.(?:attention_norm|ffn_norm|attention\.(?:q_a|kv_a)_norm)\.|norm\.|tok_embeddings\.)weight"
)


def _vllm_mistral_quant(params: dict) -> dict:
    """vLLM's reading of params.json's quantization (configs/mistral.py _remap_mistral_quantization_args):
    fp8_e4m3 per-tensor, or compressed-tensors passed through; anything else is a ValueError there."""
    quant = params["quantization"]
    assert str(quant.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors", quant
    from compressed_tensors.quantization import QuantizationConfig

    QuantizationConfig.model_validate(quant)  # compressed-tensors' own parser refuses a malformed entry
    return quant


@pytest.mark.parametrize("to", ["channel", "block"])
def test_mistral_native_only_fp8_targets(tmp_path, to):
    """Consolidated files only, to channel / block FP8: written in the names vLLM's Mistral loader remaps,
    scales in its spelling (channel `qscale_weight` [N, 1], block compressed-tensors `weight_scale` grids),
    each weight our own reference quantization of the exact decode; params.json's quantization a
    compressed-tensors entry whose ignore uses vLLM's module names."""
    truth = build_mistral_native(tmp_path / "in")
    result = fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to=to))
    out = load_dir(tmp_path / "out")
    scale_suffix = ".qscale_weight" if to == "channel" else ".weight_scale"
    for name, value in truth.items():
        module = name[: -len(".weight")]
        q, scale = quantize_reference(value, None if to == "channel" else (128, 128))
        assert same_bits(out[name], q), name
        assert same_bits(out[module + scale_suffix], scale.reshape(-1, 1) if to == "channel" else scale), name
    for name in out:
        module, _, suffix = name.rpartition(".")
        accepted = _LARGE3_MODULES.fullmatch(module) and suffix in ("weight", scale_suffix[1:])
        assert accepted or _LARGE3_NORMS.fullmatch(name), f"{name}: a name vLLM's MistralLarge3 loader refuses"
    assert not [n for n in out if n.endswith((".qscale_act", "_scale_inv"))]
    assert out["layers.1.gate.weight"].dtype == torch.bfloat16 and out["output.weight"].dtype == torch.bfloat16
    params = json.loads((tmp_path / "out" / "params.json").read_text())
    quant = _vllm_mistral_quant(params)
    weights = quant["config_groups"]["group_0"]["weights"]
    assert weights["strategy"] == to and (to == "channel" or weights["block_structure"] == [128, 128])
    assert quant["ignore"] == ["lm_head", "model.layers.1.mlp.gate"]
    assert params["moe"] == mistral_large3_params()["moe"] and not (tmp_path / "out" / "config.json").exists()
    assert any("fake-quantizer" in w for w in result.warnings)
    assert fp8conv.verify(tmp_path / "in", tmp_path / "out").ok


@pytest.mark.parametrize("to", ["channel", "block"])
def test_a_mistral_native_fp8_output_reads_back(tmp_path, to):
    """fp8conv's own Mistral-native FP8 output, whose block size is stated only in params.json's
    compressed-tensors quantization: inspect reads it from there, and converting it to bf16 gives every
    weight our reference's bf16 rounding of its FP8 values (block: the exact decode, requantized
    losslessly here)."""
    truth = build_mistral_native(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "fp8", fp8conv.ConvertOptions(to=to))
    report = fp8conv.inspect(tmp_path / "fp8")
    assert not report.problems, report.problems
    if to == "block":
        assert list(report.block_size) == [128, 128] and report.block_size_from == "params.json"
    fp8conv.convert(tmp_path / "fp8", tmp_path / "bf16", fp8conv.ConvertOptions(to="bf16"))
    fp8, back = load_dir(tmp_path / "fp8"), load_dir(tmp_path / "bf16")
    suffix = ".qscale_weight" if to == "channel" else ".weight_scale"
    for name in truth:
        scale = fp8[name[: -len(".weight")] + suffix].float()
        values = fp8[name].float() * (
            scale
            if to == "channel"
            else scale.repeat_interleave(128, 0)[: fp8[name].shape[0]].repeat_interleave(128, 1)[
                :, : fp8[name].shape[1]
            ]
        )
        assert same_bits(back[name], values.to(torch.bfloat16)), name


def test_mistral_native_dense_names_and_refusals(tmp_path):
    """A dense Mistral-native params.json (vLLM's MistralForCausalLM, llama.py mistral_mapping): ignore in
    its module names; block FP8 refused when wq/wk's rotary permutation would cross scale blocks (head_dim
    96 with 128-row blocks), and MXFP8 and INT8 refused (no confirmed Mistral-format reading), each naming
    the file."""
    from fp8conv.source.mistral_native import engine_module

    assert engine_module("layers.3.attention.wk", "dense", False) == "model.layers.3.self_attn.k_proj"
    assert engine_module("layers.3.feed_forward.w3", "dense", True) == "language_model.model.layers.3.mlp.up_proj"
    assert engine_module("layers.2.experts.5.w2", "mla", False) == "model.layers.2.mlp.experts.5.down_proj"
    assert engine_module("vision_encoder.transformer.layers.0.attention.wq", "dense", True) == (
        "vision_encoder.transformer.layers.0.attention.wq"
    )
    build_mistral_native(tmp_path / "in")
    dense = {k: v for k, v in mistral_large3_params().items() if k not in ("moe", "q_lora_rank", "qk_nope_head_dim")}
    (tmp_path / "in" / "params.json").write_text(json.dumps(dense | {"head_dim": 96}))
    message = _refusals(tmp_path / "in", tmp_path / "out", "block")
    assert re.search(r"consolidated-0000[12].*Mistral-native.*head of 96.*128-row scale blocks.*--to block", message)
    message = _refusals(tmp_path / "in", tmp_path / "out2", "mxfp8")
    assert re.search(r"consolidated-0000[12].*Mistral-native.*MXFP8.*--to mxfp8", message), message
    message = _refusals(tmp_path / "in", tmp_path / "out4", "int8")
    assert re.search(r"consolidated-0000[12].*Mistral-native.*INT8.*--to int8", message), message
    assert not (tmp_path / "out4" / "params.json").exists()
    fp8conv.convert(tmp_path / "in", tmp_path / "out3", fp8conv.ConvertOptions(to="channel"))
    quant = _vllm_mistral_quant(json.loads((tmp_path / "out3" / "params.json").read_text()))
    assert quant["ignore"] == ["layers.1.gate", "lm_head"]  # a dense layout has no router: kept as named


def test_hf_file_beside_consolidated_without_index(tmp_path):
    """HF shards present too (no index): they are the checkpoint, the consolidated file is skipped as before."""
    from safetensors.torch import save_file

    build_mistral_native(tmp_path / "in")
    q = torch.ones(8, 64).to(torch.float8_e4m3fn)
    hf = {"model.layers.0.mlp.down_proj.weight": q, "model.layers.0.mlp.down_proj.weight_scale_inv": torch.tensor(0.5)}
    save_file(hf, str(tmp_path / "in" / "model.safetensors"))
    (tmp_path / "in" / "config.json").write_text(
        json.dumps({"model_type": "mistral", "quantization_config": {"quant_method": "fp8", "weight_block_size": None}})
    )
    result = fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    assert list(load_dir(tmp_path / "out")) == ["model.layers.0.mlp.down_proj.weight"]
    assert "consolidated-00001-of-00002.safetensors" in dict(result.files_skipped)


def test_mimo_bf16_output_loads_in_transformers(tmp_path):
    """transformers' MiMoV2FlashForCausalLM (its config: layer_types, SWA layers with twice the KV heads)
    loads the bf16 output with no missing or unexpected key, its weights the exact decode; the model
    that read v_proj's naive grid computes other logits (tolerance 1e-2, bf16 ulps of float reductions)."""
    transformers = pytest.importorskip("transformers")
    _, exact, naive = build_mimo_transformers(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to="bf16"))
    loaded, info = transformers.MiMoV2FlashForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    got = loaded.state_dict()
    assert all(same_bits(got[n], exact[n]) for n in exact if n in got), "weights are not the exact decode"
    tokens = torch.tensor([[1, 7, 42, 3, 9, 20, 17, 5]])
    reference = transformers.MiMoV2FlashForCausalLM(loaded.config).to(torch.bfloat16)
    reference.load_state_dict(naive)
    with torch.no_grad():
        logits = loaded(tokens).logits.float()
        reference.load_state_dict(exact)
        same = reference(tokens).logits.float()
        reference.load_state_dict(naive)
        wrong = reference(tokens).logits.float()
    assert torch.allclose(logits, same, atol=1e-2, rtol=0)  # a few bf16 ulps: float reductions
    assert (logits - wrong).abs().max() > 0.2


@pytest.mark.parametrize("options", [{"to": "block"}, {"to": "block", "scale_fmt": "ue8m0"}, {"to": "bf16"}])
def test_mimo_fused_qkv_outputs_verify_as_the_engines_read_them(tmp_path, options):
    build_mimo_fused_qkv(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(**options))
    result = fp8conv.verify(tmp_path / "in", tmp_path / "out")
    assert result.ok, result.failures


@pytest.mark.parametrize("to", ["block", "bf16"])
def test_the_engine_check_fails_the_layouts_engines_misread(tmp_path, to):
    """verify's independent check (check/engine_layouts.py) reads an output from its config.json and tensors
    alone, never from a plan: the layouts this project once wrote (one plain grid over the chunks; bf16 in
    the stored chunk order) fail it, the ones written now pass it."""
    from fp8conv.check.engine_layouts import engine_layout_problems

    stored, _ = build_mimo_fused_qkv(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "out", fp8conv.ConvertOptions(to=to))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    good = load_dir(tmp_path / "out")
    misread: dict[str, torch.Tensor] = dict(good)
    for name, value in stored.items():
        if to == "block":  # requantized onto one plain grid over the chunks, as --to block once wrote it
            misread[name], misread[name + "_scale_inv"] = quantize_reference(value, (128, 128))
        else:  # the stored chunk order, as a plain dequantization writes it
            misread[name] = value.to(torch.bfloat16)

    def problems(tensors: dict[str, torch.Tensor]) -> list[str]:
        shapes = {n: (_dtype_name(t), tuple(t.shape)) for n, t in tensors.items()}
        return engine_layout_problems(config, shapes, tensors.__getitem__, stored.get)

    assert problems(good) == []
    found = problems(misread)
    if to == "block":  # the full layer: 11 scale rows where the engines read 2 chunks of 6; the sliding-window
        # and MTP layers' chunks are whole blocks, so a plain grid is their per-chunk grid and reads right
        assert len(found) == 1 and "model.layers.0.self_attn.qkv_proj.weight_scale_inv: [11, 2]" in found[0], found
    else:
        assert len(found) == 3 and all("plain [Q; K; V]" in f for f in found), found


def _dtype_name(t: torch.Tensor) -> str:
    return {torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype]


@pytest.mark.parametrize("to", ["channel", "block"])
def test_a_float_mimo_fused_qkv_is_refused_for_fp8_targets(tmp_path, to):
    build_mimo_fused_qkv(tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "bf16", fp8conv.ConvertOptions(to="bf16"))
    message = _refusals(tmp_path / "bf16", tmp_path / "out", to)
    for prefix in MIMO_FUSED_LAYERS:
        assert re.search(rf"{re.escape(prefix)}qkv_proj\.weight.*float checkpoint.*2 chunks", message), message
