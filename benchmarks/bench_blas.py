"""The BLAS lever: one prefill and decode of the default model, bundled BLAS vs OpenBLAS.

Runs the same measurement in two fresh processes, one with Debian's OpenBLAS preloaded (a
preload only works at process start), and prints a Markdown table.

    .venv/bin/python benchmarks/bench_blas.py [--model DIR] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MEASURE = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from troupe.actors.models.blas import loaded_blas
model, _ = load(sys.argv[1])
n = int(sys.argv[2])
x = mx.array([list(range(100, 100 + n))])
cache = make_prompt_cache(model)
start = time.perf_counter(); mx.eval(model(x, cache=cache)); prefill = time.perf_counter() - start
y = mx.array([[5]])
start = time.perf_counter()
for _ in range(10):
    mx.eval(model(y, cache=cache))
decode = (time.perf_counter() - start) / 10
print(json.dumps({"blas": loaded_blas(), "prefill_s": prefill, "decode_s": decode}))
"""


def measure(model_dir: str, tokens: int, preload: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, "-c", MEASURE, model_dir, str(tokens)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    from troupe.actors.models.blas import find_openblas

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--prompt-tokens", type=int, default=512)
    args = p.parse_args()
    model_dir = args.model or subprocess.run(
        [sys.executable, "-m", "troupe.api.cli", "pull"], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    openblas = find_openblas()
    runs = [measure(model_dir, args.prompt_tokens, None)]
    if openblas is not None:
        runs.append(measure(model_dir, args.prompt_tokens, str(openblas)))
    print(f"| BLAS | {args.prompt_tokens}-token prefill (s) | decode step (s) |")
    print("|---|---|---|")
    for r in runs:
        print(f"| {r['blas']} | {r['prefill_s']:.2f} | {r['decode_s']:.3f} |")
    if len(runs) == 2:
        speedup = runs[0]["prefill_s"] / runs[1]["prefill_s"]
        print(f"\nprefill speed-up with OpenBLAS: {speedup:.1f}x")


if __name__ == "__main__":
    main()
