"""Which BLAS MLX runs on (Linux CPU), and the OpenBLAS preload that makes prefill fast.

The ``mlx-cpu`` wheel bundles the reference (netlib) BLAS. Preloading Debian's OpenBLAS
(``libopenblas0-pthread``) makes MLX's float32 matmuls use it instead: on a 2-core x86 machine
a 512-token prefill of the default model went from about 100 s to about 4 s, with the same
greedy output (docs/benchmarks.md). This module only inspects files and environment
variables: it never imports MLX, so the CLI can decide before MLX is loaded.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

# Set by the CLI when it re-executes itself, so it never loops.
REEXEC_MARK = "TROUPE_BLAS_PRELOADED"
# "auto" (default): preload OpenBLAS when it helps; "bundled": never.
CHOICE_ENV = "TROUPE_BLAS"

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


def loaded_blas() -> str:
    """A one-line description of the BLAS this process has mapped (read /proc/self/maps)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "the platform's default BLAS"
    for line in maps.splitlines():
        if "libopenblas" in line:
            return f"OpenBLAS ({line.split()[-1]})"
    ref = bundled_reference_blas()
    if ref is not None:
        return f"mlx's bundled reference BLAS ({ref.name}): slow prefill"
    return "the platform's default BLAS"


def preload_command(argv: list[str]) -> tuple[list[str], dict[str, str]] | None:
    """The command and environment to re-execute with OpenBLAS preloaded, or None when there
    is nothing to gain: not Linux, opted out, already preloaded, no reference BLAS to replace,
    or no OpenBLAS installed."""
    env = dict(os.environ)
    if not sys.platform.startswith("linux") or env.get(REEXEC_MARK):
        return None
    if env.get(CHOICE_ENV, "auto").lower() in ("bundled", "off", "0", "no"):
        return None
    if "libopenblas" in env.get("LD_PRELOAD", ""):
        return None
    if bundled_reference_blas() is None:
        return None
    openblas = find_openblas()
    if openblas is None:
        return None
    env["LD_PRELOAD"] = " ".join(p for p in (str(openblas), env.get("LD_PRELOAD", "")) if p)
    env[REEXEC_MARK] = "1"
    return [sys.executable, *argv], env
