"""A Claude-Code-shaped session replayed against mlx-troupe and its peers: TTFT and the prefix
cache's read share, turn by turn.

The session is ``agent_shapes.ClaudeCode``'s: the billing line with a new hash on every
request, Claude Code's 15 tools, a system prompt sized so that it and the tools fill
``--system-tokens`` (half the default model's 8,192), then ``--turns`` turns, each the
assistant's last answer (a line of text and one tool call) and the tool's
result (``--result-tokens``, 200-1,000 tokens). The assistant's turns are scripted, not the
model's, so that every server gets the same requests; each request asks for ``--answer-tokens``
(the answer is not what is measured: the time to its first token is), with thinking off
(Claude Code's budget of 31,999 must stay below ``max_tokens``). When the next prompt
would pass ``--compact-at`` of the context, the history is compacted as Claude Code does it:
a request asking for a summary of the conversation so far, then the conversation starts again
from the summary (the system prompt and the tools stay). The decision is made before the next
request: the last prompt and what the turn added, counted with the model's tokenizer.

Per turn: the prompt tokens the server counted, the ones it read from its cache, the share of
the previous turn's prompt that was among them (``agent_shapes.reuse``), and the TTFT. How
each server is reached, as a Claude Code user reaches it:

- **mlx-troupe** and **llama.cpp** (xllamacpp's server) speak Anthropic's Messages API: the
  request goes as Claude Code sends it.
- **mlx_lm.server** speaks OpenAI's API only: the request goes through a gateway's conversion
  (as claude-code-router or LiteLLM make it: the system blocks joined, the billing line
  kept, tool calls and results as OpenAI's), with the tools written into the prompt since the
  model's template has none (``actors.tool_prompt``, as benchmarks/sessions.py does).

    .venv/bin/python benchmarks/agents_replay.py                  # troupe, mlx_lm.server, llama.cpp
    .venv/bin/python benchmarks/agents_replay.py --servers mlx-troupe --turns 6
    make bench-agents                                            # installs llama.cpp first

Writes ``agents_replay.json`` and ``agents_replay.md`` (and each server's log) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (beside this file; it puts the repository on the path)
import sessions  # noqa: E402
from agent_shapes import Answer, ClaudeCode, Request, Script, reuse  # noqa: E402

from troupe.actors.tool_prompt import with_tools_in_prompt  # noqa: E402  (json only)

TROUPE, MLX_LM, LLAMACPP = sessions.TROUPE, sessions.MLX_LM, sessions.LLAMACPP
# Servers that speak Anthropic's Messages API; the others get a gateway's conversion.
ANTHROPIC = (TROUPE, LLAMACPP)
SUMMARY = ("Summary of the session so far: the user asked to fix the failing cache tests. "
           "The assistant read src/cache.py and tests/test_cache.py, ran the tests (two "
           "failures in the eviction path), and is about to change the eviction order.")


@dataclass
class Turn:
    """What one request cost: the prompt the server counted and what it read from its cache."""

    ttft: float | None
    prompt: int | None
    cached: int | None
    error: str | None = None


# --- the session ----------------------------------------------------------------------------


def system_chars(tokenizer: Any, target: int) -> int:
    """The instructions' length in characters that makes them and the tools (as troupe writes
    them into a template without a tool format) about ``target`` tokens."""
    from troupe.actors.tool_prompt import tools_instructions

    probe = ClaudeCode(Script(seed=0), system_chars=0)
    tools = [{"type": "function", "function": {"name": t["name"], "description":
              t["description"], "parameters": t["input_schema"]}} for t in probe.tools]
    fixed = len(tokenizer.encode(tools_instructions(tools) + probe.instructions))
    sample = Script(seed=0).filler(20_000)
    per_char = len(tokenizer.encode(sample)) / len(sample)
    return max(0, int((target - fixed) / per_char))


def gateway_body(request: Request, model: str, answer_tokens: int) -> dict[str, Any]:
    """A Messages request as a gateway hands it to an OpenAI-only server."""
    body = request.body
    system = "\n".join(block["text"] for block in body["system"])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for message in body["messages"]:
        texts, calls = [], []
        for block in message["content"]:
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "tool_use":
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block["input"])}})
            elif block["type"] == "tool_result":
                result = "\n".join(part["text"] for part in block["content"])
                messages.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                 "content": result})
        if texts or calls:
            turn: dict[str, Any] = {"role": message["role"], "content": "\n".join(texts)}
            if calls:
                turn["tool_calls"] = calls
            messages.append(turn)
    tools = [{"type": "function", "function": {"name": t["name"], "description":
              t["description"], "parameters": t["input_schema"]}} for t in body["tools"]]
    return {"model": model, "messages": with_tools_in_prompt(messages, tools),
            "max_tokens": answer_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


# --- one request ----------------------------------------------------------------------------


async def messages_turn(http: aiohttp.ClientSession, base: str, request: Request,
                        answer_tokens: int) -> Turn:
    """One streamed Messages request: its usage (the start's, or the end's where a server
    counts there) and the time to its first content."""
    body = {**request.body, "max_tokens": answer_tokens, "temperature": 0}
    sent = time.perf_counter()
    first = None
    prompt = cached = None
    try:
        async with http.post(base + request.path, json=body, headers=request.headers) as resp:
            if resp.status != 200:
                return Turn(None, None, None, f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                usage = (event.get("message") or {}).get("usage") or event.get("usage") or {}
                if "input_tokens" in usage:
                    cached = usage.get("cache_read_input_tokens") or 0
                    prompt = max(prompt or 0, usage["input_tokens"] + cached)
                if first is None and event.get("type") in ("content_block_delta",
                                                           "message_delta"):
                    first = time.perf_counter()
                if event.get("type") == "error":
                    return Turn(None, prompt, cached, str(event)[:300])
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Turn(None, prompt, cached, f"{type(exc).__name__}: {exc}")
    return Turn(None if first is None else first - sent, prompt, cached)


async def chat_turn(http: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> Turn:
    a = await sessions.stream_turn(http, f"{base}/v1/chat/completions", body)
    ttft = None if a.first is None else a.first - a.sent
    return Turn(ttft, a.prompt_tokens, a.cached_tokens, a.error)


# --- one server -----------------------------------------------------------------------------


async def replay(server: sessions.Server, args: argparse.Namespace, chars: int,
                 context: int, tokenizer: Any) -> list[dict[str, Any]]:
    """The session on ``server`` (started): one record per request."""
    script = Script(seed=args.seed, result_chars=(args.result_tokens[0] * 3,
                                                  args.result_tokens[1] * 3))
    # Thinking off: its budget (31,999) must stay below max_tokens, which asks for a few.
    session = ClaudeCode(script, system_chars=chars, thinking=None)
    records: list[dict[str, Any]] = []
    previous: Answer | None = None

    async def send(kind: str, request: Request, turn: int) -> Answer:
        nonlocal previous
        async with sessions.fresh_connections() as http:
            if server.name in ANTHROPIC:
                t = await messages_turn(http, server.base, request, args.answer_tokens)
            else:
                t = await chat_turn(http, server.base,
                                    gateway_body(request, server.model, args.answer_tokens))
        now = Answer(prompt_tokens=t.prompt or 0, cached_tokens=t.cached or 0)
        share = reuse(previous, now) if previous is not None and t.prompt else None
        records.append({"turn": turn, "kind": kind, "ttft": t.ttft, "prompt": t.prompt,
                        "cached": t.cached, "read_share": share, "error": t.error})
        print(f"    {server.name} t{turn:>2} {kind:<8} TTFT {harness.fmt(t.ttft)} s  prompt "
              f"{t.prompt}  cached {t.cached}  share {harness.fmt(share)}"
              f"{'  ' + t.error if t.error else ''}", flush=True)
        previous = now
        return now

    for turn in range(1, args.turns + 1):
        answer = await send("turn", session.request(), turn)
        before = len(session.messages)
        session.take(session.scripted(turn))
        # Claude Code compacts before the next request would pass its threshold: this one's
        # prompt and what the turn added (counted as JSON: a little over).
        added = sum(len(tokenizer.encode(json.dumps(m))) for m in session.messages[before:])
        if answer.prompt_tokens and answer.prompt_tokens + added > args.compact_at * context:
            compact = session.request()
            compact.body["messages"].append({"role": "user", "content": [{
                "type": "text", "text": "Your task is to create a detailed summary of the "
                "conversation so far."}]})
            await send("compact", compact, turn)
            session.compact(SUMMARY)
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the turns after the first that did not follow a compaction."""
    kept = [r for i, r in enumerate(records) if r["kind"] == "turn" and i > 0
            and records[i - 1]["kind"] == "turn" and not r["error"]]
    ttfts = [r["ttft"] for r in kept if r["ttft"] is not None]
    shares = [r["read_share"] for r in kept if r["read_share"] is not None]
    return {"turns": len(kept), "median_ttft": statistics.median(ttfts) if ttfts else None,
            "median_read_share": statistics.median(shares) if shares else None,
            "min_read_share": min(shares) if shares else None,
            "compactions": sum(r["kind"] == "compact" for r in records),
            "errors": sum(bool(r["error"]) for r in records)}


async def bench_one(name: str, args: argparse.Namespace, model_dir: str, chars: int,
                    context: int, tokenizer: Any) -> dict[str, Any]:
    out_dir = Path(args.out)
    port = harness.free_port()
    with tempfile.TemporaryDirectory(prefix="agents-cache-") as cache_dir, \
            open(out_dir / f"{name}.log", "w") as log:
        cmd = sessions.server_command(name, args, model_dir, port, cache_dir, 1, None)
        server = sessions.Server(name, cmd, f"http://127.0.0.1:{port}", log)
        try:
            await server.start(model_dir)
            await harness.quiesce([server.proc.pid])
            records = await replay(server, args, chars, context, tokenizer)
        finally:
            await server.stop()
    return {"server": name, "command": " ".join(cmd), "turns": records,
            "summary": summarize(records)}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Agents replay: {report['meta']['turns']} Claude-Code-shaped turns", "",
             f"`{report['meta']['command']}` on {report['meta']['cpu']}, "
             f"{report['meta']['started']}.", "",
             "| server | median TTFT (s) | median read share | lowest read share | "
             "compactions | errors |", "|---|---|---|---|---|---|"]
    for run in report["runs"]:
        s = run["summary"]
        lines.append(f"| {run['server']} | {harness.fmt(s['median_ttft'])} | "
                     f"{harness.fmt(s['median_read_share'], 3)} | "
                     f"{harness.fmt(s['min_read_share'], 3)} | {s['compactions']} | "
                     f"{s['errors']} |")
    lines += ["", "Per turn (TTFT s / prompt tokens / read share of the previous prompt); a "
              "server compacts after the turn its prompts filled the context:", "",
              "| turn | kind | " + " | ".join(r["server"] for r in report["runs"]) + " |",
              "|---|---|" + "---|" * len(report["runs"])]
    by_run = [{(r["turn"], r["kind"]): r for r in run["turns"]} for run in report["runs"]]
    # A compaction follows its turn.
    for turn, kind in sorted({key for recs in by_run for key in recs},
                             key=lambda k: (k[0], k[1] == "compact")):
        cells = []
        for recs in by_run:
            r = recs.get((turn, kind))
            cells.append("" if r is None else f"{harness.fmt(r['ttft'])} / {r['prompt']} / "
                         f"{harness.fmt(r['read_share'], 3)}" if not r["error"] else "error")
        lines.append(f"| {turn} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", default=f"{TROUPE},{MLX_LM},{LLAMACPP}")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=4096)
    p.add_argument("--result-tokens", type=harness.int_list, default=[200, 1000])
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--compact-at", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/agents-replay")
    p.add_argument("--troupe-args", default="")
    p.add_argument("--mlx-lm-args", default="")
    p.add_argument("--llamacpp-args", default="")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    harness.same_blas_as_troupe_serve()  # every server started on troupe's BLAS
    args = parse_args(argv)
    names = [sessions.ALIASES[n] for n in args.servers.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = harness.resolve_default_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = json.loads((Path(model_dir) / "config.json").read_text())[
        "max_position_embeddings"]
    chars = system_chars(tokenizer, args.system_tokens)
    report: dict[str, Any] = {
        "meta": {"command": " ".join(["benchmarks/agents_replay.py", *(argv or sys.argv[1:])]),
                 "cpu": harness.cpu_model(), "turns": args.turns, "context": context,
                 "system_chars": chars,
                 "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "runs": []}
    for name in names:
        print(f"  {name}", flush=True)
        report["runs"].append(asyncio.run(bench_one(name, args, model_dir, chars, context,
                                                    tokenizer)))
        (out / "agents_replay.json").write_text(json.dumps(report, indent=1))
    (out / "agents_replay.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
