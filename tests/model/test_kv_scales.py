"""KV-cache scales (ModelOpt `k_proj.k_scale`, compressed-tensors `self_attn.k_scale` / `k_proj.output_scale`):
dropped from a bf16 output, which has no quantization_config, and named in a warning (the output loads in
transformers with no unexpected key); kept in channel and block FP8 outputs, whose fp8 / compressed-tensors
config makes vLLM load them for an FP8 KV cache."""

from __future__ import annotations

import json

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from tests.support.helpers import fp8, load_dir, write_checkpoint
from tests.support.modelopt_builders import EXCLUDED, PRODUCER, build_modelopt, modelopt_logits, tiny_llama

transformers = pytest.importorskip("transformers")

KV_SCALES = [f"model.layers.{i}.self_attn.{p}_proj.{p}_scale" for i in range(2) for p in "kv"]


def test_modelopt_kv_scales_are_dropped_from_a_bf16_output_that_transformers_loads(tmp_path):
    nested = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDED, "kv_cache_quant_algo": "FP8"}
    build_modelopt(tmp_path / "c", None, {"producer": PRODUCER, "quantization": nested})
    tensors = load_dir(tmp_path / "c") | {name: torch.tensor(0.0625 * (i + 1)) for i, name in enumerate(KV_SCALES)}
    for shard in (tmp_path / "c").glob("*.safetensors"):
        shard.unlink()
    write_checkpoint(tmp_path / "c", tensors, json.loads((tmp_path / "c" / "config.json").read_text()), shards=3)

    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    assert not set(KV_SCALES) & set(got)
    warning = next(w for w in result.warnings if "KV-cache scale" in w)
    assert warning.startswith("4 KV-cache scale tensor(s) dropped (model.layers.0.self_attn.k_proj.k_scale, ")
    assert "and 1 more" in warning and "a bf16 output has no quantization_config" in warning
    modelopt_logits(tmp_path / "out")  # asserts no missing and no unexpected key
    assert fp8conv.verify(tmp_path / "c", tmp_path / "out").ok


@pytest.mark.parametrize("to", ["channel", "block", "int8"])
def test_kv_scales_are_kept_in_fp8_outputs(tmp_path, to):
    """vLLM's Fp8Config and CompressedTensorsConfig give every attention layer a KV-cache method, with or
    without kv_cache_scheme, and load these names into it: the FP8 outputs keep them, byte for byte."""
    qc = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
    }
    scales = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor(0.125),
    }
    tensors = {
        "model.layers.0.self_attn.k_proj.weight": fp8((16, 32)),
        "model.layers.0.self_attn.k_proj.weight_scale": torch.ones(16, 1),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
        **scales,
    }
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama", "quantization_config": qc})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to))
    got = load_dir(tmp_path / "out")
    assert all(torch.equal(got[n], t) for n, t in scales.items())
    # the block output's fp8 config cannot declare the input's kv_cache_scheme, and says so
    assert len([w for w in result.warnings if "KV-cache" in w]) == (to in ("block", "int8"))

    fp8conv.convert(tmp_path / "c", tmp_path / "bf16", ConvertOptions(to="bf16"))
    assert not set(scales) & set(load_dir(tmp_path / "bf16"))


def test_a_bf16_model_parameter_named_like_a_kv_scale_is_kept(tmp_path):
    """Without a quantization_config nothing is a KV-cache scale: a model's own `k_scale` is copied."""
    tensors = {"model.layers.0.self_attn.k_scale": torch.ones(4), "x.weight": torch.ones(4, 4)}
    write_checkpoint(tmp_path / "c", tensors, {"model_type": "llama"})
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))
    assert "model.layers.0.self_attn.k_scale" in load_dir(tmp_path / "out")
    assert not [w for w in result.warnings if "KV-cache" in w]


# --- the KV-cache declaration: kept in the channel output's compressed-tensors config, as vLLM reads it ---

KV_ATTN = [f"model.layers.{i}.self_attn.{p}_scale" for i in range(2) for p in "kv"]
# as llm-compressor writes it (older compressed-tensors dump every field): copied verbatim
CT_KV_SCHEME = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "group_size": None,
    "strategy": "tensor",
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "observer": "minmax",
    "observer_kwargs": {},
}


def build_llama(path, dialect: str, extra_qc: dict, kv: dict[str, torch.Tensor]) -> None:
    """A tiny Llama whose *_proj Linears are FP8 in `dialect` (synthetic.py), with the given KV scales."""
    from tests.support.synthetic import _quantized_tensors, dialect_quantization_config

    config = tiny_llama()
    torch.manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in transformers.LlamaForCausalLM(config).state_dict().items():
        if name.endswith("_proj.weight"):
            tensors |= _quantized_tensors(dialect, name, t.float(), (128, 128))
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    qc = dialect_quantization_config(dialect, (128, 128)) | extra_qc
    write_checkpoint(path, tensors | kv, json.loads(config.to_json_string()) | {"quantization_config": qc}, shards=2)


def kv_values(names: list[str], shape: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    return {n: torch.full(shape, 0.03125 * (i + 1)) for i, n in enumerate(names)}


def modelopt_with_kv_scales(path, algo: str) -> dict[str, torch.Tensor]:
    """The ModelOpt NVFP4 Llama of test_modelopt with `k_proj.k_scale` / `v_proj.v_scale`, hf_quant_config.json
    declaring kv_cache_quant_algo `algo`; returns the KV scales."""
    nested = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDED, "kv_cache_quant_algo": algo}
    build_modelopt(path, None, {"producer": PRODUCER, "quantization": nested})
    kv = kv_values(KV_SCALES)
    tensors = load_dir(path) | kv
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    write_checkpoint(path, tensors, json.loads((path / "config.json").read_text()), shards=3)
    return kv


def written_qc(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def vllm_accepts_kv_scheme(scheme: dict) -> bool:
    """vLLM 0.32's CompressedTensorsKVCacheMethod.validate_kv_cache_scheme, by its definition."""
    return (
        scheme.get("type") == "float"
        and scheme.get("num_bits") == 8
        and scheme.get("strategy") in ("tensor", "attn_head")
        and bool(scheme.get("symmetric"))
    )


def load_channel(path, kv: dict[str, torch.Tensor]):
    """transformers + compressed-tensors load the output: nothing missing, the declaration parsed, and every
    KV scale either loaded into the attention module with its value or reported unexpected. (transformers
    5's attention forward takes `cache`, not `past_key_values`, so compressed-tensors 0.20 does not
    recognize it as cached attention and registers no k_scale: there all of them are unexpected.)"""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    params = dict(model.named_parameters())
    loaded = {n for n in kv if n in params}
    assert all(torch.equal(params[n].float().flatten(), kv[n].flatten()) for n in loaded)
    assert set(info["unexpected_keys"]) == set(kv) - loaded, info["unexpected_keys"]
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 7, 42, 3]])).logits).all()
    return model.config.quantization_config.quantization_config


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_kv_cache_scheme_is_kept_in_the_channel_output(tmp_path):
    pytest.importorskip("compressed_tensors")
    kv = kv_values(KV_ATTN)
    build_llama(tmp_path / "c", "ct-channel", {"kv_cache_scheme": CT_KV_SCHEME}, kv)
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="channel"))
    assert written_qc(tmp_path / "out")["kv_cache_scheme"] == CT_KV_SCHEME
    assert not [w for w in result.warnings if "KV-cache" in w]
    parsed = load_channel(tmp_path / "out", kv).kv_cache_scheme
    assert (parsed.num_bits, parsed.type, parsed.strategy, parsed.dynamic) == (8, "float", "tensor", False)


def test_the_block_output_declares_no_kv_cache_and_says_vllm_needs_kv_cache_dtype_fp8(tmp_path):
    """vLLM's Fp8Config reads no KV-cache key, and transformers' FineGrainedFP8Config has none: nothing to
    write; the input ran an FP8 KV cache by default in vLLM, the output does not, so the user is told."""
    kv = kv_values(KV_ATTN)
    build_llama(tmp_path / "c", "ct-channel", {"kv_cache_scheme": CT_KV_SCHEME}, kv)
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="block"))
    qc = written_qc(tmp_path / "out")
    assert qc["quant_method"] == "fp8" and not [k for k in qc if "kv" in k]
    (warning,) = [w for w in result.warnings if "KV-cache" in w]
    assert warning.startswith("the input declares kv_cache_scheme {'num_bits': 8, ")
    assert "an fp8 config has no KV-cache declaration" in warning
    assert warning.endswith(
        "unless served with --kv-cache-dtype fp8, which applies the 4 KV-cache scale tensor(s) kept"
    )
    assert all(torch.equal(load_dir(tmp_path / "out")[n], t) for n, t in kv.items())


def test_the_int8_output_keeps_the_kv_scales_but_declares_no_fp8_kv_cache(tmp_path):
    """--to int8 is for hardware without FP8: its compressed-tensors config carries no kv_cache_scheme (vLLM
    would switch the KV cache to FP8), the scales stay for a server that asks for --kv-cache-dtype fp8."""
    kv = kv_values(KV_ATTN)
    build_llama(tmp_path / "c", "ct-channel", {"kv_cache_scheme": CT_KV_SCHEME}, kv)
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="int8"))
    qc = written_qc(tmp_path / "out")
    assert qc["format"] == "int-quantized" and "kv_cache_scheme" not in qc
    (warning,) = [w for w in result.warnings if "KV-cache" in w]
    assert "an INT8 output is for hardware without FP8, so it declares no FP8 KV cache" in warning
    assert all(torch.equal(load_dir(tmp_path / "out")[n], t) for n, t in kv.items())


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_modelopt_fp8_kv_cache_becomes_compressed_tensors_kv_cache_scheme(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs

    kv = modelopt_with_kv_scales(tmp_path / "c", "FP8")
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="channel"))
    scheme = written_qc(tmp_path / "out")["kv_cache_scheme"]
    assert vllm_accepts_kv_scheme(scheme) and scheme["dynamic"] is False
    # compressed-tensors writes exactly this for the same arguments
    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", symmetric=True, dynamic=False)
    assert scheme == json.loads(json.dumps(args.model_dump()))
    assert not [w for w in result.warnings if "KV-cache" in w]
    assert all(torch.equal(load_dir(tmp_path / "out")[n], t) for n, t in kv.items())
    load_channel(tmp_path / "out", kv)


@pytest.mark.parametrize(
    ("dialect", "extra_qc", "kv", "to", "warns"),
    [
        # an fp8 input declares nothing (no such key in its config): nothing declared, nothing to say
        ("block", {}, KV_ATTN, "channel", None),
        ("block", {}, KV_ATTN, "block", None),
        # an fp8 config's kv_cache_scheme: vLLM's Fp8Config does not read it, so it declares nothing
        ("block", {"kv_cache_scheme": CT_KV_SCHEME}, KV_ATTN, "channel", None),
        # a declaration without any scale: no declaration (vLLM would run an FP8 KV cache at scale 1.0)
        ("ct-channel", {"kv_cache_scheme": CT_KV_SCHEME}, [], "channel", "carries no KV-cache scale"),
    ],
)
def test_no_kv_cache_declaration_is_invented(tmp_path, dialect, extra_qc, kv, to, warns):
    build_llama(tmp_path / "c", dialect, extra_qc, kv_values(kv))
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to=to))
    assert "kv_cache_scheme" not in written_qc(tmp_path / "out")
    said = [w for w in result.warnings if "KV-cache" in w]
    assert len(said) == (warns is not None) and all(warns in w for w in said), said
    assert sorted(n for n in load_dir(tmp_path / "out") if n.endswith("_scale") and "_proj." not in n) == sorted(kv)


def test_per_head_kv_scales_keep_their_attn_head_scheme_and_are_refused_in_a_block_output(tmp_path):
    per_head = CT_KV_SCHEME | {"strategy": "attn_head"}
    build_llama(tmp_path / "c", "ct-channel", {"kv_cache_scheme": per_head}, kv_values(KV_ATTN, (2, 1, 1)))
    fp8conv.convert(tmp_path / "c", tmp_path / "ch", ConvertOptions(to="channel"))
    assert written_qc(tmp_path / "ch")["kv_cache_scheme"] == per_head
    with pytest.raises(fp8conv.CheckpointError, match="is a per-head KV-cache scale") as err:
        fp8conv.convert(tmp_path / "c", tmp_path / "block", ConvertOptions(to="block"))
    assert str(err.value).startswith("tensor 'model.layers.0.self_attn.")
    assert "--to channel (which keeps kv_cache_scheme strategy attn_head)" in str(err.value)
    assert "(and 3 more problem(s)" in str(err.value)
    assert not (tmp_path / "block").exists()


def test_modelopt_nvfp4_kv_cache_has_no_compressed_tensors_spelling_and_is_not_declared(tmp_path):
    """compressed-tensors would spell it as a 4-bit float kv_cache_scheme, which vLLM's
    CompressedTensorsKVCacheMethod refuses (8-bit float only): the channel output declares none, and says so."""
    modelopt_with_kv_scales(tmp_path / "c", "NVFP4")
    result = fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="channel"))
    assert "kv_cache_scheme" not in written_qc(tmp_path / "out")
    (warning,) = [w for w in result.warnings if "KV-cache" in w]
    assert warning.startswith("the input declares ModelOpt kv_cache_quant_algo 'NVFP4'; compressed-tensors has no")
