"""Planning grows linearly: 4x the tensors and 4x the ignore list cost about 4x, never 16x.

The checkpoints are header-only (bench/plan_scale.py: real headers, the data a hole), Kimi-K2.5-shaped:
compressed-tensors INT4 routed experts (weight_packed, whose companions are looked up by name) and a
plain-name ignore list as long as the model is deep, plus entries that name no tensor. Both sizes are
timed in this process, best of three, so a loaded machine slows both alike.
"""

from __future__ import annotations

import time
from pathlib import Path

from fp8conv.model.classify import classify
from fp8conv.options import ConvertOptions
from fp8conv.plan.conversion import plan_conversion
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.plan_scale_bench import plan_scale


def _kimi_like(bench, root: Path, layers: int, experts: int) -> int:
    tensors = []
    for layer in range(1, layers + 1):
        tensors += [t for t in bench._kimi_layer(layer) if ".experts." not in t[0] or _expert(t[0]) < experts]
    config = bench.kimi25_config(tensors)
    text = config["text_config"]["quantization_config"]
    text["ignore"] += [f"language_model.model.layers.{i}.self_attn.absent_proj" for i in range(8 * layers)]
    bench.write_header_only(root, tensors, config, per_shard=500)
    return len(tensors)


def _expert(name: str) -> int:
    return int(name.split(".experts.")[1].split(".")[0])


def _planning_seconds(root: Path) -> float:
    ckpt = open_checkpoint(root, headers_only=True)
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        cls = classify(ckpt.index, ckpt.config)
        plan_conversion(ckpt, cls, ConvertOptions(to="bf16"))
        best = min(best, time.process_time() - start)
    assert not cls.problems and cls.unmatched_not_converted  # the stale entries are found, every time
    return best


def test_planning_time_grows_linearly_with_tensors_and_ignore_entries(tmp_path: Path) -> None:
    bench = plan_scale()
    small = _kimi_like(bench, tmp_path / "small", layers=2, experts=96)
    large = _kimi_like(bench, tmp_path / "large", layers=8, experts=96)
    assert 3.9 < large / small < 4.1
    ratio = _planning_seconds(tmp_path / "large") / _planning_seconds(tmp_path / "small")
    # linear work gives ~4; a scan of every name per weight_packed, or of every entry per module, ~16
    assert ratio < 8, f"planning 4x the tensors took {ratio:.1f}x as long"
