"""Packed 4-bit weights are classified once per layout and copied with each weight's own names: a copy must
be what classifying that weight alone gives, and any weight whose companions differ (another shape, one
missing, one extra) must get its own verdict, named for itself."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from fp8conv.model import classify as classify_module
from fp8conv.model.classify import classify
from fp8conv.model.weight_format import Kind
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.plan_scale_bench import plan_scale


def _layer_tensors(bench, experts: int) -> list[tuple[str, str, tuple[int, ...]]]:
    return [
        t
        for t in bench._kimi_layer(1)
        if ".experts." not in t[0] or int(t[0].split(".experts.")[1].split(".")[0]) < experts
    ]


def test_packed_verdicts_are_each_weights_own(tmp_path: Path, monkeypatch) -> None:
    bench = plan_scale()
    tensors = _layer_tensors(bench, experts=6)
    p = "language_model.model.layers.1.mlp.experts."
    odd = {
        p + "2.up_proj.weight_scale": None,  # expert 2's up_proj has no scale
        p + "3.down_proj.weight_scale": (7168, 8),  # expert 3's scale grid is off
    }
    tensors = [(n, d, odd.get(n) or s) for n, d, s in tensors if n not in odd or odd[n] is not None]
    tensors.append((p + "4.gate_proj.weight_zero_point", "I32", (2048, 7)))  # expert 4 asymmetric
    config = bench.kimi25_config(tensors)
    bench.write_header_only(tmp_path, tensors, config, per_shard=40)
    ckpt = open_checkpoint(tmp_path, headers_only=True)
    got = classify(ckpt.index, ckpt.config)
    # every packed weight classified alone: in a checkpoint of its own module's tensors and the config
    alone = {}
    for name in [n for n in got.weights if n.endswith(".weight_packed")]:
        module = name.removesuffix("weight_packed")
        own = [t for t in tensors if t[0].startswith(module)]
        bench.write_header_only(tmp_path / name, own, config)
        solo = open_checkpoint(tmp_path / name, headers_only=True)
        alone[name] = classify(solo.index, solo.config).weights[name]
    assert len(alone) == 18
    assert {n: asdict(got.weights[n]) for n in alone} == {n: asdict(f) for n, f in alone.items()}
    refused = {n: f.reason for n, f in got.weights.items() if f.kind is Kind.UNSUPPORTED}
    assert set(refused) == {
        p + "2.up_proj.weight_packed",
        p + "3.down_proj.weight_packed",
        p + "4.gate_proj.weight_packed",
    }
    assert p + "3.down_proj.weight_scale" in refused[p + "3.down_proj.weight_packed"]
    assert "weight_zero_point" in refused[p + "4.gate_proj.weight_packed"]
    fine = got.weights[p + "5.down_proj.weight_packed"]
    assert fine.kind is Kind.INT4 and fine.scale == p + "5.down_proj.weight_scale"
    assert (fine.out_name, fine.shape_tensor) == (p + "5.down_proj.weight", p + "5.down_proj.weight_shape")
    # the verdicts were copied: far fewer made than weights
    from fp8conv.model.packed_formats import classify_packed

    made = []
    monkeypatch.setattr(classify_module, "classify_packed", lambda *a: made.append(a[2]) or classify_packed(*a))
    again = classify(ckpt.index, ckpt.config)
    assert {n: asdict(f) for n, f in again.weights.items()} == {n: asdict(f) for n, f in got.weights.items()}
    assert 3 <= len(made) <= 9
