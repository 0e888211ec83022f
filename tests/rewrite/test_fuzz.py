"""Mutated bytes of a tiny valid checkpoint: fp8conv converts it or refuses it cleanly, never a traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.errors import Fp8ConvError
from fp8conv.storage.out_dir import TEMP_SUFFIX
from tests.support.synthetic import TinyModelShape, build_tiny_deepseek

SMALL = TinyModelShape(
    vocab_size=16,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=1,
    n_routed_experts=2,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return build_tiny_deepseek(tmp_path_factory.mktemp("fuzz") / "ckpt", shape=SMALL, block=(32, 32), num_shards=2).path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_checkpoint_converts_or_is_refused_cleanly(pristine, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("case")
    ckpt = work / "ckpt"
    shutil.copytree(pristine, ckpt)
    targets = sorted(p for p in ckpt.iterdir() if p.suffix in (".safetensors", ".json"))
    victim = data.draw(st.sampled_from(targets), label="file")
    raw = bytearray(victim.read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice"]), label="kind")
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
            raw[pos] ^= data.draw(st.integers(1, 255), label="xor")
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    else:
        pos = data.draw(st.integers(0, min(len(raw) - 1, 400)), label="pos")  # mostly inside the header
        raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=16), label="junk")
    victim.write_bytes(bytes(raw))
    out = work / "out"
    try:
        fp8conv.convert(
            ckpt, out, ConvertOptions(to=data.draw(st.sampled_from(["bf16", "channel", "block"]), label="to"))
        )
    except Fp8ConvError as exc:
        assert "\n" not in str(exc)  # one line
        if out.exists():  # refused mid-run: nothing that looks complete
            assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
            assert not list(out.glob(f".*{TEMP_SUFFIX}"))
        return
    assert (out / "config.json").exists()  # converted: the output is complete and readable
    fp8conv.inspect(out)
