"""Shared fixtures: tiny random-weight model directories made once per test session."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import make_tiny_model  # noqa: E402

# Tests never write into the user's ~/.cache: converted models and KV-cache blocks go to a
# directory of this run (subprocess servers inherit it). A caller may point it elsewhere.
if "TROUPE_HOME" not in os.environ:
    os.environ["TROUPE_HOME"] = tempfile.mkdtemp(prefix="troupe-test-home-")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with a real BPE tokenizer and ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    """The tiny llama loaded with mlx-lm: (model, tokenizer)."""
    from mlx_lm import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_short_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama under another name ("tiny-short"), with a context of 64 tokens."""
    out = tmp_path_factory.mktemp("tiny-short") / "tiny-short"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer lfm2 (ArraysCache and KVCache layers mixed)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-lfm2") / "tiny-lfm2", arch="lfm2", layers=4
    )


# --- the end-to-end server: the real default model over HTTP, one for the whole run ---------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e") / "server.log"


@pytest.fixture(scope="session")
def server(server_log: Path) -> Iterator[str]:
    """`troupe serve` on the bundled default model (a subprocess on 127.0.0.1): its base URL."""
    port = _free_port()
    log = server_log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{server_log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not become healthy in time")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
