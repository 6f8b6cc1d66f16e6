"""Which BLAS MLX runs on (Linux CPU), and the OpenBLAS preload that makes prefill fast.

The ``mlx-cpu`` wheel bundles the reference (netlib) BLAS. Preloading Debian's OpenBLAS
(``libopenblas0-pthread``) makes MLX's float32 matmuls use it instead: on a 2-core x86 machine
a 512-token prefill of the default model went from about 100 s to about 4 s, with the same
greedy output (docs/benchmarks.md). In front of OpenBLAS goes troupe's batch-1 matrix-vector
product (``gemv_shim.c``, built here once with ``gcc``): a one-stream decode step about 2x
faster, the same bits. The same re-execution asks glibc for huge pages under large
allocations (``HUGE_PAGES``). This module only inspects files and environment variables (and
runs ``gcc``): it never imports MLX, so the CLI can decide before MLX is loaded.
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

from actors.models.home import troupe_home

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

# glibc's tunable for transparent huge pages under malloc (glibc 2.35+; older ones ignore it).
# MLX's CPU allocator takes every buffer past its small cache from malloc, and a fresh 4 KB
# page costs a fault: building a 2,000-token hit's 94 MB cache took ~15,000 of them, ~45 ms;
# with it, ~30 faults and ~15 ms. Prefill over 3,000 cached tokens: ~11% less CPU per token.
HUGE_PAGES = "glibc.malloc.hugetlb=1"

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


def huge_pages_in_use() -> bool:
    """Whether this process's malloc asks for huge pages: ``HUGE_PAGES`` (or the hugetlb
    tunable's other "on" value) in its environment, under a glibc that knows the tunable."""
    tunables = os.environ.get("GLIBC_TUNABLES", "").split(":")
    if not any(t in (HUGE_PAGES, "glibc.malloc.hugetlb=2") for t in tunables):
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)
    except (ValueError, OSError, AttributeError):
        return False


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


def huge_pages_tunables(env: dict[str, str]) -> str | None:
    """``env``'s ``GLIBC_TUNABLES`` with ``HUGE_PAGES`` added, or None where it is not
    wanted: not Linux, not the mlx-cpu wheel (MLX not on the CPU), or the malloc hugetlb
    tunable already set either way (the user's own choice stands)."""
    if not sys.platform.startswith("linux") or bundled_reference_blas() is None:
        return None
    have = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if any(t.split("=")[0] == HUGE_PAGES.split("=")[0] for t in have):
        return None
    return ":".join([*have, HUGE_PAGES])


def preload_command(argv: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute with ``wanted_preload()`` and
    ``huge_pages_tunables``, or None when neither changes anything or this process is
    already the re-execution (never loop)."""
    env = dict(os.environ)
    wanted = wanted_preload()
    if env.get(REEXEC_MARK) == " ".join(wanted):
        return None
    have = env.get("LD_PRELOAD", "").split()
    preload = bool(wanted) and wanted != [p for p in have if p in wanted]
    if preload:
        env["LD_PRELOAD"] = " ".join([*wanted, *(p for p in have if p not in wanted)])
    tunables = huge_pages_tunables(env)
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    if not preload and tunables is None:
        return None
    env[REEXEC_MARK] = " ".join(wanted)
    return [sys.executable, *argv], env


def for_other_servers(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what is troupe's own: its matrix-vector product out of ``LD_PRELOAD``
    (OpenBLAS stays) and ``HUGE_PAGES`` out of ``GLIBC_TUNABLES``. What another server is
    started with in a benchmark, which compares servers on the same BLAS, not on troupe's own
    kernels and settings."""
    kept = [p for p in env.get("LD_PRELOAD", "").split() if GEMV_LIB not in p]
    out = {**env, "LD_PRELOAD": " ".join(kept)}
    if "GLIBC_TUNABLES" in env:
        tunables = [t for t in env["GLIBC_TUNABLES"].split(":") if t and t != HUGE_PAGES]
        if tunables:
            out["GLIBC_TUNABLES"] = ":".join(tunables)
        else:
            del out["GLIBC_TUNABLES"]
    return out
