"""Agent sessions replayed against mlx-troupe and its peers: TTFT turn by turn.

What an agent sends: N sessions at once (``--sessions 1,4,8``), each a scripted conversation
of ``--turns`` turns (benchmarks/sessions_workload.py): a shared ~1,500-token system prompt
with OpenAI ``tools``, then turns that add a user message or a tool call and its result
(100-600 tokens), each answered with up to ``--max-tokens`` tokens that stay in the history,
until the context reaches ~6,000 tokens. Streaming, greedy; each session sends its next turn
when the last one is answered. The model's template has no tool format: troupe writes the
tools into the prompt, and the peers, whose templates would drop them, get that same
conversation as text (``request_prompt``), so every server computes the same prompt.

- **Restart**: once every session has had turn ``--restart-after`` (6), the server is stopped
  and started again on the same cache directory: troupe's next turn reads its blocks from
  disk; a server without a disk tier pays a cold turn. With ``--no-restart`` (the control for
  the after/before figure) the sessions still wait for each other there and the report splits
  there, but the server goes on: the later turns' longer context without the disk tier.
- **Idle**: with two or more sessions, the last one sits out after turn ``--idle-at`` - 1 (the
  turn after the restart) until the others have finished, then plays its remaining turns
  alone. troupe gets a ``--cache-ram-max`` sized so that the others' growth evicts part of the
  idle session's blocks from RAM (``ram_budget``); whether it was evicted is read from troupe's
  own counters around its return turn (blocks read from disk), not assumed. Its lone turns
  are reported on their own and left out of the medians.

Per turn: TTFT (to the first token of any kind), the prompt tokens the server counted, the
ones it took from its cache (``usage.prompt_tokens_details.cached_tokens``, where the server
gives it) and so the ones it computed. Summary: the median TTFT over turns 2-T, before and
after the restart; tokens computed against sent; each session's busy time.

    .venv/bin/python benchmarks/sessions.py                               # 1, 4, 8 sessions
    .venv/bin/python benchmarks/sessions.py --sessions 1,4 --out bench-results/sessions
    make bench-sessions ARGS="--sessions 4"
    make bench-peers ARGS="--sessions 4"          # vllm-mlx and llama.cpp too (installs them)

Writes ``sessions.json``, ``sessions.md`` and ``sessions.png`` (and each server's log) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (beside this file: the harness's helpers)
import sessions_peers as peers  # noqa: E402
import sessions_workload as scripts  # noqa: E402

from troupe.actors.tool_prompt import with_tools_in_prompt  # noqa: E402  (json only; the path is set)

TROUPE, MLX_LM, VLLM, LLAMACPP = "mlx-troupe", "mlx_lm.server", "vllm-mlx", "llama.cpp"
ALIASES = {"troupe": TROUPE, TROUPE: TROUPE, "mlx_lm": MLX_LM, MLX_LM: MLX_LM,
           "vllm-mlx": VLLM, "vllm_mlx": VLLM, "llama.cpp": LLAMACPP, "llamacpp": LLAMACPP}
PEERS = (MLX_LM, VLLM, LLAMACPP)
COLOURS = {TROUPE: "tab:blue", MLX_LM: "tab:orange", VLLM: "tab:green", LLAMACPP: "tab:red"}


# --- one turn ------------------------------------------------------------------------------


@dataclass
class Answer:
    """What the client saw of one streamed turn."""

    sent: float
    first: float | None = None  # the first token of any kind: text, reasoning, a tool call
    done: float | None = None
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None


async def stream_turn(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                      ) -> Answer:
    """Stream one chat completion; errors are recorded, not raised."""
    a = Answer(sent=time.perf_counter())
    calls: dict[int, dict[str, Any]] = {}
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                a.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return a
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("error"):
                    a.error = str(data["error"])[:300]
                    break
                if usage := data.get("usage"):
                    a.prompt_tokens = usage.get("prompt_tokens")
                    a.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    a.cached_tokens = details.get("cached_tokens")
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    a.content += text
                    for call in delta.get("tool_calls") or []:
                        merge_call(calls, call)
                    if a.first is None and (text or delta.get("reasoning_content")
                                            or delta.get("reasoning") or delta.get("tool_calls")
                                            or choice.get("finish_reason")):
                        a.first = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        a.error = f"{type(exc).__name__}: {exc}"
    a.done = time.perf_counter()
    a.tool_calls = [calls[i] for i in sorted(calls)]
    return a


def merge_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    """Fold one streamed ``tool_calls`` delta into the calls by index."""
    call = calls.setdefault(delta.get("index", len(calls)), {
        "id": "", "type": "function", "function": {"name": "", "arguments": ""}})
    call["id"] = delta.get("id") or call["id"]
    fn = delta.get("function") or {}
    call["function"]["name"] += fn.get("name") or ""
    call["function"]["arguments"] += fn.get("arguments") or ""


def fresh_connections() -> aiohttp.ClientSession:
    """A client that opens a connection per request: a kept-alive connection goes stale when
    the server restarts, or when llama.cpp's server drops it after 5 idle seconds (the next
    request on it failed with "Server disconnected")."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                 connector=aiohttp.TCPConnector(limit=0, force_close=True))


def request_prompt(name: str, messages: list[dict[str, Any]], work: scripts.Workload
                   ) -> dict[str, Any]:
    """The conversation as each server gets it. troupe gets OpenAI ``tools`` and writes them
    into the prompt itself (actors/tool_prompt.py) since the model's template has no tool
    format. The peers' templates drop ``tools`` without a word (llama.cpp's prompt is the
    same 954 tokens with or without them), so they get the conversation as troupe writes
    it: every server then computes the same prompt, and every model sees its tools."""
    if name == TROUPE:
        return {"messages": messages, "tools": work.tools}
    return {"messages": with_tools_in_prompt(messages, work.tools)}


def history_after(answer: Answer) -> list[dict[str, Any]]:
    """The messages an agent keeps of an answer: the assistant's text and calls, and (so that
    the conversation stays valid) a short result for each call it made."""
    if not answer.tool_calls:
        return [{"role": "assistant", "content": answer.content}]
    calls = [{**c, "id": c["id"] or f"call_{i}"} for i, c in enumerate(answer.tool_calls)]
    return [{"role": "assistant", "content": answer.content or None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "(not run)"}
              for c in calls)]


# --- servers -------------------------------------------------------------------------------


@dataclass
class Server:
    """One server under test, started and restarted on the same cache directory."""

    name: str
    command: list[str]
    base: str
    log: IO[str]
    profile_prefix: Path | None = None
    proc: subprocess.Popen | None = None
    spy: subprocess.Popen | None = None
    model: str = ""
    starts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start_env(self) -> dict[str, str]:
        """troupe's own BLAS preload for troupe; OpenBLAS alone for the MLX peers."""
        if self.name == TROUPE:
            return harness.START_ENV
        return harness.without_troupe_gemv(harness.START_ENV)

    async def start(self, model_dir: str) -> None:
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=harness.REPO, env={**self.start_env(), **self.env})
        ids = await harness.wait_healthy(self.base, self.proc)
        # mlx_lm.server loads whatever the model field names: send it the directory it serves.
        self.model = model_dir if self.name == MLX_LM or not ids else ids[0]
        if self.profile_prefix is not None:
            path = self.profile_prefix.with_name(f"{self.profile_prefix.name}-{self.starts}"
                                                 ".pyspy.txt")
            self.spy = harness.start_py_spy(self.proc.pid, path, self.log)
        self.starts += 1

    async def stop(self) -> None:
        if self.spy is not None:
            self.spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
            await asyncio.to_thread(self.spy.wait, 60)
            self.spy = None
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            await asyncio.to_thread(self.proc.wait, 120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        self.proc = None

    async def report(self, actor: str) -> dict[str, Any]:
        """troupe's ``GET /actors/<actor>`` report ({} from a peer or on failure)."""
        if self.name != TROUPE:
            return {}
        try:
            async with harness.client(30) as s, s.get(f"{self.base}/actors/{actor}") as r:
                return (await r.json()).get("report", {}) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return {}


def server_command(name: str, args: argparse.Namespace, model_dir: str, port: int,
                   cache_dir: str, sessions: int, ram_budget: int | None) -> list[str]:
    if name == TROUPE:
        budget = [] if ram_budget is None else ["--cache-ram-max", str(ram_budget)]
        return [sys.executable, "-m", "troupe.api.cli", "serve", "--model", model_dir, "--port",
                str(port), "--cache-dir", cache_dir, "--log-level", "info", *budget,
                *shlex.split(args.troupe_args)]
    if name == MLX_LM:
        return [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port",
                str(port), "--log-level", "WARNING", *shlex.split(args.mlx_lm_args)]
    if name == VLLM:
        return [str(peers.vllm_mlx_exe()), "serve", model_dir, "--host", "127.0.0.1",
                "--port", str(port), "--continuous-batching", "--ssd-cache-dir",
                str(Path(cache_dir) / "vllm-ssd"), *shlex.split(args.vllm_args)]
    return [str(peers.xllamacpp_python()), str(Path(__file__).with_name("sessions_peers.py")),
            "serve-llamacpp", "--gguf", str(peers.bundled_gguf()), "--port", str(port),
            "--slots", str(sessions), *shlex.split(args.llamacpp_args)]


def kv_bytes_per_token(model_dir: str) -> int:
    """Bytes of keys and values one token takes in every layer (the cache's unit)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    itemsize = 2
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        itemsize = 4 if "F32" in dtypes else 2
        break
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize


def predicted_contexts(tokenizer: Any, work: scripts.Workload, max_tokens: int
                       ) -> list[list[int]]:
    """Each session's context after each turn (prompt and a full answer), as troupe renders
    the tools for a template without a tool format, the answers counted at ``max_tokens``."""
    filler = tokenizer.decode(tokenizer.encode(" ok" * max_tokens,
                                               add_special_tokens=False)[:max_tokens])
    out = []
    for s in work.sessions:
        messages, sizes = [work.system], []
        for turn in s.turns:
            messages += turn.messages
            ids = harness.chat_tokens(tokenizer, with_tools_in_prompt(messages, work.tools))
            sizes.append(len(ids) + max_tokens)
            messages.append({"role": "assistant", "content": filler})
        out.append(sizes)
    return out


def ram_budget(contexts: list[list[int]], idle_at: int, shared: int,
               bytes_per_token: int) -> int:
    """troupe's RAM budget for the idle session's eviction: the shared system prompt once
    (its blocks are the same blocks for every session), the other sessions' own final
    contexts, and half of the idle session's own context when it goes idle. The others'
    growth while it idles then pushes about half of it out of RAM (least recently used
    first); before that, everything fits."""
    *others, idle = contexts
    tokens = shared + sum(c[-1] - shared for c in others) + (idle[idle_at - 2] - shared) // 2
    return tokens * bytes_per_token


# --- one run: N sessions on one server -----------------------------------------------------


@dataclass
class Plan:
    turns: int
    restart_after: int  # 0: no restart
    idle_at: int  # the idle session's first turn after its idle; 0: none
    max_tokens: int
    restart: bool = True  # False: the barrier after ``restart_after`` without the restart


async def run_sessions(server: Server, work: scripts.Workload, plan: Plan, model_dir: str,
                       out: dict[str, Any]) -> None:
    """Every session's turns on ``server`` (already started), the restart and the idle
    session included; per-turn records into ``out["turns"]``."""
    n = len(work.sessions)
    idle_index = n - 1 if plan.idle_at else -1
    url = f"{server.base}/v1/chat/completions"
    restarted, others_done = asyncio.Event(), asyncio.Event()
    arrived, others_left = [0], [n - 1]
    start = time.perf_counter()
    records: list[dict[str, Any]] = out.setdefault("turns", [])

    async def restart() -> None:
        await harness.quiesce([server.proc.pid])  # blocks still going to disk land first
        if not plan.restart:
            print(f"    {server.name}: no restart (the control)", flush=True)
            restarted.set()
            return
        t0 = time.perf_counter()
        await server.stop()
        await server.start(model_dir)
        out["restart_s"] = time.perf_counter() - t0
        print(f"    {server.name}: restarted in {out['restart_s']:.1f} s", flush=True)
        restarted.set()

    async def arrive() -> None:
        arrived[0] += 1
        if arrived[0] == n:
            await restart()

    async def one(s: scripts.Session, http: aiohttp.ClientSession) -> None:
        messages: list[dict[str, Any]] = [work.system]
        alone = at_barrier = False
        idle_start: dict[str, Any] = {}
        try:
            for t, turn in enumerate(s.turns, 1):
                if plan.restart_after and t == plan.restart_after + 1:
                    await restarted.wait()
                before: dict[str, Any] = {}
                if s.index == idle_index and t == plan.idle_at:
                    await others_done.wait()
                    alone = True
                    before = {a: await server.report(a) for a in ("scheduler", "ssd_writer",
                                                                  "cache_index")}
                messages += turn.messages
                body = {"model": server.model, **request_prompt(server.name, messages, work),
                        "max_tokens": plan.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                a = await stream_turn(http, url, body)
                rec = turn_record(s, t, turn, a, start, plan, alone)
                records.append(rec)
                if before:
                    after = {k: await server.report(k) for k in before}
                    out["idle"] = {"session": s.index, "turn": t,
                                   **idle_evidence(idle_start, before, after, rec)}
                if s.index == idle_index and t == plan.idle_at - 1:
                    idle_start = {k: await server.report(k) for k in ("scheduler",
                                                                      "cache_index")}
                print(f"    {server.name} n={n} s{s.index} t{t:>2} {turn.kind:<4} TTFT "
                      f"{harness.fmt(rec['ttft'])} s  computed {rec['computed']} of "
                      f"{rec['sent']}{'  ' + rec['error'] if rec['error'] else ''}",
                      flush=True)
                messages += history_after(a)
                if plan.restart_after and t == plan.restart_after:
                    at_barrier = True
                    await arrive()
        finally:
            # A session that broke off still lets the others restart and go on.
            if plan.restart_after and not at_barrier:
                await arrive()
            if s.index != idle_index:
                others_left[0] -= 1
                if others_left[0] <= 0:
                    others_done.set()

    async with fresh_connections() as http:
        await asyncio.gather(*(one(s, http) for s in work.sessions))
    out["wall_s"] = time.perf_counter() - start - out.get("restart_s", 0.0)


def turn_record(s: scripts.Session, t: int, turn: scripts.Turn, a: Answer, start: float,
                plan: Plan, alone: bool) -> dict[str, Any]:
    computed = None if a.prompt_tokens is None or a.cached_tokens is None \
        else a.prompt_tokens - a.cached_tokens
    return {
        "session": s.index, "turn": t, "kind": turn.kind, "message_tokens": turn.tokens,
        "ttft": None if a.first is None else a.first - a.sent,
        "duration": None if a.done is None else a.done - a.sent,
        "sent": a.prompt_tokens, "cached": a.cached_tokens, "computed": computed,
        "completion_tokens": a.completion_tokens, "tool_calls": len(a.tool_calls),
        "at": a.sent - start, "error": a.error,
        "phase": "pre" if not plan.restart_after or t <= plan.restart_after else "post",
        "alone": alone,
    }


def ram_evictions(reports: dict[str, Any]) -> int | None:
    """Blocks evicted from RAM so far: the scheduler's ``ram_evicted``, or the cache index's
    ``evicted["ram"]`` where the index keeps the RAM tier."""
    n = reports.get("scheduler", {}).get("ram_evicted")
    if isinstance(n, int):
        return n
    n = reports.get("cache_index", {}).get("evicted")
    return n.get("ram") if isinstance(n, dict) else None


def idle_evidence(idle_start: dict[str, Any], before: dict[str, Any], after: dict[str, Any],
                  rec: dict[str, Any]) -> dict[str, Any]:
    """What troupe's counters say of the idle session's return turn, which ran alone (so the
    deltas are its own): the blocks it read from disk, and the blocks evicted from RAM while
    it idled (anyone's)."""
    def delta(actor: str, key: str) -> int | None:
        a, b = after.get(actor, {}).get(key), before.get(actor, {}).get(key)
        return a - b if isinstance(a, int) and isinstance(b, int) else None

    out: dict[str, Any] = {"ttft": rec["ttft"], "sent": rec["sent"], "cached": rec["cached"],
                           "computed": rec["computed"], "evicted": None}
    if before.get("ssd_writer"):
        out["disk_blocks_read"] = delta("ssd_writer", "read_blocks")
        out["disk_loads"] = delta("scheduler", "disk_loads")
        ram, ram0 = ram_evictions(before), ram_evictions(idle_start)
        out["ram_evicted_while_idle"] = None if ram is None or ram0 is None else ram - ram0
        out["evicted"] = bool(out["disk_blocks_read"])
    return out


async def bench_one(name: str, n: int, args: argparse.Namespace, model_dir: str,
                    work: scripts.Workload, plan: Plan, budget: int | None) -> dict[str, Any]:
    out_dir = Path(args.out)
    port = harness.free_port()
    result: dict[str, Any] = {"server": name, "sessions": n}
    with tempfile.TemporaryDirectory(prefix="sessions-cache-") as cache_dir, \
            open(out_dir / f"{name}-n{n}.log", "w") as log:
        cmd = server_command(name, args, model_dir, port, cache_dir, n, budget)
        result["command"] = shlex.join(cmd)
        if name == TROUPE:
            result["cache_ram_max"] = budget
        server = Server(name, cmd, f"http://127.0.0.1:{port}", log,
                        out_dir / f"{name}-n{n}" if args.profile else None)
        if name == VLLM:
            # vllm-mlx saves its prefix cache under ~/.cache/vllm-mlx at exit and loads it at
            # start: a home of this run's own keeps it across the restart, not across runs.
            server.env["HOME"] = cache_dir
        try:
            await server.start(model_dir)
            # Warm-up: nothing of the script, only the server's first-request costs.
            async with fresh_connections() as http:
                await stream_turn(http, f"{server.base}/v1/chat/completions", {
                    "model": server.model, "messages": [{"role": "user", "content": "Hello!"}],
                    "max_tokens": 8, "temperature": 0, "stream": True})
            await harness.quiesce([server.proc.pid])
            result["loadavg"] = os.getloadavg()[0]
            await run_sessions(server, work, plan, model_dir, result)
        finally:
            await server.stop()
    result["turns"].sort(key=lambda r: (r["session"], r["turn"]))
    result["summary"] = summarize(result["turns"], plan)
    return result


# --- the report ----------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def summarize(turns: list[dict[str, Any]], plan: Plan) -> dict[str, Any]:
    """Medians over the sessions' turns that ran beside the others (the idle session's lone
    turns are reported on their own), tokens computed against sent, busy time per session."""
    shared = [r for r in turns if not r["alone"] and r["error"] is None]

    def ttft(pred: Any) -> float | None:
        return median([r["ttft"] for r in shared if pred(r)])

    r_after = plan.restart_after
    sessions = sorted({r["session"] for r in turns})
    busy = [sum(r["duration"] or 0 for r in turns if r["session"] == s) for s in sessions]
    reported = all(r["cached"] is not None for r in turns if r["error"] is None)
    return {
        "first_turn_ttft": ttft(lambda r: r["turn"] == 1),
        "ttft_median": ttft(lambda r: r["turn"] >= 2),
        # The whole answer, what an agent waits for before it acts: a server that stalls the
        # streams to prefill sooner shows a lower TTFT and a longer turn.
        "turn_median": median([r["duration"] for r in shared if r["turn"] >= 2]),
        "pre_restart_ttft": ttft(lambda r: 2 <= r["turn"] <= r_after) if r_after else None,
        "restart_turn_ttft": ttft(lambda r: r["turn"] == r_after + 1) if r_after else None,
        "post_restart_ttft": ttft(lambda r: r["turn"] > r_after) if r_after else None,
        "last_turn_ttft": ttft(lambda r: r["turn"] == plan.turns),
        "tokens_sent": sum(r["sent"] or 0 for r in turns),
        "tokens_computed": sum(r["computed"] or 0 for r in turns) if reported else None,
        "cached_tokens_reported": reported,
        "session_busy_s": median(busy),
        "errors": sum(1 for r in turns if r["error"]),
        "per_turn": {str(t): {
            "ttft": median([r["ttft"] for r in shared if r["turn"] == t]),
            "sent": median([r["sent"] for r in shared if r["turn"] == t]),
            "computed": median([r["computed"] for r in shared if r["turn"] == t]),
        } for t in range(1, plan.turns + 1)},
    }


def goals(runs: list[dict[str, Any]], control: bool = False) -> list[dict[str, Any]]:
    """The issue's goals: troupe's median TTFT (turns 2-T) at most 0.5x the best peer's at
    every N; after the restart at most 1.5x its own pre-restart median (with ``control``, a
    run without the restart: the same ratio, reported, not a goal)."""
    rows = []
    for n in sorted({r["sessions"] for r in runs}):
        at = {r["server"]: r["summary"] for r in runs if r["sessions"] == n}
        if TROUPE not in at:
            continue
        t = at[TROUPE]
        peer_medians = {k: v["ttft_median"] for k, v in at.items()
                        if k != TROUPE and v["ttft_median"] is not None}
        if peer_medians:
            best = min(peer_medians, key=peer_medians.get)
            value = harness.ratio(t["ttft_median"], peer_medians[best])
            rows.append({"goal": f"n={n}: median TTFT turns 2+ vs the best peer ({best}) ≤ 0.5x",
                         "value": value, "holds": None if value is None else value <= 0.5})
        value = harness.ratio(t["post_restart_ttft"], t["pre_restart_ttft"])
        if control:
            rows.append({"goal": f"n={n}: median TTFT after the barrier vs before, no restart "
                                 "(the control)", "value": value, "holds": None,
                         "control": True})
            continue
        rows.append({"goal": f"n={n}: median TTFT after the restart vs before ≤ 1.5x",
                     "value": value, "holds": None if value is None else value <= 1.5})
    return rows


def s_(x: float | None) -> str:
    return harness.fmt(x, 2)


def merged_line(meta: dict[str, Any]) -> list[str]:
    """For a report made of several runs: when each ran, how long, under what load."""
    if not meta.get("merged"):
        return []
    return [f"Merged from {len(meta['merged'])} runs, one after the other: " + "; ".join(
        f"ended {m['date']}, {m['wall_s'] / 60:.0f} min, load average "
        f"{harness.fmt(m['loadavg_start'], 1)} → {harness.fmt(m['loadavg_end'], 1)}"
        for m in meta["merged"]) + "."]


def markdown(report: dict[str, Any]) -> str:
    meta, runs = report["meta"], report["runs"]
    r_after, turns = meta["restart_after"], meta["turns"]
    event = "barrier" if meta.get("no_restart") else "restart"
    split = (f"no restart (the control): the sessions wait for each other after turn {r_after}"
             if meta.get("no_restart") else f"restart after turn {r_after or 'none'}")
    lines = [
        f"Model `{meta['model']}`, BLAS {meta['blas']}, {meta['cpus']} CPUs ({meta['cpu']}); "
        f"{turns} turns a session, a {meta['system_tokens_rendered']}-token system prompt and "
        f"tools shared by all sessions, messages of {meta['message_tokens'][0]}-"
        f"{meta['message_tokens'][1]} tokens, answers of up to {meta['max_tokens']} tokens, "
        f"context ~{meta['context_tokens']} tokens at the last turn; seed {meta['seed']}; "
        f"{split}. Load average "
        f"{harness.fmt(meta['loadavg_start'])} at start, {harness.fmt(meta['loadavg_end'])} at "
        f"end; {meta['wall_s'] / 60:.1f} min.",
        *merged_line(meta),
        "",
        "| sessions | server | turn 1 TTFT (s) | median TTFT, turns 2-"
        f"{turns} (s) | before the {event}, 2-{r_after} | {event} turn ({r_after + 1}) "
        f"| after, {r_after + 1}-{turns} | median whole turn, 2-{turns} (s) "
        "| prompt tokens computed / sent | session busy (s) | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        m = r["summary"]
        computed = (f"{m['tokens_computed']:,} / {m['tokens_sent']:,}"
                    if m["tokens_computed"] is not None
                    else f"(no cached_tokens) / {m['tokens_sent']:,}")
        lines.append(
            f"| {r['sessions']} | {r['server']} | {s_(m['first_turn_ttft'])} "
            f"| **{s_(m['ttft_median'])}** | {s_(m['pre_restart_ttft'])} "
            f"| {s_(m['restart_turn_ttft'])} | {s_(m['post_restart_ttft'])} "
            f"| {s_(m.get('turn_median'))} | {computed} "
            f"| {harness.fmt(m['session_busy_s'], 0)} | {m['errors']} |")
    for n in sorted({r["sessions"] for r in runs}):
        at = [r for r in runs if r["sessions"] == n]
        lines += ["", f"{n} session(s), per turn: median TTFT (s) and prompt tokens computed "
                  "/ sent (medians over the sessions)", "",
                  "| turn | " + " | ".join(r["server"] for r in at) + " |",
                  "|---|" + "---|" * len(at)]
        for t in range(1, turns + 1):
            cells = []
            for r in at:
                p = r["summary"]["per_turn"][str(t)]
                tok = "–" if p["sent"] is None else \
                    f"{harness.fmt(p['computed'], 0)} / {harness.fmt(p['sent'], 0)}"
                cells.append(f"{s_(p['ttft'])} ({tok})")
            mark = f" ({event})" if r_after and t == r_after + 1 else ""
            lines.append(f"| {t}{mark} | " + " | ".join(cells) + " |")
    idle = [r for r in runs if r.get("idle")]
    if idle:
        lines += ["", "The idle session's return turn (alone, after the others finished):", "",
                  "| sessions | server | turn | TTFT (s) | computed / sent | blocks read from "
                  "disk | evicted from RAM |", "|---|---|---|---|---|---|---|"]
        for r in idle:
            i = r["idle"]
            evicted = {True: "yes", False: "**no**", None: "(no counters)"}[i.get("evicted")]
            tokens = "–" if i["sent"] is None else \
                f"{harness.fmt(i['computed'], 0)} / {i['sent']}"
            lines.append(f"| {r['sessions']} | {r['server']} | {i['turn']} | {s_(i['ttft'])} "
                         f"| {tokens} | {i.get('disk_blocks_read', '–')} | {evicted} |")
    lines += ["", "| goal | measured | holds |", "|---|---|---|"]
    for g in report["goals"]:
        holds = "(the control)" if g.get("control") else \
            {True: "yes", False: "**no**", None: "not measured"}[g["holds"]]
        lines.append(f"| {g['goal']} | {harness.fmt(g['value'], 3)} | {holds} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """TTFT by turn, one line per server, one panel per session count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ns = sorted({r["sessions"] for r in report["runs"]})
    fig, axes = plt.subplots(1, len(ns), figsize=(max(6.0, 4.2 * len(ns) + 0.6), 3.6),
                             dpi=100, squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    r_after = report["meta"]["restart_after"]
    for ax, n in zip(axes[0], ns, strict=True):
        for r in (r for r in report["runs"] if r["sessions"] == n):
            per = r["summary"]["per_turn"]
            xs = [int(t) for t in per if per[t]["ttft"] is not None]
            ax.plot(xs, [per[str(t)]["ttft"] for t in xs], marker="o", markersize=3,
                    color=COLOURS.get(r["server"]), label=r["server"])
        if r_after:
            ax.axvline(r_after + 0.5, color="gray", linestyle="--", linewidth=1)
            ax.text(r_after + 0.6, 0.97,
                    "no restart" if report["meta"].get("no_restart") else "restart",
                    transform=ax.get_xaxis_transform(), fontsize=7, color="gray", va="top")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_title(f"{n} session{'s' if n > 1 else ''}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("TTFT, median over sessions (s)")
    axes[0][0].legend(fontsize=7)
    meta = report["meta"]
    fig.suptitle(f"Agent sessions: TTFT by turn ({Path(meta['model']).name.split('-')[0]}, "
                 f"{meta['cpus']} CPUs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]
                 ) -> dict[str, Any]:
    order = [TROUPE, *PEERS]
    runs = sorted(runs, key=lambda r: (r["sessions"], order.index(r["server"])))
    report = {"meta": meta, "runs": runs,
              "goals": goals(runs, control=bool(meta.get("no_restart")))}
    (out / "sessions.json").write_text(json.dumps(report, indent=2))
    (out / "sessions.md").write_text(markdown(report))
    plot(report, out / "sessions.png")
    return report


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--servers", default=f"{TROUPE},{MLX_LM}",
                   help=f"comma-separated, of {TROUPE}, {MLX_LM}, {VLLM}, {LLAMACPP} "
                        "(the last two: make bench-peers installs them)")
    p.add_argument("--sessions", type=harness.int_list, default=[1, 4, 8],
                   help="comma-separated session counts (default: 1,4,8)")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--system-tokens", type=int, default=1500,
                   help="the shared system prompt with its tools, as troupe renders them")
    p.add_argument("--context-tokens", type=int, default=6000,
                   help="about where a session's context ends, at its last turn")
    p.add_argument("--message-tokens", type=lambda s: tuple(harness.int_list(s)),
                   default=(100, 600), help="a turn's new message: min,max tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's max_tokens")
    p.add_argument("--tools", type=int, default=len(scripts.TOOLS),
                   help=f"how many of the {len(scripts.TOOLS)} tools the requests carry")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-after", type=int, default=6,
                   help="restart the server once every session has had this turn (0: never)")
    p.add_argument("--no-restart", action="store_true",
                   help="the control for the after/before figure: the sessions wait for each "
                        "other after --restart-after and the report splits there, but the "
                        "server is not restarted")
    p.add_argument("--idle-at", type=int,
                   help="the idle session's first turn after its idle (default: two turns "
                        "after the restart; 0: no idle session)")
    p.add_argument("--troupe-args", default="",
                   help="extra `troupe serve` flags, with '=' (a --cache-ram-max here wins)")
    p.add_argument("--mlx-lm-args", default="", help="extra mlx_lm.server flags")
    p.add_argument("--vllm-args", default="", help="extra `vllm-mlx serve` flags")
    p.add_argument("--llamacpp-args", default="",
                   help="extra flags for sessions_peers.py serve-llamacpp")
    p.add_argument("--profile", action="store_true",
                   help="record each server with py-spy into --out")
    p.add_argument("--out", default="bench-results/sessions")
    p.add_argument("--from-json", metavar="PATHS",
                   help="run nothing: rewrite the Markdown and PNG of saved sessions.json "
                        "files (comma-separated: their runs in one report)")
    args = p.parse_args(argv)
    args.servers = [ALIASES[s.strip()] for s in args.servers.split(",") if s.strip()]
    if args.idle_at is None:
        args.idle_at = args.restart_after + 2 if args.restart_after + 2 <= args.turns else 0
    if args.idle_at and args.restart_after and args.idle_at <= args.restart_after + 1:
        p.error("--idle-at must come after the turn after the restart (the idle session "
                "waits for the others, who wait for it at the restart)")
    if args.restart_after >= args.turns:
        p.error("--restart-after must be below --turns")
    return args


def source_state() -> dict[str, Any]:
    """The commit troupe was measured at, and the files changed on top of it."""
    def git(*a: str) -> str:
        done = subprocess.run(["git", *a], cwd=harness.REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "changed_files": len(git("status", "--porcelain", "--untracked-files=no")
                                 .splitlines())}


def installed(names: list[str]) -> list[str]:
    """The servers of ``names`` that can run here; a peer not installed is left out, and
    said so (make bench-peers installs them)."""
    exes = {VLLM: peers.vllm_mlx_exe(), LLAMACPP: peers.xllamacpp_python()}
    missing = [n for n in names if n in exes and not exes[n].exists()]
    for n in missing:
        print(f"{n}: not installed, left out (make bench-peers, or .venv/bin/python "
              "benchmarks/sessions_peers.py install)", file=sys.stderr)
    return [n for n in names if n not in missing]


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = installed(args.servers)
    model_dir = str(Path(args.model).resolve()) if args.model else harness.resolve_default_model()
    from transformers import AutoTokenizer  # lazy and MLX-free: only to size the messages

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    predicted: dict[str, list[int]] = {}
    bpt = kv_bytes_per_token(model_dir)
    for i, n in enumerate(args.sessions):
        work = scripts.make_workload(
            tokenizer, seed=args.seed, sessions=n, turns=args.turns,
            system_tokens=args.system_tokens, context_tokens=args.context_tokens,
            message_tokens=args.message_tokens, max_tokens=args.max_tokens, tools=args.tools)
        idle_at = args.idle_at if n > 1 else 0
        plan = Plan(args.turns, args.restart_after, idle_at, args.max_tokens,
                    restart=not args.no_restart)
        contexts = predicted_contexts(tokenizer, work, args.max_tokens)
        budget = ram_budget(contexts, idle_at, work.system_tokens, bpt) if idle_at \
            else None
        predicted[str(n)] = [c[-1] for c in contexts]
        # Alternate which server goes first, as the harness does.
        for name in servers if i % 2 == 0 else servers[::-1]:
            print(f"  {name}, {n} session(s)", flush=True)
            runs.append(asyncio.run(bench_one(name, n, args, model_dir, work, plan, budget)))
            meta = {
                "model": model_dir, "blas": harness.blas_name(), "cpus": os.cpu_count(),
                "cpu": harness.cpu_model(), "python": sys.version.split()[0],
                "mlx": harness.version("mlx"), "mlx_lm": harness.version("mlx-lm"),
                "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
                "wall_s": time.perf_counter() - started,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": shlex.join(sys.argv),
                **source_state(),
                "system_tokens_rendered": work.system_tokens,
                "kv_bytes_per_token": bpt,
                "predicted_context": predicted,
                **{k: v for k, v in vars(args).items() if k not in ("model", "from_json")},
                "servers_left_out": [n for n in args.servers if n not in servers],
            }
            report = write_report(out, meta, runs)
    return report


def main() -> None:
    args = parse_args()
    if args.from_json:
        # Several runs (one per server, say) make one report: the first's meta, every run.
        saved = [json.loads(Path(f).read_text()) for f in args.from_json.split(",")]
        meta = dict(saved[0]["meta"])
        if len(saved) > 1:
            meta["merged"] = [{k: m["meta"].get(k) for k in ("command", "date", "wall_s",
                                                            "loadavg_start", "loadavg_end")}
                              for m in saved]
            meta["wall_s"] = sum(m["meta"]["wall_s"] for m in saved)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_report(out, meta, [r for m in saved for r in m["runs"]])
        print((out / "sessions.md").read_text())
        return
    harness.same_blas_as_troupe_serve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    print()
    print((Path(args.out) / "sessions.md").read_text())
    print(f"wrote {args.out}/sessions.json, sessions.md, sessions.png "
          f"({report['meta']['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
