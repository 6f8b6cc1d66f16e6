"""Memory safety figures: the flood's peak against the limit, the time to a 413, a model swap.

Runs the real serving stack in-process (``actors.serving.start_serving`` + ``serve_http`` on a
free port) and talks to it over HTTP:

- **flood**: ``--flood`` concurrent prompts of ``--flood-tokens`` tokens (half streamed) under
  a limit of the idle usage plus ``--headroom`` MB; reports MLX's peak (the memory monitor's
  ``peak_max_bytes``: MLX's own peak counter, read and reset every poll) against the limit,
  the answers' statuses and the time taken; then the same flood with ``--no-prefill-guard``
  for comparison.
- **413**: a ``--long-tokens`` prompt under a limit of the idle usage plus
  ``--refuse-headroom`` MB, which it cannot fit, ``--reps`` times, streamed and not: the time
  from sending the request to the 413 (client side), and the scheduler's ``prefill_tokens``
  before and after (no prefill may start).
- **swap**: two models (the model and a copy of its directory under another name) with a
  ``--models-memory`` budget that fits one; alternating one-token requests, each loading its
  model and unloading the other. Reports the request latency with a swap and without.

    .venv/bin/python benchmarks/bench_memory.py                 # the bundled default model
    .venv/bin/python benchmarks/bench_memory.py --model DIR
    .venv/bin/python benchmarks/bench_memory.py --tiny --headroom 40 --refuse-headroom 10 \
        --flood 16

On Linux it re-executes itself with OpenBLAS preloaded, as ``troupe serve`` does. Prints a JSON
report and a Markdown summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MB = 1_000_000
TEXT = (
    "The river runs past the old mill, where the miller counts 1234 sacks of grain each "
    "autumn and writes the numbers in a ledger that his grandmother started in 1901. "
)


def report(system: Any, name: str) -> dict[str, Any]:
    return next(s for s in system.snapshot() if s.name == name).report


class Stack:
    """The serving actors and the HTTP server for one configuration."""

    def __init__(self, config: Any) -> None:
        self.config = config

    async def __aenter__(self) -> Stack:
        from troupe.actors.serving import start_serving
        from troupe.api.server import start_http
        from troupe.runtime import ActorSystem

        self.system = ActorSystem()
        await self.system.__aenter__()
        self.handles = await start_serving(self.system, self.config)
        self.server = await start_http(self.system, self.config, self.handles)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.server.close()
        await self.system.__aexit__(None, None, None)

    async def set_limit(self, limit: int) -> None:
        from troupe.actors.memory_messages import SetMemoryLimit

        await self.handles.monitor.ask(SetMemoryLimit(limit=limit), timeout=10)

    def usage(self) -> int:
        return report(self.system, "memory_monitor")["usage_bytes"]


def serve_config(model: str | list[str], **fields: Any) -> Any:
    from troupe.actors.config import ServeConfig

    return ServeConfig.of(model=model, host="127.0.0.1", port=0, block_size=0,
                          memory_poll_ms=50, **fields)


async def post(session: Any, url: str, body: dict[str, Any]) -> tuple[int, float, str]:
    """(status, seconds, how it ended) for one request, its whole answer read."""
    started = time.perf_counter()
    async with session.post(url, json=body) as resp:
        text = await resp.text()
        status = resp.status
    ended = "ok"
    if status == 200 and body.get("stream") and '"error"' in text:
        ended = "error event"
    elif status != 200:
        ended = json.loads(text)["error"].get("code") or str(status)
    return status, time.perf_counter() - started, ended


async def flood(model: str, args: argparse.Namespace, tokens: list[int], guard: bool) -> dict:
    import aiohttp

    config = serve_config(model, prefill_step_size=args.step, prefill_guard=guard)
    async with Stack(config) as stack:
        idle = stack.usage()
        limit = idle + args.headroom * MB
        await stack.set_limit(limit)
        url = stack.server.url + "/v1/completions"
        name = stack.handles.models[0].id
        started = time.perf_counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            results = await asyncio.gather(*(
                post(session, url, {"model": name, "prompt": tokens[: args.flood_tokens - i],
                                    "max_tokens": 8, "stream": i % 2 == 0})
                for i in range(args.flood)))
        took = time.perf_counter() - started
        await asyncio.sleep(0.2)  # the monitor's next poll reads the last peak
        monitor = report(stack.system, "memory_monitor")
        sched = report(stack.system, "scheduler")
    endings: dict[str, int] = {}
    for _, _, ended in results:
        endings[ended] = endings.get(ended, 0) + 1
    peak = monitor["peak_max_bytes"]
    return {
        "guard": guard,
        "idle_usage_mb": round(idle / MB, 1),
        "limit_mb": round(limit / MB, 1),
        "peak_mb": round(peak / MB, 1),
        "peak_over_limit_mb": round((peak - limit) / MB, 1),
        "peak_over_limit_pct_of_limit": round(100 * (peak - limit) / limit, 1),
        "endings": endings,
        "gate_failures": sched["gate_failures"],
        "seconds": round(took, 1),
    }


async def time_to_413(model: str, args: argparse.Namespace, tokens: list[int]) -> dict:
    import aiohttp

    config = serve_config(model, prefill_step_size=args.step)
    async with Stack(config) as stack:
        await stack.set_limit(stack.usage() + args.refuse_headroom * MB)
        url = stack.server.url + "/v1/completions"
        name = stack.handles.models[0].id
        before = report(stack.system, "scheduler")["prefill_tokens"]
        times: dict[bool, list[float]] = {False: [], True: []}
        statuses = set()
        async with aiohttp.ClientSession() as session:
            await post(session, url, {"model": name, "prompt": "warm up", "max_tokens": 1})
            before = report(stack.system, "scheduler")["prefill_tokens"]
            for i in range(2 * args.reps):
                stream = i % 2 == 1
                status, took, _ = await post(session, url, {
                    "model": name, "prompt": tokens[: args.long_tokens], "max_tokens": 8,
                    "stream": stream})
                statuses.add(status)
                times[stream].append(took)
        after = report(stack.system, "scheduler")["prefill_tokens"]
        estimate = report(stack.system, "admission")["last_estimate_bytes"]
    return {
        "prompt_tokens": args.long_tokens,
        "statuses": sorted(statuses),
        "estimate_mb": round(estimate / MB, 1),
        "median_ms": round(1000 * statistics.median(times[False]), 1),
        "max_ms": round(1000 * max(times[False]), 1),
        "median_ms_streamed": round(1000 * statistics.median(times[True]), 1),
        "max_ms_streamed": round(1000 * max(times[True]), 1),
        "prefill_tokens_during": after - before,
    }


async def swap(model: str, args: argparse.Namespace) -> dict:
    import aiohttp

    from troupe.actors.engine.memory_estimate import model_memory_of
    from troupe.actors.models.store import resolve_model

    path = resolve_model(model).path
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as tmp:
        twin = Path(tmp) / f"{path.name}-twin"
        twin.mkdir()
        for f in path.iterdir():
            if f.is_file():
                (twin / f.name).symlink_to(f)
        weights = model_memory_of(path).weights_bytes
        config = serve_config([str(path), str(twin)], models_memory=int(weights * 1.5))
        async with Stack(config) as stack:
            url = stack.server.url + "/v1/completions"
            a, b = (card.id for card in stack.handles.models)
            swaps, stays = [], []
            async with aiohttp.ClientSession() as session:
                body = {"prompt": "Paris", "max_tokens": 1}
                await post(session, url, {**body, "model": a})
                for _ in range(args.reps):
                    for name in (b, a):
                        status, took, _ = await post(session, url, {**body, "model": name})
                        assert status == 200, status
                        swaps.append(took)
                        status, took, _ = await post(session, url, {**body, "model": name})
                        stays.append(took)
            pool = report(stack.system, "engine_pool")
    return {
        "weights_mb": round(weights / MB, 1),
        "swap_request_median_s": round(statistics.median(swaps), 3),
        "swap_request_max_s": round(max(swaps), 3),
        "loaded_request_median_s": round(statistics.median(stays), 3),
        "last_load_s": pool["last_load_s"],
        "last_unload_s": pool["last_unload_s"],
        "loads": pool["loads"],
        "unloads": pool["unloads"],
    }


async def run(args: argparse.Namespace) -> dict:
    from mlx_lm.utils import load_tokenizer

    from troupe.actors.models.blas import loaded_blas
    from troupe.actors.models.store import resolve_model

    if args.tiny:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from tiny_model import make_tiny_model

        model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-memory-")) / "tiny"))
    else:
        model = str(resolve_model(args.model).path)
    from troupe.actors.scheduler import context_length

    context = context_length(json.loads((Path(model) / "config.json").read_text()))
    # Prompt plus max_tokens must fit the context, or the answer is a 400, not a 413.
    args.long_tokens = min(args.long_tokens, context - 16)
    args.flood_tokens = min(args.flood_tokens, context - 16)
    tok = load_tokenizer(model)
    tokens = tok.encode(TEXT * (max(args.flood_tokens, args.long_tokens) // 20 + 1))
    result: dict[str, Any] = {"model": Path(model).name, "blas": loaded_blas(),
                              "prefill_step_size": args.step, "headroom_mb": args.headroom}
    steps: list[tuple[str, Any]] = [
        ("time_to_413", lambda: time_to_413(model, args, tokens)),
        ("flood", lambda: flood(model, args, tokens, guard=True)),
    ]
    if not args.skip_unguarded:
        steps.append(("flood_unguarded", lambda: flood(model, args, tokens, guard=False)))
    steps.append(("swap", lambda: swap(model, args)))
    for name, step in steps:
        result[name] = await step()
        print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
    return result


def markdown(r: dict) -> str:
    f, t, s = r["flood"], r["time_to_413"], r["swap"]
    lines = [
        f"model {r['model']}, prefill step {r['prefill_step_size']}, BLAS: {r['blas']}",
        "",
        "| figure | value |",
        "|---|---|",
        f"| flood: peak over the limit | {f['peak_over_limit_mb']} MB "
        f"({f['peak_over_limit_pct_of_limit']}% of the {f['limit_mb']} MB limit) |",
        f"| flood: answers | {f['endings']} in {f['seconds']} s |",
    ]
    if "flood_unguarded" in r:
        u = r["flood_unguarded"]
        lines.append(f"| flood without the guard: peak over the limit | "
                     f"{u['peak_over_limit_mb']} MB ({u['endings']}) |")
    lines += [
        f"| time to 413 ({t['prompt_tokens']} tokens), median / max | {t['median_ms']} / "
        f"{t['max_ms']} ms; streamed {t['median_ms_streamed']} / {t['max_ms_streamed']} ms |",
        f"| prefill tokens run for the refused prompts | {t['prefill_tokens_during']} |",
        f"| swap ({s['weights_mb']} MB of weights): request, median / max | "
        f"{s['swap_request_median_s']} / {s['swap_request_max_s']} s "
        f"(loaded: {s['loaded_request_median_s']} s; load {s['last_load_s']} s, "
        f"unload {s['last_unload_s']} s) |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model spec (default: the bundled one)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model, made here")
    parser.add_argument("--step", type=int, default=512, help="prefill step size")
    parser.add_argument("--flood", type=int, default=8, help="concurrent long prompts")
    parser.add_argument("--flood-tokens", type=int, default=1500)
    parser.add_argument("--headroom", type=int, default=300,
                        help="MB of limit above the idle usage")
    parser.add_argument("--long-tokens", type=int, default=6000,
                        help="the prompt refused with 413")
    parser.add_argument("--refuse-headroom", type=int, default=100,
                        help="MB of limit above the idle usage for the 413 figure")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--skip-unguarded", action="store_true")
    args = parser.parse_args()

    from troupe.actors.models import blas

    plan = blas.preload_command([str(Path(__file__).resolve()), *sys.argv[1:]])
    if plan is not None:
        os.execve(sys.executable, *plan)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=2))
    print()
    print(markdown(result))


if __name__ == "__main__":
    main()
