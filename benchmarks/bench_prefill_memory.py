"""What one prefill chunk holds beyond the KV: the memory guard's transient, measured.

Loads the model (default: the bundled one, ``troupe pull``'s directory) with troupe's CPU
attention (``--kernels native``) or MLX's (``mlx``), fills mlx-lm's cache with the context
but the last ``--chunk`` tokens, then runs that chunk with MLX's peak counter reset and
reports the peak less what is held after it (the grown KV, the chunk's output): the
transient ``memory_estimate.prefill_transient`` estimates, printed beside it. In MB (10^6
bytes). On Linux it re-executes itself with OpenBLAS preloaded, as ``troupe serve`` does.

    .venv/bin/python benchmarks/bench_prefill_memory.py
    .venv/bin/python benchmarks/bench_prefill_memory.py --kernels mlx --shapes 1x512,1x2560
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import blas_name, resolve_default_model, same_blas_as_troupe_serve  # noqa: E402

MB = 1e6
SHAPES = "1x512,1x1536,1x2560,1x3072,1x4096,1x4608,1x6144,1x8192,2x2560,4x512,8x512"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--kernels", choices=("native", "mlx"), default="native")
    p.add_argument("--chunk", type=int, default=512, help="the measured chunk's tokens")
    p.add_argument("--shapes", default=SHAPES,
                   help="sequences x context tokens (the chunk included), comma-separated")
    args = p.parse_args()
    same_blas_as_troupe_serve()
    model_dir = args.model or resolve_default_model()

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from troupe.actors.engine import cpu_kernels
    from troupe.actors.engine.memory_estimate import (
        model_memory_of,
        prefill_transient,
        score_factor,
    )
    from troupe.actors.models.home import troupe_home

    cpu_kernels.enable(args.kernels, troupe_home() / "jit")
    model, _ = load(model_dir)
    shape = model_memory_of(Path(model_dir))
    print(f"model {model_dir}, BLAS {blas_name()}, attention {args.kernels}, "
          f"{args.chunk}-token chunk, the estimate's copies of the scores {score_factor()}; "
          "MB beyond the KV\n")
    print("| sequences | context | measured | estimate | estimate / measured |")
    print("|---|---|---|---|---|")
    for item in args.shapes.split(","):
        batch, context = (int(x) for x in item.split("x"))
        if context < args.chunk:
            sys.exit(f"context {context} is shorter than the chunk ({args.chunk})")
        cache = make_prompt_cache(model)
        tokens = mx.array([[(i * 7 + b) % 5000 + 10 for i in range(context)]
                           for b in range(batch)])
        start = context - args.chunk
        # Hidden states only, as the engine's prefill runs it (no logits for a whole chunk).
        for i in range(0, start, args.chunk):
            end = min(start, i + args.chunk)
            mx.eval(model.model(tokens[:, i:end], cache=cache), [c.state for c in cache])
        mx.clear_cache()
        mx.reset_peak_memory()
        out = model.model(tokens[:, start:], cache=cache)
        mx.eval(out, [c.state for c in cache])
        measured = (mx.get_peak_memory() - mx.get_active_memory()) / MB
        estimate = prefill_transient(shape, chunk=args.chunk, context=context,
                                     batch=batch) / MB
        print(f"| {batch} | {context} | {measured:.1f} | {estimate:.1f} | "
              f"{estimate / measured:.2f} |", flush=True)
        del cache, out
        mx.clear_cache()


if __name__ == "__main__":
    main()
