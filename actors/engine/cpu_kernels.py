"""Faster MLX CPU kernels that give bit-for-bit the same results as MLX's own.

Four changes, all measured on the default model (docs/benchmarks.md, "CPU kernels"):

* **Fused kernels built for this CPU.** ``mx.compile`` on the CPU fuses elementwise ops into
  C++ that MLX compiles at run time with ``g++ -std=c++17 -O3`` and no ``-march``: the ``fma``
  of MLX's ``exp`` (used by ``sigmoid``, hence by mlx-lm's compiled SwiGLU) then goes through
  a library call. A ``g++`` shim placed first on ``PATH`` adds ``-march=native``, and the
  kernels go to a directory of their own (MLX writes them under ``$TMPDIR``), keyed by this
  CPU, so no other process ever loads them. The shim also turns floating-point contraction
  off, so the fused code rounds exactly as before: identical logits, measured and tested.
* **Attention's softmax in prefill.** MLX's CPU ``scaled_dot_product_attention`` falls back
  to primitives whose ``softmax`` computes each exponential through a library ``fma``; on a
  512-token prompt that softmax is most of the attention's time. For prefill (more than one
  query), the same arithmetic runs as: row max, ``exp(s - max)`` as a fused kernel, the row
  sum in the order MLX's softmax adds in (its ``sum``, checked once to add a row in order;
  else the last of a ``cumsum``), then ``e * (1 / sum)``. The heads go in groups, one after
  the other, whose scores stay small enough for MLX's allocator to reuse their memory.
* **Decode attention with grouped KV heads.** With one query per sequence, MLX's fallback
  multiplies each query head by its keys separately (a batch of B x heads vector products);
  the query heads that share a KV head go into one product instead (B x KV heads), with the
  same sums. Its softmax stays MLX's: on short rows our extra passes measured slower.
* **Rotary position embedding.** MLX's CPU ``rope`` recomputes its inverse frequencies and
  spends about 25 ops on every call, two calls a layer every step; here the frequencies are
  made once, the angles once for a layer's queries and keys, and the rotation is one fused
  kernel.

Everything here is process-wide (it replaces ``mx.fast.scaled_dot_product_attention`` and
``mx.fast.rope``, and sets ``PATH``/``TMPDIR``) and meant for the serving process: ``enable``
is idempotent and ``disable`` undoes it. ``--cpu-kernels mlx`` keeps MLX's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CHOICES = ("native", "mlx")
# Prefill attention takes its heads in groups whose scores take at most this much (at least a
# head; a larger head's softmax in blocks of rows this size): MLX's CPU allocator keeps freed
# buffers for reuse up to 32 MB in all, and glibc maps anything over 32 MB afresh, so larger
# arrays were mapped and faulted in anew at every layer.
GROUP_BYTES = 8 << 20
# -ffp-contract=off: a product and a sum round separately, as in MLX's prebuilt kernels (with
# -march=native alone GCC fuses them into FMAs and the logits move in the last bits).
# -fno-semantic-interposition and a high inline limit: MLX's ``simd::exp`` (and the other
# math of its kernels) inlined instead of a call through the PLT for every element, and
# -fno-trapping-math: the loop vectorised (its selects for NaN and overflow no longer keep it
# scalar). Each result is the same float: the same operations, 8 lanes at a time.
JIT_FLAGS = ("-march=native", "-ffp-contract=off", "-fno-semantic-interposition",
             "-finline-limit=10000", "-fno-trapping-math")

_lock = threading.Lock()
_state: dict[str, Any] = {}


# --- the JIT compiler shim ------------------------------------------------------------------


def _cpu_key() -> str:
    """Names this CPU (model and feature flags), MLX's version and our flags."""
    try:
        import mlx.core as mx

        version = mx.__version__
    except ImportError:  # pragma: no cover - MLX is a dependency
        version = "?"
    ident = [platform.machine(), version, " ".join(JIT_FLAGS)]
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                ident.append(line)
                if len(ident) >= 5:
                    break
    except OSError:
        pass
    return hashlib.blake2b("\n".join(ident).encode(), digest_size=8).hexdigest()


def _compiler_accepts_flags(gxx: str) -> bool:
    try:
        done = subprocess.run(
            [gxx, *JIT_FLAGS, "-std=c++17", "-x", "c++", "-fsyntax-only", "-"],
            input=b"int main() { return 0; }\n", capture_output=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def jit_env(home: Path) -> dict[str, str] | None:
    """``PATH`` and ``TMPDIR`` that make MLX's JIT build kernels for this CPU, or None where
    that is not possible (not Linux, no ``g++``, the flags refused, the directory not
    writable). Writes the shim under ``home/jit``."""
    if not sys.platform.startswith("linux"):
        return None
    path = os.environ.get("PATH", "")
    shim_dir = home / "jit" / "bin"
    dirs = [d for d in path.split(os.pathsep) if d and Path(d) != shim_dir]
    gxx = shutil.which("g++", path=os.pathsep.join(dirs))
    if gxx is None or not _compiler_accepts_flags(gxx):
        return None
    kernels = home / "jit" / _cpu_key()
    shim = shim_dir / "g++"
    text = f'#!/bin/sh\nexec "{gxx}" "$@" {" ".join(JIT_FLAGS)}\n'
    try:
        kernels.mkdir(parents=True, exist_ok=True)
        shim_dir.mkdir(parents=True, exist_ok=True)
        if not shim.exists() or shim.read_text() != text:
            tmp = shim.with_name(f".g++.{os.getpid()}")
            tmp.write_text(text)
            tmp.chmod(0o755)
            tmp.replace(shim)  # atomic: two servers starting at once both see a whole file
    except OSError as exc:
        log.info("CPU kernels: no JIT shim (%s)", exc)
        return None
    return {"PATH": os.pathsep.join([str(shim_dir), *dirs]), "TMPDIR": str(kernels)}


# --- attention -------------------------------------------------------------------------------


def _fused() -> tuple[Any, Any, Any]:
    import mlx.core as mx

    fns = _state.get("fused")
    if fns is None:
        # Shapeless: traced once, not once per shape (a decode step's keys grow by one every
        # step; a trace per shape grew the compile cache without bound, and a process that
        # had made hundreds of them aborted at exit: "terminate called without an active
        # exception").
        fns = _state["fused"] = (
            mx.compile(lambda s, m: mx.exp(s - m), shapeless=True),
            mx.compile(lambda keep, s, low: mx.where(keep, s, low), shapeless=True),
            mx.compile(lambda keep, s, low, m: mx.exp(mx.where(keep, s, low) - m),
                       shapeless=True),
        )
    return fns


def softmax_rows(scores: Any, keep: Any = None, kept: int = 0) -> Any:
    """``mx.softmax(scores, axis=-1)`` for float32, to the bit, with the exponentials fused;
    with ``keep`` (a mask: boolean, or 0 and 1 as uint8), the softmax of ``where(keep, scores,
    lowest float)``. ``kept``: how many first columns every row of a uint8 mask keeps (as in
    a causal mask), whose maximum is then taken without the mask.

    A uint8 mask goes into the exponentials' fused kernel, which the compiler vectorises; it
    cannot vectorise loads of booleans, so a boolean mask is applied by MLX's ``where``."""
    import mlx.core as mx

    shifted_exp, masked, masked_exp = _fused()
    if keep is None:
        e = shifted_exp(scores, _row_max(scores))
    elif keep.dtype == mx.bool_:
        scores = mx.where(keep, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        e = shifted_exp(scores, _row_max(scores))
    else:
        low = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
        if kept > 0:  # the maximum of a row is that of its parts, in any order
            top = mx.maximum(_row_max(scores[..., :kept]),
                             _row_max(masked(keep[..., kept:], scores[..., kept:], low)))
        else:
            top = _row_max(masked(keep, scores, low))
        e = masked_exp(keep, scores, low, top)
    if _sum_is_sequential():
        total = e.sum(axis=-1, keepdims=True)
    else:  # the last of a running sum adds in MLX's softmax's order anywhere, at a row's cost
        total = mx.cumsum(e, axis=-1)[..., -1:]
    return e * (1.0 / total)


# The width of the column blocks whose maxima _row_max takes first.
MAX_WIDTH = 64


def _row_max(x: Any) -> Any:
    """``x.max(axis=-1, keepdims=True)``. A maximum does not depend on the order it compares
    in, so a long row is first reduced as [n, MAX_WIDTH] over n (MLX's loop for that runs
    across the width, vectorised; along a row it is one comparison after another), then
    the width's maxima and any columns left over."""
    import mlx.core as mx

    keys = x.shape[-1]
    n = keys - keys % MAX_WIDTH
    if n < 4 * MAX_WIDTH:
        return x.max(axis=-1, keepdims=True)
    top = x[..., :n].reshape(*x.shape[:-1], n // MAX_WIDTH, MAX_WIDTH).max(axis=-2)
    top = top.max(axis=-1, keepdims=True)
    if n == keys:
        return top
    return mx.maximum(top, x[..., n:].max(axis=-1, keepdims=True))


def _sum_is_sequential() -> bool:
    """Whether MLX's CPU ``sum`` adds a contiguous row from first to last, as its ``softmax``
    does (it does where SIMD width is 1, as in the Linux wheel): checked once, to the bit."""
    import mlx.core as mx

    known = _state.get("sequential_sum")
    if known is None:
        rows = mx.array(np.random.default_rng(7).standard_normal((4, 777)).astype(np.float32))
        rows = mx.exp(rows * 8)
        known = bool(mx.array_equal(rows.sum(axis=-1), mx.cumsum(rows, axis=-1)[:, -1]).item())
        _state["sequential_sum"] = known
    return known


def attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, sinks: Any = None,
              stream: Any = None) -> Any:
    """``mx.fast.scaled_dot_product_attention`` with MLX's CPU arithmetic, in fewer, faster steps.

    Takes float32 attention (4-D, no sinks, default stream, CPU): prefill (more than one
    query) with the fused softmax, and decode (one query) of grouped-query attention with
    each KV head's queries in one matrix product instead of one per query head. Hands
    everything else to MLX's own function."""
    import mlx.core as mx

    original = _state["sdpa"]
    mask_ok = mask is None or isinstance(mask, mx.array) or mask == "causal"
    if (stream is not None or sinks is not None or not mask_ok or q.ndim != 4 or k.ndim != 4
            or q.dtype != mx.float32 or k.dtype != mx.float32 or v.dtype != mx.float32
            or mx.default_device() != mx.cpu or q.shape[1] % k.shape[1]
            or (isinstance(mask, mx.array) and mask.ndim > 4)
            # Empty (Qwen2.5-VL's vision tower attends in windows, some of them empty).
            or q.size == 0 or k.size == 0):
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    b, n_q, length, dim = q.shape
    n_kv, keys = k.shape[1], k.shape[2]
    repeats = n_q // n_kv
    if length == 1 and repeats == 1:
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)
    # The steps and their order are those of MLX's fallback (mlx/fast.cpp); every product
    # and sum is the one it computes, so the result is the same to the bit.
    q = mx.array(scale, q.dtype) * q
    if length == 1:
        # [B, kv, repeats, D] @ [B, kv, D, keys]: one product per KV head. A causal mask
        # with one query allows every key.
        scores = q.reshape(b, n_kv, repeats, dim) @ k.swapaxes(-1, -2)
        keep = None
        if isinstance(mask, mx.array):
            if mask.dtype == mx.bool_:
                keep = mx.broadcast_to(mask, (b, n_q, 1, keys)).reshape(scores.shape)
            else:
                scores = _apply_mask(scores, mask, (b, n_q, 1, keys), scores.shape)
        # The fused softmax: MLX's CPU softmax is scalar code (a batch of 32 decoding rows
        # at ~110 keys: 0.84 ms a layer against 0.18 ms, the same bits).
        out = softmax_rows(scores, keep) @ v
        return out.reshape(b, n_q, 1, -1)
    # The heads go in groups (see GROUP_BYTES), each with its own products and softmax, one
    # after the other. MLX's CPU matmul makes one BLAS call per head, so the products are the
    # same calls, to the bit (rows are never split: a threaded BLAS may split a product's rows
    # differently for a different number of rows, and round differently).
    q = q.reshape(b, n_kv, repeats, length, dim)
    k = mx.broadcast_to(mx.expand_dims(k, 2), (b, n_kv, repeats, keys, dim))
    v = mx.broadcast_to(mx.expand_dims(v, 2), (b, n_kv, repeats, keys, dim))
    boolean = isinstance(mask, str) or (mask is not None and mask.dtype == mx.bool_)
    kept = 0
    if isinstance(mask, str):
        kept = max(0, keys - length + 1)  # up to the first query's own key: kept by all
        mask = mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None]
    if mask is not None:
        if boolean:
            mask = mask.astype(mx.uint8)  # see softmax_rows
        if mask.ndim >= 3:  # MLX's fallback: its heads axis is the query heads'
            mask = mx.broadcast_to(mask, (b, n_q, length, keys)).reshape(
                b, n_kv, repeats, length, keys)
        # A view: a group's part of a mask shared by heads or rows is not copied.
        mask = mx.broadcast_to(mask, (b, n_kv, repeats, length, keys))
    outs: list[Any] = []
    for group in _groups(b, n_kv, repeats, max(1, length * keys * 4)):
        # After the previous group, so that its memory is free to reuse.
        qg = q[group] if not outs else mx.depends(q[group], outs[-1])
        scores = qg @ k[group].swapaxes(-1, -2)
        part = None if mask is None else mask[group]
        probs: list[Any] = []
        for rows in _row_blocks(length, keys):
            x = scores if rows is None else scores[..., rows, :]
            if probs:  # likewise, after the previous block
                x = mx.depends(x, probs[-1])
            keep = None
            if boolean:
                keep = part if rows is None else part[..., rows, :]
            elif part is not None:
                x = x + (part if rows is None else part[..., rows, :]).astype(x.dtype)
            probs.append(softmax_rows(x, keep, kept))
        p = probs[0] if len(probs) == 1 else mx.concatenate(probs, axis=-2)
        outs.append((p @ v[group]).reshape(-1, length, dim))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    return out.reshape(b, n_q, length, dim)


def _groups(b: int, n_kv: int, repeats: int, head: int) -> Iterator[tuple[Any, ...]]:
    """Indices into [b, n_kv, repeats, ...] of groups of heads, in order, whose scores take at
    most GROUP_BYTES (at least one head): all of them, whole KV heads, or repeats of one."""
    per = max(1, GROUP_BYTES // head)
    if per >= b * n_kv * repeats:
        yield (slice(None),)
    elif per >= repeats:
        kvs = per // repeats
        for i in range(b):
            for kv in range(0, n_kv, kvs):
                yield i, slice(kv, min(n_kv, kv + kvs))
    else:
        for i in range(b):
            for kv in range(n_kv):
                for r in range(0, repeats, per):
                    yield i, kv, slice(r, min(repeats, r + per))


def _row_blocks(length: int, keys: int) -> Iterator[slice | None]:
    """The rows of a group's softmax, in order: all of them (None), or where one head's scores
    take more than GROUP_BYTES, blocks of rows that take at most that."""
    rows = max(1, GROUP_BYTES // (keys * 4))
    if rows >= length:
        yield None
        return
    for r in range(0, length, rows):
        yield slice(r, min(length, r + rows))


def _apply_mask(scores: Any, mask: Any, full: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """MLX's fallback's masking: a boolean mask keeps scores (others get the lowest float), any
    other is added."""
    import mlx.core as mx

    mask = mx.broadcast_to(mask, full).reshape(shape)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    return scores + mask.astype(scores.dtype)


# --- rotary position embedding ---------------------------------------------------------------

_rope_memo = threading.local()


def _logf(x: float) -> float:
    """``std::log`` of a float, as MLX's C++ computes it: libm's ``logf``."""
    fn = _state.get("logf")
    if fn is None:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        fn = libm.logf
        fn.argtypes, fn.restype = [ctypes.c_float], ctypes.c_float
        _state["logf"] = fn
    return fn(x)


def _inv_freqs(base: float, half: int) -> Any:
    """MLX's default inverse frequencies, ``exp(-i * log(base) / half)``, made once."""
    import mlx.core as mx

    key = ("inv_freqs", base, half)
    inv = _state.get(key)
    if inv is None:
        step = float(np.float32(_logf(base)) / np.float32(half))  # float arithmetic, as in C++
        inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(step, mx.float32))
        mx.eval(inv)
        _state[key] = inv
    return inv


def _rotate() -> Any:
    """The rotation as one fused kernel: ``x`` seen as [..., 2, half] (its two halves), times
    ``(cos, cos)``, plus the halves swapped times ``(-sin, sin)``: per element the products
    and the sum of MLX's ``x1 * cos - x2 * sin`` and ``x1 * sin + x2 * cos`` (``a - b`` is
    ``a + (-b)``, and a sum's order does not change it), without slicing the halves out and
    concatenating them back (two kernels and a copy: 3x slower on a prefill chunk's queries).
    A partial rotation (``dims`` < head size) keeps the rest of the head as it is."""
    import mlx.core as mx

    fn = _state.get("rotate")
    if fn is None:
        def rotate(x: Any, cos2: Any, sin2: Any) -> Any:
            half = cos2.shape[-1]
            head = x[..., :2 * half] if x.shape[-1] > 2 * half else x
            y = head.reshape(*head.shape[:-1], 2, half)
            out = (y * cos2 + y[..., ::-1, :] * sin2).reshape(head.shape)
            if x.shape[-1] > 2 * half:
                out = mx.concatenate([out, x[..., 2 * half:]], axis=-1)
            return out

        fn = _state["rotate"] = mx.compile(rotate)
    return fn


@contextlib.contextmanager
def shared_angles() -> Iterator[None]:
    """Inside, ``rope`` keeps the angles of every offset object it is given, not only the
    last one's: a forward pass that gives each layer the same offset objects (copies taken
    before the first layer, which nothing changes in place) makes each group's angles once
    for all layers. Outside, only the last offset's are kept, for the same layer's queries
    and keys: a cache's own offset is updated in place after them."""
    if getattr(_rope_memo, "shared", None) is not None:
        yield
        return
    _rope_memo.shared = {}
    try:
        yield
    finally:
        _rope_memo.shared = None


def rope(a: Any, dims: int, *, traditional: bool, base: float | None, scale: float,
         offset: Any, freqs: Any = None, stream: Any = None) -> Any:
    """``mx.fast.rope`` with MLX's CPU arithmetic in about a third of the ops.

    MLX's CPU fallback recomputes the inverse frequencies on every call and spends ~25 ops a
    call (two calls a layer, every step). Here the default inverse frequencies are made once,
    the cosines and sines of a step are made once for a layer's queries and keys (the same
    offset object; once for all layers inside ``shared_angles``), and the rotation is one
    compiled kernel: the same products, sums and roundings. Takes float32, non-traditional,
    4-D input on the default stream."""
    import mlx.core as mx

    original = _state["rope"]
    if (stream is not None or traditional or a.ndim != 4 or a.dtype != mx.float32
            or dims % 2 or dims > a.shape[-1] or mx.default_device() != mx.cpu
            or (freqs is None) == (base is None)):
        return original(a, dims, traditional=traditional, base=base, scale=scale,
                        offset=offset, freqs=freqs, stream=stream)
    length = a.shape[2]
    memo = getattr(_rope_memo, "last", None)
    shared = getattr(_rope_memo, "shared", None)
    key = (dims, base, scale, length, id(freqs) if freqs is not None else None)
    same_offset = memo is not None and (
        memo[1] is offset if isinstance(offset, mx.array)
        else not isinstance(memo[1], mx.array) and memo[1] == offset)
    kept = None if shared is None else shared.get((key, id(offset)))
    if kept is not None and kept[0] is offset:
        cos2, sin2 = kept[1], kept[2]
    elif same_offset and memo[0] == key:
        cos2, sin2 = memo[2], memo[3]
    else:
        off = offset if isinstance(offset, mx.array) else mx.array(offset, mx.int32)
        if off.ndim > 1 or (off.size != 1 and off.size != a.shape[0]):
            return original(a, dims, traditional=traditional, base=base, scale=scale,
                            offset=offset, freqs=freqs, stream=stream)
        if off.dtype.size != 4:
            off = off.astype(mx.int32)
        if off.size > 1:
            off = off[:, None, None]
        positions = (mx.arange(length, dtype=mx.float32) + off) * mx.array(scale, mx.float32)
        if freqs is None:
            inv = _inv_freqs(base, dims // 2)
        else:
            inv = mx.reciprocal(freqs.astype(mx.float32))
        theta = positions[..., None] * inv
        cos, sin = mx.cos(theta), mx.sin(theta)
        cos2, sin2 = mx.stack([cos, cos], axis=-2), mx.stack([-sin, sin], axis=-2)
        _rope_memo.last = (key, offset, cos2, sin2, freqs)  # refs keep the ids unique
        if shared is not None:
            shared[(key, id(offset))] = (offset, cos2, sin2, freqs)
    return _rotate()(a, cos2, sin2)


# --- switching ---------------------------------------------------------------------------------


def enable(choice: str = "native", home: Path | None = None) -> str:
    """Use the faster kernels in this process (``choice`` "native"), or MLX's ("mlx").
    Returns a line for the start-up log."""
    if choice not in CHOICES:
        raise ValueError(f"cpu kernels must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "mlx":
        disable()
        return "MLX's own"
    import mlx.core as mx

    with _lock:
        if "sdpa" not in _state:
            _state["sdpa"] = mx.fast.scaled_dot_product_attention
            _state["rope"] = mx.fast.rope
            mx.fast.scaled_dot_product_attention = attention
            mx.fast.rope = rope
        if "env" not in _state and home is not None:
            env = jit_env(home)
            _state["env"] = {k: os.environ.get(k) for k in env} if env else {}
            if env:
                os.environ.update(env)
    return describe()


def disable() -> None:
    """Back to MLX's kernels: its attention and rope, and ``PATH``/``TMPDIR`` as they were."""
    import mlx.core as mx

    with _lock:
        original = _state.pop("sdpa", None)
        if original is not None:
            mx.fast.scaled_dot_product_attention = original
            mx.fast.rope = _state.pop("rope")
        _rope_memo.__dict__.clear()
        for key, value in (_state.pop("env", None) or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def enabled() -> bool:
    return "sdpa" in _state


def describe() -> str:
    """The kernels this process runs, for the start-up log."""
    if "sdpa" not in _state:
        return "MLX's own"
    jit = ("fused kernels built for this CPU" if _state.get("env")
           else "fused kernels with MLX's default flags")
    return f"native ({jit}; attention and rope in fewer ops)"
