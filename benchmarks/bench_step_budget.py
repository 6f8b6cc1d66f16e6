"""A short request behind a long prefill, with the step budget off (``step_budget_ms`` 0,
whole chunks where the interleave rules give them) and on (``--budget-ms``).

Through troupe's ``Engine`` with the server's defaults (prefix cache on, troupe's CPU
kernels, OpenBLAS preloaded as ``troupe serve`` does), two scenarios, each with a new,
uncached ``--long``-token prompt:

- ``alone``: the long prompt prefills by itself; a chat message is sent ``--delay`` s later.
- ``streams``: ``--streams`` chats decode; the long prompt is sent, and a chat message
  ``--delay`` s after it.

For each: the chat message's time to its first token and to its first 8 (from the moment it
was sent: the step running then counts), the long prompt's time to its first token, and the
streams' inter-token gaps while the long prompt prefilled (p50, p99, max). Both budgets run
on one engine, alternating, the order flipped every repetition.

    .venv/bin/python benchmarks/bench_step_budget.py
    .venv/bin/python benchmarks/bench_step_budget.py --long 6000 --streams 4 --reps 1
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

from engine_bench import prompts, served_engine  # noqa: E402
from harness import (  # noqa: E402
    blas_name,
    chat_tokens,
    load_ceiling,
    long_text,
    resolve_default_model,
    same_blas_as_troupe_serve,
)

SCENARIOS = ("alone", "streams")
# Tokens each stream has decoded before the long prompt is sent.
STREAM_WARM_TOKENS = 4


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_once(engine: Any, tok: Any, scenario: str, args: argparse.Namespace,
             key: str) -> dict[str, Any]:
    """One scenario on ``engine`` as it is configured: the figures of one run."""
    from troupe.actors.messages import SamplingParams, TokensGenerated

    stream = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    streams = [f"stream-{i}" for i in range(args.streams if scenario == "streams" else 0)]
    for rid, ids in zip(streams, prompts(tok, len(streams), f"{key}-streams"), strict=True):
        engine.add(rid, ids, stream)
    # The streams have been decoding a while when the long prompt comes (a few steps without
    # prefill, as a serving engine has had): the schedule knows a decode step's time.
    while any(engine.requests[rid].generated < STREAM_WARM_TOKENS for rid in streams):
        engine.step()
    long_ids = chat_tokens(tok, [{"role": "user", "content": long_text(tok, args.long, key)}])
    chat_ids = prompts(tok, 1, f"{key}-chat")[0]
    engine.add("long", long_ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    sent = time.perf_counter()
    chat_at: float | None = None
    times: dict[str, list[float]] = {rid: [] for rid in [*streams, "long", "chat"]}
    while "long" in engine.requests or len(times["chat"]) < 8:
        now = time.perf_counter()
        if chat_at is None and now - sent >= args.delay:
            chat_at = sent + args.delay  # sent then: the step running at that moment counts
            engine.add("chat", chat_ids, SamplingParams(max_tokens=8, temperature=0.0,
                                                        ignore_eos=True))
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                times[ev.request_id] += [time.perf_counter()] * len(ev.token_ids)
    long_first = times["long"][0]
    gaps = [b - a for rid in streams for a, b in zip(times[rid], times[rid][1:], strict=False)
            if a >= sent and b <= long_first]
    for rid in streams:
        engine.abort(rid)
    assert chat_at is not None
    return {"long_tokens": len(long_ids), "chat_tokens": len(chat_ids),
            "long_ttft_s": long_first - sent,
            "chat_ttft_s": times["chat"][0] - chat_at, "chat_8_s": times["chat"][7] - chat_at,
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "itl_max_s": max(gaps, default=None)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--long", type=int, default=6000, help="tokens of the long prompt")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--delay", type=float, default=3.0,
                   help="seconds after the long prompt that the chat message is sent")
    p.add_argument("--budget-ms", type=float, default=200.0)
    p.add_argument("--interleave", type=float, default=None,
                   help="prefill_interleave for both runs (default: the server's)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    import msgspec

    from troupe.actors.messages import SamplingParams

    model, tok = load_ceiling(args.model or resolve_default_model())
    engine = served_engine(model, tok, SamplingParams(max_tokens=1, temperature=0.0))
    modes = {"off": 0.0, "on": args.budget_ms}
    out: dict[str, Any] = {"blas": blas_name(), "args": vars(args), "runs": []}
    print(f"BLAS: {out['blas']}", flush=True)
    for r in range(args.reps):
        for scenario in args.scenarios.split(","):
            for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                engine.config = msgspec.structs.replace(engine.config,
                                                        step_budget_ms=modes[mode])
                if args.interleave is not None:
                    engine.config = msgspec.structs.replace(
                        engine.config, prefill_interleave=args.interleave)
                got = run_once(engine, tok, scenario, args, f"{scenario}-{mode}-{r}-{time.time()}")
                out["runs"].append({"rep": r, "scenario": scenario, "mode": mode, **got})
                print(f"rep {r} {scenario:>7} budget {mode:>3}: "
                      + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in got.items()), flush=True)
    engine.close()
    print("\n| scenario | budget | chat TTFT (s) | chat 8 tokens (s) | long TTFT (s) "
          "| streams' ITL p50 / p99 / max (ms) |\n|---|---|---|---|---|---|")
    for scenario in args.scenarios.split(","):
        for mode in modes:
            runs = [x for x in out["runs"] if x["scenario"] == scenario and x["mode"] == mode]

            def med(k: str, runs: list[dict[str, Any]] = runs) -> float | None:
                vals = [x[k] for x in runs if x[k] is not None]
                return statistics.median(vals) if vals else None

            itl = " / ".join("-" if med(k) is None else f"{med(k) * 1e3:.0f}"
                             for k in ("itl_p50_s", "itl_p99_s", "itl_max_s"))
            label = "0 (off)" if mode == "off" else f"{args.budget_ms:.0f} ms"
            print(f"| {scenario} | {label} | {med('chat_ttft_s'):.2f} | {med('chat_8_s'):.2f} "
                  f"| {med('long_ttft_s'):.1f} | {itl} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
