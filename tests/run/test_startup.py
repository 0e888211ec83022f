"""Reading, planning, inspect and --help never import torch: each check runs in a fresh interpreter."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from tests.support.interpreter import run_fresh_interpreter
from tests.support.synthetic import build_tiny_deepseek


def test_import_cli_and_help_do_not_import_torch() -> None:
    run_fresh_interpreter(
        "import fp8conv, fp8conv.cli.commands\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(fp8conv.cli.commands.main, ['--help'])\n"
        "assert r.exit_code == 0 and 'convert' in r.output, r.output\n"
        "r = CliRunner().invoke(fp8conv.cli.commands.main, ['convert', '--help'])\n"
        "assert r.exit_code == 0 and '--to' in r.output, r.output\n"
    )


def test_inspect_does_not_import_torch(tmp_path: Path) -> None:
    ckpt = build_tiny_deepseek(tmp_path / "ckpt")
    run_fresh_interpreter(
        "from click.testing import CliRunner\n"
        "from fp8conv.cli.commands import main\n"
        f"r = CliRunner().invoke(main, ['inspect', {str(ckpt.path)!r}])\n"
        "assert r.exit_code == 0 and 'block-fp8' in r.output, r.output\n"
        f"r = CliRunner().invoke(main, ['inspect', '--json', {str(ckpt.path)!r}])\n"
        "assert r.exit_code == 0 and '\"shards\"' in r.output, r.output\n"
    )


def test_reading_classifying_and_planning_do_not_import_torch(tmp_path: Path) -> None:
    ckpt = build_tiny_deepseek(tmp_path / "ckpt")
    run_fresh_interpreter(
        "from fp8conv.model.classify import classify\n"
        "from fp8conv.plan.conversion import ConvertOptions, plan_conversion\n"
        "from fp8conv.source.checkpoint import open_checkpoint\n"
        f"ck = open_checkpoint({str(ckpt.path)!r})\n"
        "cls = classify(ck.index, ck.config)\n"
        "for target in ('bf16', 'channel', 'block'):\n"
        "    plan = plan_conversion(ck, cls, ConvertOptions(target))\n"
        "    assert plan.shards, target\n"
    )


def test_the_read_ahead_while_torch_loads_needs_no_torch(tmp_path: Path) -> None:
    ckpt = build_tiny_deepseek(tmp_path / "ckpt")
    run_fresh_interpreter(
        "from fp8conv.run import warm_start\n"
        "from fp8conv.plan.conversion import ConvertOptions\n"
        "warm = warm_start.WarmStart()\n"
        f"warm.begin({str(ckpt.path)!r}, ConvertOptions('bf16')).join()\n"
        "assert warm.preread.held_bytes() > 0\n"
    )


def test_torch_files_are_hinted_without_importing_torch() -> None:
    run_fresh_interpreter(
        "from fp8conv.run import warm_start\n"
        "warm = warm_start.WarmStart()\n"
        "thread = warm.torch(even_if_cached=True)\n"  # the test's page cache holds torch already
        "assert thread is not None\n"
        "thread.join()\n"
        "warm.close()\n"
        "hinted = [p for p in warm.hinted if '/torch/' in p]\n"
        "assert len(hinted) > 100 and any(p.endswith('.pyc') for p in hinted), warm.hinted[:5]\n"
    )


def test_the_command_process_ends_with_its_status_and_everything_said(tmp_path: Path) -> None:
    """entry.run ends the process without Python's teardown: the status and the printed lines must survive."""
    ckpt = build_tiny_deepseek(tmp_path / "ckpt")
    out = tmp_path / "out"

    def fp8conv(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fp8conv", *args], capture_output=True, text=True, timeout=300)

    done = fp8conv("convert", str(ckpt.path), "--to", "bf16", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: ") and (out / "config.json").is_file()
    again = fp8conv("convert", str(ckpt.path), "--to", "bf16", "-o", str(out))
    assert again.returncode == 1 and again.stderr.startswith("error: output directory"), again.stderr
    usage = fp8conv("convert", str(ckpt.path), "--to", "nope", "-o", str(out))
    assert usage.returncode == 2 and "Invalid value for '--to'" in usage.stderr, usage.stderr


def test_every_runtime_dependency_is_imported() -> None:
    """pyproject.toml's dependencies are packages fp8conv imports: none is installed for nothing (rich was)."""
    root = Path(__file__).resolve().parents[2]
    block = re.search(r"^dependencies = \[(.*?)^\]", (root / "pyproject.toml").read_text(), re.M | re.S)
    assert block
    deps = {
        re.split(r"[<>=!~\[ ]", d)[0].lower().replace("-", "_") for d in re.findall(r'^\s*"([^"]+)"', block[1], re.M)
    }
    imported = set()
    for path in (root / "fp8conv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    assert deps and deps <= imported, f"dependencies nothing imports: {sorted(deps - imported)}"
