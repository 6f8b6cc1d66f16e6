"""Prefix-cache benchmark: TTFT of a repeated ~2,000-token prompt, against mlx_lm.server.

mlx-troupe (a fresh --cache-dir): cold, then the same prompt again (RAM hit), then the same
prompt after a server restart (disk hit), then the prompt with a new ending (a coding agent's
next turn). mlx_lm.server: cold, the repeat (its own prompt cache), the new ending. Both
servers run as subprocesses of this script, which preloads OpenBLAS first when `troupe serve`
would, so both run on the same BLAS.

    .venv/bin/python benchmarks/bench_prefix.py [--model DIR] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    free_port,
    resolve_default_model,
    same_blas_as_troupe_serve,
    wait_healthy,
    without_troupe_gemv,
)

PARAGRAPH = ("The river carved its valley over thousands of years, carrying stone from the "
             "mountains to the sea, and every village along its banks kept a different story "
             "about where the water came from. ")


CACHED: dict[str, int] = {}  # cached_tokens reported by each measurement, for the record


async def ttft(base: str, model: str, content: str, label: str = "") -> float:
    """Seconds to the first content delta of a streamed chat request."""
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    timeout = aiohttp.ClientTimeout(total=3600)
    first = None
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content") and first is None:
                        first = time.perf_counter() - start
                usage = data.get("usage") or {}
                details = usage.get("prompt_tokens_details") or {}
                if label and "cached_tokens" in details:
                    CACHED[label] = details["cached_tokens"]
    return first if first is not None else time.perf_counter() - start


async def actor_reports(base: str) -> dict:
    """The cache actors' counters (GET /actors), to show what each measurement used."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/actors") as resp:
            actors = await resp.json()
    return {a["name"]: a["report"] for a in actors
            if a["name"] in ("scheduler", "cache_index", "ssd_writer")}


async def run_server(cmd: list[str], port: int, log_path: Path, env: dict, steps):
    """Start a server, run ``steps(base)``, stop it; returns what steps returned."""
    with open(log_path, "a") as log:
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=log, stderr=log, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base, _PopenShim(proc))
            return await steps(base)
        finally:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()


class _PopenShim:
    """wait_healthy() polls ``poll()`` of a subprocess.Popen; adapt an asyncio process."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    def poll(self) -> int | None:
        return self.proc.returncode


async def main_async(args) -> dict:
    model_dir = args.model or resolve_default_model()
    name = Path(model_dir).name
    words = PARAGRAPH.split()
    # ~1.3 tokens per word for this text; unique per run so no earlier cache can help.
    text = " ".join(words * (args.prompt_tokens // len(words) // 1 + 1))
    text = f"Run {time.time():.0f}. " + " ".join(text.split()[: int(args.prompt_tokens / 1.3)])
    prompt = text + " Summarise the story in one sentence."
    new_ending = text + " Which village told the oldest story?"
    logs = Path(args.log_dir)
    logs.mkdir(exist_ok=True)
    env = os.environ.copy()
    cache_dir = tempfile.mkdtemp(prefix="bench-prefix-cache-")
    results: dict[str, dict[str, float]] = {"mlx-troupe": {}, "mlx_lm.server": {}}

    port = free_port()
    troupe = [sys.executable, "-m", "troupe.api.cli", "serve", "--model", model_dir, "--port",
              str(port), "--cache-dir", cache_dir, "--log-level", "warning"]

    async def first_run(base: str) -> None:
        results["mlx-troupe"]["cold"] = await ttft(base, name, prompt, "cold")
        results["mlx-troupe"]["ram_hit"] = await ttft(base, name, prompt, "ram_hit")
        results["mlx-troupe"]["new_ending"] = await ttft(base, name, new_ending, "new_ending")
        await asyncio.sleep(args.settle)  # let the SSD writer persist the blocks
        results["actors_before_restart"] = await actor_reports(base)

    async def after_restart(base: str) -> None:
        results["mlx-troupe"]["disk_hit"] = await ttft(base, name, prompt, "disk_hit")
        results["actors_after_restart"] = await actor_reports(base)

    await run_server(troupe, port, logs / "prefix-troupe.log", env, first_run)
    await run_server(troupe, port, logs / "prefix-troupe.log", env, after_restart)

    port = free_port()
    peer = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port",
            str(port), "--log-level", "WARNING"]

    async def peer_run(base: str) -> None:
        results["mlx_lm.server"]["cold"] = await ttft(base, model_dir, prompt)
        results["mlx_lm.server"]["repeat"] = await ttft(base, model_dir, prompt)
        results["mlx_lm.server"]["new_ending"] = await ttft(base, model_dir, new_ending)

    await run_server(peer, port, logs / "prefix-mlx_lm.log", without_troupe_gemv(env),
                     peer_run)
    results["cached_tokens"] = dict(CACHED)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds to let blocks reach disk before the restart")
    p.add_argument("--json", help="write the results here as JSON")
    p.add_argument("--log-dir", default="bench-results")
    args = p.parse_args()
    same_blas_as_troupe_serve()
    results = asyncio.run(main_async(args))
    t, m = results["mlx-troupe"], results["mlx_lm.server"]
    print("| server | cold (s) | RAM hit (s) | disk hit after restart (s) | new ending (s) |")
    print("|---|---|---|---|---|")
    print(f"| mlx-troupe | {t['cold']:.2f} | {t['ram_hit']:.2f} | {t['disk_hit']:.2f} "
          f"| {t['new_ending']:.2f} |")
    print(f"| mlx_lm.server | {m['cold']:.2f} | {m['repeat']:.2f} (repeat) | | "
          f"{m['new_ending']:.2f} |")
    print()
    print(f"RAM hit / cold: {t['ram_hit'] / t['cold']:.3f}   "
          f"disk hit / cold: {t['disk_hit'] / t['cold']:.3f}   "
          f"troupe RAM hit / mlx_lm.server repeat: {t['ram_hit'] / m['repeat']:.2f}   "
          f"troupe disk hit / mlx_lm.server repeat: {t['disk_hit'] / m['repeat']:.2f}")
    print(f"cached tokens: {results['cached_tokens']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
