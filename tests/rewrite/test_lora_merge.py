"""--merge-lora: a PEFT LoRA adapter merged into an FP8 checkpoint, against PEFT's own merge_and_unload on the
dequantized base (the reference), in every target; the delta against its plain definition; the same bytes
on every backend; verify, resume and the refusals; the report of what the rounding kept."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from click.testing import CliRunner
from peft import LoraConfig, PeftModel, get_peft_model

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import CheckpointError, OptionsError, PlanRefused
from fp8conv.output.requant_report import summary_line
from fp8conv.rewrite.lora_merge import AdapterTensors, lora_delta
from fp8conv.source.lora_adapter import open_adapter
from tests.support.families import build_family
from tests.support.helpers import dir_snapshot, load_dir
from tests.support.peft_adapters import saved_adapter
from tests.support.reference import dequant_reference

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def merged_case(tmp_path_factory):
    """A tiny Qwen3 block-FP8 checkpoint, an adapter PEFT made on its dequantized (float32) copy, and PEFT's
    merged float32 weights: the reference every output is held to."""
    work = tmp_path_factory.mktemp("lora")
    fixture = build_family("qwen3-8b", work / "base")
    model = _float_model(fixture)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=TARGETS,
        rank_pattern={"layers.1.self_attn.q_proj": 2},  # PEFT's patterns: one module's rank and alpha differ
        alpha_pattern={"down_proj": 16},
        init_lora_weights=False,  # a trained adapter's B is not zero
    )
    reference = saved_adapter(model, config, work / "adapter", 0.05)  # the delta a few percent of the weights
    return fixture, work / "adapter", reference


def _decoded_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block FP8 (or float) output's weights as float32 values: each e4m3 weight times its 128x128 grid."""
    return {
        name: dequant_reference(tensors, name) if t.dtype == torch.float8_e4m3fn else t.float()
        for name, t in tensors.items()
        if not name.endswith("_scale_inv")
    }


def _float32_slack(adapter_dir) -> dict[str, torch.Tensor]:
    """Per merged weight, how far PEFT's float32 merge (a float32 matmul, then a float32 add) and fp8conv's
    (float64 outer products, one rounding, then the add) may differ: a few float32 roundings of the terms'
    magnitudes, (|B| @ |A|) x scaling, and of the merged value."""
    adapter = open_adapter(str(adapter_dir))
    tensors = AdapterTensors(adapter)
    try:
        out = {}
        for name, term in adapter.terms.items():
            a, b = tensors.read(term.a).double().abs(), tensors.read(term.b).double().abs()
            magnitude = (b @ a).t() if term.embedding else b @ a
            out[name] = (magnitude * term.scaling * (term.rank + 2) * 2**-23).float()
        return out
    finally:
        tensors.close()


def _float_model(fixture):
    config = transformers.AutoConfig.from_pretrained(fixture.path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in fixture.reference.items()}, strict=True)
    return model


def _merged_names(reference_names, targets=TARGETS):
    return sorted(n for n in reference_names if any(f".{t}.weight" in n for t in targets))


def test_the_adapter_is_read_as_peft_reads_it(merged_case):
    _, adapter_dir, _ = merged_case
    adapter = open_adapter(str(adapter_dir))
    q1 = adapter.terms["model.layers.1.self_attn.q_proj.weight"]
    down = adapter.terms["model.layers.0.mlp.down_proj.weight"]
    v0 = adapter.terms["model.layers.0.self_attn.v_proj.weight"]
    assert (q1.rank, q1.scaling) == (2, 4.0)  # rank_pattern: 8 / 2
    assert (down.rank, down.scaling) == (4, 4.0)  # alpha_pattern: 16 / 4
    assert (v0.rank, v0.scaling) == (4, 2.0)
    assert len(adapter.terms) == 6 and not adapter.replacements


def test_the_delta_is_its_plain_definition_bit_for_bit(merged_case):
    """Sum over the rank of float64 outer products, in order, times the scaling, one rounding to float32;
    and within float32's rounding of PEFT's own matmul."""
    _, adapter_dir, _ = merged_case
    adapter = open_adapter(str(adapter_dir))
    tensors = AdapterTensors(adapter)
    try:
        for name, term in adapter.terms.items():
            a, b = tensors.read(term.a).double(), tensors.read(term.b).double()
            plain = torch.zeros(b.shape[0], a.shape[1], dtype=torch.float64)
            for i in range(term.rank):
                plain += torch.outer(b[:, i], a[i])
            got = lora_delta(term, tensors)
            assert torch.equal(got, (plain * term.scaling).float()), name
            peft_delta = (b.float() @ a.float()) * term.scaling
            assert torch.allclose(got, peft_delta, rtol=1e-5, atol=1e-7), name
    finally:
        tensors.close()


def test_bf16_output_is_one_rounding_of_the_peft_merge(merged_case, tmp_path):
    fixture, adapter_dir, reference = merged_case
    result = fp8conv.convert(fixture.path, tmp_path / "m", ConvertOptions(to="bf16", merge_lora=str(adapter_dir)))
    plain = fp8conv.convert(fixture.path, tmp_path / "p", ConvertOptions(to="bf16"))
    got, unmerged = load_dir(result.output), load_dir(plain.output)
    merged = _merged_names(reference)
    assert len(merged) == 6 and sorted(result.requantization["tensors"]) == merged
    slack = _float32_slack(adapter_dir)
    for name in merged:
        ref = reference[name]
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-126))) - 7)  # bf16's step at ref
        assert bool(((got[name].float() - ref).abs() <= ulp / 2 + slack[name]).all()), name
        assert not torch.equal(got[name], unmerged[name]), name  # the fine-tune is there
    for name in set(got) - set(merged):  # everything else as the plain conversion writes it
        assert torch.equal(got[name].view(torch.uint8), unmerged[name].view(torch.uint8)), name


@pytest.mark.parametrize(
    "options",
    [
        ConvertOptions(to="channel"),
        ConvertOptions(to="block"),
        ConvertOptions(to="int8"),
        ConvertOptions(to="block", scale_fmt="ue8m0"),  # (--to mxfp8: this model's widths are not 32s)
    ],
    ids=["channel", "block", "int8", "ue8m0"],
)
def test_quantized_outputs_are_within_one_step_of_the_peft_merge(merged_case, tmp_path, options):
    """Each merged weight, decoded as engines read it, within half a step (e4m3: 2^-4 of the value, or the
    smallest subnormal step; INT8: half the row's scale) of PEFT's merged float32 weight, with fresh scales."""
    fixture, adapter_dir, reference = merged_case
    options = ConvertOptions(**{**options.__dict__, "merge_lora": str(adapter_dir)})
    result = fp8conv.convert(fixture.path, tmp_path / "m", options)
    got, slack = load_dir(result.output), _float32_slack(adapter_dir)
    for name in _merged_names(reference):
        ref, q = reference[name], got[name]
        scale = _expanded_scale(got, name, q.shape, options)
        value = q.float() * scale
        # INT8: half the row's step; e4m3: 3 mantissa bits, and half the subnormal step 2^-9
        bound = scale * 0.5 if q.dtype == torch.int8 else ref.abs() * 2**-4 + scale * 2**-10
        assert bool(((value - ref).abs() <= bound + slack[name]).all()), name
    summary = result.requantization["summary"]
    assert summary["merged"] == 6 and summary["mean_survived"] > 0.9 and not summary["rounded_away"]
    line = summary_line(result.requantization, options.to)  # the target's own line, where it reports
    if options.scale_fmt:  # every weight requantized: the merged ones count their flushed values too
        assert isinstance(summary["flushed"], int) and line is not None and "None" not in line
    elif options.to == "int8":
        assert summary["flushed"] is None and line is not None and "INT8 rows" in line
    else:
        assert line is None  # only the merged weights reported: merge_line says it


def _expanded_scale(got, name, shape, options):
    base = name.removesuffix(".weight")
    n, k = shape
    if options.to in ("channel", "int8"):
        return got[base + ".weight_scale"].float().expand(n, k)
    if options.to == "mxfp8":
        exps = got[name + "_scale"].view(torch.uint8).to(torch.int32) - 127
        return torch.exp2(exps.float()).repeat_interleave(32, 1)[:, :k]
    grid = got[name + "_scale_inv"].float()
    return grid.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def test_every_backend_writes_the_same_bytes_and_verify_recomputes_them(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    options = ConvertOptions(to="block", merge_lora=str(adapter_dir))
    fp8conv.convert(fixture.path, tmp_path / "cpu", options)
    fp8conv.convert(fixture.path, tmp_path / "ref", options, run=RunOptions(device="reference"))
    shards = {k: v for k, v in dir_snapshot(tmp_path / "cpu").items() if k.endswith(".safetensors")}
    assert shards and shards == {k: v for k, v in dir_snapshot(tmp_path / "ref").items() if k in shards}
    assert fp8conv.verify(fixture.path, tmp_path / "cpu").ok  # the manifest names the adapter and its hash
    # a merged weight's byte changed: verify says which
    name = "model.layers.0.self_attn.q_proj.weight"
    out = tmp_path / "cpu"
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    _flip_one_byte(out / shard, name)
    result = fp8conv.verify(fixture.path, out)
    assert not result.ok and any(name in f and "merged weight" in f for f in result.failures)


def _flip_one_byte(path, name):
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    start = json.loads(raw[8 : 8 + header_len])[name]["data_offsets"][0] + 8 + header_len
    raw[start] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_block_release_keeps_its_untouched_weights_byte_for_byte(merged_case, tmp_path):
    """--to block from block FP8: the weights the adapter does not touch keep their bytes and scales; the
    merged ones are quantized afresh in the same 128x128 blocks (one scheme across q/k/v)."""
    fixture, adapter_dir, _ = merged_case
    src = load_dir(fixture.path)
    got = load_dir(
        fp8conv.convert(fixture.path, tmp_path / "m", ConvertOptions(to="block", merge_lora=str(adapter_dir))).output
    )
    k0 = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(got[k0].view(torch.uint8), src[k0].view(torch.uint8))
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(got[q0].view(torch.uint8), src[q0].view(torch.uint8))
    assert got[q0 + "_scale_inv"].shape == src[q0 + "_scale_inv"].shape and got[q0].dtype == src[q0].dtype


def test_a_delta_under_the_fp8_step_is_reported_rounded_away(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    tiny = tmp_path / "tiny-adapter"
    shutil.copytree(adapter_dir, tiny)
    _scale_b(tiny, 1e-4)  # a fine-tune far under e4m3's step (2^-4 of each value)
    block = fp8conv.convert(fixture.path, tmp_path / "b", ConvertOptions(to="block", merge_lora=str(tiny)))
    bf16 = fp8conv.convert(fixture.path, tmp_path / "h", ConvertOptions(to="bf16", merge_lora=str(tiny)))
    away = block.requantization["summary"]["rounded_away"]
    assert len(away) == 6 and any("mostly rounded away in 6 weight(s)" in w for w in block.warnings)
    survived = [block.requantization["tensors"][n]["survived"] for n in away]
    assert all(s < 0.5 for s in survived)
    kept = bf16.requantization["summary"]["mean_survived"]
    assert kept > max(survived)  # bf16's finer step keeps more of it


def _scale_b(adapter_dir, factor):
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({k: (v * factor if "lora_B" in k else v) for k, v in tensors.items()}, path)


def test_a_resume_or_verify_with_another_adapter_is_refused(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    mine = tmp_path / "mine"
    shutil.copytree(adapter_dir, mine)
    other = tmp_path / "other"
    shutil.copytree(adapter_dir, other)
    _scale_b(other, 2.0)
    out = tmp_path / "m"
    fp8conv.convert(fixture.path, out, ConvertOptions(to="channel", merge_lora=str(mine)))
    (out / "config.json").unlink()  # as if interrupted before the end
    with pytest.raises(OptionsError, match=r"cannot resume.*merge_lora"):
        fp8conv.convert(
            fixture.path, out, ConvertOptions(to="channel", merge_lora=str(other)), run=RunOptions(resume=True)
        )
    resumed = fp8conv.convert(
        fixture.path, out, ConvertOptions(to="channel", merge_lora=str(mine)), run=RunOptions(resume=True)
    )
    assert resumed.requantization["summary"]["merged"] == 6 and resumed.shards_kept
    assert fp8conv.verify(fixture.path, out).ok
    _scale_b(mine, 3.0)  # the same folder, other contents: the manifest's hash tells them apart
    with pytest.raises(OptionsError, match="is not the adapter this run must merge"):
        fp8conv.verify(fixture.path, out)
    pinned = ["convert", str(fixture.path), "--to", "bf16", "--merge-lora", str(other), "-o", str(tmp_path / "pin")]
    run = CliRunner().invoke(main, [*pinned, "--merge-lora-sha256", "0" * 64])
    assert run.exit_code == 1 and "is not the adapter this run must merge" in run.output
    assert not (tmp_path / "pin").exists()


def test_the_cli_prints_what_the_merge_kept(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    run = CliRunner().invoke(
        main,
        ["convert", str(fixture.path), "--to", "block", "--merge-lora", str(adapter_dir), "-o", str(tmp_path / "o")],
    )
    assert run.exit_code == 0, run.output
    line = next(x for x in run.output.splitlines() if x.startswith("merged a LoRA adapter into 6 weight(s)"))
    assert "of its delta" in line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "asks for DoRA"),
        ({"peft_type": "LOHA"}, "is a LOHA adapter; fp8conv merges LoRA adapters only"),
        ({"target_parameters": ["mlp.gate.weight"]}, "targets parameter mlp.gate.weight; fp8conv merges LoRA on fused"),
        ({"r": 8}, "not the rank 8 the config gives"),
    ],
)
def test_adapters_fp8conv_does_not_merge_are_refused_by_name(merged_case, tmp_path, change, message):
    fixture, adapter_dir, _ = merged_case
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change, "rank_pattern": {}}))
    with pytest.raises(CheckpointError, match=message):
        fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to="block", merge_lora=str(bad)))
    assert not (tmp_path / "o").exists()


def test_an_adapter_for_another_model_is_refused_before_anything_is_written(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    from safetensors.torch import load_file, save_file

    tensors = load_file(bad / "adapter_model.safetensors")
    renamed = {k.replace("layers.1.self_attn.v_proj", "layers.7.self_attn.v_proj"): v for k, v in tensors.items()}
    renamed["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"] = torch.zeros(5, 4)  # wrong width
    save_file(renamed, bad / "adapter_model.safetensors")
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to="channel", merge_lora=str(bad)))
    lines = [p.one_line() for p in refused.value.problems]
    assert any(
        "targets model.layers.7.self_attn.v_proj.weight, which the base checkpoint does not have" in x for x in lines
    )
    assert any("B @ A is [5, " in x and "model.layers.0.mlp.down_proj.weight is [" in x for x in lines)
    assert not (tmp_path / "o").exists()


def test_transformers_loads_the_merged_outputs_and_computes_the_peft_model(merged_case, tmp_path):
    """The merged outputs' weights, decoded plainly, compute PEFT's merged model to their rounding (bf16's;
    e4m3's, 2^-4 of each weight); transformers loads each output as those weights (bf16: exactly; block FP8:
    its FP8 layer also quantizes the activations per token group, ~12% of the logits' range on this tiny
    random model, measured the same without a merge)."""
    fixture, adapter_dir, reference = merged_case
    peft_model = _float_model(fixture)
    peft_model.load_state_dict(reference)
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 8, 4]])
    with torch.no_grad():
        want = peft_model(ids).logits
    for to, weights_tolerance, load_tolerance in (("bf16", 0.01, 0.0), ("block", 0.05, 0.2)):
        out = fp8conv.convert(fixture.path, tmp_path / to, ConvertOptions(to=to, merge_lora=str(adapter_dir))).output
        model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        decoded = _float_model(fixture)
        decoded.load_state_dict(_decoded_weights(load_dir(out)))
        with torch.no_grad():
            got, plain = model(ids).logits.float(), decoded(ids).logits
        assert torch.isfinite(got).all()
        assert (plain - want).abs().max() <= weights_tolerance * want.abs().max(), to
        assert (got - plain).abs().max() <= load_tolerance * plain.abs().max(), to


@pytest.mark.parametrize("to", ["bf16", "block"])
def test_embedding_lora_and_modules_to_save_are_merged_as_peft_merges_them(merged_case, tmp_path, to):
    """An Embedding's LoRA (its delta (B @ A) transposed) and a whole module saved beside the adapter
    (modules_to_save: lm_head) into a release that keeps both bf16: written bf16, one rounding of PEFT's."""
    fixture, _, _ = merged_case
    model = _float_model(fixture)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["embed_tokens", "q_proj"],
        modules_to_save=["lm_head"],
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.01)  # the trained copy differs from the base's
            elif "lora_embedding_B" in name:
                p.mul_(0.01)
    peft_model.save_pretrained(tmp_path / "adapter")
    reference = peft_model.merge_and_unload().state_dict()
    adapter = open_adapter(str(tmp_path / "adapter"))
    assert adapter.terms["model.embed_tokens.weight"].embedding and "lm_head.weight" in adapter.replacements
    result = fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to=to, merge_lora=str(tmp_path / "adapter")))
    got, slack = load_dir(result.output), _float32_slack(tmp_path / "adapter")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        ref = reference[name]
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-126))) - 7)
        assert got[name].dtype == torch.bfloat16, name
        bound = ulp / 2 + slack.get(name, ref.abs() * 2**-23)  # lm_head: the saved tensor itself, rounded once
        assert bool(((got[name].float() - ref).abs() <= bound).all()), name
        assert result.requantization["tensors"][name]["survived"] > 0.5, name


def test_parts_and_stream_write_the_whole_runs_bytes(merged_case, tmp_path):
    """--part 1/2 and 2/2, and --stream from a source that delivers shards one by one, with the same adapter:
    the bytes of one whole run (the manifests name the adapter's hash each time)."""
    from tests.support.local_shards import LocalShardSource

    fixture, adapter_dir, _ = merged_case
    options = ConvertOptions(to="block", merge_lora=str(adapter_dir))
    fp8conv.convert(fixture.path, tmp_path / "whole", options)
    for part in ((1, 2), (2, 2)):
        fp8conv.convert(fixture.path, tmp_path / "parts", options, run=RunOptions(part=part))
    source = LocalShardSource(fixture.path, tmp_path / "staging")
    fp8conv.convert(fixture.path, tmp_path / "stream", options, run=RunOptions(stream=source, evict_input=True))
    whole = {k: v for k, v in dir_snapshot(tmp_path / "whole").items() if not k.startswith(".fp8conv/")}
    for other in ("parts", "stream"):
        got = dir_snapshot(tmp_path / other)
        assert {k: v for k, v in got.items() if k in whole and k != "README.md"} == {
            k: v for k, v in whole.items() if k != "README.md"
        }, other
        assert fp8conv.verify(fixture.path, tmp_path / other).ok, other


def test_pad_for_tp_pads_the_merged_weight(merged_case, tmp_path):
    """--pad-for-tp: the merged down_proj's values (the delta added before the padding) in its leading
    columns, zeros after, verify recomputing it."""
    fixture, adapter_dir, _ = merged_case
    merged = fp8conv.convert(fixture.path, tmp_path / "m", ConvertOptions(to="block", merge_lora=str(adapter_dir)))
    padded = fp8conv.convert(
        fixture.path, tmp_path / "p", ConvertOptions(to="block", pad_for_tp=4, merge_lora=str(adapter_dir))
    )
    name = "model.layers.0.mlp.down_proj.weight"
    a, b = load_dir(merged.output), load_dir(padded.output)
    k = a[name].shape[1]
    assert b[name].shape[1] > k and torch.equal(b[name][:, :k].view(torch.uint8), a[name].view(torch.uint8))
    assert not bool(b[name][:, k:].float().any())
    assert fp8conv.verify(fixture.path, padded.output).ok


def test_an_adapter_from_the_hub_cache(merged_case, tmp_path, monkeypatch):
    """A Hub ID, through huggingface_hub's own cache in offline mode (the tests reach no network)."""
    from huggingface_hub import constants

    from tests.support.hf_cache import lay_out_hf_cache

    fixture, adapter_dir, _ = merged_case
    cache = tmp_path / "hub-cache"
    lay_out_hf_cache(adapter_dir, cache, "acme/tiny-lora")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    hub = fp8conv.convert(fixture.path, tmp_path / "hub", ConvertOptions(to="channel", merge_lora="acme/tiny-lora"))
    local = fp8conv.convert(fixture.path, tmp_path / "local", ConvertOptions(to="channel", merge_lora=str(adapter_dir)))
    assert hub.requantization == local.requantization
    shards = [k for k in dir_snapshot(hub.output) if k.endswith(".safetensors")]
    assert shards and all(dir_snapshot(hub.output)[k] == dir_snapshot(local.output)[k] for k in shards)
    with pytest.raises(CheckpointError, match="acme/other-lora cannot be fetched"):
        fp8conv.convert(fixture.path, tmp_path / "x", ConvertOptions(to="channel", merge_lora="acme/other-lora"))


# ---- LoRA on fused experts parameters (target_parameters) ----


def test_the_fused_experts_layout_is_transformers_own_for_every_model_type_merged():
    """FUSED_LORA_MODEL_TYPES: transformers' experts class for each registers gate_up_proj then down_proj
    (PEFT nests their ParamWrappers in that order), holds gate_up_proj as [E, 2I, H] concatenated gate then
    up and down_proj as [E, H, I], not transposed: the layout for_base splits per expert."""
    from fp8conv.plan.lora_merge import FUSED_LORA_MODEL_TYPES
    from tests.support.families import SPECS

    specs = {spec.model_type: spec for spec in SPECS.values()}
    for model_type in FUSED_LORA_MODEL_TYPES:
        config = transformers.AutoConfig.for_model(model_type, **specs[model_type].hf)
        model = transformers.AutoModelForCausalLM.from_config(config)
        experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
        assert list(experts._parameters)[:2] == ["gate_up_proj", "down_proj"], model_type
        assert experts.has_gate and experts.is_concatenated and not experts.is_transposed, model_type
        e, two_i, h = experts.gate_up_proj.shape
        assert tuple(experts.down_proj.shape) == (e, h, two_i // 2), model_type


@pytest.fixture(scope="module")
def moe_case(tmp_path_factory):
    """A tiny Qwen3-MoE block FP8 release twice: one Linear per expert (as the FP8 releases ship them) and its
    experts fused 3-D (as transformers 5 holds them, block FP8 per expert); an adapter PEFT made with
    target_parameters on both experts parameters (and q_proj) on the dequantized copy; PEFT's merged
    weights (transformers' fused names)."""
    from safetensors.torch import save_file

    from tests.support.families import quantize_3d

    work = tmp_path_factory.mktemp("lora-moe")
    split = build_family("qwen3-moe", work / "split")
    (work / "float").mkdir()  # the dequantized copy, as transformers loads it (per-expert names folded)
    save_file(
        {k: v.float().contiguous() for k, v in split.reference.items()}, str(work / "float" / "model.safetensors")
    )
    config = {k: v for k, v in split.config.items() if k != "quantization_config"}
    (work / "float" / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32)
    fused, fused_values = _fused_release(split, model.state_dict(), work / "fused", quantize_3d)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,
    )
    reference = saved_adapter(model, lora, work / "adapter", 0.05)
    # the fused release's experts are another rounding of the same values: PEFT merges into those too
    fused_model = transformers.AutoModelForCausalLM.from_pretrained(work / "float", dtype=torch.float32)
    fused_model.load_state_dict(fused_values, strict=False)
    fused_reference = PeftModel.from_pretrained(fused_model, work / "adapter").merge_and_unload().state_dict()
    return fused, split, work / "adapter", {"split": reference, "fused": fused_reference}


def _fused_release(split, fused_float: dict[str, torch.Tensor], folder, quantize_3d):
    """The per-expert release with its experts as transformers' fused parameters, block FP8 per expert
    (`experts.gate_up_proj` [E, 2I, H] with `gate_up_proj_scale_inv` [E, gn, gk]; down_proj likewise)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    src = load_dir(split.path)
    tensors = {k: v for k, v in src.items() if ".mlp.experts." not in k}
    values = {}
    for name, value in fused_float.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, scale, values[name] = quantize_3d(value, torch.float32)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(split.path / "config.json", folder / "config.json")
    return SimpleNamespace(path=folder), {k: v.float() for k, v in values.items()}


def _experts_slack(adapter_dir) -> dict[str, torch.Tensor]:
    """_float32_slack for the fused parameters' terms: [E, N, K], expert by expert."""
    adapter = open_adapter(str(adapter_dir))
    tensors = AdapterTensors(adapter)
    try:
        out = {}
        for name, term in adapter.terms.items():
            if term.experts:
                a = tensors.read(term.a).double().abs().reshape(term.experts, term.rank, -1)
                b = tensors.read(term.b).double().abs().reshape(-1, term.rank, term.experts)
                magnitude = torch.stack([b[:, :, e] @ a[e] for e in range(term.experts)])
                out[name] = (magnitude * term.scaling * (term.rank + 2) * 2**-23).float()
        return out
    finally:
        tensors.close()


def test_peft_reads_the_parameter_lora_as_fp8conv_does(moe_case):
    _, _, adapter_dir, _ = moe_case
    adapter = open_adapter(str(adapter_dir))
    gate_up = adapter.terms["model.layers.0.mlp.experts.gate_up_proj"]
    down = adapter.terms["model.layers.0.mlp.experts.down_proj"]
    assert gate_up.a.endswith("experts.base_layer.lora_A.weight") and down.a.endswith("experts.lora_A.weight")
    assert (gate_up.experts, gate_up.rank, gate_up.scaling) == (4, 4, 2.0)


@pytest.mark.parametrize("layout", ["fused", "split"])
@pytest.mark.parametrize("to", ["bf16", "block"])
def test_parameter_lora_merges_into_fused_and_per_expert_experts(moe_case, tmp_path, layout, to):
    """Into fused 3-D experts (the parameter itself) and into one Linear per expert (gate rows, up rows,
    down): each expert's weights one rounding (bf16) or one e4m3 step (block) of PEFT's merge."""
    fused, split, adapter_dir, references = moe_case
    base, reference = (fused if layout == "fused" else split), references[layout]
    result = fp8conv.convert(base.path, tmp_path / "o", ConvertOptions(to=to, merge_lora=str(adapter_dir)))
    got, slack = load_dir(result.output), _experts_slack(adapter_dir)
    for layer in (0, 1):
        prefix = f"model.layers.{layer}.mlp.experts."
        for parameter in ("gate_up_proj", "down_proj"):
            ref, extra = reference[prefix + parameter], slack[prefix + parameter]
            value = _experts_values(got, prefix, parameter, layout, ref.shape)
            if to == "bf16":
                ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp(min=2.0**-126))) - 7)
                bound = ulp / 2
            else:
                bound = ref.abs() * 2**-4 + _experts_scale(got, prefix, parameter, layout, ref.shape) * 2**-10
            assert bool(((value - ref).abs() <= bound + extra).all()), (layout, prefix + parameter)
    assert result.requantization["summary"]["mean_survived"] > 0.9
    assert fp8conv.verify(base.path, result.output).ok  # the adapter resolved against the base again


def _experts_values(got, prefix, parameter, layout, shape) -> torch.Tensor:
    """The written experts as transformers' fused [E, 2I, H] / [E, H, I], decoded to float32."""
    return _experts_tensor(got, prefix, parameter, layout, shape, scale=False)


def _experts_scale(got, prefix, parameter, layout, shape) -> torch.Tensor:
    return _experts_tensor(got, prefix, parameter, layout, shape, scale=True)


def _experts_tensor(got, prefix, parameter, layout, shape, scale) -> torch.Tensor:
    def decoded(name: str) -> torch.Tensor:
        t = got[name]
        if t.dtype != torch.float8_e4m3fn:
            return torch.ones_like(t, dtype=torch.float32) if scale else t.float()
        grid = got[name + "_scale_inv"].float()
        n, k = t.shape[-2:]
        s = grid.repeat_interleave(128, dim=-2)[..., :n, :].repeat_interleave(128, dim=-1)[..., :k]
        return s if scale else t.float() * s

    if layout == "fused":
        return decoded(prefix + parameter)
    experts = shape[0]
    if parameter == "down_proj":
        return torch.stack([decoded(f"{prefix}{e}.down_proj.weight") for e in range(experts)])
    return torch.stack(
        [
            torch.cat([decoded(f"{prefix}{e}.gate_proj.weight"), decoded(f"{prefix}{e}.up_proj.weight")])
            for e in range(experts)
        ]
    )


def test_a_parameter_lora_for_a_model_type_not_known_is_refused(moe_case, tmp_path):
    fused, _, adapter_dir, _ = moe_case
    other = tmp_path / "base"
    shutil.copytree(fused.path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama4_text"}))
    with pytest.raises(PlanRefused) as refused:
        fp8conv.convert(other, tmp_path / "o", ConvertOptions(to="bf16", merge_lora=str(adapter_dir)))
    assert any("a fused experts parameter" in p.one_line() for p in refused.value.problems)


def test_per_expert_linear_lora_merges_into_the_release_s_expert_linears(moe_case, tmp_path):
    """An adapter made when experts were one Linear each (PEFT on transformers 4: `experts.E.gate_proj` as a
    target module) merges into the per-expert release as any Linear LoRA does."""
    from safetensors.torch import save_file

    _, split, _, _ = moe_case
    src = load_dir(split.path)
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    n, k = src[name].shape
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, k, generator=gen) * 0.1, torch.randn(n, 2, generator=gen) * 0.1
    module = "base_model.model." + name.removesuffix(".weight")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({f"{module}.lora_A.weight": a, f"{module}.lora_B.weight": b}, str(adapter / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    got = load_dir(
        fp8conv.convert(split.path, tmp_path / "o", ConvertOptions(to="bf16", merge_lora=str(adapter))).output
    )
    plain = load_dir(fp8conv.convert(split.path, tmp_path / "p", ConvertOptions(to="bf16")).output)
    base = fp8conv.convert(split.path, tmp_path / "f", ConvertOptions(to="bf16", dtype="float32")).output
    want = load_dir(base)[name] + (b.double() @ a.double() * 2.0).float()
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp(min=2.0**-126))) - 7)
    assert bool(((got[name].float() - want).abs() <= ulp / 2 + want.abs() * 2**-22).all())
    other = "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert torch.equal(got[other].view(torch.uint8), plain[other].view(torch.uint8))


def test_an_adapter_tensor_that_is_not_a_float_is_refused(merged_case, tmp_path):
    from safetensors.torch import load_file, save_file

    fixture, adapter_dir, _ = merged_case
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dir, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    save_file({**tensors, key: tensors[key].to(torch.int8)}, bad / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{key}' .*is I8; an adapter's tensors are floats"):
        fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to="bf16", merge_lora=str(bad)))


def test_an_adapter_trained_on_another_named_model_warns(merged_case, tmp_path):
    fixture, adapter_dir, _ = merged_case
    named = tmp_path / "named"
    shutil.copytree(adapter_dir, named)
    config = json.loads((named / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "acme/Other-7B"}))
    result = fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to="bf16", merge_lora=str(named)))
    assert any("the adapter was trained on acme/Other-7B" in w for w in result.warnings)
    (named / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": f"acme/{fixture.path.name}"})
    )
    result = fp8conv.convert(fixture.path, tmp_path / "p", ConvertOptions(to="bf16", merge_lora=str(named)))
    assert not any("the adapter was trained on" in w for w in result.warnings)


def test_jobs_2_splits_a_merge_into_two_worker_processes(merged_case, tmp_path):
    """convert -j 2: the parts run as processes of their own, each opening the adapter and checking its hash."""
    fixture, adapter_dir, _ = merged_case
    args = ["convert", str(fixture.path), "--to", "channel", "--merge-lora", str(adapter_dir), "-q"]
    run = CliRunner().invoke(main, [*args, "-j", "2", "-o", str(tmp_path / "j2")])
    assert run.exit_code == 0, run.output
    fp8conv.convert(fixture.path, tmp_path / "one", ConvertOptions(to="channel", merge_lora=str(adapter_dir)))
    shards = [k for k in dir_snapshot(tmp_path / "one") if k.endswith(".safetensors")]
    assert shards and all(dir_snapshot(tmp_path / "j2")[k] == dir_snapshot(tmp_path / "one")[k] for k in shards)


@pytest.mark.parametrize("to", ["bf16", "channel", "block"])
def test_the_merge_report_is_its_plain_definition(merged_case, tmp_path, to):
    """delta_relative, survived and relative_frobenius of one merged weight against their definitions in
    float64 from the input's exact decode, the merged float32 weight (input + the delta) and the written
    values as engines read them."""
    fixture, adapter_dir, _ = merged_case
    result = fp8conv.convert(fixture.path, tmp_path / "o", ConvertOptions(to=to, merge_lora=str(adapter_dir)))
    name = "model.layers.1.mlp.down_proj.weight"
    adapter = open_adapter(str(adapter_dir))
    tensors = AdapterTensors(adapter)
    try:
        delta = lora_delta(adapter.terms[name], tensors)
    finally:
        tensors.close()
    base = dequant_reference(load_dir(fixture.path), name).float()
    merged = base + delta
    got = load_dir(result.output)
    options = ConvertOptions(to=to)
    written = got[name].float() * (1 if to == "bf16" else _expanded_scale(got, name, got[name].shape, options))
    b, m, w = base.double(), merged.double(), written.double()
    report = result.requantization["tensors"][name]
    assert report["delta_relative"] == pytest.approx(float((m - b).norm() / b.norm()), rel=1e-9)
    assert report["survived"] == pytest.approx(float(((w - b) * (m - b)).sum() / ((m - b) ** 2).sum()), rel=1e-9)
    assert report["relative_frobenius"] == pytest.approx(float((w - m).norm() / m.norm()), rel=1e-9)


def test_mxfp8_output_of_a_merge_is_within_one_step_of_the_peft_merge(tmp_path):
    """--to mxfp8 (widths in whole 1x32 groups: a model of its own): each merged weight within half an e4m3
    step of PEFT's merge at its group's power-of-two scale."""
    from dataclasses import replace

    from tests.support.families import SPECS

    hf = {**SPECS["qwen3-8b"].hf, "hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
    fixture = build_family("qwen3-8b", tmp_path / "base", replace(SPECS["qwen3-8b"], hf=hf))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    reference = saved_adapter(_float_model(fixture), config, tmp_path / "adapter", 0.05)
    options = ConvertOptions(to="mxfp8", merge_lora=str(tmp_path / "adapter"))
    result = fp8conv.convert(fixture.path, tmp_path / "o", options)
    got, slack = load_dir(result.output), _float32_slack(tmp_path / "adapter")
    for name in _merged_names(reference):
        ref = reference[name]
        value = got[name].float() * _expanded_scale(got, name, got[name].shape, options)
        bound = ref.abs() * 2**-4 + _expanded_scale(got, name, got[name].shape, options) * 2**-10
        assert bool(((value - ref).abs() <= bound + slack[name]).all()), name
    assert result.requantization["summary"]["merged"] == 6
