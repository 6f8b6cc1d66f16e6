"""The BLAS lever: OpenBLAS preloaded under MLX gives the same greedy output, and `troupe serve`
re-executes itself with it only when that helps."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from troupe.actors.models import blas

GREEDY = """
import json, sys
from mlx_lm import load
from mlx_lm.generate import stream_generate
from troupe.actors.models.blas import loaded_blas
from troupe.actors.models.store import resolve_model
model, tok = load(str(resolve_model(None).path))
prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                 add_generation_prompt=True)
tokens = [r.token for r in stream_generate(model, tok, prompt, max_tokens=8)]
print(json.dumps({"tokens": tokens, "blas": loaded_blas()}))
"""


def _greedy(preload: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", GREEDY], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(blas.find_openblas() is None, reason="libopenblas0-pthread not installed "
                    "(make setup installs it as root)")
def test_greedy_output_is_identical_with_and_without_openblas():
    bundled = _greedy(None)
    openblas = _greedy(str(blas.find_openblas()))
    assert "OpenBLAS" in openblas["blas"]
    assert "OpenBLAS" not in bundled["blas"]
    assert openblas["tokens"] == bundled["tokens"]


def test_preload_is_planned_only_when_it_helps(monkeypatch, tmp_path):
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"")
    shim = tmp_path / "libtroupe_gemv-x.so"
    monkeypatch.setattr(blas, "find_openblas", lambda: fake)
    monkeypatch.setattr(blas, "gemv_shim", lambda cache_dir=None: shim)
    monkeypatch.setattr(blas, "bundled_reference_blas", lambda: tmp_path / "libblas-x.so.3")
    for key in (blas.REEXEC_MARK, blas.CHOICE_ENV, "LD_PRELOAD"):
        monkeypatch.delenv(key, raising=False)

    # auto: troupe's matrix-vector product first (MLX binds to its cblas_sgemm), then OpenBLAS
    command, env = blas.preload_command(["-m", "troupe.api.cli", "serve"])
    assert command == [sys.executable, "-m", "troupe.api.cli", "serve"]
    assert env["LD_PRELOAD"] == f"{shim} {fake}"
    assert env[blas.REEXEC_MARK] == f"{shim} {fake}"

    monkeypatch.setenv(blas.CHOICE_ENV, "openblas")  # OpenBLAS alone
    assert blas.preload_command(["x"])[1]["LD_PRELOAD"] == str(fake)
    monkeypatch.setenv(blas.CHOICE_ENV, "bundled")  # the opt-out
    assert blas.preload_command(["x"]) is None
    monkeypatch.delenv(blas.CHOICE_ENV)

    # OpenBLAS preloaded by hand (or by a benchmark): the shim goes in front, the rest stays.
    monkeypatch.setenv("LD_PRELOAD", f"{fake} /lib/other.so")
    assert blas.preload_command(["x"])[1]["LD_PRELOAD"] == f"{shim} {fake} /lib/other.so"
    monkeypatch.setenv("LD_PRELOAD", f"{shim} {fake}")  # already there: nothing to do
    assert blas.preload_command(["x"]) is None
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(blas.REEXEC_MARK, f"{shim} {fake}")  # already tried: never loop
    assert blas.preload_command(["x"]) is None
    monkeypatch.delenv(blas.REEXEC_MARK)

    monkeypatch.setattr(blas, "gemv_shim", lambda cache_dir=None: None)  # cannot be built
    assert blas.preload_command(["x"])[1]["LD_PRELOAD"] == str(fake)
    monkeypatch.setattr(blas, "bundled_reference_blas", lambda: None)  # nothing to replace
    assert blas.preload_command(["x"]) is None


def test_other_servers_of_a_benchmark_get_openblas_without_the_shim():
    env = {"LD_PRELOAD": "/j/libtroupe_gemv-1.so /usr/lib/libopenblas.so.0", "X": "1"}
    assert blas.without_troupe_gemv(env) == {"LD_PRELOAD": "/usr/lib/libopenblas.so.0",
                                             "X": "1"}


def test_the_mlx_cpu_wheel_is_recognised_as_reference_blas():
    if not sys.platform.startswith("linux"):
        pytest.skip("the reference BLAS ships only in the Linux wheel")
    assert blas.bundled_reference_blas() is not None
