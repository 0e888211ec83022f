"""Every published FP8 family (tests/support/families.py) through the CLI to every target, checked against the
fixtures' own references and, where transformers has the model class, by loading the output in
transformers and comparing logits with a model built from reference weights."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fp8conv.cli.commands import main
from fp8conv.model import families as table
from fp8conv.model.roles import ROLE_TENSORS
from tests.support.families import FAMILIES, FamilyFixture, build_family
from tests.support.helpers import load_dir
from tests.support.reference import dequant_block_reference, quantize_reference, same_bits

transformers = pytest.importorskip("transformers")

TOKENS = torch.tensor([[1, 7, 42, 3, 99, 250, 17, 5]])
SCALE_NAMES = ("_scale", "_scale_inv", "input_scale", "activation_scale")
REFUSED = {("qwen3-vl-moe-fused", "channel"): "fused expert parameter as transformers 5 saves it"}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Each family built once per module, on first use."""
    built: dict[str, FamilyFixture] = {}

    def get(name: str) -> FamilyFixture:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp("families") / name)
        return built[name]

    return get


def _cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _convert(fx: FamilyFixture, tmp_path: Path, to: str) -> Path:
    out = tmp_path / to
    result = _cli("convert", fx.path, "--to", to, "-o", out, "-q")
    assert result.exit_code == 0, result.output
    return out


def _assert_refused(fx: FamilyFixture, tmp_path: Path, to: str, message: str) -> None:
    out = tmp_path / to
    result = _cli("convert", fx.path, "--to", to, "-o", out, "-q")
    assert result.exit_code == 1 and message in result.output, result.output
    assert not (out / "config.json").exists()  # nothing that looks complete


def _assert_mxfp4_to_bf16(fx: FamilyFixture, tmp_path: Path) -> None:
    """gpt-oss: every *_blocks / *_scales pair becomes the bf16 tensor transformers' own decoder gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    got = load_dir(_convert(fx, tmp_path, "bf16"))
    src = load_dir(fx.path)
    blocks = [n for n in src if n.endswith("_blocks")]
    assert blocks
    for name in blocks:
        base = name.removesuffix("_blocks")
        assert same_bits(got[base], convert_moe_packed_tensors(src[name], src[base + "_scales"])), base
    assert set(got) == {n.removesuffix("_blocks") for n in src if not n.endswith("_scales")}


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain float32 product of a block-FP8 output, per expert for fused [E, N, K] tensors."""
    if q.dim() == 3:
        return torch.stack([_dequant(q[e], scale[e]) for e in range(q.shape[0])])
    return dequant_block_reference(q, scale, (128, 128), torch.float32)


def _plain_linears(fx: FamilyFixture) -> set[str]:
    """Modules whose 2-D weight stays unquantized (routers, lm_head, the release's bf16 layers): an engine
    quantizes every Linear the config does not list, so each must be listed."""
    return {
        n.removesuffix(".weight")
        for n, t in fx.reference.items()
        if n.endswith(".weight") and t.dim() == 2 and n not in fx.fp8_weights and "embed" not in n
    }


def _logits(fx: FamilyFixture, path: Path, **kwargs) -> torch.Tensor:
    cls = getattr(transformers, fx.hf_class)
    model, info = cls.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith(fx.unexpected_prefixes) for k in info["unexpected_keys"]), info["unexpected_keys"]
    with torch.no_grad():
        return model(input_ids=TOKENS).logits.float()


def _reference_model(fx: FamilyFixture, folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """The same model with plain bf16 weights computed here, and no quantization_config."""
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
    config = {k: v for k, v in fx.config.items() if k != "quantization_config"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("name", FAMILIES)
def test_inspect(families, name):
    fx = families(name)
    result = _cli("inspect", fx.path, "--json")
    report = json.loads(result.output)
    if fx.layout == "mxfp4":  # packed 4-bit, converted to bf16 only
        assert result.exit_code == 0 and report["format"] == "mxfp4-gpt-oss", result.output
        return
    if fx.refusal:
        assert result.exit_code != 0 or report["problems"], result.output
        assert fx.refusal in result.output, result.output
        return
    assert result.exit_code == 0 and not report["problems"], result.output
    kinds = {"block": "block-fp8", "channel": "channel-fp8", "tensor": "per-tensor-fp8"}
    assert report["format"] == kinds[fx.layout], report
    assert report["formats"][kinds[fx.layout]] == len(fx.fp8_weights), report


@pytest.mark.parametrize("name", FAMILIES)
def test_to_bf16(families, tmp_path, name):
    fx = families(name)
    if fx.layout == "mxfp4":
        return _assert_mxfp4_to_bf16(fx, tmp_path)
    if fx.refusal:
        return _assert_refused(fx, tmp_path, "bf16", fx.refusal)
    out = _convert(fx, tmp_path, "bf16")
    got = load_dir(out)
    assert set(got) == set(fx.reference)  # every scale dropped, nothing else lost or added
    expected = {n: t.to(torch.bfloat16) if n in fx.fp8_weights else t for n, t in fx.reference.items()}
    for n, t in expected.items():
        assert same_bits(got[n], t), n  # one rounding of the float32 product; the rest byte for byte
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in json.dumps(config)
    if "params.json" in fx.extra_files:  # Mistral: params.json must not declare FP8 any more
        assert "quantization" not in json.loads((out / "params.json").read_text())
    if fx.hf_loadable:
        ref = _reference_model(fx, tmp_path / "reference", expected)
        got_logits, ref_logits = _logits(fx, out), _logits(fx, ref)
        assert got_logits.abs().max() > 0 and same_bits(got_logits, ref_logits)


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("name", FAMILIES)
def test_to_channel(families, tmp_path, name):
    fx = families(name)
    if fx.refusal or (name, "channel") in REFUSED:
        return _assert_refused(fx, tmp_path, "channel", fx.refusal or REFUSED[(name, "channel")])
    out = _convert(fx, tmp_path, "channel")
    got = load_dir(out)
    dequantized = {}
    for n, ref in fx.reference.items():
        if n not in fx.fp8_weights:
            assert same_bits(got[n], ref), n
            dequantized[n] = ref
            continue
        q, scale = got[n], got[n + "_scale"]
        expected_q, expected_scale = quantize_reference(ref, None)
        assert same_bits(q, expected_q) and same_bits(scale, expected_scale), n
        dequantized[n] = (expected_q.to(torch.float32) * expected_scale).to(torch.bfloat16)
    assert set(got) == set(fx.reference) | {n + "_scale" for n in fx.fp8_weights}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["weights"]["strategy"] == (
        "channel"
    )
    assert _plain_linears(fx) <= set(qc["ignore"])
    if "params.json" in fx.extra_files:  # vLLM's Mistral reader passes a compressed-tensors entry through
        assert json.loads((out / "params.json").read_text())["quantization"] == qc
    if fx.hf_loadable:
        pytest.importorskip("compressed_tensors")
        ref = _reference_model(fx, tmp_path / "reference", dequantized)
        decompressed = transformers.CompressedTensorsConfig(run_compressed=False)
        got_logits = _logits(fx, out, quantization_config=decompressed)
        assert got_logits.abs().max() > 0 and same_bits(got_logits, _logits(fx, ref))


@pytest.mark.parametrize("name", FAMILIES)
def test_to_block(families, tmp_path, name):
    fx = families(name)
    if fx.refusal:
        return _assert_refused(fx, tmp_path, "block", fx.refusal)
    out = _convert(fx, tmp_path, "block")
    got = load_dir(out)
    for n, ref in fx.reference.items():
        if n not in fx.fp8_weights:
            assert same_bits(got[n], ref), n
            continue
        q, scale = got[n], got[n + "_scale_inv"]
        grid = (*ref.shape[:-2], math.ceil(ref.shape[-2] / 128), math.ceil(ref.shape[-1] / 128))
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == grid, n
        if fx.layout == "block":  # the same blocks: the FP8 bytes pass through, scales widen exactly
            assert same_bits(_dequant(q, scale), ref), n
        else:  # requantized from the float32 product into 128x128 blocks
            expected_q, expected_scale = quantize_reference(ref, (128, 128))
            assert same_bits(q, expected_q) and same_bits(scale, expected_scale), n
    assert set(got) == set(fx.reference) | {n + "_scale_inv" for n in fx.fp8_weights}
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["fmt"] == "e4m3" and qc["weight_block_size"] == [128, 128]
    listed = qc.get("modules_to_not_convert", [])  # absent when every Linear is FP8 (tied embeddings)
    assert _plain_linears(fx) <= set(listed) and qc.get("ignored_layers", []) == listed
    # V3.1 / V3.2 claim ue8m0 and every scale is a power of two: the claim survives the pass-through
    assert qc.get("scale_fmt") == fx.config["quantization_config"].get("scale_fmt")
    if "params.json" in fx.extra_files:  # no Mistral-format spelling of DeepSeek-style block FP8 exists
        assert not (out / "params.json").exists()


@pytest.mark.parametrize("fmt", ["e4m3", "float8_e4m3fn", "F8_E4M3", "fp8_e4m3", "E4M3FN"])
def test_fmt_spellings_of_e4m3_are_read(fmt):
    from fp8conv.model.quant_config import read_quant_settings

    settings = read_quant_settings({"quantization_config": {"quant_method": "fp8", "fmt": fmt}})
    assert settings.problems == []


@pytest.mark.parametrize(
    ("fmt", "named"),
    [
        ("e5m2", "is e5m2 FP8"),
        ("float8_e5m2", "is e5m2 FP8"),
        ("float8_e4m3fnuz", "is AMD's e4m3fnuz"),
        ("int8", "is not a known spelling"),
    ],
)
def test_other_fmt_types_are_refused_by_name(families, tmp_path, fmt, named):
    """MiniMax-M2's layout with its fmt changed: only a different type is refused, and named."""
    import shutil

    src = families("minimax-m2")
    path = tmp_path / "ckpt"
    shutil.copytree(src.path, path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["fmt"] = fmt
    (path / "config.json").write_text(json.dumps(config))
    result = _cli("convert", path, "--to", "bf16", "-o", tmp_path / "out")
    assert result.exit_code == 1 and f"fmt '{fmt}' {named}" in result.output, result.output


def test_fbgemm_fp8_reads_as_channel(families):
    fx = families("llama-3.1-fbgemm")
    report = json.loads(_cli("inspect", fx.path, "--json").output)
    assert report["quant_method"] == "fbgemm_fp8" and report["format"] == "channel-fp8" and not report["problems"]
    # attention and the first/last MLP are bf16 in Meta's release: only layer 1's MLP is FP8
    assert report["formats"]["channel-fp8"] == 3


def test_mistral_params_without_quantization_entry_is_copied_for_bf16(families, tmp_path):
    """A bf16 params.json (no `quantization`) stays as it was, apart from formatting."""
    import shutil

    path = tmp_path / "ckpt"
    shutil.copytree(families("ministral-3").path, path)
    params = json.loads((path / "params.json").read_text())
    del params["quantization"]
    (path / "params.json").write_text(json.dumps(params))
    result = _cli("convert", path, "--to", "bf16", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "params.json").read_text()) == params
    assert "consolidated.safetensors" in result.output and "Mistral-native" in result.output  # skipped, said why


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_verify_checks_mistral_params(families, tmp_path, to):
    """`verify` passes on the output, and fails once params.json declares the input's FP8 again."""
    import shutil

    fx = families("ministral-3")
    out = _convert(fx, tmp_path, to)
    assert _cli("verify", fx.path, out).exit_code == 0
    shutil.copy(fx.path / "params.json", out / "params.json")
    result = _cli("verify", fx.path, out)
    assert result.exit_code == 1 and "params.json" in result.output, result.output


def test_every_role_pattern_takes_any_expert_index() -> None:
    """Roles are matched once per layer with the expert index made 0 (families.one_expert): a pattern
    naming one expert (`experts\\.3\\.`) would then be matched wrongly for every other one."""
    patterns = [t.pattern.pattern for f in table.FAMILIES for r in f.roles for t in r.tensors]
    patterns += [t.pattern.pattern for tensors in ROLE_TENSORS.values() for t in tensors]
    assert len(patterns) > 50
    pins = re.compile(r"experts\\\\?\.(?:\(\?:)?[0-9]")
    assert pins.search(r"mlp\.experts\.3\.up_proj") and pins.search(r"experts\.(?:0|1)\.")  # what it looks for
    assert [p for p in patterns if pins.search(p)] == []
    assert table.one_expert("mlp.experts.17.up_proj.weight") == "mlp.experts.0.up_proj.weight"
    for name in ("mlp.shared_experts.up_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.3", "experts.x.y"):
        assert table.one_expert(name) == name


_NAME_PARTS = ["layers", "experts", "sublayers", "vision_tower", "visual", "mm_projector", "audio", "mlp", "", "0"]
_NAME_PARTS += ["17", "٣", "3x", "up_proj", "weight"]


def test_layer_keys_are_what_the_plain_regexes_give() -> None:
    """layer_key finds `layers.N.` with str.find before one regex match, and skips the expert regex when no
    `experts.` is there: on every name it must give what the two regexes alone give (a Unicode digit is a
    digit to both), and in_vision what VISION.search gives."""
    import random

    layer, expert = re.compile(r"(?:^|\.)layers\.\d+\."), re.compile(r"experts\.\d+\.")

    def reference(name: str) -> str | None:
        m = layer.search(name)
        return None if m is None else expert.sub("experts.0.", name[m.end() :], count=1)

    rng = random.Random(24)
    names = ["model.layers.3.mlp.experts.17.up_proj.weight", "a.layers.x.layers.2.b", "xlayers.1.a", "layers.5.v"]
    names += [".".join(rng.choice(_NAME_PARTS) for _ in range(rng.randint(1, 10))) for _ in range(20000)]
    assert sum(reference(n) is not None for n in names) > 500  # the names reach both answers
    assert [n for n in names if table.layer_key(n) != reference(n)] == []
    assert [n for n in names if table.in_vision(n) != bool(table.VISION.search(n))] == []
    assert table.layer_key("model.layers.3.mlp.experts.17.up_proj.weight") == "mlp.experts.0.up_proj.weight"


def _literal_endings(items: list) -> set[str]:
    """The literal text every match of the parsed regex `items` ends with, per alternative (up to the
    first non-literal from the end)."""
    endings = {""}
    for op, av in reversed(items):
        name = str(op)
        if name == "AT":  # `$`
            continue
        if name == "LITERAL":
            endings = {chr(av) + e for e in endings}
        elif name == "SUBPATTERN":
            endings = {inner + e for inner in _literal_endings(list(av[-1])) for e in endings}
        elif name == "BRANCH":
            endings = {inner + e for branch in av[1] for inner in _literal_endings(list(branch)) for e in endings}
        else:
            return endings
    return endings


def test_no_role_tensor_ends_like_a_scale() -> None:
    """The passes over a release's names skip those ending in NO_ROLE_TAILS: sound only while every role
    tensor's pattern ends `$` after literal text that no such name can end with."""
    from re import _parser as sre_parse  # type: ignore[attr-defined]

    from fp8conv.model.roles import ROLE_TENSORS

    patterns = {t.pattern.pattern for f in table.FAMILIES for r in f.roles for t in r.tensors}
    patterns |= {t.pattern.pattern for tensors in ROLE_TENSORS.values() for t in tensors}
    assert len(patterns) > 20 and all(p.endswith("$") for p in patterns)
    for pattern in patterns:
        for ending in _literal_endings(list(sre_parse.parse(pattern))):
            assert len(ending) >= 4, (pattern, ending)
            # a name ending in `tail` matches only if one of ending / tail ends the other
            assert [t for t in table.NO_ROLE_TAILS if t.endswith(ending) or ending.endswith(t)] == [], pattern
    for tail in table.NO_ROLE_TAILS:  # and a scale of a role tensor is indeed no role's
        name = "model.layers.0.mlp.experts.3.up_proj.weight" + tail
        assert all(table.role_of(f, name) is None for f in table.FAMILIES if f.roles)


def test_fused_modules_are_their_members_start() -> None:
    """fused_mismatches matches only names starting with a fused module the other side has: sound only
    while every fused pattern's group 1 is the name's start."""
    from fp8conv.model.roles import EXCEPTIONS, FUSED_RULES

    patterns = {p.pattern for f in table.FAMILIES for p in f.fused} | {p.pattern for p in FUSED_RULES}
    patterns |= {p for e in EXCEPTIONS.values() for p in e.fused}
    assert len(patterns) > 5
    assert [p for p in patterns if not p.startswith("^(")] == []
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    module, pattern = table.fused_module(name)
    assert name.startswith(module) and table.fused_group(name) == f"{module}<{pattern}>"
