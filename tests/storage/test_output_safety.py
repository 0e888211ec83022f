"""The output side of safety: nothing written outside OUT, no link written through or kept, no code run
from the working directory or the checkpoint, part records and manifests checked before use, one run
per OUT, and nothing that looks finished unless it is."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import fp8conv
from fp8conv import ConvertOptions, RunOptions
from fp8conv.cli.commands import main
from fp8conv.errors import OutputError
from fp8conv.storage.lock import OutputLock
from fp8conv.storage.out_dir import TEMP_SUFFIX, OutDir
from fp8conv.storage.writer import ShardFile
from tests.support.helpers import dir_snapshot

FP8CONV = Path(sys.executable).parent / "fp8conv"  # the console script, as users run it
HOSTILE = "open({marker!r}, 'w').write('ran')\n"


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _one_line_refusal(code: int, output: str, *needles: str) -> None:
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output
    for needle in needles:
        assert needle in errors[0], output


def _records(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in dir_snapshot(out).items() if not k.startswith(".fp8conv/part-")}


# -- no code from the working directory or the checkpoint -------------------------------------------


def test_workers_import_nothing_from_the_working_directory_or_the_checkpoint(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2)
    markers = tmp_path / "markers"
    markers.mkdir()
    for name in ("click", "torch", "safetensors"):
        (ckpt.path / f"{name}.py").write_text(HOSTILE.format(marker=str(markers / name)))
    (ckpt.path / "fp8conv").mkdir()
    (ckpt.path / "fp8conv" / "__init__.py").write_text(HOSTILE.format(marker=str(markers / "fp8conv")))
    (ckpt.path / "fp8conv" / "__main__.py").write_text(HOSTILE.format(marker=str(markers / "fp8conv-main")))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [str(FP8CONV), "convert", ".", "--to", "bf16", "-o", "../out", "-j", "2", "-q"],
        cwd=ckpt.path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in markers.iterdir()) == []  # nothing hostile ran, in the parent or a worker
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    assert _records(tmp_path / "out") == _records(tmp_path / "single")


# -- -o names a directory fp8conv may write ------------------------------------------------------------


def test_an_empty_output_name_is_refused_and_the_checkpoint_kept(tiny, monkeypatch):
    before = dir_snapshot(tiny.path)
    monkeypatch.chdir(tiny.path)
    code, output = _cli("convert", ".", "--to", "bf16", "-o", "", "--overwrite")
    _one_line_refusal(code, output, "empty name")
    code, output = _cli("convert", ".", "--to", "bf16", "-o", "", "--overwrite", "-j", "2")
    _one_line_refusal(code, output, "empty name")
    assert dir_snapshot(tiny.path) == before


def test_an_output_that_cannot_be_a_directory_is_one_line(tiny, tmp_path):
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    _one_line_refusal(*_cli("convert", str(tiny.path), "--to", "bf16", "-o", str(dangling)), "dangling")
    assert not (tmp_path / "nowhere").exists()
    long = tmp_path / ("x" * 300)
    _one_line_refusal(*_cli("convert", str(tiny.path), "--to", "bf16", "-o", str(long)), "too long")
    inside = tiny.path / "sub"
    _one_line_refusal(*_cli("convert", str(tiny.path), "--to", "bf16", "-o", str(inside)), "inside the input")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_a_read_only_output_is_one_line(tiny, tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    _one_line_refusal(*_cli("convert", str(tiny.path), "--to", "bf16", "-o", str(out)), "not writable")


# -- writes contained in OUT -----------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["extra", ".fp8conv", "config.json", "model-00001-of-00002.safetensors"])
def test_a_link_planted_in_the_output_is_refused_and_nothing_outside_written(make_tiny, tmp_path, planted):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("secret")
    target = outside if planted == ".fp8conv" else outside / "secret"
    victim = out / planted
    if victim.is_dir():
        shutil.rmtree(victim)
    else:
        victim.unlink(missing_ok=True)
    victim.symlink_to(target)
    for extra in (["--overwrite"], ["--resume"]):
        code, output = _cli("convert", str(ckpt.path), "--to", "bf16", "-o", str(out), *extra)
        _one_line_refusal(code, output, "link", planted)
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_text() == "secret"


@pytest.mark.parametrize("planted", ["model-00001-of-00002.safetensors", "config.json", ".fp8conv/manifest.json"])
def test_verify_refuses_an_output_holding_a_link_without_reading_its_target(make_tiny, tmp_path, planted):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"))
    moved = tmp_path / "outside"
    (out / planted).rename(moved)  # the same bytes, now reached through a link out of OUT
    (out / planted).symlink_to(moved)
    code, output = _cli("verify", str(ckpt.path), str(out))
    _one_line_refusal(code, output, "link", planted)


def test_a_link_planted_during_the_run_is_never_written_through_or_shipped(make_tiny, tmp_path, monkeypatch):
    """Planted after the checks: shards and manifest replace links rather than follow them, and the
    output is refused before its index and config.json make it look finished."""
    import fp8conv.output.manifest as manifest_module

    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    outside = tmp_path / "secret"
    outside.write_text("secret")
    real = manifest_module.Manifest.record_shard

    def plant(self, out_path, name, sha256, extra=None):
        real(self, out_path, name, sha256, extra)
        if not (out / "evil").is_symlink():
            (out / "evil").symlink_to(outside)
            (out / ".fp8conv" / "manifest.json").unlink()
            (out / ".fp8conv" / "manifest.json").symlink_to(outside)  # the next save replaces it

    monkeypatch.setattr(manifest_module.Manifest, "record_shard", plant)
    with pytest.raises(OutputError, match="evil, a symbolic link"):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"))
    assert outside.read_text() == "secret"
    assert not (out / "config.json").exists() and not (out / "model.safetensors.index.json").exists()
    assert not (out / ".fp8conv" / "manifest.json").is_symlink()


def test_a_temporary_name_planted_as_a_link_is_replaced_not_followed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    outside = tmp_path / "secret"
    outside.write_text("secret")
    final = out / "model.safetensors"
    with OutDir.open(out) as within:
        temp = ShardFile(final, direct=False, within=within)
        temp.abort()
        Path(temp.temp).symlink_to(outside)  # the very name this process will use
        shard = ShardFile(final, direct=False, within=within)
        shard.write(memoryview(b"shard bytes"), 0)
        shard.commit(11)
    assert outside.read_text() == "secret"
    assert final.read_bytes() == b"shard bytes" and not final.is_symlink()
    assert not list(out.glob(f".*{TEMP_SUFFIX}"))


# -- finalize and resume trust no record -------------------------------------------------------------


def _fanned_out(ckpt, out: Path) -> None:
    for i in (1, 2):
        fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(i, 2)))
    (out / "config.json").unlink()


def _edit_records(out: Path, edit) -> None:
    for i in (1, 2):
        path = out / ".fp8conv" / f"part-{i}-of-2.json"
        doc = json.loads(path.read_text())
        edit(doc)
        path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["finalize"].update(copy_from="/etc", copy_files=["passwd"]), "does not hold the input"),
        (lambda d: d["finalize"].update(copy_files=["../../escaped"]), "finalize.copy_files"),
        (lambda d: d["finalize"].update(json_files={"../escaped.json": {}}), "finalize.json_files"),
        (lambda d: d["finalize"].update(json_files={"/tmp/escaped.json": {}}), "finalize.json_files"),
        (lambda d: d["finalize"].update(planned_shards="x"), "finalize.planned_shards"),
        (lambda d: d.update(options=[]), "under options"),
        (lambda d: d["shards"].update({"model-00001-of-00002.safetensors": {"size": True}}), "under shards."),
        (lambda d: d["shards"].update({"../x.safetensors": {"size": 1, "sha256": "0" * 64}}), "under shards."),
    ],
)
def test_finalize_refuses_a_record_that_leaves_the_output_or_is_damaged(make_tiny, tmp_path, edit, needle):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "sub" / "out"
    _fanned_out(ckpt, out)
    _edit_records(out, edit)
    _one_line_refusal(*_cli("finalize", str(out)), needle, "part-")
    assert not (out / "passwd").exists() and not (out / "config.json").exists()
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["out"]
    assert not Path("/tmp/escaped.json").exists()


def test_finalize_refuses_a_file_to_copy_that_links_out_of_the_input(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    _fanned_out(ckpt, out)
    secret = tmp_path / "secret"
    secret.write_text("secret")
    (ckpt.path / "evil.json").symlink_to(secret)  # after the parts ran: finalize copies it
    _edit_records(out, lambda d: d["finalize"]["copy_files"].append("evil.json"))
    _one_line_refusal(*_cli("finalize", str(out)), "evil.json is not a regular file inside the input")
    assert not (out / "evil.json").exists()


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda d: d.update(options="bf16"), "options"),
        (lambda d: d.update(options={"to": ["bf16"]}), "options"),
        (lambda d: d["shards"].update({"model-00001-of-00002.safetensors": 7}), "shards.model-00001-of-00002"),
        (lambda d: d.update(input=[]), "input"),
    ],
)
def test_a_damaged_manifest_is_one_line_for_resume_and_verify(make_tiny, tmp_path, edit, key):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"))
    path = out / ".fp8conv" / "manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    resume = _cli("convert", str(ckpt.path), "--to", "bf16", "-o", str(out), "--resume")
    _one_line_refusal(*resume, "manifest.json", f"under {key}")
    _one_line_refusal(*_cli("verify", str(ckpt.path), str(out)), "manifest.json", f"under {key}")


# -- one run per OUT -------------------------------------------------------------------------------


def test_a_second_run_into_a_locked_output_is_refused_naming_the_holder(make_tiny, tmp_path):
    ckpt = make_tiny(num_shards=2)
    out = tmp_path / "out"
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"))
    before = dir_snapshot(out)
    with OutDir.open(out) as within, OutputLock.for_run(within, None, "convert"):
        code, output = _cli("convert", str(ckpt.path), "--to", "channel", "-o", str(out), "--overwrite")
        _one_line_refusal(code, output, "in use by another fp8conv run", f"pid {os.getpid()}", "since ")
        with pytest.raises(OutputError, match="in use"):
            fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(part=(1, 2), overwrite=True))
        with pytest.raises(OutputError, match="in use"):
            fp8conv.finalize(out)
    assert dir_snapshot(out) == before  # the refused runs wrote nothing
    # a part holds it shared: a whole run is refused, naming that part
    with OutDir.open(out) as within, OutputLock.for_run(within, (2, 3), "convert"):
        code, output = _cli("convert", str(ckpt.path), "--to", "bf16", "-o", str(out), "--overwrite")
        _one_line_refusal(code, output, "--part 2/3", f"pid {os.getpid()}")
    # a stale lock (its holder killed: nobody holds the file, its record remains) is taken over
    (out / ".fp8conv" / "lock").write_text(json.dumps({"pid": 999999, "host": "gone", "started": "then"}))
    fp8conv.convert(ckpt.path, out, ConvertOptions(to="bf16"), run=RunOptions(overwrite=True))
    assert dir_snapshot(out) == before  # and the finished output holds no lock file


# -- the space estimate ----------------------------------------------------------------------------


def test_the_space_check_counts_every_byte_the_run_writes(make_tiny, tmp_path, monkeypatch):
    """Headers, index, config, manifest and copied files too: free space one byte short of what a
    finished output holds is refused (the estimate of the tensor bytes alone passed, then ENOSPC)."""
    ckpt = make_tiny(num_shards=2)
    fp8conv.convert(ckpt.path, tmp_path / "single", ConvertOptions(to="bf16"))
    written = sum(len(data) for data in dir_snapshot(tmp_path / "single").values())
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=written - 1))
    with pytest.raises(OutputError, match=rf"needs \d+ bytes .* has {written - 1} bytes"):
        fp8conv.convert(ckpt.path, tmp_path / "out", ConvertOptions(to="bf16"))
    assert not (tmp_path / "out").exists()


def test_a_failing_worker_is_one_line_and_leaves_no_output_behind(tmp_path):
    out = tmp_path / "out"
    code, output = _cli("convert", str(tmp_path / "missing"), "--to", "bf16", "-o", str(out), "-j", "2")
    _one_line_refusal(code, output, "missing")
    assert not out.exists()  # the parent made it to hold the lock, and removed it again
