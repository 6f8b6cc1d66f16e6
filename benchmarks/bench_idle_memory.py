"""Memory a burst of long prompts leaves behind: the server's RSS before, at the peak, right after,
and once the idle engine gave memory back (``IDLE_RELEASE_S`` after its last request: MLX's
buffer cache and glibc's free heap pages; the model and the prefix cache stay).

`troupe serve` runs as a subprocess on a fresh --cache-dir; RSS is ``VmRSS`` of its process
(Linux), sampled every 0.2 s. Each prompt is new (no cache hit), all are sent at once.

    .venv/bin/python benchmarks/bench_idle_memory.py [--model DIR] [--prompts 16]
        [--prompt-tokens 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import free_port, resolve_default_model, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MB = 2**20
WORDS = ("river valley stone mountain village harbour lantern orchard meadow bridge tower "
         "market winter summer autumn spring keeper ship storm candle letter garden").split()
# Longer than the server's IDLE_RELEASE_S (actors/scheduler.py), and then some.
RELEASE_WAIT_S = 30.0


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return kb / 1024


async def scheduler_report(session: aiohttp.ClientSession, base: str) -> dict:
    async with session.get(f"{base}/actors/scheduler") as resp:
        return (await resp.json())["report"]


async def burst(session: aiohttp.ClientSession, base: str, model: str, n: int,
                tokens: int) -> list[int]:
    """``n`` prompts of about ``tokens`` tokens each, all at once; their prompt lengths."""
    run = f"{time.time():.0f}"

    async def one(i: int) -> int:
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(int(tokens / 1.3))]
        body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "user", "content": f"Run {run}, text {i}. " + " ".join(words)}]}
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {data}")
            return data["usage"]["prompt_tokens"]

    return await asyncio.gather(*(one(i) for i in range(n)))


async def measure(args: argparse.Namespace) -> dict:
    model_dir = args.model or resolve_default_model()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cache_dir = tempfile.mkdtemp(prefix="bench-idle-memory-")
    log = open(args.log, "w")  # noqa: SIM115 (open for the server's whole life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "troupe.api.cli", "serve", "--model", model_dir, "--port", str(port),
         "--cache-dir", cache_dir, "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    result: dict = {"model": Path(model_dir).name, "prompts": args.prompts,
                    "prompt_tokens_asked": args.prompt_tokens}
    try:
        model = (await wait_healthy(base, proc))[0]
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.sleep(2.0)  # start-up's own allocations settle
            result["rss_start_mb"] = rss_mb(proc.pid)
            peak = result["rss_start_mb"]
            sampling = True

            async def sample() -> None:
                nonlocal peak
                while sampling:
                    peak = max(peak, rss_mb(proc.pid))
                    await asyncio.sleep(0.2)

            sampler = asyncio.create_task(sample())
            began = time.perf_counter()
            lengths = await burst(session, base, model, args.prompts, args.prompt_tokens)
            result["burst_s"] = round(time.perf_counter() - began, 1)
            result["rss_after_burst_mb"] = rss_mb(proc.pid)  # before the idle release
            sampling = False
            await sampler
            result["rss_peak_mb"] = peak
            result["prompt_tokens"] = [min(lengths), max(lengths)]
            report = await scheduler_report(session, base)
            deadline = time.monotonic() + RELEASE_WAIT_S
            while report["memory_releases"] == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                report = await scheduler_report(session, base)
            if report["memory_releases"] == 0:
                raise RuntimeError(f"no idle release within {RELEASE_WAIT_S:.0f} s")
            await asyncio.sleep(0.5)
            result["rss_released_mb"] = rss_mb(proc.pid)
            result["prefix_cache_ram_mb"] = round(
                (report["ram_block_bytes"] + report["hot_bytes"]) / MB, 1)
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
    for key in [k for k in result if k.startswith("rss_")]:
        result[key] = round(result[key])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--log", default="bench-idle-memory.log", help="the server's log")
    p.add_argument("--json", help="write the results here as JSON")
    args = p.parse_args()
    result = asyncio.run(measure(args))
    print("| RSS at start | peak | right after the burst | after the idle release | "
          "prefix cache in RAM |")
    print("|---|---|---|---|---|")
    print(f"| {result['rss_start_mb']:,} MB | {result['rss_peak_mb']:,} MB | "
          f"{result['rss_after_burst_mb']:,} MB | {result['rss_released_mb']:,} MB | "
          f"{result['prefix_cache_ram_mb']:,} MB |")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
