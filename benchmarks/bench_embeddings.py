"""Embeddings on troupe's engine against llama.cpp's embedding server on the same model:
inputs per second at 1, 8 and 64 inputs a request, whether the two servers' vectors agree, and
chat streams' inter-token latency alone and while an embedding job runs on troupe.

One ``troupe serve`` holds two models: the chat model, and the same weights as an embedding
model (a directory of links to its files, with a sentence-transformers pooling config, mean
pooling). The embedding phase sends ``--inputs`` texts of about ``--tokens`` tokens each, in
requests of 1, 8 and 64 inputs, ``--concurrency`` requests at a time; the chat phase runs
``--streams`` greedy streams of ``--max-tokens`` tokens, alone, then beside 64-input embedding
requests sent back to back until the streams end. Then llama.cpp (xllamacpp, ``make
bench-peers`` installs it) serves the GGUF the default model is converted from with
``--embeddings --pooling mean`` (64 slots: a 64-input request runs in one batch) and gets the
same embedding requests; the cosine between the two servers' vectors of the same texts is
reported (llama.cpp gets them one a request). Its server serves embeddings or chat, not
both: no chat runs beside it.

    .venv/bin/python benchmarks/bench_embeddings.py
    .venv/bin/python benchmarks/bench_embeddings.py --inputs 512 --json out.json
    .venv/bin/python benchmarks/bench_embeddings.py --beside-only   # the chat phase alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sessions_peers as peers  # noqa: E402
from harness import (  # noqa: E402
    REPO,
    free_port,
    resolve_default_model,
    stream_chat,
    summarize,
    wait_healthy,
)

WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly judge "
         "boxing matches and a sphinx of black quartz reviews my vow").split()


def embedding_copy(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s files linked into ``out``, with sentence-transformers files that make
    troupe serve it as a mean-pooling embedding model."""
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        (out / f.name).symlink_to(f.resolve())
    (out / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return out


def texts(n: int, words: int, key: int) -> list[str]:
    """``n`` distinct texts of ``words`` words."""
    return [f"{key}-{i}: " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
            for i in range(n)]


async def embed_rate(session: aiohttp.ClientSession, base: str, model: str, inputs: list[str],
                     per_request: int, concurrency: int) -> dict[str, Any]:
    """Inputs per second with ``per_request`` inputs a request, ``concurrency`` at a time."""
    batches = [inputs[i:i + per_request] for i in range(0, len(inputs), per_request)]
    gate = asyncio.Semaphore(concurrency)
    errors = 0

    async def one(batch: list[str]) -> None:
        nonlocal errors
        async with gate, session.post(f"{base}/v1/embeddings",
                                      json={"model": model, "input": batch}) as resp:
            await resp.read()
            errors += resp.status != 200

    started = time.perf_counter()
    await asyncio.gather(*(one(b) for b in batches))
    wall = time.perf_counter() - started
    return {"per_request": per_request, "inputs_per_s": len(inputs) / wall, "wall_s": wall,
            "errors": errors}


async def chat_beside(session: aiohttp.ClientSession, base: str, chat: str, embed: str,
                      args: argparse.Namespace, busy: bool) -> dict[str, Any]:
    """``--streams`` chat streams, alone or beside back-to-back 64-input embedding requests."""
    url = f"{base}/v1/chat/completions"
    prompts = [[{"role": "user", "content": f"Story {i}: tell me about {WORDS[i]}."}]
               for i in range(args.streams)]
    done = asyncio.Event()
    embedded = 0

    async def job() -> None:
        nonlocal embedded
        key = 0
        while not done.is_set():
            key += 1
            async with session.post(f"{base}/v1/embeddings", json={
                    "model": embed, "input": texts(64, args.tokens, 10_000 + key)}) as resp:
                await resp.read()
                embedded += 64 if resp.status == 200 else 0

    background = asyncio.create_task(job()) if busy else None
    started = time.perf_counter()
    streams = await asyncio.gather(*(stream_chat(session, url, chat, p, args.max_tokens)
                                     for p in prompts))
    wall = time.perf_counter() - started
    done.set()
    if background is not None:
        await background
    out = summarize(list(streams), wall)
    out["embedded_inputs"] = embedded
    return out


async def vectors(session: aiohttp.ClientSession, base: str, model: str,
                  inputs: list[str]) -> list[list[float]]:
    """The vectors a server gives ``inputs``, in one request."""
    async with session.post(f"{base}/v1/embeddings",
                            json={"model": model, "input": inputs}) as resp:
        body = await resp.json(content_type=None)
    return [d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def probes() -> list[str]:
    """Texts of 1 to about 120 words whose vectors both servers give."""
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))
            for i, n in enumerate((1, 2, 5, 9, 17, 33, 65, 120))]


async def rates(session: aiohttp.ClientSession, base: str, model: str,
                args: argparse.Namespace) -> list[dict[str, Any]]:
    await embed_rate(session, base, model, texts(8, args.tokens, -1), 8, 1)  # load, warm up
    return [await embed_rate(session, base, model, texts(args.inputs, args.tokens, n), n,
                             args.concurrency)
            for n in (1, 8, 64)]


async def llamacpp(args: argparse.Namespace) -> dict[str, Any] | None:
    """llama.cpp's embedding server on the bundled GGUF: its rates and its probe vectors
    (None when xllamacpp is not installed)."""
    python = peers.xllamacpp_python()
    if not python.exists():
        print("llama.cpp: not installed (make bench-peers installs it); troupe alone",
              file=sys.stderr)
        return None
    port = free_port()
    proc = subprocess.Popen([
        str(python), str(Path(__file__).with_name("sessions_peers.py")), "serve-llamacpp",
        "--gguf", str(peers.bundled_gguf()), "--port", str(port), "--slots", "64",
        "--ctx-per-slot", "512", "--threads", str(os.cpu_count() or 1), "--pooling", "mean"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base, proc)
        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # One text a request: several in one request change llama.cpp's vectors (a
            # one-token text's aside), against the same texts sent one by one.
            probe = [(await vectors(session, base, "", [text]))[0] for text in probes()]
            return {"embeddings": await rates(session, base, "", args), "probe": probe}
    finally:
        proc.terminate()
        proc.wait()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    chat_dir = Path(args.model or resolve_default_model())
    with tempfile.TemporaryDirectory() as tmp:
        embed_dir = embedding_copy(chat_dir, Path(tmp) / f"{chat_dir.name}-embedding")
        port = free_port()
        proc = subprocess.Popen([
            sys.executable, "-m", "troupe.api.cli", "serve", "--model", str(chat_dir), "--model",
            str(embed_dir), "--port", str(port), "--cache-dir", str(Path(tmp) / "cache"),
            "--log-level", "warning"], cwd=REPO)
        base = f"http://127.0.0.1:{port}"
        try:
            ids = await wait_healthy(base, proc)
            chat, embed = ids[0], ids[1]
            timeout = aiohttp.ClientTimeout(total=3600)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                if args.beside_only:  # loaded and warmed up, as the rates would leave it
                    await embed_rate(session, base, embed, texts(8, args.tokens, -1), 8, 1)
                    troupe, probe = [], []
                else:
                    troupe = await rates(session, base, embed, args)
                    probe = await vectors(session, base, embed, probes())
                alone = await chat_beside(session, base, chat, embed, args, busy=False)
                beside = await chat_beside(session, base, chat, embed, args, busy=True)
        finally:
            proc.terminate()
            proc.wait()
    peer = await llamacpp(args) if args.llamacpp and not args.beside_only else None
    out = {"model": chat_dir.name, "tokens_per_input": args.tokens, "inputs": args.inputs,
           "embeddings": troupe, "chat_alone": alone, "chat_beside_embeddings": beside}
    if peer is not None:
        out["llamacpp_embeddings"] = peer["embeddings"]
        out["cosine_with_llamacpp"] = [cosine(a, b) for a, b in
                                       zip(probe, peer["probe"], strict=True)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--inputs", type=int, default=256, help="texts embedded at each size")
    p.add_argument("--tokens", type=int, default=32, help="words a text (about as many tokens)")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false",
                   help="troupe alone (no llama.cpp run)")
    p.add_argument("--beside-only", action="store_true",
                   help="only the chat streams alone and beside embeddings (no rates, no "
                        "llama.cpp)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args()
    result = asyncio.run(run(args))
    peer = result.get("llamacpp_embeddings") or [None] * len(result["embeddings"])
    for r, q in zip(result["embeddings"], peer, strict=True):
        versus = "" if q is None else (f"; llama.cpp {q['inputs_per_s']:8.1f} inputs/s "
                                       f"({q['errors']} errors)")
        print(f"{r['per_request']:>3} inputs/request: troupe {r['inputs_per_s']:8.1f} inputs/s "
              f"({r['errors']} errors){versus}")
    if "cosine_with_llamacpp" in result:
        cos = result["cosine_with_llamacpp"]
        print(f"cosine troupe/llama.cpp over {len(cos)} texts: min {min(cos):.4f}, "
              f"mean {sum(cos) / len(cos):.4f}")
    for name in ("chat_alone", "chat_beside_embeddings"):
        r = result[name]
        print(f"{name}: ITL p50 {r['itl_p50'] * 1000:.1f} ms, p99 {r['itl_p99'] * 1000:.1f} ms, "
              f"{r['tokens_per_s']:.1f} tokens/s, {r['errors']} errors "
              f"({r['embedded_inputs']} inputs embedded meanwhile)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
