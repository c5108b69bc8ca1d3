"""SIGKILL a process in the middle of saving: the checkpoint is always the old or the new tree, never partial.

A helper process (``python -c``) imports the library once and then forks one saver per round, so
each round costs a fork instead of a fresh interpreter with torch. The saver overwrites the same
path with versions k+1, k+2, ... until the test kills it at a random moment; the test then loads
the path and checks it is exactly some complete version >= the last one seen. A killed save leaves
its hidden ``.<name>.tmp-<host>.<pid>-<hex>`` file; the next save removes it (its writer is dead and
its lock gone), so at most one such file exists after any kill, however many kills there were.
Two trees: a few large arrays (kills land mostly in raw data writes) and many small datasets with
strings (kills land in HDF5 metadata, the header, fsync and publish too).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from ort_trainer import checkpoint as C
from tests.paths import REPO

pytestmark = [pytest.mark.faults, pytest.mark.processes]  # SIGKILL loop: part of `make test-faults`

TREE_CODE = """
import numpy as np
def make_tree(k, kind):
    if kind == "large":  # ~20 MB: ten 2 MB arrays whose every element is the version number
        model = {f"w{i}": np.full(500_000, k, dtype=np.float32) for i in range(10)}
    else:  # ~400 small datasets and strings
        model = {f"layer{i}": {"w": np.full((16, 16), k, dtype=np.float32), "b": np.full(16, k, dtype=np.int64),
                               "name": f"layer {i} of version {k}", "tags": ["x", str(k)]} for i in range(100)}
    return {"model": model, "train_step_info": {"step": k}, "note": f"version {k}"}
"""
HELPER = (
    TREE_CODE
    + """
import os, sys
from ort_trainer import checkpoint

path, kind = sys.argv[1], sys.argv[2]
print("ready", flush=True)
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "go":
        pid = os.fork()
        if pid == 0:
            k = int(arg)
            try:
                while True:
                    k += 1
                    checkpoint.save(make_tree(k, kind), path, overwrite=True)
            finally:
                os._exit(1)
        print(pid, flush=True)
    else:
        print(os.waitpid(int(arg), 0)[1], flush=True)
"""
)
KILLS = {"large": 40, "many": 20}
DELAY_S = {"large": 0.2, "many": 0.8}  # the kill lands up to this long after the saver starts
SEED = 20240601
_namespace: dict = {}
exec(TREE_CODE, _namespace)  # the same tree builder the helper runs
make_tree = _namespace["make_tree"]
TEMP_NAME = re.compile(r"^\.c\.ortcp\.tmp-[A-Za-z0-9_-]+\.\d+-[0-9a-f]{8}$")


def _assert_is_version(tree, k, kind):
    assert tree["train_step_info"] == {"step": k} and tree["note"] == f"version {k}"
    expected = make_tree(k, kind)["model"]
    assert _same(tree["model"], expected)


def _same(loaded, saved):
    if isinstance(saved, dict):
        keys_match = isinstance(loaded, dict) and loaded.keys() == saved.keys()
        return keys_match and all(_same(loaded[k], saved[k]) for k in saved)
    if isinstance(saved, np.ndarray):
        return np.array_equal(loaded.numpy(), saved) and loaded.numpy().dtype == saved.dtype
    return loaded == saved


def _ask(proc, line):
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    assert answer, f"helper died: {proc.stderr.read()}"
    return int(answer)


@pytest.mark.parametrize("kind", sorted(KILLS))
def test_sigkill_during_save_leaves_old_or_new_checkpoint(tmp_path, kind):
    path = tmp_path / "c.ortcp"
    C.save(make_tree(0, kind), path)
    proc = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(path), kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    watchdog = threading.Timer(300, proc.kill)
    watchdog.start()
    rng, seen, advanced, strays, most = random.Random(SEED), 0, 0, set(), 0
    try:
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(KILLS[kind]):
            pid = _ask(proc, f"go {seen}")
            threading.Event().wait(rng.uniform(0.0, DELAY_S[kind]))
            os.kill(pid, signal.SIGKILL)
            status = _ask(proc, f"reap {pid}")
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "saver ended before the kill"
            tree = C.load(path)
            version = tree["train_step_info"]["step"]
            assert version >= seen, f"checkpoint went back from version {seen} to {version}"
            _assert_is_version(tree, version, kind)
            advanced += version > seen
            seen = version
            others = {p.name for p in tmp_path.iterdir()} - {"c.ortcp"}
            assert all(TEMP_NAME.match(name) for name in others), others
            assert len(others) <= 1, f"temporary files of killed saves pile up: {sorted(others)}"
            strays |= others
            most = max(most, len(others))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        watchdog.cancel()
    assert advanced > 0, "no save ever completed between kills"
    assert strays, "no kill landed in the middle of a save"
    print(
        f"{KILLS[kind]} kills ({kind}), {advanced} rounds saw a newer version, {len(strays)} killed saves left a "
        f"temporary file, never more than {most} at once"
    )
    C.save(make_tree(seen + 1, kind), path, overwrite=True)  # the next save removes the last one
    assert [p.name for p in tmp_path.iterdir()] == ["c.ortcp"]
