"""The one-pass step on a random-weight gemma3_text (or another architecture): the time to
prefill a prompt while 4 streams decode, mixed steps on against off (mlx-lm's decode call and
prefill call). In-process Engine runs, alternating, medians.

    .venv/bin/python benchmarks/bench_gemma3_mixed.py --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from harness import blas_name, same_blas_as_troupe_serve  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gemma3_text")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk size")
    p.add_argument("--prompt-reps", type=int, default=4, help="the prompt: all PROMPTS x this")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", choices=("native", "mlx"), default="native")
    return p.parse_args()


def once(model: Any, tok: Any, long_prompt: list[int], chunk: int,
         mixed: bool) -> tuple[float, int]:
    """Seconds and steps until the long prompt's first token, 4 streams decoding meanwhile."""
    from engine_helpers import engine_config, greedy
    from reference import PROMPTS

    from troupe.actors.engine.core import Engine

    engine = Engine(model, tok, engine_config(prefill_step_size=chunk, mixed_step=mixed))
    assert engine.runner.mixed is mixed
    for i in range(4):
        engine.add(f"d{i}", tok.encode(PROMPTS[i]), greedy(10_000, ignore_eos=True))
    while engine.runner.decoding < 4:
        engine.step()
    for _ in range(3):
        engine.step()
    engine.add("long", long_prompt, greedy(4, ignore_eos=True))
    steps = 0
    began = time.perf_counter()
    while engine.requests["long"].first_token_at is None:
        engine.step()
        steps += 1
    seconds = time.perf_counter() - began
    for rid in list(engine.requests):
        engine.abort(rid)
    return seconds, steps


def main() -> None:
    args = parse_args()
    same_blas_as_troupe_serve()
    from mlx_lm import load
    from reference import PROMPTS
    from tiny_model import make_tiny_model

    from troupe.actors.engine import cpu_kernels

    if args.kernels == "native":
        print(cpu_kernels.enable("native"))
    directory = make_tiny_model(Path(tempfile.mkdtemp()) / "m", arch=args.arch,
                                hidden=args.hidden, layers=args.layers)
    model, tok = load(str(directory))
    print(f"{args.arch}: hidden {args.hidden}, {args.layers} layers, window "
          f"{getattr(model.args, 'sliding_window', None)}; BLAS: {blas_name()}")
    long_prompt = tok.encode(" ".join(PROMPTS) * args.prompt_reps)
    for mixed in (True, False):  # warm-up
        once(model, tok, long_prompt, args.chunk, mixed)
    runs: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
    for rep in range(args.reps):
        for mixed in (True, False) if rep % 2 == 0 else (False, True):
            runs[mixed].append(once(model, tok, long_prompt, args.chunk, mixed))
    median = {m: statistics.median(s for s, _ in runs[m]) for m in runs}
    for mixed in (True, False):
        print(f"mixed={mixed}: a {len(long_prompt)}-token prompt in chunks of {args.chunk}: "
              f"{runs[mixed][0][1]} steps, median {median[mixed] * 1e3:.1f} ms")
    print(f"off / on: {median[False] / median[True]:.2f}x")


if __name__ == "__main__":
    main()
