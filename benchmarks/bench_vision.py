"""Images: troupe against mlx-vlm's own server, over HTTP, on the same vision-language model.

Both servers are started on ``--model`` (default: a random-weight Gemma 3 made with mlx-vlm's
classes at a small real shape: a 576-wide, 12-layer text model and a 6-layer SigLIP-style tower
over 224-pixel images in 14-pixel patches, 64 image tokens; tests/tiny_vlm.py) and measured
in one run, one server at a time:

- an image prompt's time to first token, cold (an image never seen) and again (the same
  image and question: troupe's prefix cache; mlx-vlm's own caches where it has them), medians
  of ``--repeats``;
- text streams' inter-token latency while an image prefills: ``--streams`` chat streams
  decode and an image prompt arrives when each has its first token; the p50 and p99 of the
  streams' gaps, and the image's time to first token.

    .venv/bin/python benchmarks/bench_vision.py --out bench-results/vision.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
QUESTION = "Describe this picture: its colours, its shapes and what it might show."


def make_model(out: Path) -> Path:
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from tiny_vlm import make_tiny_gemma3_vlm

    if (out / "config.json").exists():
        return out
    return make_tiny_gemma3_vlm(out, hidden=576, layers=12, heads=9, kv_heads=3, image_size=224,
                                patch=14, image_tokens=64, vision_hidden=384,
                                vision_layers=6, vision_heads=6)


def png(seed: int) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray((rng.random((300, 400, 3)) * 255).astype("uint8")).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def image_chat(seed: int) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png(seed)}"}},
        {"type": "text", "text": QUESTION}]}]


async def stream(http: Any, url: str, model: str, messages: list[dict], max_tokens: int,
                 first: asyncio.Event | None = None) -> tuple[float, list[float]]:
    """One streamed chat: seconds to its first token, and the times of every token."""
    began = time.perf_counter()
    times: list[float] = []
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
                if first is not None and len(times) == 1:
                    first.set()
    return (times[0] - began if times else float("nan")), times


async def measure(url: str, model: str, args: argparse.Namespace, seed0: int
                  ) -> dict[str, Any]:
    import httpx

    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        await stream(http, url, model, image_chat(seed0), 4)  # warm-up
        cold, again = [], []
        for r in range(args.repeats):
            cold.append((await stream(http, url, model, image_chat(seed0 + 1 + r), 8))[0])
            again.append((await stream(http, url, model, image_chat(seed0 + 1 + r), 8))[0])
        out["image_ttft_cold_s"] = statistics.median(cold)
        out["image_ttft_again_s"] = statistics.median(again)
        started = [asyncio.Event() for _ in range(args.streams)]
        texts = [asyncio.create_task(stream(
            http, url, model, [{"role": "user", "content": f"Tell me a long story, number {i}."}],
            args.stream_tokens, started[i])) for i in range(args.streams)]
        await asyncio.gather(*(e.wait() for e in started))
        image = await stream(http, url, model, image_chat(seed0 + 100), 8)
        gaps = []
        for _, times in await asyncio.gather(*texts):
            gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
        gaps.sort()
        out["streams_itl_p50_ms"] = 1000 * gaps[len(gaps) // 2]
        out["streams_itl_p99_ms"] = 1000 * gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]
        out["image_ttft_beside_streams_s"] = image[0]
    return out


def start(cmd: list[str], url: str, log: Path) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:4]} exited; see {log}")
        time.sleep(1)
    raise RuntimeError(f"{cmd[:4]} did not start; see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a vision-language checkpoint (default: random Gemma 3)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--servers", default="troupe,mlx-vlm")
    parser.add_argument("--out", default="bench-results/vision.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import blas_name, same_blas_as_troupe_serve

    # Both servers inherit this process's BLAS preload (troupe serve's own choice).
    same_blas_as_troupe_serve()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else make_model(out.parent / "vision-gemma3-random")
    py = sys.executable
    servers = {
        "troupe": [py, "-m", "troupe.api.cli", "serve", "--model", str(model), "--port", "8731",
                   "--cache-dir", str(out.parent / "vision-kv")],
        "mlx-vlm": [py, "-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", "8732"],
    }
    results: dict[str, Any] = {"model": str(model), "cpus": os.cpu_count(),
                               "blas": blas_name()}
    for i, name in enumerate(args.servers.split(",")):
        url = f"http://127.0.0.1:{8731 + list(servers).index(name)}"
        proc = start(servers[name], url, out.parent / f"vision-{name}.log")
        try:
            import httpx

            served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            results[name] = asyncio.run(measure(url, served, args, 1000 * (i + 1)))
        finally:
            proc.terminate()
            proc.wait(30)
        print(name, json.dumps(results[name], indent=1), flush=True)
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
