"""What a step costs by the size of its prefill chunk, at a long context: the model the step
budget and the prefill interleave size chunks by (a decode step's time plus a prompt token's
time per chunk token) against what a step takes.

Through troupe's ``Engine`` with the server's defaults: ``--streams`` chats decode (a few
steps alone, so the decode step's time is measured), a ``--long``-token prompt is prefilled
in whole chunks to ``--context`` tokens, then steps run with chunks of each ``--chunks`` size
in turn, ``--reps`` steps each, the order reversed every round. Per size: the median step,
the step less the measured decode step, and that per chunk token. A line through them
(least squares of the step's time on the chunk's tokens) splits a step into a fixed part
and a part per prompt token.

    .venv/bin/python benchmarks/bench_chunk_cost.py
    .venv/bin/python benchmarks/bench_chunk_cost.py --context 5000 --chunks 8,32,128,512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_bench import prompts, served_engine  # noqa: E402
from harness import (  # noqa: E402
    blas_name,
    chat_tokens,
    load_ceiling,
    long_text,
    resolve_default_model,
    same_blas_as_troupe_serve,
)


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares ``seconds = fixed + per_token * tokens``: (fixed, per_token)."""
    n = len(points)
    mx_ = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx_) ** 2 for x, _ in points)
    slope = sum((x - mx_) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx_, slope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--long", type=int, default=6000, help="tokens of the long prompt")
    p.add_argument("--context", type=int, default=3000,
                   help="prompt tokens prefilled before the chunks are timed")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--chunks", default="8,32,128,512")
    p.add_argument("--reps", type=int, default=3, help="steps timed per chunk size and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    import msgspec

    from troupe.actors.messages import SamplingParams

    model, tok = load_ceiling(args.model or resolve_default_model())
    engine = served_engine(model, tok, SamplingParams(max_tokens=1, temperature=0.0))
    step_size = engine.config.prefill_step_size
    stream = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    streams = [f"stream-{i}" for i in range(args.streams)]
    for rid, ids in zip(streams, prompts(tok, len(streams), f"streams-{time.time()}"),
                        strict=True):
        engine.add(rid, ids, stream)
    while any(engine.requests[rid].generated < 4 for rid in streams):
        engine.step()
    decode_ms = round((engine._decode_s or 0.0) * 1e3, 1)
    long_ids = chat_tokens(tok, [{"role": "user",
                                  "content": long_text(tok, args.long, f"c{time.time()}")}])
    engine.add("long", long_ids, SamplingParams(max_tokens=1, temperature=0.0))

    def run(chunk: int) -> float:
        """One step whose prefill is ``chunk`` tokens: whole chunks of that size (no
        interleave, no step budget), timed."""
        engine.config = msgspec.structs.replace(engine.config, prefill_step_size=chunk,
                                                prefill_interleave=0.0, step_budget_ms=0.0)
        began = time.perf_counter()
        engine.step()
        return time.perf_counter() - began

    def prefilled() -> int:
        return next(p["prefilled_tokens"] for p in engine.progress() if p["id"] == "long")

    run(step_size)
    while prefilled() < args.context:
        run(step_size)
    context = prefilled()
    sizes = [int(x) for x in args.chunks.split(",")]
    walls: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(args.rounds):
        for n in sizes if r % 2 == 0 else sizes[::-1]:
            walls[n] += [run(n) for _ in range(args.reps)]
    end = prefilled()
    engine.close()
    medians = {n: statistics.median(w) for n, w in walls.items()}
    fixed, per_token = fit([(n, w) for n, ws in walls.items() for w in ws])
    out = {"blas": blas_name(), "args": vars(args), "context": [context, end],
           "decode_step_ms": decode_ms, "step_s": walls, "fixed_s": fixed,
           "per_token_s": per_token}
    print(f"BLAS: {out['blas']}\nlong prompt prefilled from {context} to {end} tokens while "
          f"timed; {args.streams} streams decoding; decode step alone: {decode_ms} ms")
    print("\n| chunk (tokens) | step (ms, median) | per chunk token (ms) |\n|---|---|---|")
    for n in sizes:
        print(f"| {n} | {medians[n] * 1e3:.0f} | {medians[n] * 1e3 / n:.1f} |")
    print(f"\nfit: step = {fixed * 1e3:.0f} ms + {per_token * 1e3:.2f} ms per chunk token")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
