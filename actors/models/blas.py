"""Which BLAS MLX runs on (Linux CPU), and the OpenBLAS preload that makes prefill fast.

The ``mlx-cpu`` wheel bundles the reference (netlib) BLAS. Preloading Debian's OpenBLAS
(``libopenblas0-pthread``) makes MLX's float32 matmuls use it instead: on a 2-core x86 machine
a 512-token prefill of the default model went from about 100 s to about 4 s, with the same
greedy output (docs/benchmarks.md). In front of OpenBLAS goes troupe's batch-1 matrix-vector
product (``gemv_shim.c``, built here once with ``gcc``): a one-stream decode step about 2x
faster, the same bits. This module only inspects files and environment variables (and runs
``gcc``): it never imports MLX, so the CLI can decide before MLX is loaded.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from troupe.actors.models.home import troupe_home

# Set by the CLI when it re-executes itself (to the preload it asked for), so it never loops.
REEXEC_MARK = "TROUPE_BLAS_PRELOADED"
# "auto" (default): preload OpenBLAS, with troupe's matrix-vector product in front, when that
# helps; "openblas": OpenBLAS alone; "bundled": never.
CHOICE_ENV = "TROUPE_BLAS"
CHOICES = ("auto", "openblas", "bundled")
GEMV_SOURCE = Path(__file__).with_name("gemv_shim.c")
# Its built library's name begins so: how a preload list or a process's maps are read for it.
GEMV_LIB = "libtroupe_gemv"
# Its kernels: AVX2 and FMA, the roundings of OpenBLAS's Zen/Haswell sgemm (checked per shape).
GEMV_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-shared", "-fPIC")

OPENBLAS_GLOBS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
)


def bundled_reference_blas() -> Path | None:
    """The reference BLAS shipped inside the mlx-cpu wheel, if that is what MLX links."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "mlx_cpu.libs"
    found = sorted(libs.glob("libblas-*.so*"))
    return found[0] if found else None


def find_openblas() -> Path | None:
    """Debian's threaded OpenBLAS, if installed."""
    for pattern in OPENBLAS_GLOBS:
        for path in sorted(glob.glob(pattern)):
            return Path(path)
    return None


def gemv_shim(cache_dir: Path | None = None) -> Path | None:
    """``gemv_shim.c`` built for this machine (once, under ``cache_dir``, default troupe's
    ``jit`` directory), or None where it cannot be: not x86-64 Linux with AVX2 and FMA, no
    ``gcc``, or the directory not writable."""
    if not sys.platform.startswith("linux") or platform.machine() != "x86_64":
        return None
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "").split()
    except OSError:
        return None
    gcc = shutil.which("gcc")
    if "avx2" not in flags or "fma" not in flags or gcc is None:
        return None
    cache_dir = cache_dir or troupe_home() / "jit"
    key = hashlib.blake2b(GEMV_SOURCE.read_bytes() + " ".join(GEMV_FLAGS).encode(),
                          digest_size=8).hexdigest()
    lib = cache_dir / f"{GEMV_LIB}-{key}.so"
    if lib.exists():
        return lib
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f".{lib.name}.{os.getpid()}")
        subprocess.run([gcc, *GEMV_FLAGS, str(GEMV_SOURCE), "-o", str(tmp), "-ldl", "-lm"],
                       check=True, capture_output=True, timeout=120)
        tmp.replace(lib)  # atomic: two servers starting at once both see a whole file
    except (OSError, subprocess.SubprocessError):
        return None
    return lib


def loaded_blas() -> str:
    """A one-line description of the BLAS this process has mapped (read /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "the platform's default BLAS"
    shim = " with troupe's batch-1 matrix-vector product" if GEMV_LIB in maps else ""
    for line in maps.splitlines():
        if "libopenblas" in line:
            return f"OpenBLAS ({line.split()[-1]}){shim}"
    ref = bundled_reference_blas()
    if ref is not None:
        return f"mlx's bundled reference BLAS ({ref.name}): slow prefill"
    return "the platform's default BLAS"


def wanted_preload(choice: str | None = None) -> list[str]:
    """The libraries to preload for ``choice`` (default ``$TROUPE_BLAS``, else auto), in
    order: troupe's matrix-vector product first (its ``cblas_sgemm`` is the one MLX binds to;
    it calls OpenBLAS's for the rest), then OpenBLAS. Empty where there is nothing to gain:
    not Linux, opted out, no reference BLAS to replace, or no OpenBLAS installed."""
    choice = (choice or os.environ.get(CHOICE_ENV) or "auto").lower()
    if not sys.platform.startswith("linux") or choice in ("bundled", "off", "0", "no"):
        return []
    if bundled_reference_blas() is None:
        return []
    openblas = find_openblas()
    if openblas is None:
        return []
    shim = gemv_shim() if choice == "auto" else None
    return [str(p) for p in (shim, openblas) if p is not None]


def preload_command(argv: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute with ``wanted_preload()``, or None when it
    is empty, already preloaded, or already tried (never loop)."""
    env = dict(os.environ)
    wanted = wanted_preload()
    have = env.get("LD_PRELOAD", "").split()
    if not wanted or env.get(REEXEC_MARK) == " ".join(wanted):
        return None
    if wanted == [p for p in have if p in wanted]:
        return None  # already preloaded, in this order
    env["LD_PRELOAD"] = " ".join([*wanted, *(p for p in have if p not in wanted)])
    env[REEXEC_MARK] = " ".join(wanted)
    return [sys.executable, *argv], env


def without_troupe_gemv(env: dict[str, str]) -> dict[str, str]:
    """``env`` with troupe's matrix-vector product taken out of ``LD_PRELOAD`` (OpenBLAS
    stays): what another server is started with in a benchmark, which compares servers on
    the same BLAS, not on troupe's own kernels."""
    kept = [p for p in env.get("LD_PRELOAD", "").split() if GEMV_LIB not in p]
    return {**env, "LD_PRELOAD": " ".join(kept)}
