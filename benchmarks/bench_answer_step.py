"""When a step's tokens reach the caller: in the step that sampled them, or one step later.

mlx-lm's ``GenerationBatch`` answers, in each step, the tokens the previous step sampled: it
queues the next forward pass with ``mx.async_eval`` first, so that Python's work overlaps
the model's. troupe's ``JoiningGenerationBatch`` (``actors/engine/batch.py``) answers the tokens
the step sampled. This script measures, on the default model (troupe's CPU kernels,
OpenBLAS preloaded as ``troupe serve`` does):

1. how much of a decode step ``mx.async_eval`` takes before it returns (the overlap left
   for Python), at each ``--batch``;
2. decode tokens/s with troupe's answering and with mlx-lm's (the same generator, its
   step put back), alternating, medians over ``--reps``;
3. a burst of ``--burst`` chat prompts (the harness's serving prompt) through troupe's
   ``Engine`` with a prefix-cache warm-up, as the server runs it: when each prompt's first
   token came, both ways.

    .venv/bin/python benchmarks/bench_answer_step.py
    .venv/bin/python benchmarks/bench_answer_step.py --batch 1,32 --reps 3 --burst 16
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
    SERVING_PROMPT,
    blas_name,
    chat_tokens,
    int_list,
    load_ceiling,
    resolve_default_model,
    same_blas_as_troupe_serve,
    tag,
)


def prompts(tok: Any, n: int, key: str) -> list[list[int]]:
    return [chat_tokens(tok, [{"role": "user",
                               "content": SERVING_PROMPT.format(key=tag(f"{key}-{i}"))}])
            for i in range(n)]


def served_engine(model: Any, tok: Any, sampling: Any) -> Any:
    """troupe's ``Engine`` with ``troupe serve``'s defaults, its chat template already cached
    by one request (as a server that has answered before)."""
    import mlx.core as mx

    from actors.config import ServeConfig
    from actors.engine.core import Engine

    cfg = ServeConfig()
    engine = Engine(model, tok, cfg.engine, stream=mx.default_stream(mx.cpu))
    engine.add("warm-up", prompts(tok, 1, f"warm-{time.time()}")[0], sampling)
    while engine.has_work:
        engine.step()
    return engine


def first_tokens(engine: Any, batch: list[list[int]], sampling: Any) -> tuple[list[float], int]:
    """Add ``batch`` at once and step: the seconds from adding to each prompt's first token
    (sorted), and the steps until the last of them; the requests then run to their end."""
    from actors.messages import TokensGenerated

    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    for i, ids in enumerate(batch):
        engine.add(f"r{i}", ids, sampling)
        sent[f"r{i}"] = time.perf_counter()
    steps = 0
    while len(first) < len(batch):
        events = engine.step()
        steps += 1
        now = time.perf_counter()
        for ev in events:
            if isinstance(ev, TokensGenerated) and ev.request_id not in first:
                first[ev.request_id] = now - sent[ev.request_id]
    while engine.has_work:
        engine.step()
    return sorted(first.values()), steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--batch", type=int_list, default=[1, 16, 32])
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--burst", type=int, default=16)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch
    from mlx_lm.models.cache import make_prompt_cache

    from actors.engine.batch import JoiningGenerationBatch, MixedBatchGenerator
    from actors.messages import SamplingParams

    model, tok = load_ceiling(args.model or resolve_default_model())  # troupe's CPU kernels
    troupe_step = JoiningGenerationBatch._step

    troupe_next = JoiningGenerationBatch.next

    def mlx_lm_step(self: Any) -> Any:  # mlx-lm's answering: the previous step's tokens
        if self._deferred:
            return None
        return GenerationBatch._step(self)

    def mlx_lm_next(self: Any) -> Any:
        """GenerationBatch.next over mlx-lm's step, where a joining sequence's first answer
        (its last prompt token, the step's input) is not answered, as troupe's generator did
        before it answered in the step."""
        seen = self.__dict__.setdefault("_bench_seen", set())
        fresh = set(self.uids) - seen
        seen |= fresh
        responses = GenerationBatch.next(self)
        for i, uid in enumerate(self.uids):
            if uid in fresh:
                self._num_tokens[i] -= 1
        return [r for r in responses if r.uid not in fresh]

    def answering(mode: str) -> None:
        ours = mode == "troupe"
        JoiningGenerationBatch._step = troupe_step if ours else mlx_lm_step
        JoiningGenerationBatch.next = troupe_next if ours else mlx_lm_next

    out: dict[str, Any] = {"blas": blas_name(), "async_eval": {}, "decode": {}, "burst": {}}
    print(f"BLAS: {out['blas']}")

    # 1. mx.async_eval's share of a decode step.
    for b in args.batch:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1] * 64] * b), cache=cache))
        y = mx.array([[5]] * b)
        shares, steps = [], []
        for _ in range(8):
            t0 = time.perf_counter()
            logits = model(y, cache=cache)
            t1 = time.perf_counter()
            mx.async_eval(logits)
            t2 = time.perf_counter()
            mx.eval(logits)
            t3 = time.perf_counter()
            shares.append((t2 - t1) / (t3 - t0))
            steps.append(t3 - t0)
        out["async_eval"][b] = {"share": statistics.median(shares[2:]),
                                "step_ms": 1e3 * statistics.median(steps[2:])}
        a = out["async_eval"][b]
        print(f"batch {b:>2}: mx.async_eval returns after {100 * a['share']:.0f}% of a "
              f"{a['step_ms']:.0f} ms decode step")

    # 2. Decode tokens/s both ways.
    def decode_rate(b: int, mode: str) -> float:
        answering(mode)
        gen = MixedBatchGenerator(model, completion_batch_size=max(b, 1), prefill_batch_size=b)
        gen.insert(prompts(tok, b, f"{time.time()}"), max_tokens=[10_000] * b)
        while len(gen._generation_batch) < b or gen._prompt_batch.uids:
            gen.next()
        for _ in range(3):
            gen.next()
        t0, n = time.perf_counter(), 0
        for _ in range(args.steps):
            n += len(gen.next()[1])
        rate = n / (time.perf_counter() - t0)
        gen.close()
        return rate

    for b in args.batch:
        runs: dict[str, list[float]] = {"troupe": [], "mlx-lm": []}
        for r in range(args.reps):
            for mode in ("troupe", "mlx-lm") if r % 2 else ("mlx-lm", "troupe"):
                runs[mode].append(decode_rate(b, mode))
        med = {m: statistics.median(v) for m, v in runs.items()}
        out["decode"][b] = {**med, "ratio": med["troupe"] / med["mlx-lm"], "runs": runs}
        print(f"batch {b:>2}: decode {med['troupe']:.1f} tok/s answering in the step, "
              f"{med['mlx-lm']:.1f} one step later: {out['decode'][b]['ratio']:.2f}x")

    # 3. A burst of prompts: when each first token comes.
    def burst(mode: str) -> list[float]:
        answering(mode)
        greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        engine = served_engine(model, tok, greedy)
        times, _ = first_tokens(engine, prompts(tok, args.burst, f"{mode}-{time.time()}"),
                                greedy)
        engine.close()
        return times

    for r in range(args.reps):
        for mode in ("troupe", "mlx-lm") if r % 2 else ("mlx-lm", "troupe"):
            out["burst"].setdefault(mode, []).append(burst(mode))
    for mode, reps in out["burst"].items():
        p50 = statistics.median(statistics.median(t) for t in reps)
        worst = statistics.median(max(t) for t in reps)
        first = statistics.median(min(t) for t in reps)
        how = "in the step" if mode == "troupe" else "one step later"
        print(f"burst of {args.burst}, answering {how}: first token after {first:.2f} s "
              f"(the earliest), {p50:.2f} s (median), {worst:.2f} s (the last)")
    answering("troupe")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
