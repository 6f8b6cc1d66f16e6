"""What one prefill call costs, by chunk size and context: why a step's prefill has a floor.

Loads the model (default: the bundled one, ``troupe pull``'s directory), fills a cache with
``--contexts`` tokens of context, then times one forward pass of ``--chunks`` new tokens on
top of it (the cache is trimmed back after each pass), the best of ``--reps``. On Linux it
re-executes itself with OpenBLAS preloaded, as ``troupe serve`` does.

    .venv/bin/python benchmarks/bench_prefill_chunk.py
    .venv/bin/python benchmarks/bench_prefill_chunk.py --contexts 200,1900 --chunks 1,32

A call carrying one token costs about a decode step (the weights are read once per call), so
interleaving a long prompt's prefill with decoding streams in small chunks costs the streams
at least that per step, and the long prompt a fixed cost per chunk.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
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
    p.add_argument("--contexts", type=int_list, default=[200, 1000, 1900])
    p.add_argument("--chunks", type=int_list, default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model_dir = args.model or resolve_default_model()
    model, _ = load(model_dir)
    rng = random.Random(0)

    def tokens(n: int) -> mx.array:
        return mx.array([[rng.randrange(1000, 20000) for _ in range(n)]])

    print(f"model {model_dir}, BLAS {blas_name()}")
    print("| context | chunk | call (ms) | per token (ms) |\n|---|---|---|---|")
    rows = []
    for ctx in args.contexts:
        cache = make_prompt_cache(model)
        filler = tokens(ctx)
        for i in range(0, ctx, 256):
            model(filler[:, i : i + 256], cache=cache)
            mx.eval([c.state for c in cache])
        for n in args.chunks:
            times = []
            for _ in range(args.reps):
                x = tokens(n)
                t = time.perf_counter()
                model(x, cache=cache)
                mx.eval([c.state for c in cache])
                times.append(time.perf_counter() - t)
                for c in cache:
                    c.trim(n)
            best = min(times)
            rows.append({"context": ctx, "chunk": n, "call_s": best})
            print(f"| {ctx} | {n} | {best * 1e3:.0f} | {best / n * 1e3:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"blas": blas_name(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
