"""The library reports through the ``ort_trainer`` logger, never ``print``; ORT_TRAINER_LOG_LEVEL raises verbosity.

(The asynchronous-save error at exit is checked as an ERROR record in tests/checkpoint/test_checkpoint_async.py.)
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap

from ort_trainer.runtime._native_logs import quiet_native_info_logs
from tests.paths import REPO

LIBRARY = [REPO / "ort_trainer", REPO / "checkpoint", REPO / "optim", REPO / "amp"]
CLI = [REPO / "checkpoint" / "cli", REPO / "checkpoint" / "__main__.py", REPO / "ort_trainer" / "__main__.py"]


def _is_cli(path) -> bool:
    return any(path == c or c in path.parents for c in CLI)


def test_no_print_in_library_code_outside_the_command_lines():
    offenders = []
    for root in LIBRARY:
        for path in root.rglob("*.py"):
            if _is_cli(path):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert offenders == []


def _python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "ORT_TRAINER_LOG_LEVEL"} | env
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environ, capture_output=True, text=True, timeout=120
    )


def test_env_var_sets_the_level_and_adds_one_stderr_handler():
    code = """
        import logging, ort_trainer
        logger = logging.getLogger("ort_trainer")
        print(logger.level, len(logger.handlers))
        logging.getLogger("ort_trainer.engine.x").debug("built %d graphs", 3)
        logging.getLogger("other").warning("not ours")
    """
    run = _python(code, ORT_TRAINER_LOG_LEVEL="debug")
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str(logging.DEBUG), "1"]
    assert "ort_trainer.engine.x DEBUG: built 3 graphs" in run.stderr
    quiet = _python(code)  # unset: no level, no handler; debug records dropped
    assert quiet.stdout.split() == [str(logging.NOTSET), "0"] and "built" not in quiet.stderr


def test_env_var_output_prints_once_when_a_root_handler_comes_later():
    """``import onnxruntime`` (onnxruntime-training) calls logging.basicConfig: records printed twice before."""
    code = """
        import logging, ort_trainer
        logging.getLogger("ort_trainer.x").info("before")
        import onnxruntime
        logging.basicConfig(format="ROOT %(name)s %(message)s")  # a no-op if onnxruntime's import did it
        logging.getLogger("ort_trainer.x").info("after")
    """
    run = _python(code, ORT_TRAINER_LOG_LEVEL="INFO")
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("before") == 1 and run.stderr.count("after") == 1, run.stderr


def test_env_var_respects_an_existing_configuration_and_rejects_nonsense():
    configured = _python(
        """
        import logging
        logging.basicConfig(format="APP %(name)s %(message)s")
        import ort_trainer
        logging.getLogger("ort_trainer.x").info("hello")
        print(len(logging.getLogger("ort_trainer").handlers))
        """,
        ORT_TRAINER_LOG_LEVEL="INFO",
    )
    assert configured.stdout.split() == ["0"] and "APP ort_trainer.x hello" in configured.stderr, configured.stderr
    bad = _python("import ort_trainer", ORT_TRAINER_LOG_LEVEL="loud")
    assert bad.returncode == 1 and "ORT_TRAINER_LOG_LEVEL='loud' is not a logging level" in bad.stderr


def test_native_onnxruntime_lines_become_records_by_severity(caplog):
    lines = [
        "2026-11-25 [I:onnxruntime:, graph.cc:1] transformer applied",
        "2026-11-25 [W:onnxruntime:, session.cc:2] a warning",
        "2026-11-25 [E:onnxruntime:, session.cc:3] an error",
        "something else on stderr",
    ]
    with caplog.at_level(logging.DEBUG, logger="ort_trainer"), quiet_native_info_logs():
        os.write(2, ("\n".join(lines) + "\n").encode())
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    name = "ort_trainer.diagnosis._native_logs"
    assert records == [
        (name, logging.DEBUG, lines[0]),
        (name, logging.WARNING, lines[1]),
        (name, logging.ERROR, lines[2]),
        (name, logging.WARNING, lines[3]),
    ]
