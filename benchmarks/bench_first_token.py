"""A prompt's first token: sampled from the prefill chunk that runs its last prompt token, or
from a decode step after it (mlx-lm keeps the last prompt token back for that step).

troupe's ``Runner`` (``actors/engine/runner.py``, mixed steps) samples the first token
from the chunk's logits at the last prompt token, in the step that prefills it; this script
puts mlx-lm's way back (``first_token_in_chunk = False``) for the comparison. On the default
model (troupe's CPU kernels, OpenBLAS preloaded as ``troupe serve`` does), through troupe's
``Engine`` with the chat template cached (as the server runs it), alternating, medians over
``--reps``:

1. one chat prompt alone: time to its first token (the steps it took);
2. a burst of ``--burst`` chat prompts at once: when the earliest, the median and the last
   first token came.

    .venv/bin/python benchmarks/bench_first_token.py
    .venv/bin/python benchmarks/bench_first_token.py --reps 5 --burst 16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import first_tokens, prompts, served_engine  # noqa: E402
from harness import (  # noqa: E402
    blas_name,
    load_ceiling,
    resolve_default_model,
    same_blas_as_troupe_serve,
)

MODES = ("chunk", "decode-step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    from troupe.actors.engine.runner import Runner
    from troupe.actors.messages import SamplingParams

    model, tok = load_ceiling(args.model or resolve_default_model())  # troupe's CPU kernels
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def engine(mode: str) -> Any:
        Runner.first_token_in_chunk = mode == "chunk"
        e = served_engine(model, tok, greedy)
        assert e.runner.mixed, "the comparison needs mixed steps (a llama-shaped model)"
        return e

    out: dict[str, Any] = {"blas": blas_name(), "alone": {}, "burst": {}}
    print(f"BLAS: {out['blas']}")
    for r in range(args.reps):
        for mode in MODES if r % 2 else reversed(MODES):
            e = engine(mode)
            (alone,), steps = first_tokens(e, prompts(tok, 1, f"{mode}-{time.time()}"), greedy)
            out["alone"].setdefault(mode, []).append({"s": alone, "steps": steps})
            times, _ = first_tokens(e, prompts(tok, args.burst, f"{mode}-{time.time()}"),
                                    greedy)
            out["burst"].setdefault(mode, []).append(times)
            e.close()
    Runner.first_token_in_chunk = True
    for mode in MODES:
        alone = statistics.median(a["s"] for a in out["alone"][mode])
        steps = statistics.median(a["steps"] for a in out["alone"][mode])
        reps = out["burst"][mode]
        earliest = statistics.median(min(t) for t in reps)
        median = statistics.median(statistics.median(t) for t in reps)
        last = statistics.median(max(t) for t in reps)
        out[mode] = {"alone_s": alone, "alone_steps": steps, "burst_earliest_s": earliest,
                     "burst_median_s": median, "burst_last_s": last}
        print(f"first token {'from the chunk' if mode == 'chunk' else 'from a decode step'}: "
              f"one prompt {1e3 * alone:.0f} ms ({steps:.0f} steps); burst of {args.burst}: "
              f"{earliest:.2f} / {median:.2f} / {last:.2f} s (earliest / median / last)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
