"""Outputs other tools make of a tiny block-FP8 checkpoint, for `fp8conv verify SRC OTHER`.

The source is a one-layer Qwen3 whose q_proj and MLP widths are 192 (a grid of 2 blocks of 128 rows, the
last one partial): transformers' FineGrainedFP8 dequantization infers blocks of 96 from that grid.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from tests.support.families import FamilyFixture, Spec, _fp8_block, _linear, build_family, mistral_name
from tests.support.helpers import load_dir

QWEN3_192 = Spec(
    "qwen3",
    dict(
        hidden_size=256,
        num_hidden_layers=1,
        vocab_size=300,
        intermediate_size=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
    ),
    "block",
    _fp8_block(),
    _linear,
)


# every width a multiple of 128: compressed-tensors' FP8BlockDequantizer cannot save a partial block (it
# hands safetensors a non-contiguous slice of its padded result)
QWEN3_WHOLE_BLOCKS = Spec(
    "qwen3",
    dict(QWEN3_192.hf, intermediate_size=384, head_dim=64),
    "block",
    _fp8_block(),
    _linear,
)


# a Mistral-shaped dense model with per-tensor FP8, for the Mistral-native names (consolidated.safetensors)
MISTRAL_PER_TENSOR = Spec(
    "mistral",
    dict(QWEN3_192.hf),
    "tensor",
    lambda _: {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3"},
    _linear,
    scale_shape=(),
)


def build_mistral_native(folder: Path) -> tuple[FamilyFixture, Path]:
    """The same FP8 weights twice: HF names (folder/hf) and Mistral's native names with params.json
    (folder/native)."""
    from safetensors.torch import save_file

    fixture = build_family("mistral-per-tensor", folder / "hf", MISTRAL_PER_TENSOR)
    native = folder / "native"
    native.mkdir()
    save_file({mistral_name(n): t for n, t in load_dir(fixture.path).items()}, str(native / "consolidated.safetensors"))
    hf = fixture.config
    params = {
        "dim": hf["hidden_size"],
        "n_layers": hf["num_hidden_layers"],
        "head_dim": hf["head_dim"],
        "hidden_dim": hf["intermediate_size"],
        "n_heads": hf["num_attention_heads"],
        "n_kv_heads": hf["num_key_value_heads"],
        "rope_theta": 1e6,
        "norm_eps": 1e-5,
        "vocab_size": hf["vocab_size"],
        "tied_embeddings": False,
        "quantization": {"qformat_weight": "fp8_e4m3"},
    }
    (native / "params.json").write_text(json.dumps(params))
    return fixture, native


def build_qwen3_192(folder: Path) -> FamilyFixture:
    return build_family("qwen3-192", folder, QWEN3_192)


def build_qwen3_whole_blocks(folder: Path) -> FamilyFixture:
    return build_family("qwen3-whole-blocks", folder, QWEN3_WHOLE_BLOCKS)


def transformers_dequantized(src: Path, out: Path) -> None:
    """What transformers writes when asked to dequantize the FP8 release and save it."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    model.save_pretrained(out)


def copy_checkpoint(src: Path, out: Path) -> Path:
    shutil.copytree(src, out)
    return out


def rewrite_tensors(folder: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Replace (or, for None, drop) tensors of a checkpoint in place, keeping its shards and index."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for shard in sorted(folder.glob("*.safetensors")):
        tensors = load_file(shard)
        if not set(change) & set(tensors):
            continue
        for name, tensor in change.items():
            if name in tensors:
                if tensor is None:
                    del tensors[name]
                    if index:
                        del index["weight_map"][name]
                else:
                    tensors[name] = tensor.contiguous()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index))
