"""Options as values: ConvertOptions (what the output is) and RunOptions (how a run goes) check themselves
once, when made; the manifest records ConvertOptions; `convert -j N` hands both to its workers as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, OptionsError, RunOptions
from fp8conv.cli.commands import main
from fp8conv.options import Tuning
from tests.support.helpers import dir_snapshot
from tests.support.local_shards import LocalShardSource


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"to": "fp4"}, "--to fp4 is not one of bf16, channel, block"),
        ({"dtype": "int8"}, "--dtype int8 is not one of"),
        ({"to": "block", "block_size": (0, 128)}, "is not two positive integers"),
        ({"to": "block", "fp8_max": 240.0}, "applies to --to channel only"),
        ({"to": "channel", "pad_for_tp": 2}, "applies to --to block only"),
        ({"to": "block", "pad_roles": ("dense",)}, "--pad-roles applies with --pad-for-tp only"),
    ],
)
def test_convert_options_refuse_a_misfit_when_made(kwargs, message):
    with pytest.raises(OptionsError, match=message):
        ConvertOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"evict_input": True}, "--evict-input needs --stream"),
        ({"stream": True, "part": (1, 2)}, "do not combine it with -j or --part"),
        ({"prefetch": -1}, "--prefetch -1 is negative"),
        ({"part": (3, 2)}, "is not I/N with 1 <= I <= N"),
        ({"device": "tpu"}, "--device tpu is not one of"),
    ],
)
def test_run_options_refuse_a_misfit_when_made(kwargs, message):
    with pytest.raises(OptionsError, match=message):
        RunOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"convert_band_elements": 0}, "tuning convert_band_elements 0 is not a positive integer"),
        ({"max_segments": 0}, "tuning max_segments 0 is not a positive integer"),
        ({"direct_min_bytes": -1}, "tuning direct_min_bytes -1 is negative"),
        ({"segment_bytes": 5000}, "tuning segment_bytes 5000 is not a positive multiple of 4096"),
        ({"piece_bytes": 0}, "tuning piece_bytes 0 is not a positive multiple of 4096"),
        ({"verify_band_elements": "8"}, "tuning verify_band_elements '8' is not an integer"),
    ],
)
def test_tuning_refuses_a_size_the_run_cannot_use_when_made(kwargs, message):
    with pytest.raises(OptionsError, match=message):
        Tuning(**kwargs)


def test_both_values_go_through_json_unchanged():
    options = ConvertOptions(
        to="block", block_size=(64, 128), pad_for_tp=4, pad_roles=("dense", "shared"), keep_model_card=True
    )
    assert ConvertOptions.from_dict(json.loads(json.dumps(options.to_dict()))) == options
    tuning = Tuning(convert_band_elements=3000, verify_band_elements=1, segment_bytes=8192, direct_min_bytes=0)
    run = RunOptions(
        overwrite=True, part=(2, 3), device="reference", max_memory=2**30, direct_io=False, prefetch=3, tuning=tuning
    )
    assert RunOptions.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    with pytest.raises(OptionsError, match="unknown tuning value"):
        RunOptions.from_dict({"tuning": {"band": 1}})
    # the manifest of a run with default options is what it was before keep_model_card joined the record
    assert ConvertOptions().to_dict() == {
        "to": "bf16",
        "dtype": "bfloat16",
        "block_size": None,
        "fp8_max": 448.0,
        "pad_for_tp": None,
    }
    with pytest.raises(OptionsError, match="unknown conversion option"):
        ConvertOptions.from_dict({"to": "bf16", "colour": "blue"})


def test_what_cannot_cross_to_another_process_is_refused_not_dropped(tmp_path):
    with pytest.raises(OptionsError, match="cannot be sent to another process"):
        RunOptions(progress=lambda done, total: None).to_dict()
    with pytest.raises(OptionsError, match="cannot be sent to another process"):
        RunOptions(stream=LocalShardSource(tmp_path, tmp_path / "cache")).to_dict()


def test_keep_model_card_is_recorded_and_a_resume_must_agree(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(keep_model_card=True))
    manifest = json.loads((out / ".fp8conv" / "manifest.json").read_text())
    assert manifest["options"]["keep_model_card"] is True
    assert (out / "README.md").read_bytes() == (tiny.path / "README.md").read_bytes()
    with pytest.raises(OptionsError, match="option keep_model_card was True, now None"):
        fp8conv.convert(tiny.path, out, ConvertOptions(), run=RunOptions(resume=True))
    fp8conv.convert(tiny.path, out, ConvertOptions(keep_model_card=True), run=RunOptions(resume=True))


def test_jobs_workers_receive_every_option(make_tiny, tmp_path):
    """-j hands the values themselves to its workers: output options other than the defaults (padding,
    roles, the model card) and run options (buffered I/O, the reference device, small bands and segments)
    reach every part."""
    ckpt = make_tiny(num_shards=3)
    options = ConvertOptions(to="block", pad_for_tp=4, pad_roles=("shared", "routed"), keep_model_card=True)
    fp8conv.convert(ckpt.path, tmp_path / "single", options)
    out = tmp_path / "jobs"
    flags = ["--to", "block", "--pad-for-tp", "4", "--pad-roles", "shared,routed", "--keep-model-card"]
    flags += ["--buffered-io", "--device", "reference", "-j", "2", "-q"]
    flags += ["--tuning", json.dumps({"convert_band_elements": 3000, "segment_bytes": 8192})]
    cmd = [sys.executable, "-m", "fp8conv", "convert", str(ckpt.path), "-o", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    fanned = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert fanned == dir_snapshot(tmp_path / "single")
    assert json.loads(fanned[".fp8conv/manifest.json"])["options"]["pad_roles"] == ["shared", "routed"]


def test_jobs_refuses_stream_before_starting_workers(tiny, tmp_path):
    args = ["convert", str(tiny.path), "--to", "bf16", "--stream", "-j", "2", "-o", str(tmp_path / "x")]
    refused = CliRunner().invoke(main, args)
    assert refused.exit_code == 2 and "do not combine it with -j or --part" in refused.stderr
    assert not (tmp_path / "x").exists()


def test_every_option_field_is_one_click_parameter_of_convert():
    """convert's parameters are named after the fields and become the two values by name: a field with
    no click option, or a click option that is neither a field nor the CLI's own, fails here."""
    from dataclasses import fields

    from fp8conv.cli.commands import main
    from fp8conv.options import options_from
    from fp8conv.output.finish import parse_part

    names = {p.name for p in main.commands["convert"].params}
    cli_only = {"checkpoint", "output", "hardware", "threads", "jobs", "dry_run", "as_json", "quiet"}
    field_names = {f.name for cls in (ConvertOptions, RunOptions) for f in fields(cls)} - {"progress"}
    assert names - cli_only == field_names
    with pytest.raises(TypeError, match="not an option field: jobs"):
        options_from({"to": "bf16", "jobs": 2})
    options, run = options_from({"direct_io": False, "part": "2/3", "to": "block"}, {"part": parse_part})
    assert options == ConvertOptions(to="block") and run == RunOptions(part=(2, 3), direct_io=False)
    tuning = next(p for p in main.commands["convert"].params if p.name == "tuning")
    assert tuning.hidden  # how the work is cut, for tests: not in --help
