"""Every ```python block of README.md and docs/*.md runs as written.

Single-process blocks of one file run in order in one namespace, in a fresh subprocess whose working
directory is an empty temporary folder (only the installed package is importable: the repository is
not on its path). Blocks marked ``<!-- doctest: processes -->`` run by their own test, each as a script
on 2 ranks (``python -m torch.distributed.run``), in order, in one temporary folder per file. The docs/
pages are discovered when the tests are collected, so a new page is covered without editing this file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.package.doc_blocks import PROCESSES_MARKER, python_blocks, write_blocks
from tests.paths import REPO
from tests.ranks import free_port

RUNNER = Path(__file__).with_name("doc_blocks.py")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_SINGLE = [p for p in DOCS if any(not b.processes for b in python_blocks(p))]
_MULTI = [p for p in DOCS if any(b.processes for b in python_blocks(p))]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _label(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_the_markdown_files_have_python_blocks_and_the_parser_finds_them():
    readme = python_blocks(REPO / "README.md")
    assert len(readme) >= 4, readme
    assert any(b.processes for b in readme), f"README.md has no block marked {PROCESSES_MARKER}"
    assert all(b.code.strip() and "```" not in b.code for b in readme)


def _run_blocks(doc: Path, tmp_path: Path, work: Path) -> None:
    blocks = [b for b in python_blocks(doc) if not b.processes]
    spec = write_blocks(blocks, tmp_path / "blocks.json")
    run = subprocess.run(
        [sys.executable, "-I", str(RUNNER), str(spec)],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"{_label(doc)}:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert run.stdout.count("\nok ") + run.stdout.startswith("ok ") == len(blocks), run.stdout


@pytest.mark.parametrize("doc", _SINGLE, ids=_label)
def test_python_blocks_run_in_order_in_one_namespace(doc, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _run_blocks(doc, tmp_path, work)
    if doc.name == "README.md":  # what a reader does: run the examples again, in the same folder
        _run_blocks(doc, tmp_path, work)


@pytest.mark.processes
@pytest.mark.parametrize("doc", _MULTI, ids=_label)
def test_blocks_marked_processes_run_on_two_ranks(doc, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for number, block in enumerate(b for b in python_blocks(doc) if b.processes):
        script = tmp_path / f"block{number}.py"
        script.write_text(block.code)
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        command += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
        run = subprocess.run(command, cwd=work, env=_env(), capture_output=True, text=True, timeout=300)
        where = f"{_label(doc)}:{block.line}"
        assert run.returncode == 0, f"{where} on 2 ranks:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
