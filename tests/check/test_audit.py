"""`fp8conv verify SRC OTHER` on outputs other tools made: transformers' and compressed-tensors' own
dequantizations, fp8conv's outputs without their manifest, and copies broken on purpose the ways the
public threads show. Each broken copy is made here from the test's own float32 truth (the source's plain
dequantization in tests/support/families.py), so the audit's decode is checked against an independent one.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.check.audit.audit import AuditResult, TensorVerdict, audit
from fp8conv.cli.commands import main
from fp8conv.errors import Fp8ConvError
from tests.support import layouts_2026
from tests.support.audit_builders import (
    build_mistral_native,
    build_qwen3_192,
    build_qwen3_whole_blocks,
    copy_checkpoint,
    rewrite_tensors,
    transformers_dequantized,
)
from tests.support.families import FamilyFixture, build_family
from tests.support.helpers import load_dir
from tests.support.hf_cache import lay_out_hf_cache
from tests.support.packed_builders import build_v4
from tests.support.reference import dequant_block_reference

GATE = "model.layers.0.mlp.gate_proj.weight"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEARS = [f"model.layers.0.self_attn.{p}.weight" for p in ATTN] + [
    f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
]


@pytest.fixture(scope="module")
def qwen3_192(tmp_path_factory) -> FamilyFixture:
    pytest.importorskip("transformers")
    return build_qwen3_192(tmp_path_factory.mktemp("audit") / "src")


@pytest.fixture(scope="module")
def bf16_output(qwen3_192, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("audit") / "bf16"
    fp8conv.convert(qwen3_192.path, out, ConvertOptions(to="bf16"))
    shutil.rmtree(out / ".fp8conv")  # as another tool would leave it: no manifest
    return out


def _by_name(result: AuditResult) -> dict[str, TensorVerdict]:
    return {t.name: t for t in result.tensors}


def _wrong(result: AuditResult) -> set[str]:
    return {t.name for t in result.tensors if not t.ok}


def _cli(*args: object) -> tuple[int, str]:
    done = CliRunner().invoke(main, [str(a) for a in args])
    return done.exit_code, done.output


# -- other tools' outputs ----------------------------------------------------------------------------


def test_transformers_dequantization_of_192_rows_is_named_wrong_and_the_rest_pass(qwen3_192, tmp_path):
    """FineGrainedFP8 infers blocks of 96 from a grid of 2 for 192 rows (or columns): exactly those
    weights are wrong, in exactly those rows or columns, and the cause is named; every other passes."""
    out = tmp_path / "transformers"
    transformers_dequantized(qwen3_192.path, out)
    result = audit(qwen3_192.path, out)
    by_rows = {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")}
    by_columns = {f"model.layers.0.{m}.weight" for m in ("self_attn.o_proj", "mlp.down_proj")}
    assert _wrong(result) == by_rows | by_columns
    verdicts = _by_name(result)
    for name in by_rows:
        assert verdicts[name].judgement.wrong_ranges == [(0, 96, 128)], name
        assert "block size (96, 128) inferred from the scale grid (2 x 2)" in verdicts[name].cause, name
    for name in by_columns:
        assert verdicts[name].judgement.wrong_columns.nonzero().flatten().tolist() == list(range(96, 128))
        assert "block size (128, 96)" in verdicts[name].cause, name
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        assert verdicts[name].verdict == "rounded"  # 96 rows: one partial block, read right
    assert not result.missing and not result.extra and not result.findings
    code, text = _cli("verify", qwen3_192.path, out)
    assert code == 1 and "likely cause: block size (96, 128)" in text and "verify FAILED" in text, text


def test_transformers_dequantization_of_a_ragged_moe_names_every_fp8_weight(qwen3_moe, tmp_path):
    """Widths 200, 330 and 136 under 128x128 blocks: every FP8 weight (experts included, matched under
    transformers' own names) is wrong, each with the block size transformers took from its grid; the
    rest of the checkpoint passes."""
    out = tmp_path / "transformers"
    transformers_dequantized(qwen3_moe.path, out)
    result = audit(qwen3_moe.path, out)
    assert _wrong(result) == set(qwen3_moe.fp8_weights)
    for verdict in result.tensors:
        if not verdict.ok:
            assert verdict.cause and "inferred from the scale grid" in verdict.cause, verdict.line()
    assert not result.missing and not result.extra


def test_compressed_tensors_fp8_block_dequantizer_output_passes(tmp_path):
    convert = pytest.importorskip("compressed_tensors.entrypoints.convert")
    src = build_qwen3_whole_blocks(tmp_path / "src")
    out = tmp_path / "ct"
    converter = convert.converters.FP8BlockDequantizer.from_pretrained(src.path)
    convert.convert_checkpoint(src.path, out, converter, max_workers=1, device="cpu")
    result = audit(src.path, out)
    assert result.ok, _wrong(result)
    assert result.claimed == "bf16" and result.counts() == {"exact": 7, "rounded": 7}
    # one element off by a bf16 step is past one rounding: the same output, one value moved
    tensors = load_dir(out)
    moved = tensors[GATE].clone()
    moved[5, 7] = torch.nextafter(moved[5, 7].float(), torch.tensor(9.0)).to(torch.bfloat16)
    if moved[5, 7] == tensors[GATE][5, 7]:
        moved[5, 7] = (moved[5, 7].float() * 1.01).to(torch.bfloat16)
    rewrite_tensors(out, {GATE: moved})
    assert _wrong(audit(src.path, out)) == {GATE}


def test_compressed_tensors_dequantizer_of_an_fp8conv_channel_output(qwen3_192, tmp_path):
    """compressed-tensors dequantizes fp8conv's channel output right (and copies its manifest along): the
    audit says so against the channel output, and says it is not the source's values."""
    convert = pytest.importorskip("compressed_tensors.entrypoints.convert")
    channel, out = tmp_path / "channel", tmp_path / "dequantized"
    fp8conv.convert(qwen3_192.path, channel, ConvertOptions(to="channel"))
    converter = convert.converters.CompressedTensorsDequantizer(channel, ignore=["re:.*embed_tokens$", "re:.*norm$"])
    convert.convert_checkpoint(channel, out, converter, max_workers=1, device="cpu")
    assert (out / ".fp8conv" / "manifest.json").is_file()  # carried over from fp8conv's output
    code, text = _cli("verify", channel, out)
    assert code == 0 and "verify OK" in text and "another tool rewrote a copy" in text, text
    assert audit(channel, out).counts() == {"exact": 7, "rounded": 7}
    # against the block-FP8 source it is two roundings away: every linear is named wrong, nothing else
    assert _wrong(audit(qwen3_192.path, out)) == set(LINEARS)


# -- fp8conv's own outputs, audited without their manifest --------------------------------------------


@pytest.mark.parametrize(
    ("options", "claim"),
    [
        ({"to": "bf16"}, "bf16"),
        ({"to": "bf16", "dtype": "float16"}, "float16"),
        ({"to": "bf16", "dtype": "float32"}, "float32"),
        ({"to": "channel"}, "channel"),
        ({"to": "block"}, "block"),
        ({"to": "block", "scale_fmt": "ue8m0"}, "block"),
        ({"to": "block", "scale_fmt": "ue8m0", "scale_dtype": "e8m0"}, "block"),
        ({"to": "mxfp8"}, "mxfp8"),
        ({"to": "mxfp8", "mxfp8_format": "modelopt"}, "mxfp8"),
        ({"to": "int8"}, "int8"),
    ],
)
def test_fp8convs_own_outputs_pass_the_audit(qwen3_192, tmp_path, options, claim):
    out = tmp_path / "out"
    fp8conv.convert(qwen3_192.path, out, ConvertOptions(**options))
    shutil.rmtree(out / ".fp8conv")
    result = audit(qwen3_192.path, out, to=claim)
    assert result.ok, [t.line() for t in result.tensors if not t.ok] + result.findings
    assert len(result.tensors) == 14
    quantized = {t.verdict for t in result.tensors if t.name in LINEARS}
    assert quantized <= ({"exact"} if options["to"] == "block" and "scale_fmt" not in options else {"exact", "rounded"})
    # and the claim is checked: the same output is not what another target makes
    other = "channel" if claim != "channel" else "bf16"
    assert not audit(qwen3_192.path, out, to=other).ok


# -- planted faults -----------------------------------------------------------------------------------


def _codes_and_scale(fx: FamilyFixture, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_dir(fx.path)
    return tensors[name], tensors[name.removesuffix(".weight") + ".weight_scale_inv"].float()


def _scale_dropped(fx: FamilyFixture) -> torch.Tensor:
    return _codes_and_scale(fx, GATE)[0].to(torch.bfloat16)


def _scale_inverted(fx: FamilyFixture) -> torch.Tensor:
    codes, scale = _codes_and_scale(fx, GATE)
    return dequant_block_reference(codes, 1 / scale, (128, 128), torch.bfloat16)


def _block_size_from_grid(fx: FamilyFixture) -> torch.Tensor:
    codes, scale = _codes_and_scale(fx, GATE)
    return dequant_block_reference(codes, scale, (96, 128), torch.bfloat16)


def _rows_swapped(fx: FamilyFixture) -> torch.Tensor:
    w = fx.reference[GATE].to(torch.bfloat16)
    return torch.cat([w[100:110], w[10:100], w[0:10], w[110:]])


def _bit_flipped(fx: FamilyFixture) -> torch.Tensor:
    w = fx.reference[GATE].to(torch.bfloat16).clone()
    bits = w.view(torch.int16)
    bits[17, 33] ^= 1 << 4
    return w


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        (_scale_dropped, "the scale was not applied: the values are the FP8 codes themselves"),
        (_scale_inverted, "the scale was applied inverted"),
        (
            _block_size_from_grid,
            "block size (96, 128) inferred from the scale grid (2 x 2) instead of the checkpoint's (128, 128)",
        ),
        (_rows_swapped, "rows in another order: rows 0-9 hold input rows 100-109; rows 100-109 hold input rows 0-9"),
        (_bit_flipped, "1 element(s) one bit away from the right value (a flipped bit): [17, 33] bit 4"),
    ],
)
def test_a_planted_fault_is_named_with_its_cause(qwen3_192, bf16_output, tmp_path, fault, cause):
    out = copy_checkpoint(bf16_output, tmp_path / "broken")
    rewrite_tensors(out, {GATE: fault(qwen3_192)})
    result = audit(qwen3_192.path, out)
    assert _wrong(result) == {GATE}
    verdict = _by_name(result)[GATE]
    assert verdict.cause is not None and verdict.cause.startswith(cause), verdict.cause
    assert "tensor relative error" in verdict.detail and "worst [" in verdict.detail
    code, text = _cli("verify", qwen3_192.path, out)
    assert code == 1 and f"wrong       {GATE} (bfloat16)" in text and cause in text, text


def test_a_wrong_tensor_with_no_known_pattern_gets_no_cause(qwen3_192, bf16_output, tmp_path):
    out = copy_checkpoint(bf16_output, tmp_path / "broken")
    noisy = qwen3_192.reference[GATE] * 1.03  # a 3% error no misreading explains
    rewrite_tensors(out, {GATE: noisy.to(torch.bfloat16)})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert verdict.verdict == "wrong" and verdict.cause is None
    assert abs(verdict.judgement.relative_error - 0.03) < 0.003, verdict.judgement.relative_error


def _toward_zero(w: torch.Tensor) -> torch.Tensor:
    """bf16 by truncation: the float32 bits with the low 16 cut (a rounding, but not nearest-even)."""
    bits = w.to(torch.float32).contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def test_rounding_toward_zero_is_within_one_step_and_three_steps_are_wrong(qwen3_192, bf16_output, tmp_path):
    out = copy_checkpoint(bf16_output, tmp_path / "truncated")
    truncated = _toward_zero(qwen3_192.reference[GATE])
    rewrite_tensors(out, {GATE: truncated})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert verdict.verdict == "within-step" and "toward zero or stochastically" in verdict.detail
    # one element over 2.5 bf16 steps from its exact value: past any rounding
    exact = float(qwen3_192.reference[GATE][40, 50])
    step = 2.0 ** (torch.frexp(torch.tensor(exact)).exponent.item() - 8)
    moved = truncated.clone()
    moved[40, 50] = exact + 3.25 * step
    assert abs(float(moved[40, 50]) - exact) > 2.5 * step  # bf16 kept it that far
    rewrite_tensors(out, {GATE: moved})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert verdict.verdict == "wrong" and verdict.judgement.wrong == 1
    assert verdict.judgement.worst.index == (0, 40, 50)


def test_e8m0_exponents_read_as_integers_are_named(qwen3_192, tmp_path):
    """A source whose block scales are stored float8_e8m0fnu; the copy multiplies by the raw byte."""
    src = tmp_path / "ue8m0"
    fp8conv.convert(qwen3_192.path, src, ConvertOptions(to="block", scale_fmt="ue8m0", scale_dtype="e8m0"))
    tensors = load_dir(src)
    scale = tensors[GATE.removesuffix(".weight") + ".weight_scale_inv"]
    assert scale.dtype == torch.float8_e8m0fnu
    out = tmp_path / "misread"
    fp8conv.convert(src, out, ConvertOptions(to="bf16"))
    shutil.rmtree(out / ".fp8conv")
    misread = dequant_block_reference(tensors[GATE], scale.view(torch.uint8).float(), (128, 128), torch.bfloat16)
    rewrite_tensors(out, {GATE: misread})
    verdict = _by_name(audit(src, out))[GATE]
    assert verdict.verdict == "wrong"
    assert verdict.cause == "E8M0 scales read as integers (the byte b used as the scale instead of 2^(b-127))"


def test_missing_extra_and_transposed_tensors(qwen3_192, bf16_output, tmp_path):
    out = copy_checkpoint(bf16_output, tmp_path / "broken")
    up = "model.layers.0.mlp.up_proj.weight"
    rewrite_tensors(
        out, {up: None, "model.layers.0.mlp.gate_proj.weight": qwen3_192.reference[GATE].T.to(torch.bfloat16)}
    )
    from safetensors.torch import save_file

    save_file({"model.extra.weight": torch.zeros(2, 2)}, str(out / "extra.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "extra.safetensors"
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    result = audit(qwen3_192.path, out)
    assert result.missing == [up] and result.extra == ["model.extra.weight"]
    verdict = _by_name(result)[GATE]
    assert verdict.verdict == "shape" and "(stored transposed?)" in verdict.detail
    assert _wrong(result) == {GATE} and not result.ok
    code, text = _cli("verify", qwen3_192.path, out)
    assert code == 1 and f"missing     {up}" in text and "extra       model.extra.weight" in text, text


def test_config_and_companion_findings(qwen3_192, bf16_output, tmp_path):
    """A stale weight_block_size, a scale left beside a bf16 weight, and FP8 codes under a config that
    declares no quantization: each is a finding, and the values still judged."""
    stale = copy_checkpoint(bf16_output, tmp_path / "stale")
    config = json.loads((stale / "config.json").read_text())
    config["quantization_config"] = qwen3_192.config["quantization_config"]
    (stale / "config.json").write_text(json.dumps(config))
    result = audit(qwen3_192.path, stale)
    assert result.ok is False and result.tensors and all(t.ok for t in result.tensors)
    assert len(result.findings) == 1 and "weight_block_size [128, 128]" in result.findings[0]

    behind = copy_checkpoint(bf16_output, tmp_path / "behind")
    scale_name = GATE.removesuffix(".weight") + ".weight_scale_inv"
    from safetensors.torch import save_file

    save_file({scale_name: torch.ones(2, 2)}, str(behind / "scales.safetensors"))
    index = json.loads((behind / "model.safetensors.index.json").read_text())
    index["weight_map"][scale_name] = "scales.safetensors"
    (behind / "model.safetensors.index.json").write_text(json.dumps(index))
    result = audit(qwen3_192.path, behind)
    assert result.findings == [f"{scale_name}: a scale left behind beside a BF16 weight: no quantized weight uses it"]
    assert not result.extra and all(t.ok for t in result.tensors)

    codes = copy_checkpoint(bf16_output, tmp_path / "codes")
    rewrite_tensors(codes, {GATE: load_dir(qwen3_192.path)[GATE]})
    result = audit(qwen3_192.path, codes)
    assert _by_name(result)[GATE].verdict == "unreadable"
    assert any("declares no quantization_config, yet weights are float8_e4m3fn" in f for f in result.findings)


def test_a_config_width_the_tensors_disagree_with(qwen3_192, bf16_output, tmp_path):
    out = copy_checkpoint(bf16_output, tmp_path / "widths")
    config = json.loads((out / "config.json").read_text())
    config["intermediate_size"] = 256
    (out / "config.json").write_text(json.dumps(config))
    result = audit(qwen3_192.path, out)
    assert all(t.ok for t in result.tensors) and not result.ok
    # one line per MLP tensor of that width, each naming the key
    assert len(result.findings) == 3, result.findings
    for finding, proj in zip(sorted(result.findings), ("down_proj", "gate_proj", "up_proj"), strict=True):
        assert proj in finding and "intermediate_size says 256" in finding, finding


def test_faults_in_an_fp8_output(qwen3_192, tmp_path):
    """In a block-FP8 output: one code with a flipped bit is named; a weight whose scale was dropped is
    unreadable (engines read its codes as values)."""
    out = tmp_path / "block"
    fp8conv.convert(qwen3_192.path, out, ConvertOptions(to="block"))
    shutil.rmtree(out / ".fp8conv")
    original = load_dir(out)[GATE]
    codes = original.clone()
    codes.view(torch.uint8)[3, 4] ^= 1 << 2
    rewrite_tensors(out, {GATE: codes})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert verdict.verdict == "wrong" and verdict.cause is not None
    assert verdict.cause.endswith("(a flipped bit): [3, 4] bit 2"), verdict.cause
    # two e4m3 steps off in one element (a positive code in the middle of its binade): past any rounding
    codes = original.clone()
    raw = codes.view(torch.uint8)
    row, col = next(
        (r, c)
        for r, c in ((r, c) for r in range(8) for c in range(64))
        if 0x10 < raw[r, c] < 0x70 and raw[r, c] & 7 < 4
    )
    raw[row, col] += 2
    rewrite_tensors(out, {GATE: codes})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert (
        verdict.verdict == "wrong" and verdict.judgement.wrong == 1 and verdict.judgement.worst.index == (0, row, col)
    )
    rewrite_tensors(out, {GATE.removesuffix(".weight") + ".weight_scale_inv": None})
    result = audit(qwen3_192.path, out)
    assert _by_name(result)[GATE].verdict == "unreadable" and not result.ok


def test_faults_in_an_int8_output(qwen3_192, tmp_path):
    """An INT8 W8A8 output (compressed-tensors int-quantized, as --to int8 and llm-compressor write it), read
    as q * scale: truncation toward zero is within one step, a code two steps off and a dropped scale are
    wrong, a zero point (asymmetric INT8) is unreadable."""
    out = tmp_path / "int8"
    fp8conv.convert(qwen3_192.path, out, ConvertOptions(to="int8"))
    shutil.rmtree(out / ".fp8conv")
    result = audit(qwen3_192.path, out)
    assert result.ok and result.claimed == "int8"
    assert {t.verdict for t in result.tensors if t.name in LINEARS} == {"rounded"}
    got = load_dir(out)
    scale_name = GATE.removesuffix(".weight") + ".weight_scale"
    scale = got[scale_name]
    exact = dequant_block_reference(*_codes_and_scale(qwen3_192, GATE), (128, 128), torch.float32)
    rewrite_tensors(out, {GATE: torch.trunc(exact / scale).to(torch.int8)})
    assert _by_name(audit(qwen3_192.path, out))[GATE].verdict == "within-step"
    codes = got[GATE].clone()
    codes[5, 6] = codes[5, 6] + (2 if codes[5, 6] < 100 else -2)
    rewrite_tensors(out, {GATE: codes})
    verdict = _by_name(audit(qwen3_192.path, out))[GATE]
    assert verdict.verdict == "wrong" and verdict.judgement.wrong == 1 and verdict.judgement.worst.index == (0, 5, 6)
    rewrite_tensors(out, {GATE: got[GATE], scale_name: torch.ones_like(scale)})
    assert _by_name(audit(qwen3_192.path, out))[GATE].verdict == "wrong"
    rewrite_tensors(out, {scale_name: scale})
    _add_beside(
        out, GATE, GATE.removesuffix(".weight") + ".weight_zero_point", torch.zeros(scale.shape, dtype=torch.int8)
    )
    result = audit(qwen3_192.path, out)
    assert _by_name(result)[GATE].verdict == "unreadable" and not result.ok


def _add_beside(folder: Path, neighbour: str, name: str, tensor: torch.Tensor) -> None:
    """A new tensor in the shard holding `neighbour`, and in the index."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = folder / index["weight_map"][neighbour]
    save_file({**load_file(shard), name: tensor}, str(shard), metadata={"format": "pt"})
    index["weight_map"][name] = shard.name
    index_path.write_text(json.dumps(index))


# -- renames engines and transformers apply -----------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> FamilyFixture:
    pytest.importorskip("transformers")
    return build_family("qwen3-moe", tmp_path_factory.mktemp("audit") / "moe")


def _fused_multimodal_copy(src_bf16: Path, out: Path) -> dict[str, torch.Tensor]:
    """transformers 5's fused 3-D experts under a multimodal `model.language_model.` prefix."""
    import re

    tensors = load_dir(src_bf16)
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        one = re.match(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if one:
            experts.setdefault(one[1], {}).setdefault(int(one[2]), {})[one[3]] = t
        else:
            renamed[name.replace("model.", "model.language_model.", 1)] = t
    for prefix, by_expert in experts.items():
        prefix = prefix.replace("model.", "model.language_model.", 1)
        ordered = [by_expert[e] for e in sorted(by_expert)]
        renamed[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in ordered])
        renamed[f"{prefix}.down_proj"] = torch.stack([p["down_proj"] for p in ordered])
    from safetensors.torch import save_file

    out.mkdir()
    save_file(renamed, str(out / "model.safetensors"))
    shutil.copy(src_bf16 / "config.json", out / "config.json")
    return renamed


def test_fused_experts_under_a_language_model_prefix(qwen3_moe, tmp_path):
    bf16 = tmp_path / "bf16"
    fp8conv.convert(qwen3_moe.path, bf16, ConvertOptions(to="bf16"))
    out = tmp_path / "fused"
    tensors = _fused_multimodal_copy(bf16, out)
    result = audit(qwen3_moe.path, out)
    assert result.ok, [t.line() for t in result.tensors if not t.ok] + result.missing + result.extra
    fused = "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert _by_name(result)[fused].made_from == "fused from 4 experts' gate_proj and up_proj"
    # expert 1's up rows scaled: only that tensor, only matrix 1's second half of rows
    broken = tensors[fused].clone()
    half = broken.shape[1] // 2
    broken[1, half:] = (broken[1, half:].float() * 1.5).to(torch.bfloat16)
    from safetensors.torch import save_file

    save_file(tensors | {fused: broken}, str(out / "model.safetensors"))
    result = audit(qwen3_moe.path, out)
    assert _wrong(result) == {fused}
    ranges = _by_name(result)[fused].judgement.wrong_ranges
    assert ranges[0][0] == 1 and ranges[0][1] >= half and ranges[-1][2] <= broken.shape[1]


@pytest.mark.parametrize("source_names", ["native", "hf"])
def test_mistral_native_names_against_hf_names(tmp_path, source_names):
    """A Mistral-native source (consolidated.safetensors, `layers.N.attention.wq`) audited against an HF
    named output, and the other way round; a wrong wq is named under the output's own name."""
    pytest.importorskip("transformers")
    fixture, native = build_mistral_native(tmp_path / "src")
    src, made_from = (native, fixture.path) if source_names == "native" else (fixture.path, native)
    out = tmp_path / "out"
    fp8conv.convert(made_from, out, ConvertOptions(to="bf16"))
    shutil.rmtree(out / ".fp8conv")
    result = audit(src, out)
    assert result.ok and len(result.tensors) == 12, [t.line() for t in result.tensors] + result.missing + result.extra
    assert any(t.made_from.startswith("renamed from") for t in result.tensors)
    q = "layers.0.attention.wq.weight" if source_names == "hf" else "model.layers.0.self_attn.q_proj.weight"
    assert q in {t.name for t in result.tensors}
    tensors = load_dir(out)
    rewrite_tensors(out, {q: (tensors[q].float() * 2).to(torch.bfloat16)})
    assert _wrong(audit(src, out)) == {q}


def test_packed_4bit_sources_gpt_oss_transposed_and_deepseek_v4(tmp_path):
    """MXFP4 sources decoded one expert at a time: gpt-oss's fused experts in transformers' transposed
    [E, K, N] and DeepSeek-V4's per-expert MXFP4 with E8M0 block-FP8 attention. fp8conv's outputs pass;
    an expert scaled in the copy is named, in that expert alone; E8M0 exponents read as integers in an
    attention weight are named."""
    pytest.importorskip("transformers")
    gpt_oss = build_family("gpt-oss", tmp_path / "gpt-oss")
    out = tmp_path / "gpt-oss-bf16"
    fp8conv.convert(gpt_oss.path, out, ConvertOptions(to="bf16"))
    shutil.rmtree(out / ".fp8conv")
    assert audit(gpt_oss.path, out).ok
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = load_dir(out)
    assert tensors[fused].shape[1] < tensors[fused].shape[2]  # [E, hidden, 2I]: transposed
    broken = tensors[fused].clone()
    broken[2] = (broken[2].float() * 1.5).to(torch.bfloat16)
    rewrite_tensors(out, {fused: broken})
    verdict = _by_name(audit(gpt_oss.path, out))[fused]
    assert verdict.verdict == "wrong" and {m for m, _, _ in verdict.judgement.wrong_ranges} == {2}

    tensors_v4, truth = build_v4(tmp_path / "v4")
    for to in ("bf16", "block"):
        made = tmp_path / f"v4-{to}"
        fp8conv.convert(tmp_path / "v4", made, ConvertOptions(to=to))
        shutil.rmtree(made / ".fp8conv")
        result = audit(tmp_path / "v4", made)
        assert result.ok and len(result.tensors) == len(tensors_v4) - len(truth), [t.line() for t in result.tensors]
    made = tmp_path / "v4-bf16"
    name = next(n for n in truth if ".attn." in n)
    scale = tensors_v4[name.removesuffix(".weight") + ".scale"].view(torch.uint8).float()
    misread = dequant_block_reference(tensors_v4[name], scale, (128, 128), torch.bfloat16)
    rewrite_tensors(made, {name: misread})
    verdict = _by_name(audit(tmp_path / "v4", made))[name]
    assert verdict.cause is not None and verdict.cause.startswith("E8M0 scales read as integers"), verdict.line()


@pytest.mark.parametrize(
    ("layout", "to"),
    [
        ("mimo_flash", "channel"),
        ("mimo_fused_qkv", "bf16"),
        ("mimo_fused_qkv", "block"),
        ("mistral4", "block"),
        ("mistral_native", "block"),
    ],
)
def test_2026_layouts_pass_as_engines_read_them(tmp_path, layout, to):
    """Pre-sharded fused qkv (plain order once unquantized, chunked grids kept in FP8), per-head K/V
    scales, fused experts, and a Mistral-native output whose params.json holds the quantization."""
    getattr(layouts_2026, f"build_{layout}")(tmp_path / "src")
    out = tmp_path / "out"
    fp8conv.convert(tmp_path / "src", out, ConvertOptions(to=to))
    shutil.rmtree(out / ".fp8conv")
    result = audit(tmp_path / "src", out)
    assert result.ok, [t.line() for t in result.tensors if not t.ok] + result.findings


def test_a_tensor_decoded_whole_is_released_once_judged(tmp_path, monkeypatch):
    """Layouts decoded whole (MiMo's chunked qkv) or one expert at a time (gpt-oss) are held while their
    tensor is judged, then dropped: the audit's memory does not grow with the tensors it has judged."""
    from fp8conv.check.audit import values as values_module

    kept: list[weakref.ref] = []
    for name in ("whole_values", "packed_values"):
        made = getattr(values_module, name)

        def spy(*args, made=made):
            values = made(*args)
            read = values.read

            def reading(m, r0, r1, read=read):
                band = read(m, r0, r1)
                kept.append(weakref.ref(band.values._base))  # the decoded tensor the band is a view of
                return band

            values.read = reading
            return values

        monkeypatch.setattr(values_module, name, spy)
    layouts_2026.build_mimo_fused_qkv(tmp_path / "mimo")
    fp8conv.convert(tmp_path / "mimo", tmp_path / "mimo-bf16", ConvertOptions(to="bf16"))
    gpt_oss = build_family("gpt-oss", tmp_path / "gpt-oss")
    fp8conv.convert(gpt_oss.path, tmp_path / "gpt-oss-bf16", ConvertOptions(to="bf16"))
    held: list[int] = []

    def after_each_tensor(done: int, total: int) -> None:  # while the audit still holds every Values
        gc.collect()
        held.append(sum(ref() is not None for ref in kept))

    assert audit(tmp_path / "mimo", tmp_path / "mimo-bf16", progress=after_each_tensor).ok
    assert audit(gpt_oss.path, tmp_path / "gpt-oss-bf16", progress=after_each_tensor).ok
    assert kept and held and set(held) == {0}


def test_a_fused_qkv_dequantized_in_its_stored_chunks_is_named(tmp_path):
    """MiMo's qkv_proj stored as [q_0; k_0; v_0; q_1; ...]: dequantized without putting its rows in the
    plain order, an engine reads q rows as k and v. The audit names the rows that moved."""
    stored, plain = layouts_2026.build_mimo_fused_qkv(tmp_path / "src")
    out = tmp_path / "out"
    fp8conv.convert(tmp_path / "src", out, ConvertOptions(to="bf16"))
    shutil.rmtree(out / ".fp8conv")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert torch.equal(load_dir(out)[name], plain[name].to(torch.bfloat16))  # fp8conv's: the plain order
    rewrite_tensors(out, {name: stored[name].to(torch.bfloat16)})
    verdict = _by_name(audit(tmp_path / "src", out))[name]
    assert verdict.verdict == "wrong" and verdict.cause is not None
    assert verdict.cause.startswith("rows in another order: "), verdict.cause


# -- the command ----------------------------------------------------------------------------------------


def test_json_sample_and_the_exit_status(qwen3_192, bf16_output, tmp_path):
    code, text = _cli("verify", qwen3_192.path, bf16_output, "--json")
    doc = json.loads(text)
    assert code == 0 and doc["ok"] is True and len(doc["tensors"]) == 14
    assert {t["verdict"] for t in doc["tensors"]} == {"exact", "rounded"}
    out = copy_checkpoint(bf16_output, tmp_path / "broken")
    rewrite_tensors(out, {GATE: _scale_dropped(qwen3_192), "model.layers.0.mlp.up_proj.weight": None})
    code, text = _cli("verify", qwen3_192.path, out, "--json")
    doc = json.loads(text)
    assert code == 1 and doc["ok"] is False and doc["missing"] == ["model.layers.0.mlp.up_proj.weight"]
    gate = next(t for t in doc["tensors"] if t["name"] == GATE)
    assert gate["verdict"] == "wrong" and gate["cause"].startswith("the scale was not applied")
    assert gate["worst"]["index"][0] == 0 and gate["wrong"] > 0
    # a sample of no tensor judges no values, but the structure is still checked whole
    code, text = _cli("verify", qwen3_192.path, out, "--sample", "0.001", "--json")
    doc = json.loads(text)
    assert code == 1 and len(doc["tensors"]) < 13 and doc["missing"] == ["model.layers.0.mlp.up_proj.weight"]


def test_progress_counts_every_judged_value(qwen3_192, bf16_output):
    calls: list[tuple[int, int]] = []
    result = audit(qwen3_192.path, bf16_output, progress=lambda done, total: calls.append((done, total)))
    values = sum(t.judgement.elements for t in result.tensors if t.judgement)
    assert len(calls) == len(result.tensors) == 14
    assert calls[-1] == (values, values) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_hub_ids_through_an_offline_cache(qwen3_192, bf16_output, tmp_path):
    """SRC and OTHER as Hub repo IDs, read from huggingface_hub's cache in offline mode."""
    cache = tmp_path / "hub-cache"
    lay_out_hf_cache(qwen3_192.path, cache, "acme/qwen3-fp8")
    broken = copy_checkpoint(bf16_output, tmp_path / "broken")
    rewrite_tensors(broken, {GATE: _block_size_from_grid(qwen3_192)})
    lay_out_hf_cache(broken, cache, "someone/qwen3-bf16")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, "-m", "fp8conv", "verify", "acme/qwen3-fp8", "someone/qwen3-bf16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert f"wrong       {GATE}" in done.stdout and "block size (96, 128) inferred" in done.stdout, done.stdout
    assert "13 exact" not in done.stdout and "1 wrong" in done.stdout


def test_a_source_that_cannot_be_decoded_for_sure_is_refused(qwen3_192, bf16_output, tmp_path):
    src = copy_checkpoint(qwen3_192.path, tmp_path / "src")
    rewrite_tensors(src, {GATE.removesuffix(".weight") + ".weight_scale_inv": None})
    with pytest.raises(Fp8ConvError, match=r"the source cannot be decoded for sure: .*gate_proj"):
        audit(src, bf16_output)
    code, text = _cli("verify", src, bf16_output)
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "gate_proj" in errors[0] and "Traceback" not in text, text
