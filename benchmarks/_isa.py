"""``--isa {native,avx2}``: run a benchmark as on an AVX2-only x86-64 host, on an AVX-512 machine.

``avx2`` compiles ``benchmarks/isa/cpuid_avx2.c`` (once, into the git-ignored ``build/isa/``) and re-runs
the process with it in ``LD_PRELOAD``: CPUID faulting then hides AVX-512, AMX and AVX-VNNI from every
library (ONNX Runtime's MLAS, MKL, oneDNN, ATen, numpy), and ``GLIBC_TUNABLES`` tells glibc's string
functions the same. Children started with ``sys.executable`` inherit both variables. Only the ISA is
emulated: cores, caches and clocks stay this machine's (not, say, an AMD EPYC's). Needs gcc and a CPU and
kernel with CPUID faulting (``cpuid_fault`` in /proc/cpuinfo); otherwise a clear SystemExit.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ISAS = ("native", "avx2")
SOURCE = Path(__file__).resolve().parent / "isa" / "cpuid_avx2.c"
CACHE = Path(__file__).resolve().parent.parent / "build" / "isa"
# glibc chose its memcpy/strlen variants before the shim loaded: hold it to AVX2 as well.
GLIBC_HWCAPS = "-AVX512F,-AVX512CD,-AVX512BW,-AVX512DQ,-AVX512ER,-AVX512PF,-AVX512VL"


def add_isa_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--isa",
        choices=ISAS,
        default="native",
        help="avx2: hide AVX-512/AMX/AVX-VNNI from cpuid (benchmarks/_isa.py) to measure as on an AVX2 host",
    )


def shim_active() -> bool:
    """True in a process whose ``cpuid`` is masked by the preloaded shim."""
    probe = getattr(ctypes.CDLL(None), "cpuid_avx2_active", None)
    return bool(probe and probe())


def build_shim() -> Path:
    """The shim's shared object, compiled with gcc on first use (named by the source's hash)."""
    source = SOURCE.read_bytes()
    target = CACHE / f"cpuid_avx2-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if target.exists():
        return target
    gcc = shutil.which("gcc")
    if gcc is None:
        raise SystemExit(f"--isa avx2 needs gcc to compile {SOURCE}; none on PATH")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # compile aside, rename: no half-written .so
        built = Path(tmp) / target.name
        done = subprocess.run(
            [gcc, "-O2", "-shared", "-fPIC", "-o", str(built), str(SOURCE), "-ldl"], capture_output=True, text=True
        )
        if done.returncode:
            raise SystemExit(f"--isa avx2: gcc failed on {SOURCE}:\n{done.stderr.strip()}")
        built.replace(target)
    return target


def shim_env(shim: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the shim first in LD_PRELOAD and glibc held to AVX2."""
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = ":".join([str(shim), *filter(None, [env.get("LD_PRELOAD")])])
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    hwcaps = [t for t in tunables if t.startswith("glibc.cpu.hwcaps=")]
    rest = [t for t in tunables if t not in hwcaps]
    caps = ",".join([t.partition("=")[2] for t in hwcaps] + [GLIBC_HWCAPS])
    env["GLIBC_TUNABLES"] = ":".join([*rest, f"glibc.cpu.hwcaps={caps}"])
    return env


def use_isa(isa: str) -> None:
    """Make this process run under ``isa``: ``avx2`` re-executes it (same interpreter, options and
    arguments) with the shim preloaded, unless it already is; ``native`` refuses a preloaded shim."""
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if shim_active():
        if isa == "native":
            raise SystemExit("--isa native, but the cpuid_avx2 shim is preloaded (LD_PRELOAD): unset it or ask avx2")
        return
    if isa == "native":
        return
    shim = build_shim()
    if str(shim) in os.environ.get("LD_PRELOAD", "").split(":"):
        raise SystemExit(f"--isa avx2: {shim} is in LD_PRELOAD but did not load (setuid interpreter?)")
    env = shim_env(shim)
    probe = subprocess.run([shutil.which("true") or sys.executable, "-c", ""], env=env, capture_output=True, text=True)
    if probe.returncode:
        raise SystemExit(f"--isa avx2 is not possible on this host: {probe.stderr.strip()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@functools.cache
def mkl_isa() -> str:
    """The instruction set MKL dispatches to, from the header MKL_VERBOSE prints on its first call
    (one 16x16 sgemm; fd 1 captured): e.g. "AVX-512+AMX" or "AVX2"; "unknown" without that header."""
    import torch

    if not torch.backends.mkl.is_available():
        return "not built"
    sys.stdout.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(1)
        try:
            os.dup2(captured.fileno(), 1)
            with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
                torch.ones(16, 16).mm(torch.ones(16, 16))
            ctypes.CDLL(None).fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    return "+".join(re.findall(r"\(Intel\(R\) (AVX[\w-]*|AMX)\)", text)) or "unknown"


def isa_stamp(host_flags: str) -> str:
    """The ISA part of the host stamp: the CPU's flags, or, under the shim, what it emulates."""
    if not shim_active():
        return f"ISA {host_flags}"
    return f"ISA emulated avx2 (cpuid masked by benchmarks/isa/cpuid_avx2.c; the host has {host_flags})"
