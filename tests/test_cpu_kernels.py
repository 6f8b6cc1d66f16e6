"""The faster CPU kernels give MLX's results to the bit: attention, softmax, whole models, and
kernels fused by a JIT built for this CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from troupe.actors.engine import cpu_kernels


@pytest.fixture
def kernels():
    """The replacement installed for one test (and the state before it put back)."""
    was = cpu_kernels.enabled()
    cpu_kernels.enable("native")
    yield cpu_kernels
    if not was:
        cpu_kernels.disable()


def same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and np.array_equal(np.array(a), np.array(b), equal_nan=True)


def test_softmax_rows_matches_mlx_bitwise() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 8, 9, 63, 64, 65, 200, 777):
        x = mx.array((rng.standard_normal((5, n)) * rng.uniform(0.1, 40)).astype(np.float32))
        assert same(cpu_kernels.softmax_rows(x), mx.softmax(x, axis=-1)), n
    # -inf entries (masked) and a row of equal values
    x = mx.array([[0.0, -np.inf, 1.0, -np.inf], [2.0, 2.0, 2.0, 2.0]], dtype=mx.float32)
    assert same(cpu_kernels.softmax_rows(x), mx.softmax(x, axis=-1))


def test_softmax_rows_with_a_mask_matches_mlx_bitwise() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, 300)).astype(np.float32) * 9
    x[0, 0] = -np.inf  # every kept score -inf: MLX's row max is then the lowest float
    keep = rng.random((4, 300)) < 0.6
    keep[1] = False  # a row with nothing kept
    x, keep = mx.array(x), mx.array(keep)
    low = mx.array(mx.finfo(mx.float32).min, mx.float32)
    want = mx.softmax(mx.where(keep, x, low), axis=-1, precise=True)
    assert same(cpu_kernels.softmax_rows(x, keep), want)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("length,cached", [(1, 0), (1, 30), (2, 0), (17, 0), (5, 40), (64, 64),
                                           (3, 1100), (40, 900), (7, 3000), (40, 4000),
                                           (200, 700)])
def test_attention_matches_mlx_bitwise(kernels, heads, length, cached) -> None:
    check_attention(kernels, heads, length, cached)


# With small groups, prefill takes every way of splitting the heads: a few repeats of a KV
# head ((64, 64)), whole KV heads ((64, 64) without GQA), and one head's rows in blocks, the
# last one shorter ((40, 4000): a short chunk on a long context; (200, 700)).
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("length,cached", [(17, 0), (64, 64), (40, 4000), (200, 700)])
def test_attention_in_small_groups_matches_mlx_bitwise(kernels, monkeypatch, heads, length,
                                                       cached) -> None:
    monkeypatch.setattr(kernels, "GROUP_BYTES", 64 << 10)
    check_attention(kernels, heads, length, cached)


def check_attention(kernels, heads: tuple[int, int], length: int, cached: int) -> None:
    n_q, n_kv = heads
    rng = np.random.default_rng(length * 100 + cached + n_q)
    batch, dim, keys = 3, 16, length + cached

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q = rand(batch, n_q, length, dim)
    k, v = rand(batch, n_kv, keys, dim), rand(batch, n_kv, keys, dim)
    # a batch's left-padding mask as mlx-lm's BatchKVCache makes it, and an additive one; the
    # causal mask as an array; a mask per head with rows where nothing is kept
    left = mx.array([0, 3, keys - 1])
    rows = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    bool_mask = rows[None, None] & (left[:, None, None, None] <= mx.arange(keys))
    additive = mx.where(bool_mask, 0.0, -1e9).astype(mx.float32)
    per_head = rng.random((1, n_q, length, keys)) < 0.7
    per_head[0, -1, : (length + 1) // 2] = False
    original = kernels._state["sdpa"]
    for mask in (None, "causal", bool_mask, additive, rows, mx.where(rows, 0.0, -np.inf),
                 mx.array(per_head)):
        got = kernels.attention(q, k, v, scale=dim**-0.5, mask=mask)
        want = original(q, k, v, scale=dim**-0.5, mask=mask)
        assert same(got, want), (heads, length, cached, mask if isinstance(mask, str)
                                 else getattr(mask, "shape", None))


def test_causal_attention_with_fewer_keys_than_queries_matches_mlx_bitwise(kernels) -> None:
    # MLX's causal mask then masks every key for the first queries
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((2, 9, 12, 16)).astype(np.float32))
    k, v = (mx.array(rng.standard_normal((2, 3, 5, 16)).astype(np.float32)) for _ in range(2))
    got = kernels.attention(q, k, v, scale=0.25, mask="causal")
    assert same(got, kernels._state["sdpa"](q, k, v, scale=0.25, mask="causal"))


def test_empty_attention_is_mlx_s(kernels) -> None:
    # Qwen2.5-VL's vision tower splits an image's patches into windows, some of them empty
    q, k, v = (mx.zeros((1, 2, 0, 16)) for _ in range(3))
    got = kernels.attention(q, k, v, scale=0.25, mask=None)
    assert same(got, kernels._state["sdpa"](q, k, v, scale=0.25, mask=None))


def test_attention_with_infinite_scores_matches_mlx_bitwise(kernels) -> None:
    # overflowed activations: rows whose kept scores are all -inf, and rows with NaN in them
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 9, 40, 16)).astype(np.float32)
    k = rng.standard_normal((1, 3, 4040, 16)).astype(np.float32)
    q[0, 0, :5] = 0.0
    q[0, 0, :5, 0] = 1.0
    k[0, 0, :, 0] = -np.inf  # head 0's first rows: every score -inf
    q[0, 4, 7, 3] = np.inf
    q, k = mx.array(q), mx.array(k)
    v = mx.array(rng.standard_normal((1, 3, 4040, 16)).astype(np.float32))
    for mask in (None, "causal"):
        got = kernels.attention(q, k, v, scale=0.25, mask=mask)
        assert same(got, kernels._state["sdpa"](q, k, v, scale=0.25, mask=mask)), mask


def test_attention_hands_decode_and_other_dtypes_to_mlx(kernels, monkeypatch) -> None:
    calls = []  # decode without grouped heads, and half precision, go to MLX's function
    original = kernels._state["sdpa"]

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setitem(kernels._state, "sdpa", counting)
    q = mx.zeros((1, 2, 1, 8))
    kernels.attention(q, mx.zeros((1, 2, 5, 8)), mx.zeros((1, 2, 5, 8)), scale=1.0)
    h = mx.zeros((1, 2, 4, 8), dtype=mx.float16)
    kernels.attention(h, h, h, scale=1.0, mask="causal")
    assert calls == [(1, 2, 1, 8), (1, 2, 4, 8)]
    kernels.attention(mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)), mx.zeros((1, 2, 4, 8)),
                      scale=1.0, mask="causal")
    assert len(calls) == 2  # prefill in float32: ours


def test_enable_replaces_and_disable_restores() -> None:
    was = cpu_kernels.enabled()
    before = mx.fast.scaled_dot_product_attention
    try:
        cpu_kernels.enable("mlx")
        mlx_own = mx.fast.scaled_dot_product_attention
        assert mlx_own is not cpu_kernels.attention
        cpu_kernels.enable("native")
        cpu_kernels.enable("native")  # idempotent
        assert mx.fast.scaled_dot_product_attention is cpu_kernels.attention
        assert cpu_kernels.describe().startswith("native")
        cpu_kernels.disable()
        assert mx.fast.scaled_dot_product_attention is mlx_own
        assert cpu_kernels.describe() == "MLX's own"
        with pytest.raises(ValueError, match="native, mlx"):
            cpu_kernels.enable("fast")
    finally:
        if was:
            cpu_kernels.enable("native")
        else:
            cpu_kernels.disable()
        assert (mx.fast.scaled_dot_product_attention is before) or was


def _greedy_and_logits(model_dir: Path) -> tuple[list[int], np.ndarray]:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tok = load(str(model_dir))
    prompts = [tok.encode(t) for t in ("hello there, tell me a story about",
                                       "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16",
                                       "a b")]
    logits = model(mx.array([prompts[1]]))
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(prompts, max_tokens=[12, 12, 12])
    out: dict[int, list[int]] = {u: [] for u in uids}
    while any(len(t) < 12 for t in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    return [t for u in uids for t in out[u]], np.array(logits)


def test_model_output_identical(tiny_model_dir: Path) -> None:
    was = cpu_kernels.enabled()
    try:
        cpu_kernels.disable()
        want_tokens, want_logits = _greedy_and_logits(tiny_model_dir)
        cpu_kernels.enable("native")
        got_tokens, got_logits = _greedy_and_logits(tiny_model_dir)
    finally:
        if not was:
            cpu_kernels.disable()
    assert got_tokens == want_tokens
    assert np.array_equal(got_logits, want_logits)


LOGITS = """
import json, sys, hashlib
import numpy as np
import mlx.core as mx
from troupe.actors.engine import cpu_kernels
if sys.argv[2] == "native":
    cpu_kernels.enable("native", __import__("pathlib").Path(sys.argv[3]))
from mlx_lm import load
model, tok = load(sys.argv[1])
out = model(mx.array([tok.encode("the quick brown fox jumps over the lazy dog " * 4)]))
print(json.dumps({"logits": hashlib.sha256(np.array(out).tobytes()).hexdigest(),
                  "describe": cpu_kernels.describe(),
                  "tmpdir": __import__("os").environ.get("TMPDIR")}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the JIT shim is for Linux")
def test_jit_built_for_this_cpu_gives_identical_logits(tiny_model_dir: Path,
                                                        tmp_path: Path) -> None:
    home = tmp_path / "home"
    if cpu_kernels.jit_env(home) is None:
        pytest.skip("no g++ here that takes -march=native")
    shim = home / "jit" / "bin" / "g++"
    assert "-march=native -ffp-contract=off" in shim.read_text() and os.access(shim, os.X_OK)

    def run(choice: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("TMPDIR",)}
        env["TMPDIR"] = str(tmp_path / f"tmp-{choice}")  # MLX's own kernel cache, per run
        Path(env["TMPDIR"]).mkdir()
        done = subprocess.run(
            [sys.executable, "-c", LOGITS, str(tiny_model_dir), choice, str(home)],
            capture_output=True, text=True, timeout=300, env=env, cwd=Path(__file__).parent.parent)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.splitlines()[-1])

    plain, native = run("mlx"), run("native")
    assert native["logits"] == plain["logits"]
    assert native["describe"].startswith("native (fused kernels built for this CPU")
    kernels = Path(native["tmpdir"])
    assert kernels.parent == home / "jit"
    # mlx-lm's compiled SwiGLU was fused and built with the shim, in our directory only
    assert list(kernels.rglob("*.so")), "no kernel was built under the shim's directory"
    assert not list((tmp_path / "tmp-native").rglob("*.so"))


@pytest.mark.parametrize("base,dims,width,scale", [(10000.0, 64, 64, 1.0), (100000.0, 64, 64, 1.0),
                                                   (500000.0, 128, 128, 0.25), (1e6, 32, 48, 1.0)])
def test_rope_matches_mlx_bitwise(kernels, base, dims, width, scale) -> None:
    rng = np.random.default_rng(int(base) % 97 + dims)
    original = kernels._state["rope"]
    for batch, length, offset in ((1, 1, 0), (1, 7, 300), (3, 1, mx.array([5, -2, 4000])),
                                  (3, 9, mx.array([0, 17, 64])), (2, 33, 12345)):
        x = mx.array(rng.standard_normal((batch, 4, length, width)).astype(np.float32))
        got = kernels.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)
        want = original(x, dims, traditional=False, base=base, scale=scale, offset=offset)
        assert same(got, want), (base, dims, batch, length)
    # custom frequencies (mlx-lm's Llama 3 and YaRN scalings pass them)
    freqs = mx.array((rng.uniform(1, 5000, dims // 2)).astype(np.float32))
    x = mx.array(rng.standard_normal((2, 4, 5, width)).astype(np.float32))
    got = kernels.rope(x, dims, traditional=False, base=None, scale=scale, offset=mx.array([3, 9]),
                       freqs=freqs)
    want = original(x, dims, traditional=False, base=None, scale=scale, offset=mx.array([3, 9]),
                    freqs=freqs)
    assert same(got, want)


def test_rope_reuses_a_layers_angles_only_for_the_same_offset(kernels) -> None:
    x = mx.ones((2, 2, 1, 8))
    off = mx.array([3, 4])
    a = kernels.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=off)
    b = kernels.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=off)
    c = kernels.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=off + 1)
    d = kernels.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=7)
    e = kernels.rope(x, 8, traditional=False, base=10000.0, scale=1.0, offset=8)
    assert same(a, b) and not same(a, c) and not same(d, e)
    original = kernels._state["rope"]
    assert same(e, original(x, 8, traditional=False, base=10000.0, scale=1.0, offset=8))
