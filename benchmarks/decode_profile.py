"""Where one stream's decode step goes: a batch-1 step of the default model, op by op.

Times, in this process on troupe's CPU kernels (as ``troupe serve`` runs them), with OpenBLAS
on one thread:

- **troupe's Engine.step**: one decode step of one request through troupe's ``Engine`` with
  serve's defaults (greedy), at about ``--context`` tokens of context;
- **bare model call**: ``model(y, cache=cache)`` and the argmax of its logits, evaluated, and
  the same through troupe's ``mixed_forward`` (the Engine's forward pass); the Engine's step
  less the latter is the engine's overhead (scheduling, sampling, Python);
- the **matrix-vector products** alone, each kind for all layers (``x @ W.T`` at batch 1,
  as mlx-lm's ``Linear`` computes it), and the **lm_head** (the tied embeddings'
  ``as_linear``): the same products through numpy (OpenBLAS ``sgemv``) for comparison;
- **the rest of the layers**: the model's layers (``model.model``) less their products; and,
  each alone for all layers: norms, rope, attention, the KV cache's update, SwiGLU;
- **sampling**: greedy (argmax) and at temperature 1 (mlx-lm's sampler), on [1, vocab];
- the **memory bound**: a numpy copy of the weights' bytes into a buffer (reads and writes
  them: a plain read takes about half).

Figures are milliseconds of CPU time of this process per step (the best of ``--reps``;
``--wall`` adds the median wall time), each a share of the Engine's step. Rows in italics
are references, not parts of the step.

    .venv/bin/python benchmarks/decode_profile.py
    .venv/bin/python benchmarks/decode_profile.py --reps 9 --context 500 --wall
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import blas_name, resolve_default_model, same_blas_as_troupe_serve  # noqa: E402

PRODUCTS = (("q_proj", "self_attn"), ("k_proj", "self_attn"), ("v_proj", "self_attn"),
            ("o_proj", "self_attn"), ("gate_proj", "mlp"), ("up_proj", "mlp"),
            ("down_proj", "mlp"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--context", type=int, default=100, help="tokens in the cache")
    p.add_argument("--kernels", default="native", help="troupe's --cpu-kernels: native or mlx")
    p.add_argument("--wall", action="store_true", help="also the median wall time")
    p.add_argument("--speculative", choices=("off", "ngram"), default=None,
                   help="the Engine's --speculative (default: serve's); off to compare with "
                        "a commit that has no drafting")
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before the re-execution keeps it
    same_blas_as_troupe_serve()

    import mlx.core as mx
    import numpy as np
    from engine_bench import served_engine
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.llama import swiglu
    from mlx_lm.sample_utils import make_sampler

    from troupe.actors.engine import cpu_kernels
    from troupe.actors.engine.forward import mixed_forward
    from troupe.actors.messages import SamplingParams
    from troupe.actors.models.store import troupe_home

    cpu_kernels.enable(args.kernels, troupe_home())
    model_dir = args.model or resolve_default_model()
    model, tok = load(model_dir)
    inner = model.model
    layers = inner.layers
    n_layers = len(layers)
    cfg = model.args
    attn0 = layers[0].self_attn
    heads, kv_heads = attn0.n_heads, attn0.n_kv_heads
    dim = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or dim // heads
    tied = bool(getattr(cfg, "tie_word_embeddings", False)) or not hasattr(model, "lm_head")
    lm_w = inner.embed_tokens.weight if tied else model.lm_head.weight
    rows: list[tuple[str, float, float]] = []  # (component, CPU ms, wall ms)

    def timed(fn: Callable[[], object]) -> tuple[float, float]:
        fn()  # warm-up
        cpu, wall = [], []
        for _ in range(args.reps):
            c, w = time.process_time(), time.perf_counter()
            fn()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
        return min(cpu) * 1e3, statistics.median(wall) * 1e3

    def row(name: str, fn: Callable[[], object]) -> tuple[float, float]:
        got = timed(fn)
        rows.append((name, *got))
        return got

    # -- the Engine's step and the bare model call -------------------------------------------
    greedy = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    engine = served_engine(model, tok, SamplingParams(max_tokens=2, temperature=0.0),
                           speculative=args.speculative)
    engine.add("stream", [(i * 7) % 5000 + 10 for i in range(args.context)], greedy)
    while engine.runner.decoding == 0 or engine.runner.prefill_rows():
        engine.step()
    engine_ms = row("troupe's Engine.step (one stream)", engine.step)
    engine.close()

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[(i * 7) % 5000 + 10 for i in range(args.context)]]), cache=cache))
    y = mx.array([[5]])

    def rewind() -> None:
        for c in cache:
            c.offset -= 1  # the same context every step

    def bare() -> None:
        mx.eval(model(y, cache=cache)[:, -1, :].argmax(-1))
        rewind()

    def layers_only() -> None:
        mx.eval(inner(y, cache=cache))
        rewind()

    def troupe_forward() -> None:
        mx.eval(mixed_forward(model, y, cache)[:, -1, :].argmax(-1))
        rewind()

    row("bare model call + argmax", bare)
    forward_ms = row("troupe's forward (mixed_forward) + argmax", troupe_forward)
    layers_ms = row("  the layers (model.model)", layers_only)

    # -- the matrix-vector products ------------------------------------------------------------
    product_ms = [0.0, 0.0]
    numpy_rows = []
    for name, part in PRODUCTS:
        ws = [getattr(getattr(layer, part), name).weight for layer in layers]
        x = mx.random.normal((1, ws[0].shape[1]))
        mx.eval(x)
        got = row(f"    {name} {tuple(ws[0].shape)} x{n_layers}",
                  lambda ws=ws, x=x: mx.eval([x @ w.T for w in ws]))
        product_ms = [a + b for a, b in zip(product_ms, got, strict=True)]
        wn, xn = [np.array(w) for w in ws], np.array(x)[0]
        numpy_rows.append(timed(lambda wn=wn, xn=xn: [w @ xn for w in wn]))
    rows.append(("    all layers' products", *product_ms))
    rows.append(("    the rest (norms, rope, attention, cache, SwiGLU, adds, calls)",
                 layers_ms[0] - product_ms[0], layers_ms[1] - product_ms[1]))

    # The rest, each kind alone for all layers at this step's shapes.
    h = mx.random.normal((1, 1, dim))
    q = mx.random.normal((1, heads, 1, head_dim))
    k = mx.random.normal((1, kv_heads, 1, head_dim))
    keys = mx.random.normal((1, kv_heads, args.context + 1, head_dim))
    values = mx.random.normal((1, kv_heads, args.context + 1, head_dim))
    g = mx.random.normal((1, 1, cfg.intermediate_size))
    mx.eval(h, q, k, keys, values, g)
    norm = layers[0].input_layernorm
    offset = mx.array(args.context)

    row(f"      RMS norms x{2 * n_layers + 1}",
        lambda: mx.eval([norm(h + i) for i in range(2 * n_layers + 1)]))
    row(f"      rope (queries, keys) x{n_layers}", lambda: mx.eval(
        [(attn0.rope(q + i, offset=offset), attn0.rope(k + i, offset=offset))
         for i in range(n_layers)]))
    row(f"      attention over {args.context + 1} keys x{n_layers}", lambda: mx.eval(
        [scaled_dot_product_attention(q + i, keys, values, cache=None, scale=attn0.scale,
                                      mask=None) for i in range(n_layers)]))

    def cache_update() -> None:
        for c in cache:
            c.update_and_fetch(k, k)
        mx.eval([c.state for c in cache])
        rewind()

    row(f"      KV cache update x{n_layers}", cache_update)
    row(f"      SwiGLU x{n_layers}", lambda: mx.eval([swiglu(g + i, g) for i in range(n_layers)]))
    row(f"      residual adds x{2 * n_layers}",
        lambda: mx.eval([h + i for i in range(2 * n_layers)]))

    # -- the lm_head, sampling --------------------------------------------------------------------
    xh = mx.random.normal((1, dim))
    mx.eval(xh)
    lm_label = "tied embeddings, as_linear" if tied else "lm_head"
    row(f"  lm_head {tuple(lm_w.shape)} ({lm_label})", lambda: mx.eval(xh @ lm_w.T))
    logits = mx.random.normal((1, lm_w.shape[0])) * 4
    mx.eval(logits)
    row("sampling: greedy (argmax)", lambda: mx.eval(logits.argmax(-1)))
    sampler = make_sampler(temp=1.0)
    row("sampling: temperature 1 (mlx-lm's sampler)", lambda: mx.eval(sampler(logits)))
    rows.append(("Engine.step - troupe's forward (engine overhead)",
                 engine_ms[0] - forward_ms[0], engine_ms[1] - forward_ms[1]))

    # -- references ----------------------------------------------------------------------------
    for (name, _), got in zip(PRODUCTS, numpy_rows, strict=True):
        rows.append((f"_numpy sgemv: {name} x{n_layers}_", *got))
    rows.append(("_numpy sgemv: all layers' products_",
                 sum(r[0] for r in numpy_rows), sum(r[1] for r in numpy_rows)))
    lm_np, xn = np.array(lm_w), np.array(xh)[0]
    row("_numpy sgemv: lm_head_", lambda: lm_np @ xn)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    src = np.ones(weights // 4, np.float32)
    dst = np.empty_like(src)
    copy_ms = row(f"_numpy copy of the weights' {weights / 1e6:.0f} MB_",
                  lambda: np.copyto(dst, src))

    print(f"model {model_dir}, BLAS {blas_name()} on {os.environ['OPENBLAS_NUM_THREADS']} "
          f"thread(s), CPU kernels {args.kernels}, context {args.context}; CPU ms per step "
          f"(best of {args.reps}); copy bandwidth {2 * weights / copy_ms[1] / 1e6:.1f} GB/s "
          "(read + write, wall)")
    head = "| component | ms per step | share |" + (" wall ms (median) |" if args.wall else "")
    print(head + "\n|---|---|---|" + ("---|" if args.wall else ""))
    for name, cpu, wall in rows:
        cells = [name, f"{cpu:.1f}", f"{100 * cpu / engine_ms[0]:.0f}%"]
        if args.wall:
            cells.append(f"{wall:.1f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
