"""The house stays readable: no import circles between our modules, every package declares ``__all__``.

Imports are read from the source (``ast``); imports under ``if TYPE_CHECKING:`` are for annotations only
and do not count. Module names are the installed ones (``ort_trainer.checkpoint.format._codec``).
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.paths import REPO

_ROOTS = {"ort_trainer": REPO / "ort_trainer", **{f"ort_trainer.{p}": REPO / p for p in ("checkpoint", "optim", "amp")}}


@functools.cache
def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in _ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _imports(tree: ast.Module, type_checking: bool) -> list[ast.Import | ast.ImportFrom]:
    skipped: set[int] = set()
    for node in ast.walk(tree) if not type_checking else ():
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skipped]


def _import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(ast.parse(path.read_text()), type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _is_parent_package_edge(a: str, b: str) -> bool:
    """A package's ``__init__`` importing its own submodule (and that submodule importing a sibling via the
    package) is how Python packages work; only cycles between non-ancestor modules are circles."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_no_import_circles():
    graph = {
        name: {t for t in edges if not _is_parent_package_edge(name, t)} for name, edges in _import_graph().items()
    }
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_trainer_state_modules_do_not_import_the_trainer():
    """Not even for annotations: they work on the explicit `TrainerState`."""
    graph = _import_graph(type_checking=True)
    for name, edges in graph.items():
        if name.startswith(("ort_trainer._state", "ort_trainer.engine")):
            assert "ort_trainer.trainer" not in edges, name


def _folder_of(module: str) -> str:
    """The top-level folder a module lives in (``ort_trainer.checkpoint.io`` -> ``ort_trainer.checkpoint``)."""
    return max((p for p in _ROOTS if module == p or module.startswith(p + ".")), key=len)


@functools.cache
def _room_of(module: str) -> str:
    """The room a module lives in: the first sub-package of its top-level folder (``ort_trainer.engine``,
    ``ort_trainer.checkpoint.io``), or the folder itself for its flat modules (``trainer.py``, ``optim/*``)."""
    folder = _folder_of(module)
    rest = module[len(folder) :].lstrip(".")
    first = f"{folder}.{rest.split('.')[0]}" if rest else folder
    path = _modules().get(first)
    return first if path is not None and path.name == "__init__.py" else folder


def _resolved(name: str, path: Path, node: ast.ImportFrom) -> str:
    base = node.module or ""
    if node.level:
        anchor = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    return base


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def _package_all(module: str) -> set[str] | None:
    path = _modules()[module]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts}
    return None


def _crossings(scope: Callable[[str], str]) -> list[str]:
    """Imports of an underscored module or name of another ``scope`` (folder or room), and names taken from
    another room's package that its ``__init__`` does not list in ``__all__``."""
    modules, found = _modules(), []
    rooms = {_room_of(m) for m in modules}
    for name, path in modules.items():
        for node in _imports(ast.parse(path.read_text()), type_checking=True):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = _resolved(name, path, node)
            if not base.startswith("ort_trainer") or scope(base) == scope(name):
                continue
            tail = base[len(scope(base)) :].split(".")
            private = [p for p in tail if _private(p)]
            private += [a.name for a in node.names if _private(a.name) and f"{base}.{a.name}" not in rooms]
            if private:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {base} {private}")
            elif base in rooms and base == scope(base) and (listed := _package_all(base)) is not None:
                unlisted = [
                    a.name
                    for a in node.names
                    if a.name not in listed and not a.name.startswith("__") and f"{base}.{a.name}" not in modules
                ]
                if unlisted:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {base} {unlisted}: not in __all__")
    return found


def test_packages_meet_only_at_public_seams():
    """No module of one top-level folder imports an underscored module or name of another folder."""
    crossings = _crossings(_folder_of)
    assert not crossings, "\n".join(crossings)


def test_rooms_import_only_what_another_room_lists():
    """The house rule (docs/architecture.md): between rooms (``engine/``, ``graph/``, ``checkpoint/io/``...),
    only what a room's ``__init__`` lists, or a public module of it (``format.schema``), is imported."""
    crossings = _crossings(_room_of)
    assert not crossings, "\n".join(crossings)


def test_no_private_attribute_of_another_folder_or_room_is_read():
    """``S._scalar`` through a module imported from another room is the same crossing as importing ``_scalar``."""
    modules, found = _modules(), []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        foreign = set()  # local names bound to a module of another room
        for node in _imports(tree, type_checking=True):
            if isinstance(node, ast.ImportFrom):
                base = _resolved(name, path, node)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    if target in modules and _room_of(target) != _room_of(name):
                        foreign.add(alias.asname or alias.name)
            else:
                for alias in node.names:
                    if alias.name in modules and _room_of(alias.name) != _room_of(name):
                        foreign.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id in foreign and _private(node.attr):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not found, "\n".join(found)


def test_config_and_checkpoint_rooms_import_one_way():
    """config/ is read by every room and reads none; diagnosis/ sits below graph/;
    checkpoint: format <- sets <- io <- objects <- manager."""
    graph = _import_graph(type_checking=True)
    rooms = ("ort_trainer.graph", "ort_trainer.engine", "ort_trainer._state", "ort_trainer.diagnosis")
    lower = {
        "ort_trainer.config": (*rooms, "ort_trainer.trainer"),
        "ort_trainer.diagnosis": (*rooms[:3], "ort_trainer.trainer"),
        "ort_trainer.checkpoint.sets": (
            "ort_trainer.checkpoint.io",
            "ort_trainer.checkpoint.objects",
            "ort_trainer.checkpoint.manager",
        ),
        "ort_trainer.checkpoint.format": (
            "ort_trainer.checkpoint.io",
            "ort_trainer.checkpoint.sets",
            "ort_trainer.checkpoint.objects",
        ),
        "ort_trainer.checkpoint.io": ("ort_trainer.checkpoint.objects", "ort_trainer.checkpoint.manager"),
        "ort_trainer.checkpoint.objects": ("ort_trainer.checkpoint.manager", "ort_trainer.checkpoint.cli"),
    }
    for name, edges in graph.items():
        for room, forbidden in lower.items():
            if name.startswith(room):
                wrong = sorted(e for e in edges if e.startswith(forbidden))
                assert not wrong, f"{name} imports {wrong}"


def test_every_package_declares_its_public_api():
    for name, path in _modules().items():
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            names = {
                t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if hasattr(t, "id")
            }
            assert "__all__" in names, f"{name} ({path}) has no __all__"


def test_checkpoint_package_shows_its_parts():
    folder = _ROOTS["ort_trainer.checkpoint"]
    rooms = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"format", "sets", "cli"} <= rooms
    assert (folder / "format" / "FORMAT.md").exists()


def test_trainer_package_shows_its_parts_and_imports_go_one_way():
    """graph/ (making the training graph) never imports engine/ (running it) or the state code; the ONNX Runtime
    plumbing (runtime/) imports nothing of ours."""
    folder = _ROOTS["ort_trainer"]
    rooms = {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {"config", "graph", "diagnosis", "engine", "_state", "runtime"} <= rooms
    flat = {p.name for p in folder.glob("*.py")}
    assert flat == {"__init__.py", "__main__.py", "trainer.py", "train_step_info.py"}, flat  # __main__: -m
    for wing in (
        "engine/autograd",
        "engine/onnxblock",
        "graph/autograd",
        "graph/onnxblock",
        "graph/onnxblock/rewrites",
    ):
        assert (folder / wing / "__init__.py").exists(), wing
    above = {
        "ort_trainer.graph": ("ort_trainer.engine", "ort_trainer._state", "ort_trainer.trainer", "ort_trainer.module"),
        # the engine names no room above it: model parallel plugs in through its graph source (engine.ModelParallel)
        "ort_trainer.engine": ("ort_trainer._state", "ort_trainer.trainer", "ort_trainer.hf", "ort_trainer.module"),
        # ORTModule and the compile backend sit beside the trainer, on graph/ and engine/, never the trainer's state
        "ort_trainer.module": ("ort_trainer._state", "ort_trainer.trainer", "ort_trainer.parallel", "ort_trainer.hf"),
        "ort_trainer.runtime": tuple(
            f"ort_trainer.{room}"
            for room in rooms - {"runtime", "_package"} | {"trainer", "checkpoint", "optim", "amp"}
        ),
    }
    for name, edges in _import_graph(type_checking=True).items():
        for room, forbidden in above.items():
            if name.startswith(room):
                wrong = sorted(e for e in edges if e.startswith(forbidden))
                assert not wrong, f"{name} imports {wrong}"


# Each engine is a wing: its graph half, its engine half (build, session, source) and what only it runs. The
# registry (`engine._sources`) names a wing's module as a string; ORTModule (`module/`) and the training-artifact
# exporter (`export/`) reuse the autograd wing; `ort_trainer.parallel` is the public door of the onnxblock wing's
# Megatron names.
WINGS = {
    "autograd": ("ort_trainer.engine.autograd", "ort_trainer.graph.autograd"),
    "onnxblock": ("ort_trainer.engine.onnxblock", "ort_trainer.graph.onnxblock", "ort_trainer.parallel"),
}
WING_GUESTS = {"autograd": ("ort_trainer.module", "ort_trainer.export"), "onnxblock": ()}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_nothing_outside_a_wing_imports_it():
    """Not even for annotations: a wing can be taken out by deleting its folders and its registry entry."""
    found = []
    for name, edges in _import_graph(type_checking=True).items():
        for wing, packages in WINGS.items():
            if _in(name, packages) or _in(name, WING_GUESTS[wing]):
                continue
            found += [f"{name} imports {e} ({wing} wing)" for e in sorted(edges) if _in(e, packages)]
    assert not found, "\n".join(found)


def test_the_registry_names_every_wing_and_each_wing_offers_its_source():
    from ort_trainer.engine import _sources

    assert {n: m for n, m in _sources._REGISTRY.items()} == {w: p[0] for w, p in WINGS.items()}
    for module in _sources._REGISTRY.values():
        init = ast.parse(_modules()[module].read_text())
        assert "SOURCE" in ast.unparse(init), f"{module} does not offer SOURCE"


def test_ortmodule_imports_only_the_runtime_room_and_the_autograd_wing_of_the_engine():
    """ORTModule needs ONNX Runtime plumbing and the autograd graphs: importing it loads neither the trainer's engine
    core nor what that would bring (checkpoint/, optim/, the process group code)."""
    script = (
        "import sys, ort_trainer.module\n"
        "print(sorted({m.split('.')[1] + ('.' + m.split('.')[2] if m.count('.') > 1 else '') "
        "for m in sys.modules if m.startswith('ort_trainer.')}))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = set(ast.literal_eval(done.stdout.strip().splitlines()[-1]))
    rooms = {room.split(".")[0] for room in loaded}
    assert rooms <= {"_package", "amp", "config", "diagnosis", "graph", "module", "runtime"}, sorted(rooms)
    assert not {r for r in loaded if r.startswith("graph.") and not r.startswith("graph._")} - {"graph.autograd"}


def test_the_module_room_uses_only_the_public_names_of_graph_and_engine():
    """ort_trainer.module (ORTModule, the compile backend) reuses the autograd engine's pieces through their
    packages' ``__all__``: no underscored module or name of another room."""
    crossings = []
    for name, path in _modules().items():
        if not name.startswith("ort_trainer.module"):
            continue
        for node in _imports(ast.parse(path.read_text()), type_checking=True):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ort_trainer."):
                private = [p for p in node.module.split(".") if p.startswith("_")]
                private += [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    crossings.append(f"{path.relative_to(REPO)}:{node.lineno} imports {node.module} {private}")
    assert not crossings, "\n".join(crossings)
    nobody = [n for n, edges in _import_graph(type_checking=True).items() if "ort_trainer.module" in edges]
    assert nobody == ["ort_trainer"], nobody  # only the package's lazy `ORTModule` name reaches it


def test_every_module_of_a_room_is_named_in_its_init_docstring():
    """A room's ``__init__`` docstring is its door sign: a newcomer finds every module of it there."""
    unnamed = []
    for path in _modules().values():
        if path.name != "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        folder = path.parent
        parts = [p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        parts += [p.name for p in folder.iterdir() if (p / "__init__.py").is_file()]
        missing = sorted(p for p in parts if not re.search(rf"(?<!\w){re.escape(p)}(?!\w)", doc))
        if missing:
            unnamed.append(f"{path.relative_to(REPO)} does not name {missing}")
    assert not unnamed, "\n".join(unnamed)


def _class_members(module: str, name: str) -> set[str]:
    tree = ast.parse(_modules()[module].read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    members = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    members |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    return members | {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_every_session_implements_the_whole_step_session_protocol():
    """`engine.StepSession` is declared once; every engine's session (and Megatron's) has each of its members, so
    that the step, the binding check and the error explanation call them instead of probing with ``getattr``."""
    declared = _class_members("ort_trainer.engine._step_session", "StepSession")
    assert declared >= {"draws_randomness", "seed_step", "rebind_state", "run_train", "run_eval", "explain_failure"}
    sessions = [
        ("ort_trainer.engine.autograd._session", "AutogradSession"),
        ("ort_trainer.engine.onnxblock._session", "TrainingSession"),
        ("ort_trainer.engine.onnxblock.parallel.runner", "ParallelSession"),
    ]
    missing = {name: sorted(declared - _class_members(module, name)) for module, name in sessions}
    assert not any(missing.values()), missing
    probes = []
    for name, path in _modules().items():
        if name.startswith(("ort_trainer.engine", "ort_trainer.diagnosis")):
            text = path.read_text()
            found = re.findall(r"getattr\([^)]*\"(\w+)\"", text)
            probes += [f"{name}: {m}" for m in found if m in declared | {"group", "explained"}]
    assert not probes, probes  # what the protocol replaced: draws_randomness, rebind_state, group, explained
