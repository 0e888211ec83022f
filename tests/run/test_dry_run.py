"""`convert --dry-run`: the plan a run would execute, each output shard's jobs by strategy, refused as the
run would be, with nothing written and torch never imported. The expected strategies are worked out here
from the input's own headers (read with safetensors) and the rules the docs state, not from fp8conv."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import OptionsError
from fp8conv.options import Tuning
from fp8conv.run.dry_run import dry_run
from tests.support.helpers import dir_snapshot, fp8, fp8_block_config, write_checkpoint
from tests.support.interpreter import run_fresh_interpreter

MLP_PROJ = re.compile(r"\.mlp\..*(gate|up|down)_proj\.weight$")
SHARD_LINE = re.compile(r"^  (\S+\.safetensors)\s+(\d+) tensor\(s\)\s+\S+ \S+\s+(.*?)(?:  part (\d+))?$")


def _printed_shards(stdout: str) -> dict[str, tuple[int, dict[str, int], int | None]]:
    """Output shard -> (tensors, jobs by strategy, part) as the dry run printed them."""
    found = {}
    for line in stdout.splitlines():
        m = SHARD_LINE.match(line)
        if m:
            counts = {k: int(v) for k, v in (item.rsplit(" ", 1) for item in m.group(3).split(", "))}
            found[m.group(1)] = (int(m.group(2)), counts, int(m.group(4)) if m.group(4) else None)
    return found


def _expected_padded_block(ckpt: Path) -> dict[str, tuple[int, dict[str, int]]]:
    """--to block --pad-for-tp 8 of the tiny DeepSeek: its MLP widths (448, 192) are not 8 whole 128-blocks,
    so every MLP projection is padded, and padded tensors are rewritten whole; every other FP8 weight keeps
    its bytes (its block is already 128x128), with a new scale; every float tensor is copied file to file.
    A weight's scale travels with it: one job, two output tensors."""
    expected = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        jobs: Counter[str] = Counter()
        tensors = 0
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), no iteration)
                if name.endswith("_scale_inv"):
                    continue
                dtype = f.get_slice(name).get_dtype()
                if dtype == "F8_E4M3":
                    jobs["whole" if MLP_PROJ.search(name) else "keep-weight-bytes"] += 1
                    tensors += 2
                else:
                    jobs["copy-file"] += 1
                    tensors += 1
        expected[shard.name] = (tensors, dict(jobs))
    return expected


def test_dry_run_prints_each_shards_strategies_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "out"
    before = dir_snapshot(tiny.path)
    args = ["convert", str(tiny.path), "--to", "block", "--pad-for-tp", "8", "-o", str(out), "--dry-run"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert not out.exists()  # not even the directory
    assert dir_snapshot(tiny.path) == before
    printed = _printed_shards(r.stdout)
    expected = _expected_padded_block(tiny.path)
    assert {name: (t, jobs) for name, (t, jobs, _) in printed.items()} == expected
    assert all(jobs.get("whole") and jobs.get("copy-file") for _, jobs in expected.values())  # the test bites
    total = sum((Counter(jobs) for _, jobs in expected.values()), Counter())
    assert f"jobs by strategy: {', '.join(f'{k} {total[k]}' for k in ('copy-file', 'keep-weight-bytes', 'whole'))}" in (
        r.stdout
    )
    assert "nothing written (--dry-run)" in r.stdout and "not checked by --dry-run: scale values" in r.stdout


def _one_big_weight(tmp_path: Path) -> Path:
    """Two shards: a 1024x1024 FP8 weight (1M elements: one band by default, several under the smallest
    --max-memory) with its 8x8 block scale, and a bf16 norm."""
    tensors = {
        "model.layers.0.self_attn.o_proj.weight": fp8((1024, 1024)),
        "model.norm.weight": torch.ones(1024, dtype=torch.bfloat16),
        "model.layers.0.self_attn.o_proj.weight_scale_inv": torch.rand(8, 8) + 0.5,
    }  # dealt round-robin: the weight and its scale in the first shard, the norm in the second
    return write_checkpoint(tmp_path / "big", tensors, fp8_block_config(), shards=2)


def test_max_memory_changes_the_banding_the_dry_run_shows(tmp_path):
    ckpt = _one_big_weight(tmp_path)
    out = tmp_path / "out"
    base = ["convert", str(ckpt), "--to", "bf16", "-o", str(out), "--dry-run"]
    default = CliRunner().invoke(main, base)
    capped = CliRunner().invoke(
        main, [*base, "--max-memory", "289M"]
    )  # 256 MiB process, ~16 MiB writer, 16 MiB of bands
    assert default.exit_code == 0 and capped.exit_code == 0, default.output + capped.output
    weight_shard, norm_shard = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert _printed_shards(default.stdout) == {
        weight_shard: (1, {"whole": 1}, None),
        norm_shard: (1, {"copy-file": 1}, None),
    }
    assert _printed_shards(capped.stdout)[weight_shard] == (1, {"banded": 1}, None)
    assert "of bands of" in capped.stdout and "of bands of" not in default.stdout
    assert not out.exists()


def test_the_dry_run_is_the_plan_the_run_executes(tmp_path):
    """Library: dry_run() returns the plan as a value; convert() with the same values then writes exactly
    its shards, its bytes and its jobs."""
    ckpt = _one_big_weight(tmp_path)
    run = RunOptions(max_memory=289 * 2**20)
    summary = dry_run(ckpt, tmp_path / "out", ConvertOptions(to="bf16"), run=run)
    assert summary.strategies == {"copy-file": 1, "banded": 1}
    assert not (tmp_path / "out").exists()
    result = fp8conv.convert(ckpt, tmp_path / "out", ConvertOptions(to="bf16"), run=run)
    assert result.shards == [s.name for s in summary.shards]
    assert result.bytes_written == summary.nbytes
    assert result.tensors_converted + result.tensors_copied == sum(summary.strategies.values())
    assert summary.writes_config and summary.writes_index  # two shards, and a config.json
    assert (tmp_path / "out" / "config.json").is_file() and (
        tmp_path / "out" / "model.safetensors.index.json"
    ).is_file()
    assert summary.to_dict()["totals"] == {"tensors": 2, "bytes": summary.nbytes, "strategies": summary.strategies}


def test_jobs_and_json(tiny, tmp_path):
    """-j N: each shard says which part converts it, the parts fp8conv's workers take; --json: one object."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["convert", str(tiny.path), "--to", "bf16", "-o", str(out), "--dry-run", "-j", "2"])
    assert r.exit_code == 0, r.output
    parts = {name: part for name, (_, _, part) in _printed_shards(r.stdout).items()}
    assert sorted(parts.values()) == [1, 1, 2] or sorted(parts.values()) == [1, 2, 2]
    j = CliRunner().invoke(main, ["convert", str(tiny.path), "--to", "bf16", "-o", str(out), "--dry-run", "--json"])
    assert j.exit_code == 0, j.output

    doc = json.loads(j.stdout)
    assert [s["name"] for s in doc["shards"]] == sorted(p.name for p in tiny.path.glob("*.safetensors"))
    assert doc["totals"]["bytes"] == sum(s["nbytes"] for s in doc["shards"])
    assert not out.exists()
    usage = CliRunner().invoke(main, ["convert", str(tiny.path), "--to", "bf16", "-o", str(out), "--json"])
    assert usage.exit_code == 2 and "--json prints the plan of --dry-run" in usage.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-memory", "100M"], "is below what a run needs"),
        ([], "is not empty"),  # the output directory holds a file
    ],
)
def test_the_dry_run_refuses_as_the_run_does(tiny, tmp_path, extra, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    args = ["convert", str(tiny.path), "--to", "bf16", "-o", str(out), *extra]
    run = CliRunner().invoke(main, args)
    dry = CliRunner().invoke(main, [*args, "--dry-run"])
    assert run.exit_code == dry.exit_code == 1
    assert message in dry.output and dry.output.splitlines()[0] == run.output.splitlines()[0]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_the_dry_run_does_not_import_torch(tiny, tmp_path):
    out = tmp_path / "out"
    run_fresh_interpreter(
        "from click.testing import CliRunner\n"
        "from fp8conv.cli.commands import main\n"
        f"r = CliRunner().invoke(main, ['convert', {str(tiny.path)!r}, '--to', 'block', '--pad-for-tp', '8', "
        f"'-o', {str(out)!r}, '--dry-run', '--max-memory', '300M'])\n"
        "assert r.exit_code == 0 and 'jobs by strategy: copy-file' in r.output, r.output\n"
    )
    assert not out.exists()


def test_a_hub_repo_not_downloaded_is_refused_not_fetched(tiny, tmp_path, monkeypatch):
    """Without --stream a real run downloads the repo first; a dry run downloads nothing and says so."""
    import fp8conv.run.prepare as prepare

    real = prepare.open_checkpoint

    def remote(location, *, revision=None, headers_only=False):  # what a remote read gives: headers, no files
        assert headers_only
        ckpt = real(location, revision=revision, headers_only=headers_only)
        for shard in ckpt.index.shards:
            object.__setattr__(shard.header, "path", Path(shard.name))  # relative, as hub.remote_headers has it
        return ckpt

    monkeypatch.setattr(prepare, "open_checkpoint", remote)
    with pytest.raises(OptionsError, match="is not downloaded") as refused:
        dry_run(tiny.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert "add --stream" in refused.value.one_line()
    assert not (tmp_path / "out").exists()


def test_gpt_oss_experts_show_as_banded_with_their_whole_expert_reads(tmp_path):
    """gpt-oss's fused experts into bf16 stream in bands whose reads are whole experts: the dry run counts
    them BANDED, and the job holding the most is one of them (five reads of a 2 KB expert and its output
    bands, against ~1.8 KB for the 1x8x32 tensor rewritten whole), not the largest tensor rewritten whole."""
    from tests.support.gpt_oss_builders import GPT_OSS_SHAPES, build_gpt_oss

    small = RunOptions(tuning=Tuning(convert_band_elements=2000))  # E*K*N: 10656 and 20480 stream, 256 does not
    build_gpt_oss(tmp_path / "gpt-oss", GPT_OSS_SHAPES)
    summary = dry_run(tmp_path / "gpt-oss", tmp_path / "out", ConvertOptions(to="bf16"), run=small)
    assert summary.strategies == {"copy-file": 1, "banded": 2, "whole": 1}  # the router is copied
    assert summary.largest_held is not None
    name, why, _ = summary.largest_held
    banded = {"model.layers.0.mlp.experts.gate_up_proj_blocks", "model.layers.0.mlp.experts.down_proj_blocks"}
    assert name in banded and why == "streams in reads of whole gpt-oss experts"
    assert not (tmp_path / "out").exists()
