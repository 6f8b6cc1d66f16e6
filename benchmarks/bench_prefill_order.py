"""Agents' turns arriving together: long prompts prefilled one after the other (in
``schedule.start_order``'s order), against all of them together.

``--sessions`` conversations each have a ``--context``-token history in the prefix cache; then
every session sends its next turn at once (``--turns`` new tokens each, different lengths), as
agents do when a round of tool calls returns. Through troupe's ``Engine`` with the server's
defaults (prefix cache on, troupe's CPU kernels, OpenBLAS preloaded as ``troupe serve`` does),
the seconds from that moment to each turn's first token, with the order ``schedule`` gives
(``order``) and with every prompt counted as short, which prefills them together
(``together``, as before the rule), alternating on one engine (the contexts cached once),
medians over ``--reps``.

    .venv/bin/python benchmarks/bench_prefill_order.py
    .venv/bin/python benchmarks/bench_prefill_order.py --sessions 4 --context 2000 --reps 3
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

from engine_bench import served_engine  # noqa: E402
from harness import (  # noqa: E402
    blas_name,
    chat_tokens,
    int_list,
    load_ceiling,
    long_text,
    resolve_default_model,
    same_blas_as_troupe_serve,
)

MODES = ("order", "together")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--context", type=int, default=2000, help="cached tokens a session has")
    p.add_argument("--turns", type=int_list, default=[300, 600, 400, 500],
                   help="new tokens of each session's turn (cycled over the sessions)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    from troupe.actors.engine import schedule
    from troupe.actors.messages import SamplingParams, TokensGenerated

    model, tok = load_ceiling(args.model or resolve_default_model())
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long_prompt = schedule.LONG_PROMPT
    out: dict[str, Any] = {"blas": blas_name(), "args": vars(args), "reps": []}
    print(f"BLAS: {out['blas']}")

    def run(engine: Any, prompts: dict[str, list[int]]) -> dict[str, float]:
        """Add every prompt at once, step: seconds to each one's first token."""
        sent = time.perf_counter()
        for rid, ids in prompts.items():
            engine.add(rid, ids, one, cached=engine.blocks.lookup(engine.prompt_hashes(ids)))
        first: dict[str, float] = {}
        while engine.has_work:
            for ev in engine.step():
                if isinstance(ev, TokensGenerated):
                    first.setdefault(ev.request_id, time.perf_counter() - sent)
        engine.cut_pending()
        return first

    engine = served_engine(model, tok, one)
    history = {f"s{i}": [{"role": "user", "content": long_text(tok, args.context, f"ctx-{i}")}]
               for i in range(args.sessions)}
    for rid, messages in history.items():  # each session's context, cached once for all
        run(engine, {rid: chat_tokens(tok, messages)})
    for r in range(args.reps):
        rep: dict[str, Any] = {}
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            schedule.LONG_PROMPT = long_prompt if mode == "order" else 1 << 30
            turns = {}
            for i, (rid, messages) in enumerate(history.items()):
                n = args.turns[i % len(args.turns)]
                turn = long_text(tok, n, f"{mode}-{r}-{i}-{time.time()}")
                turns[f"{rid}-{mode}-{r}"] = chat_tokens(
                    tok, [*messages, {"role": "assistant", "content": "Ok."},
                          {"role": "user", "content": turn}])
            first = run(engine, turns)
            rep[mode] = sorted(first.values())
            print(f"rep {r} {mode:>8}: first tokens at "
                  + " / ".join(f"{t:.2f}" for t in rep[mode]) + " s", flush=True)
        out["reps"].append(rep)
    engine.close()
    schedule.LONG_PROMPT = long_prompt
    for mode in MODES:
        reps = [rep[mode] for rep in out["reps"]]
        out[mode] = {"median_s": statistics.median(statistics.median(t) for t in reps),
                     "first_s": statistics.median(t[0] for t in reps),
                     "last_s": statistics.median(t[-1] for t in reps)}
        print(f"{mode:>8}: first {out[mode]['first_s']:.2f} s, median "
              f"{out[mode]['median_s']:.2f} s, last {out[mode]['last_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
