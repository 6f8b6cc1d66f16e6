"""Serving benchmark: mlx-troupe against mlx_lm.server, same model and prompts, one run.

For each server it starts the server as a subprocess (the same environment, so the same BLAS),
drives it with streaming chat requests at each concurrency (every request has a unique
~64-token prompt and asks for 64 new tokens, greedy), and reports output tokens/s, TTFT p50 and
p99. It also measures the in-process ceiling: the same prompts through mlx-lm's
``BatchGenerator`` directly, no HTTP, no actors.

    .venv/bin/python benchmarks/bench_serving.py                       # the default model
    .venv/bin/python benchmarks/bench_serving.py --concurrency 1,4,16 --reps 3 --json out.json

Compare the servers as ratios within one run: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

FILLER = (
    "Please write a detailed, friendly explanation for a curious student about how rivers "
    "shape valleys over thousands of years, with examples from several continents and a few "
    "surprising facts. Request number {i}: begin now."
)


def same_blas_as_troupe_serve() -> None:
    """Re-execute this benchmark with OpenBLAS preloaded when `troupe serve` would preload it,
    so that every server and the in-process ceiling it starts run on the same BLAS."""
    from actors.blas import preload_command

    plan = preload_command([sys.argv[0], *sys.argv[1:]])
    if plan is not None:
        os.execve(sys.executable, *plan)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def make_messages(n: int, offset: int) -> list[list[dict]]:
    return [[{"role": "user", "content": FILLER.format(i=offset + i)}] for i in range(n)]


async def one_request(session: aiohttp.ClientSession, url: str, model: str,
                      messages: list[dict], max_tokens: int) -> tuple[float, int]:
    """Stream one chat completion; return (TTFT seconds, completion tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    chunks = 0
    usage_tokens = None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if data.get("usage"):
                usage_tokens = data["usage"]["completion_tokens"]
            for choice in data.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start,
            usage_tokens if usage_tokens is not None else chunks)


async def drive(base: str, model: str, concurrency: int, max_tokens: int, offset: int) -> dict:
    """``concurrency`` requests at once, twice over (closed loop); unique prompts."""
    url = f"{base}/v1/chat/completions"
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        msgs = make_messages(concurrency * 2, offset)
        queue = list(msgs)
        ttfts: list[float] = []
        tokens = 0
        errors = 0

        async def worker() -> None:
            nonlocal tokens, errors
            while queue:
                m = queue.pop()
                try:
                    ttft, n = await one_request(session, url, model, m, max_tokens)
                    ttfts.append(ttft)
                    tokens += n
                except Exception as exc:  # counted, reported; the run goes on
                    errors += 1
                    print(f"  error: {exc}", file=sys.stderr)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"tokens_per_s": tokens / wall, "ttft_p50": percentile(ttfts, 50),
            "ttft_p99": percentile(ttfts, 99), "errors": errors, "tokens": tokens}


async def wait_healthy(base: str, proc: subprocess.Popen, deadline_s: float = 300) -> None:
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("server exited during start-up")
            try:
                async with session.get(f"{base}/v1/models") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("server did not start in time")


async def bench_server(name: str, cmd: list[str], port: int, model: str, args) -> dict:
    base = f"http://127.0.0.1:{port}"
    log = open(Path(args.log_dir) / f"{name}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        await wait_healthy(base, proc)
        await drive(base, model, 1, 8, offset=10_000)  # warm-up
        results = {}
        for c in args.concurrency:
            reps = [await drive(base, model, c, args.max_tokens, offset=1000 * r + 100 * c)
                    for r in range(args.reps)]
            results[c] = {k: statistics.median(rep[k] for rep in reps) for k in reps[0]}
            print(f"{name:>14} c={c:<3} {results[c]['tokens_per_s']:8.1f} tok/s  "
                  f"TTFT p50 {results[c]['ttft_p50']*1000:7.0f} ms  "
                  f"p99 {results[c]['ttft_p99']*1000:7.0f} ms  errors {results[c]['errors']}",
                  flush=True)
        return results
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def in_process_ceiling(model_dir: str, args) -> dict:
    """The same work through BatchGenerator directly: the most any server could do."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tok = load(model_dir)
    results = {}
    for c in args.concurrency:
        runs = []
        for r in range(args.reps):
            prompts = [tok.apply_chat_template(m, add_generation_prompt=True)
                       for m in make_messages(c * 2, 50_000 + 1000 * r + 100 * c)]
            gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8,
                                 stop_tokens=[[t] for t in tok.eos_token_ids])
            start = time.perf_counter()
            pending = list(prompts)
            live = 0
            tokens = 0
            while pending or live:
                # A closed loop like the HTTP clients: at most c requests in flight.
                while pending and live < c:
                    gen.insert([pending.pop()], max_tokens=[args.max_tokens])
                    live += 1
                for resp in gen.next_generated():
                    tokens += 1
                    if resp.finish_reason is not None:
                        live -= 1
            runs.append(tokens / (time.perf_counter() - start))
            gen.close()
        results[c] = {"tokens_per_s": statistics.median(runs)}
        print(f"{'in-process':>14} c={c:<3} {results[c]['tokens_per_s']:8.1f} tok/s", flush=True)
    return results


def resolve_default_model() -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-m", "api.cli", "pull"], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    path = out[-1]
    return path, Path(path).name


def markdown(results: dict, concurrency: list[int]) -> str:
    rows = ["| server | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | errors |",
            "|---|---|---|---|---|---|"]
    for name in ("mlx-troupe", "mlx_lm.server"):
        for c in concurrency:
            r = results[name][c]
            rows.append(f"| {name} | {c} | {r['tokens_per_s']:.1f} | {r['ttft_p50']*1000:.0f} "
                        f"| {r['ttft_p99']*1000:.0f} | {r['errors']:.0f} |")
    for c in concurrency:
        rows.append(f"| in-process BatchGenerator | {c} | "
                    f"{results['in-process'][c]['tokens_per_s']:.1f} | | | |")
    rows.append("")
    rows.append("| concurrency | troupe / mlx_lm.server tok/s | troupe TTFT p99 / mlx_lm.server "
                "| troupe / in-process |")
    rows.append("|---|---|---|---|")
    for c in concurrency:
        t, m, i = (results[k][c] for k in ("mlx-troupe", "mlx_lm.server", "in-process"))
        rows.append(f"| {c} | {t['tokens_per_s'] / m['tokens_per_s']:.2f} | "
                    f"{t['ttft_p99'] / m['ttft_p99']:.2f} | "
                    f"{t['tokens_per_s'] / i['tokens_per_s']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--concurrency", default="1,4,16",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--log-dir", default="bench-results")
    args = p.parse_args()
    same_blas_as_troupe_serve()
    Path(args.log_dir).mkdir(exist_ok=True)
    model_dir, name = (args.model, Path(args.model).name) if args.model \
        else resolve_default_model()

    results = {}
    port = free_port()
    results["mlx-troupe"] = asyncio.run(bench_server(
        "mlx-troupe",
        [sys.executable, "-m", "api.cli", "serve", "--model", model_dir, "--port", str(port),
         "--log-level", "warning"],
        port, name, args))
    port = free_port()
    results["mlx_lm.server"] = asyncio.run(bench_server(
        "mlx_lm.server",
        [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port", str(port),
         "--log-level", "WARNING"],
        port, model_dir, args))
    results["in-process"] = in_process_ceiling(model_dir, args)
    table = markdown(results, args.concurrency)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
