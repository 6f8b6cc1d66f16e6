"""Speculative decoding (``--speculative ngram`` or ``draft``) against one token a step.

Through troupe's ``Engine`` with ``troupe serve``'s defaults on the default model (troupe's CPU
kernels, OpenBLAS preloaded as ``troupe serve`` does), greedy, three workloads:

- ``edit``: a 150-line Python file in the prompt, asked back whole with one function renamed;
- ``json``: a record of 40 fields, asked back with two of them changed;
- ``prose``: a story (little to look up).

``--peer llama.cpp`` also runs the workloads on llama.cpp's own server (xllamacpp, ``make
bench-peers`` installs it) with the default model's GGUF, one slot, its speculation off and
``--peer-speculative`` (``ngram_simple`` by default) alternating, over HTTP (decode tokens/s
from the first streamed token to the last), for the speed-ups side by side.

``--streams N`` runs N such requests at once (the edit of each renames another function),
the decode tokens/s then being all of theirs. ``--draft-model DIR`` drafts with that model
instead of prompt lookup; ``--draft-layers N`` with a copy of the served model cut to its
first N layers (its own final norm and head: a draft model of the same tokenizer at hand).

For each, decode tokens/s (from the first token to the last) with drafts and without,
alternating which runs first, the drafts' figures (with a hybrid model's, ``restored``: rows
whose recurrent state went back after a rejected draft), and whether the two answers are the
same tokens (they must be).

    .venv/bin/python benchmarks/bench_speculative.py
    .venv/bin/python benchmarks/bench_speculative.py --max-tokens 600 --reps 2
    .venv/bin/python benchmarks/bench_speculative.py --streams 4 --workloads edit,prose
    .venv/bin/python benchmarks/bench_speculative.py --draft-layers 8 --reps 2
    .venv/bin/python benchmarks/bench_speculative.py --reps 2 --peer llama.cpp
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
    load_ceiling,
    resolve_default_model,
    same_blas_as_troupe_serve,
)


def python_file(lines: int = 150) -> str:
    """A plausible module: small functions over orders and customers."""
    out = ['"""Orders and their totals."""', "", "from dataclasses import dataclass", ""]
    i = 0
    while len(out) < lines:
        out += [f"def compute_total_{i}(order, rate={i % 7 + 1}):",
                f'    """The total of order {i}, taxed at its rate."""',
                "    subtotal = sum(item.price * item.quantity for item in order.items)",
                f"    discount = subtotal * 0.0{i % 9 + 1} if order.customer.loyal else 0",
                "    return round((subtotal - discount) * (1 + rate / 100), 2)", ""]
        i += 1
    return "\n".join(out[:lines])


def record(fields: int = 40) -> str:
    return json.dumps({f"field_{i}": (f"value {i}" if i % 3 else i * 17) for i in range(fields)}
                      | {"status": "pending", "quantity": 1}, indent=1)


WORKLOADS = {
    "edit": lambda: ("Here is a Python file:\n\n" + python_file() + "\n\nRename the function "
                     "compute_total_3 to order_total_3 and return the whole file, unchanged "
                     "otherwise."),
    "json": lambda: ("Here is a JSON record:\n\n" + record() + "\n\nReturn the same record "
                     'with "status" set to "shipped" and "quantity" set to 3. Output only '
                     "the JSON."),
    "prose": lambda: "Write a long story about a lighthouse keeper and a storm at sea.",
}


def load_draft(model_dir: str, layers: int | None, tok: Any) -> Any:
    """A draft model (``draft_model.DraftModel``) from ``model_dir``, cut to its first
    ``layers`` layers when given, checked against the served model's tokenizer."""
    from troupe.actors.config import ServeConfig
    from troupe.actors.engine.draft_model import DraftModel, check_draft_model, vocabulary

    model, draft_tok = load_ceiling(model_dir)
    if layers:
        model.model.layers = model.model.layers[:layers]
    check_draft_model(model_dir, model, draft_tok, "the served model", tok)
    return DraftModel(model, vocab=len(vocabulary(tok)),
                      catch_up=ServeConfig().engine.prefill_step_size)


def run_once(engine: Any, prompts: list[list[int]], max_tokens: int,
             drafts: bool) -> dict[str, Any]:
    """The prompts at once, greedy, to ``max_tokens`` each: their tokens, and the decode
    tokens/s of them all (from the first token of any to the last)."""
    from troupe.actors.messages import SamplingParams, TokensGenerated

    engine.runner.speculative = drafts
    before = _counts(engine)
    for i, prompt in enumerate(prompts):
        engine.add(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    times: list[float] = []
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated):
                tokens[ev.request_id] += ev.token_ids
                times.append(time.perf_counter())
    n_drafts, drafted, accepted, restored, passes = (
        b - a for a, b in zip(before, _counts(engine), strict=True))
    total = sum(len(t) for t in tokens.values())
    return {"tokens": tokens, "decode_tok_s": (total - len(prompts)) / (times[-1] - times[0]),
            "drafts": n_drafts, "drafted": drafted, "accepted": accepted, "restored": restored,
            "draft_passes": passes}


def llamacpp_runs(workloads: list[str], max_tokens: int, reps: int, kind: str
                  ) -> list[dict[str, Any]]:
    """Each workload on llama.cpp's server, its speculation off and ``kind``, alternating
    which runs first: decode tokens/s, its draft figures and the answer's text."""
    import asyncio
    import subprocess

    import sessions_peers as peers
    from harness import free_port, wait_healthy

    runs = []
    for r in range(reps):
        for spec in ("none", kind) if r % 2 == 0 else (kind, "none"):
            port = free_port()
            base = f"http://127.0.0.1:{port}"
            proc = subprocess.Popen(
                [str(peers.xllamacpp_python()), str(Path(__file__).with_name("sessions_peers.py")),
                 "serve-llamacpp", "--gguf", str(peers.bundled_gguf()), "--port", str(port),
                 "--slots", "1", "--speculative", spec],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                asyncio.run(wait_healthy(base, proc))
                asyncio.run(_llamacpp_once(base, "Hello", 8))  # its first request warms it
                for name in workloads:
                    got = asyncio.run(_llamacpp_once(base, WORKLOADS[name](), max_tokens))
                    runs.append({"rep": r, "workload": name, "speculative": spec != "none",
                                 **got})
                    print(f"rep {r} {name:>5} llama.cpp {spec}: decode_tok_s "
                          f"{got['decode_tok_s']:.2f}, tokens {got['tokens']}, drafted "
                          f"{got['drafted']}, accepted {got['accepted']}", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    return runs


async def _llamacpp_once(base: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy answer of ``max_tokens`` from llama.cpp's server."""
    import aiohttp

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "timings_per_token": False}
    text, times, usage, timings = "", [], {}, {}
    async with aiohttp.ClientSession() as session, session.post(
            f"{base}/v1/chat/completions", json=body) as resp:
        async for line in resp.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                text += delta
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    n = usage.get("completion_tokens", 0)
    return {"text": text, "tokens": n, "decode_tok_s": (n - 1) / (times[-1] - times[0]),
            "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}


def _counts(engine: Any) -> tuple[int, ...]:
    """The runner's draft counters: drafts, their tokens, those kept, hybrid restores, and
    the draft model's passes."""
    r = engine.runner
    return (r.drafts, r.drafted, r.accepted, r.restored, r.draft.passes if r.draft else 0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--streams", type=int, default=1,
                   help="requests of the workload at once (each renames another function)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--draft-model", metavar="DIR",
                   help="draft with this model (--speculative draft), not by prompt lookup")
    p.add_argument("--draft-layers", type=int, metavar="N",
                   help="draft with the served model's first N layers (or --draft-model's)")
    p.add_argument("--peer", choices=["llama.cpp"],
                   help="also run the workloads on llama.cpp's server, speculation off and on")
    p.add_argument("--peer-speculative", default="ngram_simple",
                   help="llama.cpp's speculative type for --peer (ngram_simple, ngram_mod, ...)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    same_blas_as_troupe_serve()

    from troupe.actors.messages import SamplingParams

    model_dir = args.model or resolve_default_model()
    model, tok = load_ceiling(model_dir)
    draft = (load_draft(args.draft_model or model_dir, args.draft_layers, tok)
             if args.draft_model or args.draft_layers else None)
    engine = served_engine(model, tok, SamplingParams(max_tokens=1, temperature=0.0), draft)
    out: dict[str, Any] = {"blas": blas_name(), "args": vars(args), "runs": []}
    print(f"BLAS: {out['blas']}", flush=True)
    for r in range(args.reps):
        for name in args.workloads.split(","):
            prompts = [chat_tokens(tok, [{"role": "user", "content": WORKLOADS[name]().replace(
                "compute_total_3 to order_total_3", f"compute_total_{3 + i} to order_total_{i}")}])
                for i in range(args.streams)]
            # A cold prompt each time would time its prefill too: the first run warms the
            # prefix cache, and each answer is timed from its first token.
            answers = {}
            for drafts in (False, True) if r % 2 == 0 else (True, False):
                got = run_once(engine, prompts, args.max_tokens, drafts)
                answers[drafts] = got.pop("tokens")
                out["runs"].append({"rep": r, "workload": name, "speculative": drafts, **got})
                print(f"rep {r} {name:>5} drafts {'on ' if drafts else 'off'}: "
                      + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                  for k, v in got.items()), flush=True)
            out["runs"][-1]["same_tokens"] = answers[True] == answers[False]
            print(f"  same tokens: {answers[True] == answers[False]} "
                  f"({sum(len(t) for t in answers[True].values())} tokens)", flush=True)
    engine.close()
    mode = "draft" if draft is not None else "ngram"
    print(f"\n| workload | decode tok/s, off | decode tok/s, {mode} | speed-up | drafts | "
          "accepted / drafted tokens | accepted per draft | same tokens |\n"
          "|---|---|---|---|---|---|---|---|")
    for name in args.workloads.split(","):
        runs = [x for x in out["runs"] if x["workload"] == name]
        off = statistics.median(x["decode_tok_s"] for x in runs if not x["speculative"])
        on_runs = [x for x in runs if x["speculative"]]
        on = statistics.median(x["decode_tok_s"] for x in on_runs)
        drafts = sum(x["drafts"] for x in on_runs)
        drafted = sum(x["drafted"] for x in on_runs)
        accepted = sum(x["accepted"] for x in on_runs)
        same = all(x.get("same_tokens", True) for x in runs)
        print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {drafts} | "
              f"{accepted} / {drafted} | {accepted / drafts if drafts else 0:.2f} | "
              f"{'yes' if same else 'NO'} |")
    if args.peer:
        runs = llamacpp_runs(args.workloads.split(","), args.max_tokens, args.reps,
                             args.peer_speculative)
        out["peer_runs"] = runs
        print(f"\n| workload | llama.cpp tok/s, off | llama.cpp tok/s, {args.peer_speculative} "
              "| speed-up | accepted / drafted tokens | same text |\n|---|---|---|---|---|---|")
        for name in args.workloads.split(","):
            mine = [x for x in runs if x["workload"] == name]
            off = statistics.median(x["decode_tok_s"] for x in mine if not x["speculative"])
            on = statistics.median(x["decode_tok_s"] for x in mine if x["speculative"])
            texts = {x["text"] for x in mine}
            print(f"| {name} | {off:.1f} | {on:.1f} | {on / off:.2f}x | "
                  f"{sum(x['accepted'] for x in mine)} / {sum(x['drafted'] for x in mine)} | "
                  f"{'yes' if len(texts) == 1 else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
