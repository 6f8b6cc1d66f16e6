"""Where a cache-hit turn's prefill time goes: new tokens on top of a long cached context.

An agent's later turn prefills only its new message (~100-600 tokens), but on top of 2-6k
tokens already in the cache. This times, in this process on troupe's CPU kernels (as
``troupe serve`` runs them), for ``chunk`` new tokens over ``context`` cached ones:

- **forward**: one forward pass of the chunk on top of the context (trimmed back after);
- **forward, no context**: the same chunk on an empty cache: the weights' work;
- **attention**: the layers' ``scaled_dot_product_attention`` of the chunk's queries over
  ``context + chunk`` keys, causal (as the model calls it); the same **without a mask**;
  **the two products alone** (scores, then probabilities times values, no softmax); and
  the causal attention with **MLX's own** kernel. Each layer's call runs after the last
  one's, as in the model.

Figures are CPU time of this process per new token (the attention's summed over the
layers), the best of ``--reps``, with OpenBLAS on one thread: on a shared machine, other jobs
then stretch the wall time but not these.

    .venv/bin/python benchmarks/sessions_hit_cost.py
    .venv/bin/python benchmarks/sessions_hit_cost.py --contexts 0,3000 --chunks 64,400
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402
    blas_name,
    int_list,
    resolve_default_model,
    same_blas_as_troupe_serve,
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--contexts", type=int_list, default=[0, 1000, 3000, 5000])
    p.add_argument("--chunks", type=int_list, default=[64, 400])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernels", default="native", help="troupe's --cpu-kernels: native or mlx")
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before the re-execution keeps it
    same_blas_as_troupe_serve()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from troupe.actors.engine import cpu_kernels
    from troupe.actors.models.store import troupe_home

    mlx_sdpa = mx.fast.scaled_dot_product_attention
    cpu_kernels.enable(args.kernels, troupe_home())
    model_dir = args.model or resolve_default_model()
    model, _ = load(model_dir)
    cfg = model.args
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = len(model.layers)
    rng = random.Random(0)
    sdpa = mx.fast.scaled_dot_product_attention  # troupe's, once enabled
    scale = head_dim ** -0.5

    def tokens(n: int) -> mx.array:
        return mx.array([[rng.randrange(1000, 20000) for _ in range(n)]])

    def cpu(fn: Callable[[], object]) -> float:
        times = []
        for _ in range(args.reps):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        return min(times)

    print(f"model {model_dir}, BLAS {blas_name()} on "
          f"{os.environ['OPENBLAS_NUM_THREADS']} thread(s), CPU kernels {args.kernels}; "
          "CPU ms per new token")
    print("| context | chunk | forward | forward, no context | attention, causal | attention, "
          "no mask | the two products alone | attention, causal, MLX's own |\n"
          "|---|---|---|---|---|---|---|---|")
    base: dict[int, float] = {}
    for ctx in args.contexts:
        cache = make_prompt_cache(model)
        filler = tokens(ctx)
        for i in range(0, ctx, 512):
            model(filler[:, i : i + 512], cache=cache)
            mx.eval([c.state for c in cache])
        for n in args.chunks:
            x = tokens(n)

            def forward(x: mx.array = x, n: int = n, cache: list = cache) -> None:
                mx.eval(model(x, cache=cache))
                for c in cache:
                    c.trim(n)

            whole = cpu(forward)
            base.setdefault(n, whole if ctx == 0 else float("nan"))
            q = mx.random.normal((1, heads, n, head_dim))
            k = mx.random.normal((1, kv_heads, ctx + n, head_dim))
            v = mx.random.normal((1, kv_heads, ctx + n, head_dim))
            mx.eval(q, k, v)
            qg = q.reshape(1, kv_heads, heads // kv_heads, n, head_dim)
            kg, vg = mx.expand_dims(k, 2), mx.expand_dims(v, 2)

            def layers_of(one: Callable[[mx.array], mx.array], q: mx.array) -> float:
                def run() -> None:
                    out = None
                    for _ in range(layers):
                        out = one(q if out is None else mx.depends(q, out))
                    mx.eval(out)
                return cpu(run)

            causal = layers_of(lambda q, k=k, v=v: sdpa(q, k, v, scale=scale, mask="causal"), q)
            unmasked = layers_of(lambda q, k=k, v=v: sdpa(q, k, v, scale=scale), q)
            products = layers_of(lambda q, kg=kg, vg=vg: (q @ kg.swapaxes(-1, -2)) @ vg, qg)
            mlx_own = layers_of(
                lambda q, k=k, v=v: mlx_sdpa(q, k, v, scale=scale, mask="causal"), q)
            cells = [whole, base[n], causal, unmasked, products, mlx_own]
            print(f"| {ctx} | {n} | " + " | ".join(f"{c / n * 1e3:.1f}" for c in cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
