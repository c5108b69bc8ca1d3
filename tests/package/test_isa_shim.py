"""The AVX2-host emulation of ``benchmarks/isa/cpuid_avx2.c`` (``--isa avx2``), in child processes.

With the shim preloaded, torch must report the AVX2 capability and an ONNX Runtime MatMul must still
compute what numpy computes (MLAS then runs its AVX2 kernels); a real segmentation fault must still kill
the child with SIGSEGV, with or without Python's faulthandler (which installs its own SIGSEGV handler
and is chained by the shim). On a host without CPUID faulting the shim must refuse to run, loudly:
asserted here by taking faulting away from one child (a seccomp filter fails its arch_prctl), and by
every test on a host that lacks it, read from /proc/cpuinfo (the kernel's ``cpuid_fault`` flag).
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._isa import build_shim, shim_env
from tests.paths import REPO

pytestmark = pytest.mark.processes

FAULTING = "cpuid_fault" in Path("/proc/cpuinfo").read_text().split()
REFUSAL = "CPUID faulting is not available here"

MATMUL = """
import numpy as np, onnxruntime as ort, torch
from onnx import TensorProto, helper
from benchmarks._isa import shim_active
rng = np.random.default_rng(0)
a, b = rng.standard_normal((33, 70), np.float32), rng.standard_normal((70, 19), np.float32)
graph = helper.make_graph(
    [helper.make_node("MatMul", ["a", "b"], ["y"])], "g",
    [helper.make_tensor_value_info("a", TensorProto.FLOAT, a.shape),
     helper.make_tensor_value_info("b", TensorProto.FLOAT, b.shape)],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
(y,) = session.run(None, {"a": a, "b": b})
np.testing.assert_allclose(y, a @ b, rtol=1e-5, atol=1e-4)
print("SHIM", shim_active(), "CAPABILITY", torch.backends.cpu.get_cpu_capability(), "MATMUL ok")
"""


def _run(code: str, *options: str, args: tuple = (), env: dict | None = None, **popen) -> subprocess.CompletedProcess:
    """``python [options] -c code [args]`` in the repository root, killed after 120 s (never hangs)."""
    command = [sys.executable, *options, "-c", code, *args]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, **popen)


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def _without_cpuid_faulting() -> None:
    """preexec_fn: from the exec on, arch_prctl(ARCH_SET_CPUID, ...) fails with ENODEV in this child, as on a
    CPU or kernel without CPUID faulting (seccomp filter: load nr; arch_prctl? load arg0; 0x1012? errno)."""
    arch_prctl, set_cpuid, errno_enodev, allow = 158, 0x1012, 0x00050000 | 19, 0x7FFF0000
    insns = [(0x20, 0, 0, 0), (0x15, 0, 3, arch_prctl), (0x20, 0, 0, 16), (0x15, 0, 1, set_cpuid)]
    insns += [(0x06, 0, 0, errno_enodev), (0x06, 0, 0, allow)]
    program = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    libc = ctypes.CDLL(None)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(_Prog(len(insns), program)), 0, 0):
        raise OSError("cannot install the seccomp filter")  # PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP


@pytest.fixture(scope="module")
def avx2_env() -> dict:
    return shim_env(build_shim())


def _assert_refused(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 70, done
    assert REFUSAL in done.stderr and "cpuid_fault" in done.stderr, done.stderr


def test_refuses_to_run_unmasked_without_cpuid_faulting(avx2_env):
    _assert_refused(_run("import torch", env=avx2_env, preexec_fn=_without_cpuid_faulting))


@pytest.mark.parametrize("options", [(), ("-X", "faulthandler")], ids=["plain", "faulthandler"])
def test_torch_sees_avx2_and_ort_matmul_matches_numpy(avx2_env, options):
    done = _run(MATMUL, *options, env=avx2_env)
    if not FAULTING:
        _assert_refused(done)
        return
    assert done.returncode == 0, done.stderr
    assert "SHIM True CAPABILITY AVX2 MATMUL ok" in done.stdout, done.stdout


def test_without_the_shim_torch_sees_the_hosts_isa():
    """The masking is real: unmasked, torch on an AVX-512 host reports AVX512 (this host: Xeon, avx512f)."""
    done = _run("import torch; print(torch.backends.cpu.get_cpu_capability())")
    expected = "AVX512" if "avx512f" in Path("/proc/cpuinfo").read_text().split() else "AVX2"
    assert done.stdout.strip() == expected, done


@pytest.mark.parametrize("options", [(), ("-X", "faulthandler")], ids=["plain", "faulthandler"])
def test_a_real_segfault_still_kills_the_child(avx2_env, options):
    done = _run("import ctypes; ctypes.string_at(0)", *options, env=avx2_env)
    if not FAULTING:
        _assert_refused(done)
        return
    assert done.returncode == -signal.SIGSEGV, done
    assert ("Fatal Python error: Segmentation fault" in done.stderr) == bool(options), done.stderr


def test_use_isa_reexecutes_under_the_shim_and_native_refuses_it():
    code = (
        "import os, sys\n"
        "from benchmarks._isa import shim_active, use_isa\n"
        "use_isa(sys.argv[1])\n"
        "print('SHIM', shim_active(), os.environ['GLIBC_TUNABLES'])\n"
    )
    done = _run(code, args=("avx2",))
    if not FAULTING:
        assert done.returncode == 1 and "--isa avx2 is not possible on this host" in done.stderr, done
        assert REFUSAL in done.stderr, done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert "SHIM True glibc.cpu.hwcaps=" in done.stdout and "-AVX512F" in done.stdout, done.stdout
    refused = _run(code, args=("native",), env=shim_env(build_shim()))
    assert refused.returncode == 1 and "--isa native, but the cpuid_avx2 shim is preloaded" in refused.stderr
