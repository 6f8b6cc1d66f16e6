"""Mixed steps: a decode step and a prefill chunk in one forward pass against two calls.

Loads the model (default: the bundled one, ``troupe pull``'s directory) on troupe's CPU
kernels, builds a decode batch of ``--batch`` sequences at ``--decode-context`` tokens and a
prompt already ``--contexts`` tokens into its prefill, then times, alternating within each
repetition:

- the decode step alone (one call);
- two calls, as mlx-lm's ``BatchGenerator`` makes them: the decode step, then the chunk;
- one ``mixed_forward`` call carrying both (``actors/engine/forward.py``);

and, for one layer's attention of the chunk over the long context, MLX's scaled dot product
attention (troupe's kernel when enabled) against ``chunk_attention``. Reports medians. On
Linux it re-executes itself with OpenBLAS preloaded, as ``troupe serve`` does.

    .venv/bin/python benchmarks/bench_mixed.py
    .venv/bin/python benchmarks/bench_mixed.py --contexts 1900 --chunks 8,32 --reps 7
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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
    p.add_argument("--batch", type=int, default=8, help="sequences decoding")
    p.add_argument("--decode-context", type=int, default=200)
    p.add_argument("--contexts", type=int_list, default=[200, 1000, 1900],
                   help="tokens of the prompt already in its cache")
    p.add_argument("--chunks", type=int_list, default=[1, 8, 16, 32, 64])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", choices=("native", "mlx"), default="native")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import (
        ArraysCache,
        BatchKVCache,
        BatchRotatingKVCache,
        KVCache,
        RotatingKVCache,
        make_prompt_cache,
    )

    from troupe.actors.engine import cpu_kernels
    from troupe.actors.engine.forward import (
        chunk_attention,
        head_sizes,
        mixed_forward,
        supports_mixed,
    )
    from troupe.actors.models.store import troupe_home

    cpu_kernels.enable(args.kernels, troupe_home())
    model_dir = args.model or resolve_default_model()
    model, _ = load(model_dir)
    if not supports_mixed(model):
        sys.exit(f"{model_dir}: not a model mixed steps take")
    rng = random.Random(0)
    # Token ids within the vocabulary (MLX does not check an embedding's index).
    vocab = model.model.embed_tokens.weight.shape[0]
    lo, hi = min(1000, vocab // 2), min(20000, vocab)
    # Each layer's cache kind and shapes, from one token run through the model's own caches:
    # attention layers get random keys and values (a rotating cache for a sliding-window
    # layer), recurrent ones (hybrid models) random state.
    probe = make_prompt_cache(model)
    model(mx.array([[lo]]), cache=probe)
    attn0 = next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn"))
    n_heads, n_kv, scale, sinks = head_sizes(attn0)
    full = next(i for i, c in enumerate(probe) if type(c) is KVCache)  # a global layer
    head_dim = probe[full].keys.shape[-1]

    def kv(rows: int, length: int) -> list[Any]:
        out = []
        for c in probe:
            if isinstance(c, ArraysCache):
                out.append([mx.random.normal((rows, *a.shape[1:])) * 0.1 for a in c.cache])
            else:
                shape = (rows, c.keys.shape[1], length, c.keys.shape[-1])
                out.append((mx.random.normal(shape) * 0.5, mx.random.normal(shape)))
        mx.eval(out)
        return out

    def caches(src: list[Any], rows: int) -> list[Any]:
        out = []
        for kind, state in zip(probe, src, strict=True):
            if isinstance(kind, ArraysCache):
                c = ArraysCache(len(state))
                for j, a in enumerate(state):
                    c[j] = a
            else:
                c = (BatchRotatingKVCache(kind.max_size, [0] * rows)
                     if isinstance(kind, RotatingKVCache) else BatchKVCache([0] * rows))
                c.update_and_fetch(*state)
            out.append(c)
        mx.eval([c.state for c in out])
        return out

    def timed(fn) -> float:
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3

    decode_kv = kv(args.batch, args.decode_context)
    decode_in = mx.array([[rng.randrange(lo, hi)] for _ in range(args.batch)])
    print(f"model {model_dir}, BLAS {blas_name()}, kernels {cpu_kernels.describe()}, "
          f"{args.batch} sequences decoding at {args.decode_context} tokens, "
          f"median of {args.reps}")
    print("| prompt context | chunk | decode step alone (ms) | two calls (ms) | mixed (ms) | "
          "two calls / mixed | attention of the chunk, one layer: sdpa / stacked heads (ms) |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for ctx in args.contexts:
        prompt_kv = kv(1, ctx)
        for chunk in args.chunks:
            chunk_in = mx.array([[rng.randrange(lo, hi) for _ in range(chunk)]])
            alone, two, one, sdpa, stacked = [], [], [], [], []
            for _ in range(args.reps):
                dc = caches(decode_kv, args.batch)
                alone.append(timed(lambda: mx.eval(model(decode_in, cache=dc))))  # noqa: B023
                dc, pc = caches(decode_kv, args.batch), caches(prompt_kv, 1)

                def separate() -> None:
                    mx.eval(model(decode_in, cache=dc))  # noqa: B023
                    model(chunk_in, cache=pc)  # noqa: B023
                    mx.eval([c.state for c in pc])  # noqa: B023

                two.append(timed(separate))
                dc, pc = caches(decode_kv, args.batch), caches(prompt_kv, 1)
                one.append(timed(lambda: mx.eval(
                    mixed_forward(model, decode_in, dc, chunk_in, pc),  # noqa: B023
                    [c.state for c in pc])))  # noqa: B023
                if chunk > 1 and sinks is None:  # (chunk_attention takes no sinks)
                    c = caches(prompt_kv, 1)[full]
                    mask = create_attention_mask(mx.zeros((1, chunk, 1)), c)
                    q = mx.random.normal((1, n_heads, chunk, head_dim)) * 0.5
                    k, v = c.update_and_fetch(*kv(1, chunk)[full])
                    mx.eval(q, k, v, mask)
                    sdpa.append(timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(
                        q, k, v, scale=scale, mask=mask))))  # noqa: B023
                    stacked.append(timed(lambda: mx.eval(chunk_attention(
                        q, k, v, scale=scale, mask=mask))))  # noqa: B023
            med = statistics.median
            row = {"context": ctx, "chunk": chunk, "decode_ms": med(alone),
                   "two_calls_ms": med(two), "mixed_ms": med(one),
                   "sdpa_ms": med(sdpa) if sdpa else None,
                   "stacked_ms": med(stacked) if stacked else None}
            rows.append(row)
            attn = "–" if not sdpa else f"{row['sdpa_ms']:.1f} / {row['stacked_ms']:.1f}"
            print(f"| {ctx} | {chunk} | {row['decode_ms']:.0f} | {row['two_calls_ms']:.0f} | "
                  f"{row['mixed_ms']:.0f} | {row['two_calls_ms'] / row['mixed_ms']:.2f}x | "
                  f"{attn} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model_dir, "blas": blas_name(),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
