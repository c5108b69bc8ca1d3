"""Temporary files of killed saves are removed by the next save into the folder; a live writer's never are.

A save writes ``.<name>.tmp-<host>.<pid>-<8 hex>`` and holds an exclusive ``flock`` on it until it is
published. A later save (or ``cleanup_temp_files``) removes a temporary file only when no process holds
its lock and its writer is gone: on this host its pid is not alive, from another host it has not been
modified for ``REMOTE_GRACE_S``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ort_trainer import checkpoint as C
from ort_trainer.checkpoint.format import _tempfile as T
from ort_trainer.checkpoint.format import files as F
from ort_trainer.checkpoint.format._h5_stream import save_stream


def _slow_writer(path, gate, report_fd):
    """In a forked child: a real save (the streaming writer) held open mid-write until ``gate`` exists."""

    def items():
        yield ("a",), np.arange(1000, dtype=np.float32)
        os.write(report_fd, b"writing\n")
        while not gate.exists():  # its temporary file exists and is locked meanwhile
            time.sleep(0.02)
        yield ("b",), np.ones(10, dtype=np.float32)

    save_stream(items(), path, max_leaves=2, overwrite=True)
    os.write(report_fd, b"published\n")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _temps(folder):
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name)


@pytest.mark.processes
def test_next_save_removes_temp_files_of_dead_writers(tmp_path):
    host = F.host_tag()
    dead = _dead_pid()
    stale = [
        tmp_path / f".a.ortcp.tmp-{host}.{dead}-0123abcd",  # this library, this host, writer gone
        tmp_path / f".b.ortcp.tmp-{dead}-89abcdef",  # the older name form (no host)
    ]
    for p in stale:
        p.write_bytes(b"x" * 1000)
    unrelated = tmp_path / ".a.ortcp.tmp-notours"
    unrelated.write_bytes(b"keep")
    C.save({"w": np.zeros(3)}, tmp_path / "c.ortcp")
    assert _temps(tmp_path) == [unrelated.name]
    assert C.load(tmp_path / "c.ortcp")["w"].tolist() == [0.0, 0.0, 0.0]


@pytest.mark.processes
def test_temp_files_of_live_or_remote_writers_are_kept(tmp_path):
    host = F.host_tag()
    mine = tmp_path / f".a.ortcp.tmp-{host}.{os.getpid()}-0123abcd"  # pid alive: maybe a save in progress
    remote = tmp_path / f".b.ortcp.tmp-otherhost.example.{_dead_pid()}-0123abcd"  # fresh, from another host
    old_remote = tmp_path / f".c.ortcp.tmp-otherhost.example.{_dead_pid()}-89abcdef"
    for p in (mine, remote, old_remote):
        p.write_bytes(b"x")
    past = time.time() - F.REMOTE_GRACE_S - 10
    os.utime(old_remote, (past, past))
    C.save({"w": np.zeros(3)}, tmp_path / "d.ortcp")
    assert _temps(tmp_path) == sorted([mine.name, remote.name])


@pytest.mark.processes
def test_locked_temp_file_is_never_removed(tmp_path):
    """A lock held by any process protects the file, whatever its name says about the writer."""
    import fcntl

    victim = tmp_path / f".a.ortcp.tmp-{F.host_tag()}.{_dead_pid()}-0123abcd"
    victim.write_bytes(b"x")
    with open(victim, "rb") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        assert C.cleanup_temp_files(tmp_path) == []
        C.save({"w": 1}, tmp_path / "e.ortcp")
        assert victim.exists()
    assert C.cleanup_temp_files(tmp_path) == [victim]


@pytest.mark.processes
def test_live_concurrent_writer_keeps_its_temp_file(tmp_path):
    """A real save in another process, held open mid-write: saves beside it and cleanups leave it alone."""
    target, gate = tmp_path / "slow.ortcp", tmp_path / "gate"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the concurrent writer
        code = 1
        try:
            _slow_writer(target, gate, write_fd)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    report = os.fdopen(read_fd)
    try:
        assert report.readline().strip() == "writing"
        live = _temps(tmp_path)
        assert len(live) == 1 and live[0].startswith(".slow.ortcp.tmp-")
        assert F.TEMP_RE.match(live[0])["pid"] == str(pid)
        C.save({"w": np.arange(4)}, tmp_path / "other.ortcp")
        C.save({"w": np.arange(5)}, tmp_path / "slow.ortcp")  # even a save to the same path
        assert C.cleanup_temp_files(tmp_path) == []
        assert _temps(tmp_path) == live
        gate.touch()
        assert report.readline().strip() == "published"
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        gate.touch()
        report.close()
    assert _temps(tmp_path) == []
    assert C.load(target)["b"].tolist() == [1.0] * 10  # the slow writer published last


def test_own_temp_file_name_and_lock(tmp_path):
    name = F.temp_path(tmp_path / "x.ortcp")
    match = F.TEMP_RE.match(name.name)
    assert match and match["host"] == F.host_tag() and int(match["pid"]) == os.getpid()
    assert match["target"] == "x.ortcp"
    with T.LockedTempFile(name) as tmp:
        assert name.exists()
        assert C.cleanup_temp_files(tmp_path) == []  # our own live file
        tmp.discard()
    assert not name.exists()


@pytest.mark.parametrize("hostname", ["node-1.cluster.local", "weird host/name", ""])
def test_host_tag_is_a_safe_name_part(monkeypatch, hostname):
    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    F.host_tag.cache_clear()
    try:
        tag = F.host_tag()
        assert tag and all(c.isalnum() or c in "-_" for c in tag)
    finally:
        F.host_tag.cache_clear()


def test_one_pid_check_a_writer_we_may_not_signal_is_alive_and_keeps_its_files(tmp_path, monkeypatch):
    """The local cleanup (``format._tempfile``) and the remote one (``io._stale``: spool folders) ask the same
    ``files.pid_alive``: only ``ProcessLookupError`` means gone; another user's process (``PermissionError``)
    and any other error mean alive, so neither cleanup deletes that writer's files."""
    from ort_trainer.checkpoint.io import _stale

    def kill_raising(error):
        def kill(pid, sig):
            assert sig == 0
            raise error

        return kill

    pid = 424242
    temp = tmp_path / f".a.ortcp.tmp-{F.host_tag()}.{pid}-0123abcd"
    temp.write_bytes(b"x")
    spool = tmp_path / f"{_stale.spool_prefix().rsplit('.', 1)[0]}.{pid}-abc"
    spool.mkdir()
    for error in (PermissionError(1, "Operation not permitted"), OSError(22, "Invalid argument")):
        monkeypatch.setattr(F.os, "kill", kill_raising(error))
        assert F.pid_alive(pid) is True
        assert T.remove_stale_temp_files(tmp_path) == [] and temp.exists()
        assert _stale.remove_stale_spools(str(tmp_path)) == [] and spool.exists()
    monkeypatch.setattr(F.os, "kill", kill_raising(ProcessLookupError(3, "No such process")))
    assert F.pid_alive(pid) is False
    assert T.remove_stale_temp_files(tmp_path) == [temp]
    assert _stale.remove_stale_spools(str(tmp_path)) == [spool]
