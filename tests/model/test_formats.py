"""The classifier on hand-made checkpoints: every format named, nothing guessed, no over-rejecting."""

from __future__ import annotations

import pytest
import torch

import fp8conv
from fp8conv import ConvertOptions
from fp8conv.model.classify import Kind, classify
from fp8conv.source.checkpoint import open_checkpoint
from tests.support.helpers import fp8, fp8_block_config, load_dir, write_checkpoint
from tests.support.reference import same_bits


def _classify(tmp_path, tensors, config, block_size=None):
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors, config))
    return classify(ckpt.index, ckpt.config, block_size)


def test_block_grids_confirmed_including_partial_blocks(tmp_path):
    cls = _classify(
        tmp_path,
        {
            "a.weight": fp8((448, 320)),
            "a.weight_scale_inv": torch.ones(4, 3),
            "b.weight": fp8((576, 7168 // 16)),
            "b.weight_scale_inv": torch.ones(5, 4),
            "c.weight": fp8((1, 1)),  # one partial block: guard against over-rejecting
            "c.weight_scale_inv": torch.ones(1, 1),
        },
        fp8_block_config(),
    )
    assert cls.problems == []
    assert {n: w.kind for n, w in cls.weights.items()} == {n: Kind.BLOCK for n in ("a.weight", "b.weight", "c.weight")}
    assert cls.checkpoint_format == "block-fp8"


@pytest.mark.parametrize(
    ("scale", "config", "kind"),
    [
        (
            torch.tensor(0.5),
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
            Kind.PER_TENSOR,
        ),
        (
            torch.tensor([0.5]),
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": None}},
            Kind.PER_TENSOR,
        ),
        (torch.rand(256, 1) + 0.1, {"quantization_config": {"quant_method": "fp8"}}, Kind.CHANNEL),
        (torch.rand(256) + 0.1, None, Kind.CHANNEL),
    ],
)
def test_per_tensor_and_channel_are_never_read_as_blocks(tmp_path, scale, config, kind):
    cls = _classify(tmp_path, {"x.weight": fp8((256, 300)), "x.weight_scale": scale}, config)
    assert cls.weights["x.weight"].kind is kind and cls.problems == []


def test_per_tensor_and_channel_convert_exactly(tmp_path):
    scale_t, scale_c = torch.tensor(0.0123), torch.rand(256, 1) + 0.1
    path = write_checkpoint(
        tmp_path / "c",
        {
            "t.weight": fp8((256, 300), 1),
            "t.weight_scale": scale_t,
            "t.input_scale": torch.tensor(0.2),
            "c.weight": fp8((256, 300), 2),
            "c.weight_scale": scale_c,
        },
        {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
    )
    src = load_dir(path)
    fp8conv.convert(path, tmp_path / "out", ConvertOptions(to="bf16"))
    got = load_dir(tmp_path / "out")
    assert set(got) == {"t.weight", "c.weight"}  # weight and activation scales consumed
    assert same_bits(got["t.weight"], (src["t.weight"].float() * scale_t).to(torch.bfloat16))
    assert same_bits(got["c.weight"], (src["c.weight"].float() * scale_c).to(torch.bfloat16))


def test_grid_with_no_block_size_is_unverified(tmp_path):
    cls = _classify(
        tmp_path,
        {"x.weight": fp8((448, 320)), "x.weight_scale_inv": torch.ones(4, 3)},
        fp8_block_config(None),
    )
    assert cls.weights["x.weight"].kind is Kind.UNVERIFIED
    assert "--block-size 128,128" in cls.problems[0].one_line() and "x.weight" in cls.problems[0].one_line()


def test_asserted_block_size_must_agree_with_every_grid(tmp_path):
    tensors = {
        "x.weight": fp8((448, 320)),
        "x.weight_scale_inv": torch.ones(4, 3),
        "kv.weight": fp8((576, 320)),
        "kv.weight_scale_inv": torch.ones(5, 3),
    }
    cls = _classify(tmp_path, tensors, None, (128, 128))
    assert {w.kind for w in cls.weights.values()} == {Kind.BLOCK}
    # 448 rows under 4 grid rows fits 112-row blocks too, but 576 under 5 does not: refused, not guessed
    cls = _classify(tmp_path, tensors, None, (112, 128))
    assert cls.weights["kv.weight"].kind is Kind.UNVERIFIED
    assert len(cls.problems) == 1 and "need [6, 3]" in cls.problems[0].one_line()
    assert "kv.weight" in cls.problems[0].one_line()


@pytest.mark.parametrize(
    ("tensors", "reason"),
    [
        (
            {"x.weight": torch.zeros(4, 4).to(torch.float8_e5m2), "x.weight_scale_inv": torch.ones(1, 1)},
            "F8_E5M2",
        ),
        (
            {"x.weight_packed": torch.zeros(4, 2, dtype=torch.uint8), "x.weight_scale": torch.ones(4, 1)},
            "packed",
        ),
        ({"x.weight": torch.zeros(4, 4, dtype=torch.int8), "x.weight_scale": torch.ones(4, 1)}, "int8"),
        (
            {"x.weight": fp8((4, 4)), "x.weight_scale_inv": torch.ones(1, 1, dtype=torch.int32)},
            "scales must be",
        ),
        (
            {
                "x.weight": fp8((4, 4)),
                "x.weight_scale_inv": torch.ones(1, 1),
                "x.weight_scale": torch.ones(1),
            },
            "ambiguous",
        ),
        ({"x.kv_cache": fp8((4, 4))}, "not a '.weight'"),
    ],
)
def test_unsupported_formats_are_named_never_guessed(tmp_path, tensors, reason):
    cls = _classify(tmp_path, tensors, fp8_block_config())
    assert cls.checkpoint_format == "unsupported"
    assert any(reason in p.one_line() for p in cls.problems), [p.one_line() for p in cls.problems]
    with pytest.raises(fp8conv.CheckpointError, match="unsupported"):
        fp8conv.convert(tmp_path / "c", tmp_path / "out", ConvertOptions(to="bf16"))


def test_two_scales_are_named_in_one_order_whatever_the_file_order(tmp_path):
    """The shards list x.weight_scale first, then x.weight_scale_inv, then the weight; the refusal names the
    scales in the order their suffixes are tried, _inv first, as it did when each was looked up by name."""
    tensors = {"x.weight_scale": torch.ones(1, 1), "x.weight_scale_inv": torch.ones(1, 1), "x.weight": fp8((4, 4))}
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "c", tensors, fp8_block_config(), shards=3))
    assert list(ckpt.index.locations) == list(tensors)
    fmt = classify(ckpt.index, ckpt.config).weights["x.weight"]
    assert fmt.reason == "has both x.weight_scale_inv and x.weight_scale; which one applies is ambiguous"
    assert fmt.companions == ("x.weight_scale",)


def test_unknown_quant_method_is_refused(tmp_path):
    cls = _classify(tmp_path, {"x.weight": torch.zeros(2, 2)}, {"quantization_config": {"quant_method": "awq"}})
    assert "'awq' is not supported" in cls.problems[0].one_line()


@pytest.mark.parametrize("nested", [False, True])
def test_config_problems_name_the_file_and_section_not_a_shard(tmp_path, nested):
    """A problem in config.json is located by file (and, in a multimodal config, the section under it),
    never in the `shard` field, which names safetensors shards only."""
    quant = {"quantization_config": {"quant_method": "awq"}}
    config = {"model_type": "kimi_vl", "text_config": quant} if nested else quant
    problem = _classify(tmp_path, {"x.weight": torch.zeros(2, 2)}, config).problems[0]
    assert (problem.shard, problem.file, problem.key) == (None, "config.json", "text_config" if nested else None)
    where = "in config.json under text_config: " if nested else "in config.json: "
    assert problem.one_line().startswith(where + "quantization_config.quant_method 'awq' is not supported")


def test_fp8_config_without_fp8_tensors_warns(tmp_path):
    cls = _classify(tmp_path, {"x.weight": torch.zeros(2, 2)}, fp8_block_config())
    assert cls.checkpoint_format == "unquantized" and cls.problems == []
    assert "no tensor is FP8" in cls.warnings[0]


def test_malformed_block_size_in_config(tmp_path):
    cls = _classify(tmp_path, {"x.weight": torch.zeros(2, 2)}, fp8_block_config([128, 0]))
    assert "not two positive integers" in cls.problems[0].one_line()


def test_bf16_weight_with_a_stray_scale_is_refused(tmp_path):
    cls = _classify(
        tmp_path,
        {"x.weight": torch.zeros(2, 2, dtype=torch.bfloat16), "x.weight_scale_inv": torch.ones(1, 1)},
        None,
    )
    assert "not FP8" in cls.problems[0].one_line() and "x.weight" in cls.problems[0].one_line()
