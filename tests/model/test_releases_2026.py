"""The releases of 2026 (tests/support/releases_2026.py) through every target, checked against the decode here:
inspect, --to bf16 (one rounding of float32(q) * float32(scale)), --to channel and --to block (within the
FP8 bound of that product; block FP8 inputs keep their bytes), --to block --pad-for-tp 8 (the unpadded
weights plus zeros, the padded widths in config.json under the keys the roles use). Then the refusals of
roles by rule: two keys fitting one role, no key fitting, a tensor no rule gives a role."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.check.inspect_report import inspect
from fp8conv.errors import Fp8ConvError
from tests.support.helpers import load_dir
from tests.support.reference import dequant_block_reference, same_bits, scale_values, within_fp8_bound
from tests.support.releases_2026 import RELEASES, E, Release, _Builder, build_release

FP8 = torch.float8_e4m3fn
# The config keys each release's MLP tensors are sized by, written down from transformers 5.24's modeling
# files (qwen3_5_moe, glm_moe_dsa, nemotron_h, step3p7, hy_v3) and vLLM 0.33's loaders, not from fp8conv
PADDED_KEYS = {
    "qwen3.6-35b-a3b-fp8": {"moe_intermediate_size", "shared_expert_intermediate_size"},
    "qwen3.6-27b-fp8": {"intermediate_size"},
    "glm-5.2-fp8": {"intermediate_size", "moe_intermediate_size"},
    "glm-5.2-bf16": {"intermediate_size", "moe_intermediate_size"},
    "nemotron-3-bf16": {"intermediate_size", "moe_intermediate_size", "moe_shared_expert_intermediate_size"},
    "nemotron-3-fp8-tensor": {"intermediate_size", "moe_intermediate_size", "moe_shared_expert_intermediate_size"},
    "step-3.5-flash-fp8": {"intermediate_size", "moe_intermediate_size", "share_expert_dim"},
    "hy3-fp8": {"intermediate_size", "moe_intermediate_size"},
    "hy3-bf16": {"intermediate_size", "moe_intermediate_size"},
    "ling-fp8": {"intermediate_size", "moe_intermediate_size"},
    "minimax-m3-bf16": {"intermediate_size"},
    "gemma-4-fp8": {"intermediate_size"},
    "gemma-4-e4b-fp8": {"intermediate_size"},  # the double-wide layer follows it (2 x intermediate_size)
}
MTP = {
    "qwen3.6-35b-a3b-fp8": ([], ["mtp.layers.0"]),
    "qwen3.6-27b-fp8": ([], ["mtp.layers.0"]),
    "qwen3.6-35b-a3b-bf16": ([], ["mtp.layers.0"]),
    "glm-5.2-fp8": ([3], []),
    "glm-5.2-bf16": ([3], []),
    "nemotron-3-bf16": ([], ["mtp.layers.0"]),
    "nemotron-3-fp8-tensor": ([], ["mtp.layers.0"]),
    "dspark-bf16": ([], ["mtp.0", "mtp.1"]),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Release] = {}

    def get(name: str) -> Release:
        if name not in cache:
            cache[name] = build_release(name, tmp_path_factory.mktemp("releases") / name)
        return cache[name]

    return get


def decode(tensors: dict[str, torch.Tensor], weight: str) -> torch.Tensor:
    """float32(q) * float32(scale) by the scale's shape: per tensor, per row, 128x128 blocks (3-D: per expert)."""
    q = tensors[weight]
    if q.dtype != FP8:
        return q.to(torch.float32)
    s = scale_values(tensors.get(weight + "_scale_inv", tensors.get(weight + "_scale")))
    if s.numel() == 1:
        return q.to(torch.float32) * s.reshape(())
    if s.shape[-1] == 1 and s.shape[:-1] == q.shape[:-1]:
        return q.to(torch.float32) * s
    if q.dim() == 3:
        return torch.stack([dequant_block_reference(q[e], s[e], (128, 128), torch.float32) for e in range(len(q))])
    return dequant_block_reference(q, s, (128, 128), torch.float32)


def _ignored(config: dict) -> list[str]:
    q = (config.get("text_config") or {}).get("quantization_config") or config.get("quantization_config") or {}
    return list(q.get("ignore") or q.get("modules_to_not_convert") or [])


@pytest.mark.parametrize("name", RELEASES)
def test_inspect(built, name):
    release = built(name)
    report = inspect(release.path)
    assert report.problems == []
    assert (report.mtp_layers, report.mtp_modules) == MTP.get(name, ([], []))
    assert report.family is not None and "roles by rule" in report.family


@pytest.mark.parametrize("name", RELEASES)
def test_bf16(built, name, tmp_path):
    release = built(name)
    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to="bf16"))
    src, out = load_dir(release.path), load_dir(tmp_path / "out")
    scales = {n for n in src if n.endswith(("_scale_inv", "_scale"))}
    assert set(out) == set(src) - scales
    for n, t in out.items():
        expected = decode(src, n).to(torch.bfloat16) if src[n].dtype == FP8 else src[n]
        assert same_bits(t, expected), n
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


@pytest.mark.parametrize("to", ["channel", "block"])
@pytest.mark.parametrize("name", RELEASES)
def test_fp8_targets(built, name, to, tmp_path):
    release = built(name)
    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to=to))
    src, out = load_dir(release.path), load_dir(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    for w in release.fp8_weights:
        assert out[w].dtype == FP8, w
        ref, got = decode(src, w), decode(out, w)
        if to == "block" and release.layout == "block":
            assert same_bits(got, ref), w  # the FP8 bytes and their scales are kept
        else:
            assert within_fp8_bound(got, ref, ref.abs().amax()), w
    quantized = set(release.fp8_weights)
    for n, t in src.items():  # routers, convolutions, norms, bf16 Linears: written as they are
        if n not in quantized and not n.endswith(("_scale_inv", "_scale")):
            assert same_bits(out[n], t), n
    ignored = _ignored(config)
    for module in release.bf16_linears:  # a loader must not build these as FP8
        assert out[module + ".weight"].dtype == torch.bfloat16, module
        assert module in ignored, (module, ignored)
    assert not {w.removesuffix(".weight") for w in release.fp8_weights} & set(ignored)


@pytest.mark.parametrize("name", sorted(PADDED_KEYS))
def test_block_padded(built, name, tmp_path):
    release = built(name)
    fp8conv.convert(release.path, tmp_path / "plain", ConvertOptions(to="block"))
    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    plain, out = load_dir(tmp_path / "plain"), load_dir(tmp_path / "out")
    before = _text(release.config)
    after = _text(json.loads((tmp_path / "out" / "config.json").read_text()))
    padded = {k for k in after if isinstance(after[k], int) and after[k] != before.get(k)}
    assert padded == PADDED_KEYS[name]
    assert all(after[k] % 1024 == 0 for k in padded)
    grown = 0
    for n, t in out.items():
        if n.endswith(("_scale_inv", "_scale")):
            continue  # checked through decode()
        if t.dtype != FP8:
            assert t.shape == plain[n].shape, n
            continue
        got, ref = decode(out, n), decode(plain, n)
        crop = tuple(slice(0, s) for s in ref.shape)
        assert same_bits(got[crop], ref), n
        assert not got.count_nonzero() - ref.count_nonzero(), n  # the padding is zeros
        grown += got.shape != ref.shape
    assert grown > 0


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def test_inspect_cli_names_the_mtp_layer(built):
    from click.testing import CliRunner

    from fp8conv.cli.commands import main

    result = CliRunner().invoke(main, ["inspect", str(built("qwen3.6-35b-a3b-fp8").path)])
    assert result.exit_code == 0, result.output
    assert "MTP layers:    mtp.layers.0 (num_hidden_layers = 2)" in result.output


def test_step_shared_expert_padded_for_tp4(built, tmp_path):
    """share_expert_dim (1280 in the release, 136 here) per rank at TP 4 must be whole 128-blocks."""
    release = built("step-3.5-flash-fp8")
    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["share_expert_dim"] == 512 and config["moe_intermediate_size"] == 512
    out = load_dir(tmp_path / "out")
    assert out["model.layers.1.moe.gate_proj.weight"].shape == (E, 512, 96)
    assert out["model.layers.1.moe.down_proj.weight_scale_inv"].shape == (E, 1, 4)


def test_gemma4_double_wide_mlp_padded_for_tp8(built, tmp_path):
    """Gemma-4 E-models: the KV-sharing layer's MLP is 2 x intermediate_size wide (660 here). Padded for
    TP 8, intermediate_size becomes 1024 and that layer 2048; each MLP's tensors are the shapes
    transformers' own Gemma4TextMLP builds from the output config, the padding zeros."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextMLP

    release = built("gemma-4-e4b-fp8")
    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert text["intermediate_size"] == 1024 and text["use_double_wide_mlp"] is True
    out, src = load_dir(tmp_path / "out"), load_dir(release.path)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_kv_shared_layers", "layer_types")
    config = Gemma4TextConfig(**{k: text[k] for k in keys}, use_double_wide_mlp=True, vocab_size=300)
    for layer, width in enumerate((1024, 1024, 2048)):
        mlp = Gemma4TextMLP(config, layer)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"model.language_model.layers.{layer}.mlp.{proj}.weight"
            assert out[name].shape == getattr(mlp, proj).weight.shape, name
            assert max(out[name].shape) == width, name  # the width axis, not only transformers' view of it
            got, ref = decode(out, name), decode(src, name)
            assert same_bits(got[tuple(slice(0, n) for n in ref.shape)], ref), name
            assert got.count_nonzero() == ref.count_nonzero(), name  # the padding is zeros


def test_gemma4_double_wide_mlp_against_config_is_checked(built, tmp_path):
    """The double-wide layer is checked against 2 x intermediate_size: without use_double_wide_mlp the
    config no longer explains its 660-wide MLP, and --pad-for-tp names the tensor instead of guessing."""
    folder = _edited(built("gemma-4-e4b-fp8"), tmp_path / "in", lambda c: c.update(use_double_wide_mlp=False))
    with pytest.raises(Fp8ConvError, match=r"layers\.2\.mlp\.\w+_proj\.weight has shape \[\d+, \d+\].*330"):
        fp8conv.convert(folder, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))


def test_qwen3_5_bf16_fused_experts_to_block(built, tmp_path):
    """The Qwen3.5 bf16 master's fused 3-D experts (experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]),
    --to block: quantized in place as 3-D block FP8 with [E, N/128, K/128] `*_scale_inv` grids, the layout
    transformers' FP8Experts allocates and vLLM's qwen3_5.py / qwen3_5_mtp.py load (gate_up_proj* mapped to
    w13_weight*, weight and scale chunked in gate / up halves), when each half is whole 128-row blocks
    (padded for TP 8 here: 136 -> 1024). At 136 the halves share a scale block: kept bf16, listed."""
    from transformers.integrations.finegrained_fp8 import FP8Experts
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    from tests.support.reference import quantize_reference

    release = built("qwen3.6-35b-a3b-bf16")
    fused = [n for n in load_dir(release.path) if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(fused) == 6  # two decoder layers and the MTP layer
    plain = fp8conv.convert(release.path, tmp_path / "plain", ConvertOptions(to="block"))
    kept, config = load_dir(tmp_path / "plain"), json.loads((tmp_path / "plain" / "config.json").read_text())
    assert all(kept[n].dtype == torch.bfloat16 for n in fused)
    assert {n.rsplit(".", 1)[0] for n in fused} <= set(_ignored(config))
    assert [w for w in plain.warnings if "fused expert parameters" in w and "136 is not whole 128-row" in w]

    fp8conv.convert(release.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    src, out = load_dir(release.path), load_dir(tmp_path / "out")
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert text["moe_intermediate_size"] == 1024
    assert not {n.rsplit(".", 1)[0] for n in fused} & set(_ignored({"text_config": text}))
    keys = ("hidden_size", "moe_intermediate_size", "num_experts")
    experts = FP8Experts(Qwen3_5MoeTextConfig(**{k: text[k] for k in keys}), block_size=(128, 128))
    for name in fused:
        proj = name.rsplit(".", 1)[1]
        assert out[name].dtype == FP8, name
        assert out[name].shape == getattr(experts, proj).shape, name
        assert out[name + "_scale_inv"].shape == getattr(experts, proj + "_scale_inv").shape, name
        w = src[name].to(torch.float32)  # padded as each half is: zeros after gate's and after up's rows
        if proj == "gate_up_proj":
            gate, up = w.chunk(2, dim=1)
            w = torch.cat([torch.nn.functional.pad(h, (0, 0, 0, 1024 - h.shape[1])) for h in (gate, up)], dim=1)
        else:
            w = torch.nn.functional.pad(w, (0, 1024 - w.shape[2]))
        for e in range(E):
            q, scale = quantize_reference(w[e], (128, 128))
            assert same_bits(out[name][e], q) and same_bits(out[name + "_scale_inv"][e], scale), (name, e)
    assert fp8conv.verify(release.path, tmp_path / "out").ok


# ---------------------------------------------------------------------------------------------------
# Refusals of roles by rule


def _edited(release: Release, folder: Path, edit) -> Path:
    shutil.copytree(release.path, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(_text(config))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_two_keys_fitting_one_role_is_refused(built, tmp_path):
    folder = _edited(built("qwen3.6-35b-a3b-fp8"), tmp_path / "in", lambda c: c.update(intermediate_size=136))
    with pytest.raises(Fp8ConvError, match=r"fits config\.json's moe_intermediate_size and intermediate_size alike"):
        fp8conv.convert(folder, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    fp8conv.convert(folder, tmp_path / "unpadded", ConvertOptions(to="block"))  # nothing to guess without padding
    assert any("alike" in w for w in inspect(folder).warnings)


def test_no_key_fitting_is_refused(built, tmp_path):
    folder = _edited(built("hy3-fp8"), tmp_path / "in", lambda c: c.update(num_shared_experts=3))
    message = r"no config.json key gives the shared MLP's width: model\.layers\.1\.mlp\.shared_mlp\.\w+_proj\.weight"
    with pytest.raises(Fp8ConvError, match=message):
        fp8conv.convert(folder, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))


def test_tensor_without_a_role_inside_an_mlp_is_refused(tmp_path):
    b = _Builder("block")
    for e in range(E):
        for proj in ("gate_proj", "up_proj"):
            b.linear(f"model.layers.0.mlp.experts.{e}.{proj}", (136, 96))
        b.linear(f"model.layers.0.mlp.experts.{e}.down_proj", (96, 136))
    b.linear("model.layers.0.mlp.experts.0.odd_proj", (136, 96))
    config = {"model_type": "new_moe", "hidden_size": 96, "moe_intermediate_size": 136, "num_hidden_layers": 1}
    b.write(tmp_path / "in", config | {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with pytest.raises(Fp8ConvError, match=r"experts\.0\.odd_proj\.weight.*plays no role the naming rules"):
        fp8conv.convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))


def test_expert_dtype_fp8_is_not_deepseek_v4(tmp_path):
    """transformers-5 FineGrainedFP8Config saves write quantization_config.expert_dtype 'fp8'."""
    b = _Builder("block")
    for e in range(E):
        for proj in ("w1", "w3"):
            b.linear(f"model.layers.0.block_sparse_moe.experts.{e}.{proj}", (136, 96))
        b.linear(f"model.layers.0.block_sparse_moe.experts.{e}.w2", (96, 136))
    b.plain("model.layers.0.block_sparse_moe.gate.weight", (E, 96), torch.float32)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp8"}
    config = {"model_type": "minimax_m2", "hidden_size": 96, "intermediate_size": 136, "quantization_config": qc}
    b.write(tmp_path / "in", config)
    fp8conv.convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["intermediate_size"] == 1024
    assert "expert_dtype" not in written  # not made a DeepSeek-V4 config
    assert load_dir(tmp_path / "out")["model.layers.0.block_sparse_moe.experts.2.w2.weight"].shape == (96, 1024)


# ---------------------------------------------------------------------------------------------------
# transformers (5.24 has these architectures) loads the bf16 output's text model: every parameter found,
# each equal to the tensor written (renamed back the way its conversion_mapping renames), experts merged


_RENAMES = (
    ("model.", "model.language_model."),
    ("model.", "backbone."),
    ("mlp.gate.", "mlp.router.gate."),
    ("mlp.shared_experts.", "mlp.shared_mlp."),
    ("mlp.e_score_correction_bias", "mlp.expert_bias"),
)
HF_RELEASES = ["qwen3.6-35b-a3b-fp8", "qwen3.6-27b-fp8", "glm-5.2-fp8", "hy3-fp8", "nemotron-3-fp8-tensor"]


def _written_name(key: str, written: dict[str, torch.Tensor]) -> str | None:
    names = {key}
    for old, new in _RENAMES:
        names |= {n.replace(old, new, 1) for n in names}
    return next((n for n in names if n in written), None)


@pytest.mark.parametrize("name", HF_RELEASES)
def test_transformers_loads_the_bf16_output(built, name, tmp_path):
    transformers = pytest.importorskip("transformers")
    release = built(name)
    out = tmp_path / "out"
    fp8conv.convert(release.path, out, ConvertOptions(to="bf16"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(_text(config) | {"architectures": [release.hf_class]}))
    model_class = getattr(transformers, release.hf_class)
    model, info = model_class.from_pretrained(out, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    written = load_dir(out)
    state = model.state_dict()
    direct = 0
    for key, value in state.items():
        source = _written_name(key, written)
        if source is not None:
            assert same_bits(value, written[source].to(value.dtype)), key  # as from_pretrained casts it
            direct += 1
    assert direct > len(state) // 2
    merged = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.up_proj"))]
    for key in merged:  # expert 1 of the merged tensor is expert 1's own rows (gate first)
        prefix = _written_name(key.removesuffix("gate_up_proj").removesuffix("up_proj") + "1.up_proj.weight", written)
        assert prefix is not None, key
        rows = [
            written[prefix.replace("up_proj", p)]
            for p in ("gate_proj", "up_proj")
            if prefix.replace("up_proj", p) in written
        ]
        assert same_bits(state[key][1], torch.cat(rows)), key


def test_padded_widths_update_a_top_level_copy(built, tmp_path):
    """Multimodal configs saved by older transformers (Qwen2.5-VL's) repeat the text model's widths at the
    top level beside text_config: --pad-for-tp updates both copies, or the top-level one disagrees with
    the tensors for any reader of the top level."""
    folder = tmp_path / "in"
    shutil.copytree(built("qwen3.6-35b-a3b-fp8").path, folder)
    config = json.loads((folder / "config.json").read_text())
    keys = ("hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    config |= {k: config["text_config"][k] for k in keys} | {"intermediate_size": 4304}  # not a text width
    (folder / "config.json").write_text(json.dumps(config))
    fp8conv.convert(folder, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        assert written[key] == written["text_config"][key] == 1024, key
    assert written["hidden_size"] == 96 and written["intermediate_size"] == 4304
    out = load_dir(tmp_path / "out")
    assert out["model.language_model.layers.0.mlp.experts.2.down_proj.weight"].shape == (96, 1024)


def _gemma4_moe(folder: Path) -> Path:
    """Gemma-4 26B-A4B (transformers 5.24 modeling_gemma4.py): each decoder layer has a dense `mlp` and,
    with enable_moe_block, `router.proj` and fused 3-D experts in the layer itself (`layers.N.experts.
    gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), not under an MLP module; block FP8 as transformers'
    FP8Experts saves them ([E, N/128, K/128] `*_scale_inv`)."""
    b = _Builder("block")
    lm = "model.language_model."
    b.plain(lm + "embed_tokens.weight", (300, 96))
    for layer in range(2):
        p = f"{lm}layers.{layer}."
        b.plain(p + "input_layernorm.weight", (96,))
        for proj, shape in (("gate_proj", (330, 96)), ("up_proj", (330, 96)), ("down_proj", (96, 330))):
            b.linear(p + "mlp." + proj, shape)
        b.plain(p + "router.proj.weight", (E, 96))
        b.quantized(p + "experts.gate_up_proj", p + "experts.gate_up_proj_scale_inv", b._random((E, 272, 96)))
        b.quantized(p + "experts.down_proj", p + "experts.down_proj_scale_inv", b._random((E, 96, 136)))
    text = {"model_type": "gemma4_text", "hidden_size": 96, "intermediate_size": 330, "num_hidden_layers": 2}
    text |= {"enable_moe_block": True, "num_experts": E, "moe_intermediate_size": 136, "vocab_size": 300}
    config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text}
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    b.write(folder, config | {"quantization_config": qc})
    return folder


def test_gemma4_layer_level_experts_padded_for_tp8(tmp_path):
    """The layer-level fused experts are the routed MLP (moe_intermediate_size): --pad-for-tp pads them with
    the dense MLP, each gate / up half to 1024 rows, rather than leaving 136 / 8 = 17 rows per rank, which
    no engine splits into 128-row blocks."""
    src = _gemma4_moe(tmp_path / "in")
    fp8conv.convert(src, tmp_path / "plain", ConvertOptions(to="block"))
    fp8conv.convert(src, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert (text["intermediate_size"], text["moe_intermediate_size"]) == (1024, 1024)
    plain, out = load_dir(tmp_path / "plain"), load_dir(tmp_path / "out")
    p = "model.language_model.layers.1.experts."
    assert out[p + "gate_up_proj"].shape == (E, 2048, 96) and out[p + "gate_up_proj_scale_inv"].shape == (E, 16, 1)
    assert out[p + "down_proj"].shape == (E, 96, 1024) and out[p + "down_proj_scale_inv"].shape == (E, 1, 8)
    got, ref = decode(out, p + "gate_up_proj"), decode(plain, p + "gate_up_proj")
    for half in range(2):  # gate rows, then up rows, each followed by zeros; requantized (a block held both)
        kept = ref[:, half * 136 : (half + 1) * 136]
        assert within_fp8_bound(got[:, half * 1024 : half * 1024 + 136], kept, ref.abs().amax())
        assert not got[:, half * 1024 + 136 : (half + 1) * 1024].count_nonzero()
    got, ref = decode(out, p + "down_proj"), decode(plain, p + "down_proj")
    assert same_bits(got[..., :136], ref) and not got[..., 136:].count_nonzero()


def test_dots3_shared_width_key_is_not_left_stale(built, tmp_path):
    """dots3_note sizes its shared experts by shared_experts_intermediate_size * n_shared_experts (transformers
    configuration_dots3_note.py), equal to moe_intermediate_size in its defaults: --pad-for-tp pads that key
    with the shared experts, not moe_intermediate_size alone (exit 0 with the key at the old width, a config
    transformers builds 136-wide shared experts from)."""

    def dots3(c: dict) -> None:
        c.update(model_type="dots3_note_text", shared_experts_intermediate_size=136)

    folder = _edited(built("glm-5.2-fp8"), tmp_path / "in", dots3)
    fp8conv.convert(folder, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["moe_intermediate_size"], written["shared_experts_intermediate_size"]) == (1024, 1024)
    assert load_dir(tmp_path / "out")["model.layers.2.mlp.shared_experts.down_proj.weight"].shape == (96, 1024)


def _minimax_m3_shared(folder: Path, shared: int) -> Path:
    """MiniMax-M3's text model: routed experts sized by intermediate_size, shared experts by
    shared_intermediate_size (transformers 5.24 modeling_minimax_m3_vl.py; 3072 both in the release)."""
    b = _Builder("block")
    p = "language_model.model.layers.0.block_sparse_moe."
    for e in range(E):
        for proj, shape in (("w1", (136, 96)), ("w3", (136, 96)), ("w2", (96, 136))):
            b.linear(f"{p}experts.{e}.{proj}", shape)
    for proj, shape in (("gate_proj", (shared, 96)), ("up_proj", (shared, 96)), ("down_proj", (96, shared))):
        b.linear(f"{p}shared_experts.{proj}", shape)
    b.plain(p + "gate.weight", (E, 96), torch.float32)
    text = {"hidden_size": 96, "intermediate_size": 136, "shared_intermediate_size": shared, "num_hidden_layers": 1}
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    b.write(folder, {"model_type": "minimax_m3_vl", "text_config": text, "quantization_config": qc})
    return folder


def test_minimax_m3_shared_width_key(tmp_path):
    """--pad-for-tp pads shared_intermediate_size with the shared experts, whether it equals intermediate_size
    (the routed experts' key, as in the release) or not, rather than intermediate_size alone (the config's
    other key left at the old width, exit 0) or refusing for no key."""
    for shared in (136, 200):
        src = _minimax_m3_shared(tmp_path / f"in{shared}", shared)
        fp8conv.convert(src, tmp_path / f"out{shared}", ConvertOptions(to="block", pad_for_tp=8))
        text = json.loads((tmp_path / f"out{shared}" / "config.json").read_text())["text_config"]
        assert (text["intermediate_size"], text["shared_intermediate_size"]) == (1024, 1024)
        out = load_dir(tmp_path / f"out{shared}")
        name = "language_model.model.layers.0.block_sparse_moe.shared_experts.down_proj.weight"
        assert out[name].shape == (96, 1024)


def test_nemotron_shared_width_equal_to_routed_is_padded(tmp_path):
    """Nemotron-H sizes its shared experts by moe_shared_expert_intermediate_size (transformers
    modeling_nemotron_h.py); when it equals moe_intermediate_size * n_shared_experts both fit, and the key
    naming the shared experts is the one padded (the routed experts pad the other), not a refusal."""
    b = _Builder("tensor")
    p = "backbone.layers.0.mixer."
    for e in range(E):
        b.linear(f"{p}experts.{e}.up_proj", (136, 96))
        b.linear(f"{p}experts.{e}.down_proj", (96, 136))
    b.linear(p + "shared_experts.up_proj", (136, 96))
    b.linear(p + "shared_experts.down_proj", (96, 136))
    b.plain(p + "gate.weight", (E, 96), torch.float32)
    config = {"model_type": "nemotron_h", "hidden_size": 96, "hybrid_override_pattern": "E", "num_hidden_layers": 1}
    config |= {"moe_intermediate_size": 136, "moe_shared_expert_intermediate_size": 136, "n_shared_experts": 1}
    b.write(tmp_path / "in", config | {"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}})
    fp8conv.convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=8))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["moe_intermediate_size"], written["moe_shared_expert_intermediate_size"]) == (1024, 1024)
    assert load_dir(tmp_path / "out")[p + "shared_experts.down_proj.weight"].shape == (96, 1024)
