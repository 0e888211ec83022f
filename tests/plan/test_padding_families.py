"""--to block --pad-for-tp N for every family of tests/support/families.py: the padded output, dequantized here,
holds the unpadded output's weights plus zeros, its config.json states the padded widths for every role
and only those, and transformers computes the same logits from it. Then the refusals: a name no role
claims, a config that disagrees with its tensors (plan, verify, inspect), roles that share a width key."""

from __future__ import annotations

import json
import math

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.errors import CheckpointError
from tests.support.families import FAMILIES, build_family
from tests.support.helpers import load_dir
from tests.support.reductions import assert_same_function
from tests.support.reference import dequant_block_reference, same_bits

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 7, 42, 3, 99, 250, 17, 5]])
KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp")
# Which config widths each family's tensors use (written down here from transformers' modeling files,
# independently of fp8conv's table): these are padded, every other width is left as it is.
PADDED_KEYS = {
    "deepseek-v3": {"intermediate_size", "moe_intermediate_size"},
    "qwen3-8b": {"intermediate_size"},
    "qwen3-moe": {"moe_intermediate_size"},
    "qwen3-next": {"moe_intermediate_size", "shared_expert_intermediate_size"},
    "qwen2-moe": {"moe_intermediate_size", "shared_expert_intermediate_size"},
    "qwen3-vl-moe": {"moe_intermediate_size"},
    "glm-4.5": {"intermediate_size", "moe_intermediate_size"},
    "minimax-m2": {"intermediate_size"},
    "mixtral-autofp8": {"intermediate_size"},
    "llama-3.1-fbgemm": {"intermediate_size"},
    "llama-4": {"intermediate_size", "intermediate_size_mlp"},
}
for alias, same in (("deepseek-v3.1", "deepseek-v3"), ("kimi-k2", "deepseek-v3"), ("deepseek-v3.2", "deepseek-v3")):
    PADDED_KEYS[alias] = PADDED_KEYS[same]
for alias in ("qwen3-4b-2507", "llama-ct-tensor", "llama-ct-channel", "ministral-3"):
    PADDED_KEYS[alias] = PADDED_KEYS["qwen3-8b"]
PADDED_KEYS["qwen3-vl-moe-fused"] = PADDED_KEYS["qwen3-vl-moe"]
CONVERTED = [f for f in FAMILIES if f in PADDED_KEYS]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = build_family(name, tmp_path_factory.mktemp("families") / name)
        return cache[name]

    return get


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _dequantized(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a block-FP8 output in float32, scales applied by the plain definition here."""
    tensors = load_dir(folder)
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv", tensors.get(name.removesuffix(".weight") + ".weight_scale_inv"))
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.to(torch.float32)
        elif t.dim() == 3:
            out[name] = torch.stack(
                [dequant_block_reference(q, s, (128, 128), torch.float32) for q, s in zip(t, scale, strict=True)]
            )
        else:
            out[name] = dequant_block_reference(t, scale, (128, 128), torch.float32)
    return out


def _unpadded_view(padded: torch.Tensor, shape: tuple[int, ...], fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The leading corner of the padded tensor (each half of a fused [gate; up]) and what lies outside it."""
    (axis,) = [i for i in range(padded.dim()) if padded.shape[i] != shape[i]]
    parts = 2 if fused else 1
    pieces, rest = [], []
    for chunk in padded.chunk(parts, dim=axis):
        width = shape[axis] // parts
        pieces.append(chunk.narrow(axis, 0, width))
        rest.append(chunk.narrow(axis, width, chunk.shape[axis] - width).reshape(-1))
    return torch.cat(pieces, dim=axis), torch.cat(rest)


def _bf16_model(tmp_path, name: str, source, tensors: dict[str, torch.Tensor]):
    """A plain bf16 model folder from dequantized tensors, config without quantization_config."""
    from safetensors.torch import save_file

    folder = tmp_path / name
    folder.mkdir()
    save_file({n: t.to(torch.bfloat16).contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        section.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _logits(folder, fixture):
    cls = getattr(transformers, fixture.hf_class)
    # eager experts: the grouped_mm kernel wants 16-byte strides, which unpadded widths (330 x 2 bytes) lack
    model, info = cls.from_pretrained(
        folder, dtype=torch.bfloat16, output_loading_info=True, experts_implementation="eager"
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(fixture.unexpected_prefixes) for k in info["unexpected_keys"]), info["unexpected_keys"]
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


@pytest.mark.parametrize("family", CONVERTED)
def test_padded_family_computes_the_same_function(built, family, tmp_path):
    fixture = built(family)
    tp = (2, 4, 8)[CONVERTED.index(family) % 3]
    fp8conv.convert(fixture.path, tmp_path / "block", ConvertOptions(to="block"))
    fp8conv.convert(fixture.path, tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=tp))

    before, after = _text(fixture.config), _text(json.loads((tmp_path / "padded" / "config.json").read_text()))
    unit = tp * 128
    for key in KEYS:
        if key in before:
            want = math.ceil(before[key] / unit) * unit if key in PADDED_KEYS[family] else before[key]
            assert after[key] == want, (key, before[key], after[key])

    plain, padded = _dequantized(tmp_path / "block"), _dequantized(tmp_path / "padded")
    assert set(plain) == set(padded)
    grown = 0
    for name, t in plain.items():
        if padded[name].shape == t.shape:
            assert same_bits(padded[name], t), name
            continue
        grown += 1
        fused = name.endswith("gate_up_proj")
        corner, rest = _unpadded_view(padded[name], tuple(t.shape), fused)
        assert (rest == 0).all(), name
        if fused and (t.shape[-2] // 2) % 128:  # halves not whole blocks: quantized afresh, within FP8 rounding
            assert ((corner - t).abs() <= t.abs() * 2**-3 + t.abs().amax() * 2**-8).all(), name
        else:
            assert same_bits(corner, t), name
    assert grown > 0

    result = fp8conv.verify(fixture.path, tmp_path / "padded")
    assert result.ok, result.failures
    if fixture.hf_loadable:
        a = _logits(_bf16_model(tmp_path, "plain-bf16", tmp_path / "block", plain), fixture)
        b = _logits(_bf16_model(tmp_path, "padded-bf16", tmp_path / "padded", padded), fixture)
        assert a.abs().max() > 0
        if family.endswith("-fused"):
            torch.testing.assert_close(b, a, rtol=0.05, atol=0.05 * a.abs().max().item())
        else:
            assert_same_function(b, a)  # tests/support/reductions.py: the reductions' rounding, not exact


def test_pad_roles_leaves_the_routed_experts_alone(built, tmp_path):
    fixture = built("qwen2-moe")  # no dense layer: shared and routed experts
    fp8conv.convert(fixture.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4, pad_roles=("shared",)))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["shared_expert_intermediate_size"] == 512 and config["moe_intermediate_size"] == 136
    tensors = load_dir(tmp_path / "out")
    assert tensors["model.layers.0.mlp.shared_expert.gate_proj.weight"].shape[0] == 512
    assert tensors["model.layers.0.mlp.experts.0.gate_proj.weight"].shape[0] == 136
    report = fp8conv.inspect(fixture.path)
    sizes = report.padded_output_bytes["4"]
    assert set(sizes) == {"shared,routed", "shared"}
    assert sizes["shared"] < sizes["shared,routed"]
    assert sizes["shared"] == sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors")) - sum(
        8 + int.from_bytes(p.read_bytes()[:8], "little") for p in (tmp_path / "out").glob("*.safetensors")
    )


def test_pad_roles_refuses_to_split_a_shared_width_key(built, tmp_path):
    """DeepSeek's shared experts are moe_intermediate_size * n_shared_experts wide: padding them alone
    would give the routed experts a config width their tensors do not have."""
    fixture = built("deepseek-v3")
    with pytest.raises(fp8conv.OptionsError, match=r"share config\.json's moe_intermediate_size"):
        fp8conv.convert(
            fixture.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4, pad_roles=("dense", "shared"))
        )
    assert not (tmp_path / "out").exists()
    # --pad-roles dense (expert parallelism) is no choice here: it leaves those shared experts in partial blocks
    assert set(fp8conv.inspect(fixture.path).padded_output_bytes["4"]) == {"dense,shared,routed"}


def test_mixtral_widths_follow_their_tensors(built, tmp_path):
    """The bug this guards: intermediate_size 512 written while every w1/w3 stayed [330, 200]."""
    fixture = built("mixtral-autofp8")
    fp8conv.convert(fixture.path, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4))
    tensors = load_dir(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["intermediate_size"] == 512
    for name, t in tensors.items():
        if ".experts." in name and name.endswith((".w1.weight", ".w3.weight")):
            assert t.shape[0] == 512, name
        elif ".experts." in name and name.endswith(".w2.weight"):
            assert t.shape[1] == 512, name


def test_a_name_no_role_claims_is_refused_by_pad_for_tp(built, tmp_path):
    from safetensors.torch import load_file, save_file

    fixture = built("qwen3-8b")
    src = tmp_path / "in"
    src.mkdir()
    index = json.loads((fixture.path / "model.safetensors.index.json").read_text())
    for f in fixture.path.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    shard = index["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    tensors = load_file(src / shard)
    tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(330, 200, dtype=torch.bfloat16)
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    index["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="plays no role the family table knows") as info:
        fp8conv.convert(src, tmp_path / "out", ConvertOptions(to="block", pad_for_tp=2))
    assert "model.layers.0.mlp.extra_proj.weight" in str(info.value) and shard in str(info.value)
    fp8conv.convert(src, tmp_path / "unpadded", ConvertOptions(to="block"))  # without padding the name is no problem


def test_config_disagreeing_with_tensors_is_refused_everywhere(built, tmp_path):
    fixture = built("mixtral-autofp8")
    fp8conv.convert(fixture.path, tmp_path / "good", ConvertOptions(to="block"))
    # the input: plan refuses, inspect lists it
    bad_in = tmp_path / "bad-in"
    bad_in.mkdir()
    for f in fixture.path.iterdir():
        (bad_in / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad_in / "config.json").read_text())
    config["intermediate_size"] = 512
    (bad_in / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json's intermediate_size says 512") as info:
        fp8conv.convert(bad_in, tmp_path / "out", ConvertOptions(to="bf16"))
    assert "block_sparse_moe.experts." in str(info.value) and not (tmp_path / "out").exists()
    problems = fp8conv.inspect(bad_in).problems
    assert any("intermediate_size says 512" in p and ".w2.weight" in p for p in problems)
    # an existing output whose config was changed afterwards: verify fails on it
    out_config = tmp_path / "good" / "config.json"
    config = json.loads(out_config.read_text())
    config["intermediate_size"] = 512
    out_config.write_text(json.dumps(config))
    result = fp8conv.verify(fixture.path, tmp_path / "good")
    assert not result.ok
    assert any("intermediate_size says 512" in f and "w1.weight" in f for f in result.failures)


def _fused_model(kind: str, folder):
    """bf16 models whose experts transformers saves fused: Qwen3-VL-MoE as [E, 2I, H] / [E, H, I],
    Llama-4 as [E, H, 2I] / [E, I, H]."""
    small = dict(hidden_size=200, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    if kind == "qwen3_vl_moe":
        text = dict(small, intermediate_size=330, moe_intermediate_size=136, num_experts=4, num_experts_per_tok=2)
        text |= dict(head_dim=40, rope_parameters={"rope_type": "default", "mrope_section": [4, 8, 8]})
        vision = dict(depth=1, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=200)
        config = transformers.Qwen3VLMoeConfig(
            text_config=text, vision_config=vision | {"deepstack_visual_indexes": [0]}
        )
        model_class = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        text = dict(small, intermediate_size=136, intermediate_size_mlp=330, num_local_experts=4)
        text |= dict(num_experts_per_tok=1, interleave_moe_layer_step=2, head_dim=40)
        vision = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2)
        vision |= dict(image_size=32, patch_size=16, vision_output_dim=64, projector_input_dim=64)
        config = transformers.Llama4Config(text_config=text, vision_config=vision | {"projector_output_dim": 64})
        model_class = transformers.Llama4ForConditionalGeneration
    torch.manual_seed(0)
    model_class(config).to(torch.bfloat16).save_pretrained(folder)
    return model_class


@pytest.mark.parametrize(("kind", "tp"), [("qwen3_vl_moe", 2), ("llama4", 8)])
def test_fused_3d_experts_are_padded_half_by_half(kind, tp, tmp_path):
    model_class = _fused_model(kind, tmp_path / "in")
    fp8conv.convert(tmp_path / "in", tmp_path / "block", ConvertOptions(to="block"))
    fp8conv.convert(tmp_path / "in", tmp_path / "padded", ConvertOptions(to="block", pad_for_tp=tp))
    plain, padded = _dequantized(tmp_path / "block"), _dequantized(tmp_path / "padded")
    width = -(-136 // (tp * 128)) * tp * 128
    fused = [n for n in plain if n.endswith("experts.gate_up_proj")]
    assert fused
    for name in fused:
        t, p = plain[name], padded[name]
        axis = 1 if kind == "qwen3_vl_moe" else 2  # [E, 2I, H] or [E, H, 2I]
        assert t.shape[axis] == 272 and p.shape[axis] == 2 * width
        gate, up = p.narrow(axis, 0, width), p.narrow(axis, width, width)
        assert same_bits(gate.narrow(axis, 0, 136), t.narrow(axis, 0, 136))  # each half where it was
        assert same_bits(up.narrow(axis, 0, 136), t.narrow(axis, 136, 136))
        assert (gate.narrow(axis, 136, width - 136) == 0).all() and (up.narrow(axis, 136, width - 136) == 0).all()
        down = name.replace("gate_up_proj", "down_proj")
        assert padded[down].shape[3 - axis] == width
    assert fp8conv.verify(tmp_path / "in", tmp_path / "padded").ok

    def logits(folder):
        model = model_class.from_pretrained(folder, dtype=torch.bfloat16, experts_implementation="eager")
        if kind == "llama4":  # its multimodal forward fails on text alone (transformers 5.24); the text model
            with torch.no_grad():
                return model.language_model(input_ids=TOKENS).logits.float()
        with torch.no_grad():
            return model(input_ids=TOKENS).logits.float()

    a = logits(_bf16_model(tmp_path, "plain-bf16", tmp_path / "block", plain))
    b = logits(_bf16_model(tmp_path, "padded-bf16", tmp_path / "padded", padded))
    assert_same_function(b, a)  # tests/support/reductions.py: the reductions' rounding, not exact


def test_fused_fp8_experts_with_whole_block_halves_keep_their_bytes(tmp_path):
    """gate_up [E, 2I, H] with I a multiple of 128: each half's blocks move as they are, scales with them."""
    from tests.support.helpers import fp8, fp8_block_config, write_checkpoint

    config = fp8_block_config() | {"model_type": "qwen3_moe", "hidden_size": 200, "moe_intermediate_size": 256}
    gate_up, down = fp8((2, 512, 200), seed=1), fp8((2, 200, 256), seed=2)
    gu_scale, d_scale = torch.rand(2, 4, 2) + 0.5, torch.rand(2, 2, 2) + 0.5
    prefix = "model.layers.0.mlp.experts."
    tensors = {prefix + "gate_up_proj": gate_up, prefix + "gate_up_proj_scale_inv": gu_scale}
    tensors |= {prefix + "down_proj": down, prefix + "down_proj_scale_inv": d_scale}
    write_checkpoint(tmp_path / "in", tensors, config, shards=2)
    fp8conv.convert(tmp_path / "in", tmp_path / "out", ConvertOptions(to="block", pad_for_tp=4))
    out = load_dir(tmp_path / "out")
    w, s = out[prefix + "gate_up_proj"], out[prefix + "gate_up_proj_scale_inv"]
    assert w.shape == (2, 1024, 200) and s.shape == (2, 8, 2)
    assert same_bits(w[:, :256], gate_up[:, :256]) and same_bits(w[:, 512:768], gate_up[:, 256:])
    assert (w[:, 256:512].view(torch.uint8) == 0).all() and (w[:, 768:].view(torch.uint8) == 0).all()
    assert same_bits(s[:, :2], gu_scale[:, :2]) and same_bits(s[:, 4:6], gu_scale[:, 2:])
    assert (s[:, 2:4] == 1).all() and (s[:, 6:] == 1).all()
    assert out[prefix + "down_proj"].shape == (2, 200, 512) and same_bits(out[prefix + "down_proj"][..., :256], down)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["moe_intermediate_size"] == 512
    assert fp8conv.verify(tmp_path / "in", tmp_path / "out").ok
