"""Fan-out: N parts as separate processes on one output give exactly what a single run gives."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import OptionsError
from fp8conv.output.finish import assign_parts, parse_part
from fp8conv.plan.conversion import ShardPlan
from fp8conv.storage.out_dir import TEMP_SUFFIX
from tests.support.helpers import dir_snapshot


@pytest.mark.parametrize(
    ("to", "count", "scale_fmt"),
    [("bf16", 2, None), ("channel", 3, None), ("block", 4, None), ("block", 3, "ue8m0"), ("int8", 3, None)],
)
def test_parts_as_processes_equal_a_single_run(make_tiny, tmp_path, to, count, scale_fmt):
    """scale_fmt ue8m0 from float32 block scales: the manifest's requantization record holds every part's
    tensors (each part records its own; finalize merges them), the same bytes as a single run's."""
    ckpt = make_tiny(num_shards=4, dialect="ue8m0-u8" if to == "block" and not scale_fmt else "block")
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to=to, scale_fmt=scale_fmt))
    out = tmp_path / "fanout"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fp8conv",
                "convert",
                str(ckpt.path),
                "--to",
                to,
                "-o",
                str(out),
                "--part",
                f"{i}/{count}",
                "-q",
                *(["--scale-fmt", scale_fmt] if scale_fmt else []),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(1, count + 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
    single, fanned = dir_snapshot(tmp_path / "single"), dir_snapshot(out)
    fanned = {k: v for k, v in fanned.items() if not k.startswith(".fp8conv/part-")}
    assert fanned == single  # shards, index, config (scale_fmt too), copied files and manifest
    if scale_fmt or to == "int8":
        record = json.loads((out / ".fp8conv" / "manifest.json").read_text())["requantization"]
        assert len(record["tensors"]) == len(ckpt.fp8_weights) == record["summary"]["tensors"]


def test_finalize_waits_for_every_part_and_checks_hashes(tiny, tmp_path):
    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(1, 2)))
    assert not (out / "config.json").exists()  # part 2 has not run: not finalized
    with pytest.raises(OptionsError, match="parts 2/2 have not finished"):
        fp8conv.finalize(out)
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(2, 2)))
    assert (out / "config.json").exists()  # the last part finalized
    (out / "config.json").unlink()
    first = sorted(out.glob("model-*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[:-1] + b"\x00")
    result = CliRunner().invoke(main, ["finalize", str(out)])
    assert result.exit_code == 1 and "does not match its part's hash" in result.stderr
    assert not (out / "config.json").exists()


def test_part_assignment_is_balanced_and_deterministic():
    from fp8conv.plan.conversion import Action, Job
    from fp8conv.storage.writer import TensorSpec

    sizes = {"s0": 50, "s1": 40, "s2": 30, "s3": 20, "s4": 10}
    plans = [ShardPlan(n, [Job("t", Action.COPY, (TensorSpec("t", "U8", (b,)),))]) for n, b in sizes.items()]
    assert assign_parts(plans, 2) == [["s0", "s3", "s4"], ["s1", "s2"]]
    assert assign_parts(plans, 2) == assign_parts(list(reversed(plans)), 2)
    assert parse_part("3/8") == (3, 8)
    for bad in ("0/2", "3/2", "x", "1/0"):
        with pytest.raises(OptionsError):
            parse_part(bad)
    assert json.dumps(assign_parts(plans, 5)) == '[["s0"], ["s1"], ["s2"], ["s3"], ["s4"]]'


def test_jobs_flag_runs_worker_processes(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=4)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    out = tmp_path / "jobs"
    cmd = [
        sys.executable,
        "-m",
        "fp8conv",
        "convert",
        str(ckpt.path),
        "--to",
        "bf16",
        "-o",
        str(out),
        "-j",
        "2",
        "--verify",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "with 2 worker processes" in done.stdout and "verify ok" in done.stdout
    fanned = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert fanned == dir_snapshot(tmp_path / "single")
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and "is not empty" in again.stderr
    mixed = CliRunner().invoke(main, ["convert", str(ckpt.path), "--to", "bf16", "-o", "x", "-j", "2", "--part", "1/2"])
    assert mixed.exit_code == 2


def test_finalize_rereads_only_shards_touched_since_their_part_wrote_them(tiny, tmp_path, monkeypatch):
    """A part records each shard's mtime and inode beside its hash; finalize re-hashes a shard only when
    they changed (touched, or copied in from elsewhere) and the final manifest leaves them out."""
    import fp8conv.output.manifest as manifest_module

    out = tmp_path / "out"
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(1, 2)))
    fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(2, 2)))
    final = json.loads((out / ".fp8conv" / "manifest.json").read_text())
    assert all(set(entry) == {"size", "sha256"} for entry in final["shards"].values())
    hashed: list[str] = []
    real = manifest_module.file_sha256
    monkeypatch.setattr(manifest_module, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    fp8conv.finalize(out)
    assert hashed == []  # every shard is the file its part wrote
    shards = sorted(out.glob("model-*.safetensors"))
    st = shards[0].stat()
    os.utime(shards[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # touched, same bytes
    copy = shards[1].with_suffix(".copy")
    shutil.copyfile(shards[1], copy)
    os.replace(copy, shards[1])  # another inode, same bytes
    fp8conv.finalize(out)
    assert sorted(hashed) == [shards[0].name, shards[1].name]
    assert json.loads((out / ".fp8conv" / "manifest.json").read_text()) == final


def _without_part_records(path) -> dict[str, bytes]:
    return {k: v for k, v in dir_snapshot(path).items() if not k.startswith(".fp8conv/part-")}


def test_parts_resume_in_every_order_and_after_finalize(make_tiny, tmp_path):
    """--part I/N --resume is what a retried task runs: it must work whatever the other parts have done."""
    ckpt = make_tiny(num_shards=4)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="channel"))
    single = dir_snapshot(tmp_path / "single")
    for order in itertools.permutations((1, 2, 3)):
        out = tmp_path / "-".join(map(str, order))
        results = [
            fp8conv.convert(ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(i, 3), resume=True))
            for i in order
        ]
        assert [r.finalized for r in results] == [False, False, True]
        assert not any(r.shards_kept for r in results)
        again = fp8conv.convert(
            ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(order[0], 3), resume=True)
        )  # after finalize
        assert again.finalized and again.shards_kept == again.shards and again.tensors_converted == 0
        assert _without_part_records(out) == single, order
    # a retry between the others: the first part again, before the last has run
    out = tmp_path / "retry-between"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(2, 3), resume=True))
    retry = fp8conv.convert(ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(2, 3), resume=True))
    assert retry.shards_kept == retry.shards and not retry.finalized
    for i in (3, 1):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(i, 3), resume=True))
    assert _without_part_records(out) == single


SLOW_PART = """
import sys, time
import fp8conv
def slow(done, total):
    time.sleep(0.05)  # after each tensor: slow enough to be killed mid-shard
fp8conv.convert(
    sys.argv[1],
    sys.argv[2],
    fp8conv.ConvertOptions(to="channel"),
    run=fp8conv.RunOptions(part=(2, 2), resume=True, progress=slow),
)
"""


def test_part_killed_mid_shard_then_retried_is_byte_identical(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=4)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="channel"))
    out = tmp_path / "out"
    record = out / ".fp8conv" / "part-2-of-2.json"

    def finished() -> list[str]:
        try:
            return list(json.loads(record.read_text())["shards"])
        except (OSError, ValueError):
            return []

    proc = subprocess.Popen([sys.executable, "-c", SLOW_PART, str(ckpt.path), str(out)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if finished() and any(out.glob(".*.fp8conv-partial")):  # one shard done, the next one half-written
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = finished()
    assert len(done) == 1 and any(out.glob(".*.fp8conv-partial")), "the test must kill part 2 mid-shard"
    kept = (out / done[0]).stat()
    kept_file = (kept.st_ino, kept.st_mtime_ns)  # an inode alone may be reused by a rewrite
    other = fp8conv.convert(ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(1, 2), resume=True))
    assert not other.finalized and not (out / "config.json").exists()  # part 2 is not complete
    cmd = [sys.executable, "-m", "fp8conv", "convert", str(ckpt.path), "--to", "channel", "-o", str(out)]
    retry = subprocess.run([*cmd, "--part", "2/2", "--resume"], capture_output=True, text=True, timeout=300)
    assert retry.returncode == 0, retry.stderr
    assert "wrote part 2/2 of" in retry.stdout and "2 shard(s) (1 kept from an earlier run)" in retry.stdout
    assert "all parts done, finalized" in retry.stdout
    now = (out / done[0]).stat()
    assert (now.st_ino, now.st_mtime_ns) == kept_file  # the finished shard was kept, not redone
    assert not list(out.glob(".*.fp8conv-partial"))
    assert _without_part_records(out) == dir_snapshot(tmp_path / "single")


def test_part_summary_describes_the_part(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=4)
    out = tmp_path / "out"
    first = CliRunner().invoke(main, ["convert", str(ckpt.path), "--to", "bf16", "-o", str(out), "--part", "1/4"])
    assert first.exit_code == 0, first.output
    shards = list(out.glob("*.safetensors"))
    assert len(shards) == 1  # this part's one shard, nothing else yet
    mib = sum(p.stat().st_size for p in shards) / 2**20
    assert f"wrote part 1/4 of {out}: 1 shard(s), " in first.stdout
    assert f" {mib:.2f} MiB written in " in first.stdout and "the last to finish finalizes" in first.stdout


def test_parts_refuse_another_split_other_options_or_a_foreign_directory(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=4)
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(1, 3)))
    with pytest.raises(OptionsError, match=r"holds part 1/3 of a split into 3 parts; this is --part 2/4"):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(2, 4), resume=True))
    with pytest.raises(OptionsError, match=r"part 1/3 there differs: option dtype was 'bfloat16', now 'float16'"):
        fp8conv.convert(
            ckpt.path, out, ConvertOptions(to="bf16", dtype="float16"), run=RunOptions(part=(2, 3), resume=True)
        )
    with pytest.raises(OptionsError, match=r"cannot resume .*option to was 'bf16', now 'channel'"):
        fp8conv.convert(
            ckpt.path, out, ConvertOptions(to="channel"), run=RunOptions(part=(1, 3), resume=True)
        )  # its own record
    assert sorted(p.name for p in (out / ".fp8conv").iterdir()) == ["part-1-of-3.json"]  # nothing written
    with pytest.raises(OptionsError, match=r"holds parts of a fan-out: resume each with --part I/N --resume"):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(resume=True))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(OptionsError, match=r"not empty and holds no fp8conv output"):
        fp8conv.convert(ckpt.path, foreign, ConvertOptions(to="bf16"), run=RunOptions(part=(1, 2), resume=True))
    # --overwrite starts a new split: the records of the old one go, the result is a single run's
    for i in (1, 2):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(i, 2), overwrite=True))
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    assert _without_part_records(out) == dir_snapshot(tmp_path / "single")
    assert sorted(p.name for p in (out / ".fp8conv").glob("part-*")) == ["part-1-of-2.json", "part-2-of-2.json"]


def test_fanout_examples_keep_n_explicit_and_install_a_pinned_cpu_torch():
    """The examples must survive a rerun of one task: N written out (never Slurm's task count), parts
    1..N, a finalize and verify step after them, and fp8conv installed from a wheel with the CPU torch."""
    import re
    from pathlib import Path

    import yaml

    folder = Path(__file__).parents[2] / "examples" / "fanout"
    sbatch = (folder / "slurm_array.sbatch").read_text()
    assert "SLURM_ARRAY_TASK_COUNT" not in sbatch
    n = int(re.search(r"^N=\$\{N:-(\d+)\}", sbatch, re.M).group(1))
    assert f"#SBATCH --array=1-{n}\n" in sbatch and "--array=1-$N" in sbatch and '--part "$I/$N" --resume' in sbatch
    assert "--dependency=afterok:$JOBID --kill-on-invalid-dep=yes slurm_finalize.sbatch" in sbatch
    assert "--dependency=afterok:$RERUN --kill-on-invalid-dep=yes slurm_finalize.sbatch" in sbatch
    finalize = (folder / "slurm_finalize.sbatch").read_text()
    assert '"$FP8CONV" finalize "$OUT"' in finalize and '"$FP8CONV" verify "$SRC" "$OUT"' in finalize
    job = yaml.safe_load((folder / "k8s_indexed_job.yaml").read_text())
    count = job["spec"]["completions"]
    assert (
        f"--part $((JOB_COMPLETION_INDEX + 1))/{count} --resume"
        in job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    )
    fin = yaml.safe_load((folder / "k8s_finalize_job.yaml").read_text())
    fin_args = fin["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert "fp8conv finalize /models/DeepSeek-V3-bf16" in fin_args and "fp8conv verify /models/DeepSeek-V3 " in fin_args
    workflow = yaml.safe_load((folder / "github_actions_matrix.yml").read_text())
    assert workflow["jobs"]["convert"]["strategy"]["matrix"]["part"] == list(range(1, workflow["env"]["N"] + 1))
    for path in folder.iterdir():
        text = path.read_text()
        assert not re.search(r"pip install (--quiet )?fp8conv\b", text), path  # not published: installs nothing
        for line in re.findall(r"^[^#\n]*pip\"? install.*torch.*", text, re.M):
            assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in line, (path, line)
        if "install" in text:
            assert f"fp8conv-{fp8conv.__version__}-py3-none-any.whl" in text, path  # the wheel pip wheel builds


def _finalize_cli(out) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["finalize", str(out)])
    return result.exit_code, result.stderr


def _fanned_out(tiny, tmp_path):
    """A single run and a finished 2-part fan-out of the same checkpoint."""
    fp8conv.convert(tiny.path, tmp_path / "single", ConvertOptions(to="bf16"))
    out = tmp_path / "out"
    for i in (1, 2):
        fp8conv.convert(tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(i, 2)))
    return out


def test_finalize_names_a_damaged_part_manifest_and_its_fix_works(tiny, tmp_path):
    out = _fanned_out(tiny, tmp_path)
    part2 = out / ".fp8conv" / "part-2-of-2.json"
    good = part2.read_bytes()
    doc = json.loads(good)
    no_shards = {k: v for k, v in doc.items() if k != "shards"}
    no_planned = {**doc, "finalize": {k: v for k, v in doc["finalize"].items() if k != "planned_shards"}}
    damaged = [
        (b"{not json", "is not valid JSON (Expecting property name", ""),
        (good[: len(good) // 2], "is not valid JSON", "it ends early, as a truncated file does"),
        (b"", "is not valid JSON (Expecting value", "the file is empty"),
        (b"[]", "holds a JSON array, not an object", ""),
        (json.dumps(no_shards).encode(), "lacks shards", ""),
        (json.dumps(no_planned).encode(), "lacks finalize.planned_shards", ""),
        # a requantization record finalize would merge into the manifest: every report checked first
        (
            json.dumps({**doc, "requantization": {"tensors": {"w": {"relative_frobenius": -1}}}}).encode(),
            "under requantization: is damaged: requantization is not a requantization record",
            "",
        ),
    ]
    (out / "config.json").unlink()
    for raw, problem, why in damaged:
        part2.write_bytes(raw)
        code, err = _finalize_cli(out)
        line = err.splitlines()[0]  # the file, what is wrong with it and the fix, on one line
        assert code == 1 and f"part manifest {part2}" in line and problem in line and why in line, err
        assert "run part 2/2 again with --overwrite" in line and "Traceback" not in err
        assert not (out / "config.json").exists()
    fp8conv.convert(
        tiny.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(2, 2), overwrite=True)
    )  # the fix the message gives
    assert (out / "config.json").exists()  # the last part to finish finalized
    fanned = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
    assert fanned == dir_snapshot(tmp_path / "single")


def test_finalize_refuses_parts_of_another_fp8conv_version(tiny, tmp_path):
    out = _fanned_out(tiny, tmp_path)
    (out / "config.json").unlink()
    for part in out.glob(".fp8conv/part-*.json"):
        doc = json.loads(part.read_text())
        part.write_text(json.dumps({**doc, "fp8conv_version": "0.0.1"}))
    code, err = _finalize_cli(out)
    assert code == 1 and f"the parts in {out} were converted by fp8conv 0.0.1; this is {fp8conv.__version__}" in err
    assert "finalize with fp8conv 0.0.1, or convert every part again with --overwrite" in err
    assert not (out / "config.json").exists()
    part1 = out / ".fp8conv" / "part-1-of-2.json"  # one part of another version: the parts disagree
    part1.write_text(json.dumps({**json.loads(part1.read_text()), "fp8conv_version": fp8conv.__version__}))
    code, err = _finalize_cli(out)
    assert code == 1 and "part 2/2 was run with a different fp8conv_version" in err, err


def test_an_interrupted_finalize_is_finished_by_running_it_again(tiny, tmp_path):
    out = _fanned_out(tiny, tmp_path)
    single = dir_snapshot(tmp_path / "single")
    # What finalize leaves when killed at each of its writes (other files, manifest, index, config last):
    # the files written so far, and the temporary file of the one being written, part-way through
    order = [name for name in single if not name.startswith("model-") and name != "config.json"]
    order = [n for n in order if n not in (".fp8conv/manifest.json", "model.safetensors.index.json")]
    order += [".fp8conv/manifest.json", "model.safetensors.index.json", "config.json"]
    assert all(name in single for name in order)
    for killed_at in range(len(order)):
        for name in order[killed_at:]:
            (out / name).unlink()
        target = out / order[killed_at]
        partial = target.with_name(f".{target.name}.99999{TEMP_SUFFIX}")
        partial.write_bytes(single[order[killed_at]][:5])
        assert not (out / "config.json").exists()
        code, err = _finalize_cli(out)
        assert code == 0, err
        # finalize holds OUT's lock alone (a live part anywhere would hold it too), so the temporary is a dead
        # writer's and goes (issue 23: a killed run's temporaries are removed by finalize)
        assert not partial.exists()
        fanned = {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}
        assert fanned == single, order[killed_at]
