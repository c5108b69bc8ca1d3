"""The test tree stays honest: no test module imports another, the marker lists of ``tests/conftest.py`` name
tests that exist (a moved or renamed test would silently lose its ``slow`` marker), and the onnxblock tests live in
``tests/onnxblock/``, which only the onnxruntime-training venv collects."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import LATEST_TESTS, ONNXBLOCK_FOLDER, SLOW_TESTS
from tests.paths import REPO

TESTS = REPO / "tests"


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if ".venv" not in p.parts)


def test_no_test_module_imports_another():
    """Shared code lives in helper modules (``tests/builders.py``, ``tests/checkpoint/crafted_files.py``...),
    never in a test module: importing one collects its tests twice and ties two files together."""
    found = []
    for path in _test_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n.startswith("tests.") and n.rsplit(".", 1)[-1].startswith("test_") for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        names |= {f"{cls.name}::{n.name}" for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return {n for n in names if n.rsplit("::", 1)[-1].startswith("test")}


def test_every_entry_of_the_marker_lists_names_an_existing_test():
    stale = []
    lists = (("SLOW_TESTS", SLOW_TESTS), ("LATEST_TESTS", LATEST_TESTS))
    for list_name, entries in lists:
        for entry in sorted(entries):
            file, _, test = entry.partition("::")
            path = TESTS / file
            test = test.split("[")[0]  # LATEST_TESTS names single parametrizations too (checked by test-latest)
            if not path.is_file() or (test and test not in _test_functions(path)):
                stale.append(f"{list_name}: {entry}")
    assert not stale, "entries that name no test (moved or renamed?):\n" + "\n".join(stale)


def _recipe(target: str) -> str:
    """The pytest command of a Makefile target, with the Makefile's variables put in."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) := (.+)$", text, re.M))
    recipe = re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", text, re.M).group(1)
    return re.sub(r"\$\(([A-Z_]+)\)", lambda m: variables.get(m.group(1), m.group(0)), recipe)


def test_the_onnxblock_folder_is_collected_only_by_the_onnxruntime_training_venv():
    """tests/onnxblock/ (whose files import onnxruntime-training) is left out by every stock-venv target and
    collected by ``make test-onnxblock``; the stock targets deselect the onnxblock parametrizations elsewhere."""
    assert (TESTS / ONNXBLOCK_FOLDER).is_dir()
    for target in ("test", "test-long", "test-slow", "test-faults", "test-zoo", "test-hf", "test-install"):
        recipe = _recipe(target)
        assert f"--ignore=tests/{ONNXBLOCK_FOLDER.rstrip('/')}" in recipe and "not onnxblock" in recipe, target
    assert "--ignore" not in _recipe("test-onnxblock")


_ONNXBLOCK_IMPORT = (
    r"^\s*(from|import) (onnxruntime\.training|ort_trainer\.(engine|graph)\.onnxblock|ort_trainer\.parallel)\b"
)


def test_no_test_outside_the_onnxblock_folder_imports_onnxruntime_training():
    """A test that means the onnxblock engine lives in tests/onnxblock/ (its marker follows from the folder)."""
    found = []
    for path in _test_modules():
        if path.relative_to(TESTS).as_posix().startswith(ONNXBLOCK_FOLDER):
            continue
        imports = (
            r"^\s*(from|import) (onnxruntime\.training|ort_trainer\.(engine|graph)\.onnxblock|ort_trainer\.parallel)\b"
        )
        if re.search(imports, path.read_text(), re.M):
            found.append(str(path.relative_to(REPO)))
    assert not found, found


def _texts_that_name_tests() -> list[Path]:
    """README.md and every other Markdown and Python file of the repository (not CHANGELOG.md: its entries tell
    history), outside the virtual environments, build outputs and npm's installed packages (js/node_modules: other
    projects' READMEs name their own tests/)."""
    skip = {".git", "build", "out"}
    folders = [
        p
        for p in REPO.iterdir()
        if p.is_dir() and p.name not in skip and not p.name.startswith(".venv") and not p.name.endswith(".egg-info")
    ]
    found = [REPO / "README.md", *REPO.glob("*.py")]
    for folder in folders:
        found += [p for p in [*folder.rglob("*.md"), *folder.rglob("*.py")] if "node_modules" not in p.parts]
    return sorted(found)


def test_every_test_path_named_in_docs_and_code_exists():
    """README.md named the checkpoint tests as in the top of tests/ long after they moved into tests/checkpoint/
    (and code comments tests/interop/'s as well): each ``tests/...py`` path named (a glob too) must match a file."""
    stale = []
    for path in _texts_that_name_tests():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for named in re.findall(r"\btests/[\w*/]+\.py\b", line):
                if not any(REPO.glob(named)):
                    stale.append(f"{path.relative_to(REPO)}:{number}: {named}")
    assert not stale, "paths that name no file (moved or renamed?):\n" + "\n".join(stale)
