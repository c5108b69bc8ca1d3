"""The JS driver's own unit tests (js/test, node's test runner): the safetensors reader and writer's bounds
checks, the manifest's checks and symbolic dims, the random draws' moments, and the trainer's refusals of batches,
states and graphs that do not fit the manifest (against tests/js/linear_artifact.py's artifact)."""

from __future__ import annotations

import os
import re
import subprocess

from tests.js.linear_artifact import write_linear_artifact
from tests.js.runners import JS


def test_node_unit_tests_pass(tmp_path):
    artifact = write_linear_artifact(tmp_path / "artifact")
    done = subprocess.run(
        ["node", "--test", "--test-reporter=tap", "test/"],
        cwd=JS,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ARTIFACT": str(artifact)},
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    passed = int(re.search(r"^# pass (\d+)$", output, re.M).group(1))
    failed = int(re.search(r"^# fail (\d+)$", output, re.M).group(1))
    assert failed == 0 and passed >= 18, output
