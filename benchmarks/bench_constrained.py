"""What grammar-constrained requests cost the batch they share: decode tokens/s at concurrency
16 with 8 ``json_schema`` requests among them, against all 16 free, alternating in one run.

troupe's ``Engine`` on the default model (troupe's CPU kernels, OpenBLAS preloaded as
``troupe serve`` does), the server's defaults. Each round adds 16 chat prompts at once; in the
mixed round every other one carries the grammar of a JSON schema (compiled as admission
compiles it, before the request reaches the engine). Only steps where all 16 rows decode and
no prompt is prefilled are timed, so both rounds time the same work: 16 rows a step, one of
them a constrained row in every other position.

    .venv/bin/python benchmarks/bench_constrained.py
    .venv/bin/python benchmarks/bench_constrained.py --reps 5 --steps 48
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

from harness import (  # noqa: E402
    blas_name,
    load_ceiling,
    resolve_default_model,
    same_blas_as_troupe_serve,
)

# Long enough that a constrained row stays in the batch for every timed step.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["poem", "story", "list"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 60},
                  "minItems": 12, "maxItems": 12},
    },
    "required": ["title", "kind", "lines"],
    "additionalProperties": False,
}
TOPICS = ["the sea", "a city at night", "winter", "a cat", "the moon", "trains", "bread",
          "a garden", "mountains", "rain", "coffee", "a library", "the desert", "bees",
          "a bridge", "music"]


def chat(tok: Any, i: int, rnd: str) -> list[int]:
    text = f"({rnd}) Write twelve lines about {TOPICS[i % len(TOPICS)]}."
    return list(tok.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True))


def round_steps(engine: Any, tok: Any, grammars: Any, constrained: bool, steps: int,
                rnd: str) -> list[float]:
    """Add 16 requests, step until done; the wall times of full decode steps."""
    from troupe.actors.messages import OutputFormat, SamplingParams

    fmt = OutputFormat(type="json_schema", schema=SCHEMA)
    for i in range(16):
        constraint = grammars.for_format(fmt) if constrained and i % 2 else None
        engine.add(f"{rnd}-{i}", chat(tok, i, rnd),
                   SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True),
                   constraint=constraint)
    times: list[float] = []
    while engine.has_work:
        decoding = engine.runner.decoding
        before = engine.prefill_tokens
        began = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - began
        if decoding == 16 and engine.prefill_tokens == before:
            times.append(wall)
    return times[:steps]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps a round")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    same_blas_as_troupe_serve()

    import mlx.core as mx
    import msgspec

    from troupe.actors.config import ServeConfig
    from troupe.actors.engine.core import Engine
    from troupe.actors.engine.grammar import Grammars

    model, tok = load_ceiling(str(resolve_default_model()))
    grammars = Grammars(tok)
    cfg = ServeConfig()
    engine = Engine(model, tok, msgspec.structs.replace(cfg.engine, prefill_batch_size=16,
                                                        block_size=0),
                    stream=mx.default_stream(mx.cpu))
    engine.warm_up()
    round_steps(engine, tok, grammars, True, 4, "warm")  # builds the llguidance tokenizer
    free: list[float] = []
    mixed: list[float] = []
    for rep in range(args.reps):
        for constrained in (False, True) if rep % 2 == 0 else (True, False):
            times = round_steps(engine, tok, grammars, constrained, args.steps, f"r{rep}")
            tps = 16 / statistics.median(times)
            (mixed if constrained else free).append(tps)
            print(f"rep {rep} {'8 constrained' if constrained else 'all free    '}: "
                  f"{tps:6.1f} decode tok/s ({len(times)} steps)", flush=True)
    ratios = [m / f for m, f in zip(mixed, free, strict=True)]
    result = {
        "blas": blas_name(), "reps": args.reps, "steps": args.steps,
        "free_tok_s": free, "mixed_tok_s": mixed,
        "median_free": statistics.median(free), "median_mixed": statistics.median(mixed),
        "ratio_per_rep": ratios, "median_ratio": statistics.median(ratios),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
