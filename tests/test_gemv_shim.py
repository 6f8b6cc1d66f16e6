"""troupe's batch-1 matrix-vector product (actors/models/gemv_shim.c) in front of OpenBLAS: the
same bits as OpenBLAS alone, products and a model's logits, and it is really the one that runs
on the CPUs whose OpenBLAS kernels it reproduces."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from troupe.actors.models import blas

# In a subprocess started with a given LD_PRELOAD: products at the default model's shapes and
# odd ones (three calls each: past the shim's two checked calls), then the logits of a prompt
# and of greedy decode steps; a hash of all the bits, and the shapes the shim handled.
PRODUCTS = """
import ctypes, hashlib, json
import mlx.core as mx, numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from troupe.actors.models.store import resolve_model
h = hashlib.sha256()
rng = np.random.default_rng(7)
for n, k in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (1000, 333),
             (37, 1000), (64, 700), (5, 7), (8, 1)]:
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    for m in (1, 2, 3, 4):  # rows: sequences in a decode step
        for _ in range(3):
            x = mx.array(rng.standard_normal((m, k)).astype(np.float32))
            h.update(np.array(x @ w.T).tobytes())
model, _ = load(str(resolve_model(None).path))
cache = make_prompt_cache(model)
logits = model(mx.array([[(i * 13) % 5000 + 10 for i in range(200)]]), cache=cache)
h.update(np.array(logits[:, -1]).tobytes())
tokens = []
for _ in range(8):
    y = logits[:, -1].argmax(-1)
    tokens.append(y.item())
    logits = model(y[None], cache=cache)
    h.update(np.array(logits).tobytes())
shapes = []
try:
    out = (ctypes.c_int * 1024)()
    n = ctypes.CDLL(None).gemv_shim_shapes(out)
    shapes = [list(out[4 * i:4 * i + 4]) for i in range(n)]
except AttributeError:
    pass
print(json.dumps({"hash": h.hexdigest(), "tokens": tokens, "shapes": shapes}))
"""


def _run(preload: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["LD_PRELOAD"] = " ".join(preload)
    out = subprocess.run([sys.executable, "-c", PRODUCTS], env=env, capture_output=True,
                         text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _openblas_core(openblas: str) -> str:
    import ctypes

    lib = ctypes.CDLL(openblas)
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return lib.openblas_get_corename().decode()


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> tuple[str, str]:
    openblas = blas.find_openblas()
    if openblas is None:
        pytest.skip("libopenblas0-pthread not installed (make setup installs it as root)")
    shim = blas.gemv_shim(tmp_path_factory.mktemp("jit"))
    if shim is None:
        pytest.skip("no gcc, or not x86-64 with AVX2 and FMA: the shim is not built here")
    return str(shim), str(openblas)


def test_the_shim_gives_openblas_bits_and_runs_where_its_kernels_match(libraries):
    shim, openblas = libraries
    alone = _run([openblas])
    both = _run([shim, openblas])
    assert alone["shapes"] == []  # the shim is not loaded there
    assert both["hash"] == alone["hash"]
    assert both["tokens"] == alone["tokens"]
    handled = {(m, n, k): ok for m, n, k, ok in both["shapes"]}
    # Every product of one to three rows went through the shim's check, the model's too;
    # four rows and more stay with OpenBLAS.
    for m in (1, 2, 3):
        for n, k in [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]:
            assert (m, n, k) in handled, both["shapes"]
    assert not any(m > 3 for m, _, _ in handled)
    if _openblas_core(openblas) in ("Zen", "Haswell"):
        # The kernels it reproduces: a model's shapes pass their bit checks and run in the
        # shim. (An odd K may not: OpenBLAS's threaded driver halves a rest of K between Q
        # and 2Q without rounding it to 8, and such a shape stays with OpenBLAS.)
        assert all(ok for (m, n, k), ok in handled.items() if k % 16 == 0), both["shapes"]


def test_a_wrong_result_sends_the_shape_back_to_openblas(libraries, tmp_path):
    # A shim built to round differently (every block's sum in one FMA chain over all of K:
    # Q = 100000) fails its bit check on a K above OpenBLAS's block and must give OpenBLAS's
    # result, then leave that shape to OpenBLAS.
    shim, openblas = libraries
    source = blas.GEMV_SOURCE.read_text().replace("#define Q 320", "#define Q 100000")
    assert source != blas.GEMV_SOURCE.read_text()
    src = tmp_path / "wrong.c"
    src.write_text(source)
    wrong = tmp_path / "libtroupe_gemv-wrong.so"
    subprocess.run(["gcc", *blas.GEMV_FLAGS, str(src), "-o", str(wrong), "-ldl", "-lm"],
                   check=True, capture_output=True)
    alone = _run([openblas])
    broken = _run([str(wrong), openblas])
    assert broken["hash"] == alone["hash"]
    handled = {(m, n, k): ok for m, n, k, ok in broken["shapes"]}
    if _openblas_core(openblas) in ("Zen", "Haswell"):
        for m in (1, 2, 3):
            assert handled[(m, 576, 1536)] == 0  # K = 1536 spans several of OpenBLAS's blocks
            assert handled[(m, 576, 576)] == 0  # 576: a rest between Q and 2Q, halved
            assert handled[(m, 37, 1000)] == 0
