"""The CPU kernels: troupe's ("native") against MLX's own ("mlx"), same model, same results.

Two processes, one per choice (a kernel built for this CPU lives in the process that built
it, and MLX reads its JIT settings when it builds), stay up for the whole run and take turns:
every measurement runs in one and then the other, alternating which goes first, for
``--rounds`` rounds, so a shared machine's load falls on both alike. Each times, on the default
model (``troupe pull``'s directory) in float32: a batch of 8 chat-length prompts (74 tokens)
prefilled together, a 512-, a 1,024- and a 2,048-token prompt (512-token chunks, as the
server prefills), 400 new tokens on top of 3,000 cached (an agent's later turn), and one
decode step of 1, 16 and 32 sequences at 100 tokens of context. The report
gives medians and the median of the per-round ratios; both processes hash the logits of a
300-token prompt, which must be the same. On Linux it re-executes itself with OpenBLAS
preloaded, as ``troupe serve`` does.

    .venv/bin/python benchmarks/bench_cpu_kernels.py
    .venv/bin/python benchmarks/bench_cpu_kernels.py --rounds 9 --json bench-results/kernels.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import blas_name, resolve_default_model, same_blas_as_troupe_serve  # noqa: E402

CHOICES = ("mlx", "native")


MEASUREMENTS = ("prefill_8x74", "prefill_512", "prefill_1024", "prefill_2048",
                "hit_400_at_3000", "decode_b1", "decode_b16", "decode_b32")


def child(model_dir: str, choice: str, home: str) -> None:
    """Serve measurements named on stdin, one JSON line each on stdout."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from troupe.actors.engine import cpu_kernels

    kernels = cpu_kernels.enable(choice, Path(home))
    model, _ = load(model_dir)

    def prefill(batch: int, length: int):
        tokens = mx.array([[(i * 7 + b) % 5000 + 10 for i in range(length)]
                           for b in range(batch)])

        def run() -> None:
            cache = make_prompt_cache(model)
            for i in range(0, length, 512):
                h = model.model(tokens[:, i:i + 512], cache=cache)
                mx.eval(h, [c.state for c in cache])
        return run

    def hit(length: int, context: int):
        cache = make_prompt_cache(model)
        cached = mx.array([[(i * 11) % 5000 + 10 for i in range(context)]])
        for i in range(0, context, 512):
            mx.eval(model.model(cached[:, i:i + 512], cache=cache), [c.state for c in cache])
        tokens = mx.array([[(i * 7) % 5000 + 10 for i in range(length)]])

        def run() -> None:
            mx.eval(model.model(tokens, cache=cache))
            for c in cache:
                c.trim(length)  # the same context every time
        return run

    def decode(batch: int, context: int = 100):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[7] * context] * batch), cache=cache))
        y = mx.array([[5]] * batch)

        def step() -> None:
            for _ in range(3):
                out = model(y, cache=cache)
                mx.eval(out[:, -1, :].argmax(-1))
                for c in cache:
                    c.offset -= 1  # the same context every step
        return step

    work = {"prefill_8x74": prefill(8, 74), "prefill_512": prefill(1, 512),
            "prefill_1024": prefill(1, 1024), "prefill_2048": prefill(1, 2048),
            "hit_400_at_3000": hit(400, 3000), "decode_b1": decode(1),
            "decode_b16": decode(16), "decode_b32": decode(32)}
    for fn in work.values():
        fn()  # warm-up: kernels get built, memory allocated
    logits = model(mx.array([[(i * 13) % 5000 + 10 for i in range(300)]]))
    print(json.dumps({"kernels": kernels,
                      "logits_sha256": hashlib.sha256(np.array(logits).tobytes()).hexdigest()}),
          flush=True)
    for line in sys.stdin:
        name = line.strip()
        start = time.perf_counter()
        work[name]()
        ms = (time.perf_counter() - start) * 1000
        print(json.dumps({name: ms / (3 if name.startswith("decode") else 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--child", choices=CHOICES, help=argparse.SUPPRESS)
    p.add_argument("--home", help=argparse.SUPPRESS)
    args = p.parse_args()
    same_blas_as_troupe_serve()
    model_dir = args.model or resolve_default_model()
    if args.child:
        child(model_dir, args.child, args.home)
        return
    times: dict[str, dict[str, list[float]]] = {c: {m: [] for m in MEASUREMENTS}
                                                for c in CHOICES}
    with tempfile.TemporaryDirectory(prefix="bench-kernels-") as home:
        procs = {c: subprocess.Popen([sys.executable, __file__, "--model", model_dir, "--child",
                                      c, "--home", home], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=dict(os.environ))
                 for c in CHOICES}
        try:
            hello = {c: json.loads(procs[c].stdout.readline()) for c in CHOICES}
            for rnd in range(args.rounds):
                for m in MEASUREMENTS:
                    for c in (CHOICES if rnd % 2 == 0 else CHOICES[::-1]):
                        procs[c].stdin.write(m + "\n")
                        procs[c].stdin.flush()
                        times[c][m].append(json.loads(procs[c].stdout.readline())[m])
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for proc in procs.values():
                proc.stdin.close()
                proc.wait(timeout=60)
    same = hello["mlx"]["logits_sha256"] == hello["native"]["logits_sha256"]
    print(f"BLAS: {blas_name()}; {args.rounds} rounds; logits identical: {same}")
    print(f"troupe kernels: {hello['native']['kernels']}\n")
    print("| measurement | MLX's kernels, median (ms) | troupe's (ms) | speed-up (median of "
          "rounds' ratios, range) |")
    print("|---|---|---|---|")
    summary = {}
    for m in MEASUREMENTS:
        a, b = times["mlx"][m], times["native"][m]
        ratios = sorted(x / y for x, y in zip(a, b, strict=True))
        summary[m] = {"mlx_ms": statistics.median(a), "native_ms": statistics.median(b),
                      "speedup": statistics.median(ratios)}
        print(f"| {m} | {summary[m]['mlx_ms']:.0f} | {summary[m]['native_ms']:.0f} | "
              f"{summary[m]['speedup']:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |")
    if args.json:
        Path(args.json).write_text(json.dumps({"times": times, "summary": summary,
                                               "identical": same, "hello": hello}, indent=1))
    if not same:
        sys.exit("the logits differ between the kernels")


if __name__ == "__main__":
    main()
