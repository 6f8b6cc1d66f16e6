"""Serving harness: mlx-troupe against mlx_lm.server and the in-process ceiling, in one run.

Both servers are started on the same model directory (``troupe pull``'s by default) and the
same BLAS (this script re-executes itself with OpenBLAS preloaded when ``troupe serve`` would),
one after the other, and get the same load:

- **serving**: streaming chat, unique prompts, greedy, at each concurrency (a closed loop of
  that many clients, each sending ``--requests-per-client`` requests one after the other);
- **prefix**: a ``--long-tokens`` prompt cold, the same prompt again, and the prompt with a
  new ending (a coding agent's next turn);
- **interference**: ``--streams`` streams decoding while a ``--long-tokens`` prompt arrives;
  their inter-token latency while it is prefilled against their median before it arrived.

The in-process ceiling runs the serving load through troupe's batch runner directly (no HTTP,
no actors). Each repetition starts both servers afresh (troupe with a fresh cache
directory) and runs every step on one and then the other (then the ceiling), alternating which
server goes first and waiting for both to be idle before each: on a shared machine the
measurements of one step then see much the same load. Figures are medians over
repetitions; compare servers as ratios.

    .venv/bin/python benchmarks/harness.py                      # the default model, 3 reps
    .venv/bin/python benchmarks/harness.py --reps 1 --concurrency 1,4
    make bench ARGS="--reps 2"                                   # or: troupe bench --reps 2

Writes ``harness.json``, ``harness.md`` and ``harness.png`` (and each server's log) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import IO, Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
START_ENV = dict(os.environ)
tempfile.gettempdir()  # cached now: the ceiling's CPU kernels later point TMPDIR at their JIT
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # actors.models.blas, and plot.py beside this

from troupe.actors.models.blas import GEMV_LIB, without_troupe_gemv  # noqa: E402  (MLX-free)
from troupe.tools.soak.report import interpolated_percentile as percentile  # noqa: E402

TROUPE = "mlx-troupe"
BASELINE = "mlx-troupe@baseline"  # another commit's checkout (--baseline), served the same way
PEER = "mlx_lm.server"
CEILING = "in-process"
SERVERS = (TROUPE, BASELINE, PEER)

# The unique part comes first so that no two prompts share more than the chat template: a
# server's prompt cache must not turn "unique prompts" into prefix hits.
SERVING_PROMPT = (
    "Request {key}. Please write a detailed, friendly explanation for a curious student about "
    "how rivers shape valleys over thousands of years, with examples from several continents "
    "and a few surprising facts."
)
STREAM_PROMPT = (
    "Stream {key}. Write a very long story, at least two thousand words, about a lighthouse "
    "keeper and the ships she guided over forty years. Describe every season in detail."
)
PARAGRAPH = (
    "The river carved its valley over thousands of years, carrying stone from the mountains "
    "to the sea, and every village along its banks kept a different story about where the "
    "water came from. "
)
ENDINGS = (" Summarise the story in one sentence.", " Which village told the oldest story?")

Messages = list[dict[str, str]]


# --- statistics ----------------------------------------------------------------------------


def median_tree(trees: list[Any]) -> Any:
    """The element-wise median of equally shaped JSON trees (numbers at the leaves). A leaf
    that is None in some trees is the median of the others (None if all are)."""
    first = trees[0]
    if isinstance(first, dict):
        return {k: median_tree([t[k] for t in trees if k in t]) for k in first}
    numbers = [t for t in trees if isinstance(t, int | float) and not isinstance(t, bool)]
    if numbers:
        return statistics.median(numbers)
    return first


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# --- one streamed request ------------------------------------------------------------------


@dataclass
class Stream:
    """What the client saw of one streamed chat completion: when each content chunk came."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0  # the server's usage count when it sent one, else the content chunks
    error: str | None = None
    done: bool = False
    # When the first token came, where no content chunk shows it: the finish chunk of an
    # answer whose first token ended it (a random-weight model's greedy answer can be
    # end-of-sequence at once).
    answered: float | None = None

    @property
    def first_token(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else self.answered

    @property
    def ttft(self) -> float | None:
        first = self.first_token
        return None if first is None else first - self.sent

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every interval between two consecutive content chunks."""
        t = self.chunk_times
        return list(zip(t, t[1:], strict=False))


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: Messages,
    max_tokens: int,
    stream: Stream | None = None,
) -> Stream:
    """Stream one greedy chat completion, recording chunk arrival times into ``stream`` (pass
    one in to watch it live). Errors are recorded, not raised: a benchmark counts them."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    s = stream or Stream(sent=time.perf_counter())
    s.sent = time.perf_counter()
    usage_tokens = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return s
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:]
                if payload == b"[DONE]":
                    break
                data = json.loads(payload)
                if data.get("error"):
                    s.error = str(data["error"])[:200]
                    break
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                for choice in data.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        s.chunk_times.append(time.perf_counter())
                    if s.answered is None and choice.get("finish_reason"):
                        s.answered = time.perf_counter()
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    s.tokens = usage_tokens if usage_tokens is not None else len(s.chunk_times)
    s.done = True
    return s


def summarize(streams: list[Stream], wall: float) -> dict[str, Any]:
    """Output tokens/s, TTFT and inter-token latency percentiles (seconds), errors."""
    ok = [s for s in streams if s.error is None]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    itls = [end - start for s in ok for start, end in s.gaps()]
    tokens = sum(s.tokens for s in ok)
    return {
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99),
        "errors": len(streams) - len(ok), "requests": len(streams), "tokens": tokens,
        "wall_s": wall,
    }


# --- the workload --------------------------------------------------------------------------


@dataclass
class Workload:
    """Every prompt of one repetition; the same for both servers and the ceiling."""

    serving: dict[int, list[Messages]]
    long_prompt: Messages
    new_ending: Messages
    stream_prompts: list[Messages]
    late_prompt: Messages  # the interference scenario's: no server has seen its prefix
    long_prompt_tokens: int


def long_text(tokenizer: Any, n_tokens: int, key: str) -> str:
    """About ``n_tokens`` tokens of prose that begins with ``key`` (unique per repetition)."""
    words = f"Document {tag(key)}. {PARAGRAPH * (n_tokens // 20 + 2)}"
    ids = tokenizer.encode(words, add_special_tokens=False)[:n_tokens]
    return tokenizer.decode(ids)


def tag(key: str) -> str:
    """A short hex tag that differs between keys from its first character on: a counter
    ("run-7-1", "run-7-2") would give every prompt a shared prefix that a server's prompt
    cache reuses, which unique prompts must not allow."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def make_workload(tokenizer: Any, args: argparse.Namespace, rep: int) -> Workload:
    key = f"{rep}-{int(time.time())}"
    serving = {
        c: [[{"role": "user", "content": SERVING_PROMPT.format(key=tag(f"{key}-{c}-{i}"))}]
            for i in range(c * args.requests_per_client)]
        for c in args.concurrency
    }
    text = long_text(tokenizer, args.long_tokens, key)
    long_prompt = [{"role": "user", "content": text + ENDINGS[0]}]
    new_ending = [{"role": "user", "content": text + ENDINGS[1]}]
    streams = [[{"role": "user", "content": STREAM_PROMPT.format(key=tag(f"{key}-{i}"))}]
               for i in range(args.streams)]
    late = [{"role": "user", "content": long_text(tokenizer, args.long_tokens, f"{key}-late")
             + ENDINGS[0]}]
    return Workload(serving, long_prompt, new_ending, streams, late,
                    len(chat_tokens(tokenizer, long_prompt)))


def chat_tokens(tokenizer: Any, messages: Messages) -> list[int]:
    """The prompt tokens a server makes of ``messages`` (transformers 5 returns a dict)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


# --- driving a server ----------------------------------------------------------------------


def client(total_timeout: float = 3600) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=total_timeout),
        connector=aiohttp.TCPConnector(limit=0),
    )


async def run_level(base: str, model: str, prompts: list[Messages], concurrency: int,
                    max_tokens: int) -> dict[str, Any]:
    """A closed loop: ``concurrency`` clients, each sending its next request when the last
    one finished, until the prompts run out."""
    url = f"{base}/v1/chat/completions"
    queue = list(reversed(prompts))
    streams: list[Stream] = []
    async with client() as session:

        async def one_client() -> None:
            while queue:
                streams.append(await stream_chat(session, url, model, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(streams, wall)


async def run_prefix(base: str, model: str, work: Workload) -> dict[str, Any]:
    """TTFT (s) of the long prompt cold, repeated, and with a new ending."""
    url = f"{base}/v1/chat/completions"
    out: dict[str, Any] = {"prompt_tokens": work.long_prompt_tokens}
    async with client() as session:
        for name, messages in (("cold", work.long_prompt), ("repeat", work.long_prompt),
                               ("new_ending", work.new_ending)):
            s = await stream_chat(session, url, model, messages, 4)
            out[name] = s.ttft if s.error is None else None
            if s.error:
                print(f"    prefix {name}: {s.error}", file=sys.stderr, flush=True)
    return out


async def run_interference(base: str, model: str, work: Workload,
                           args: argparse.Namespace) -> dict[str, Any]:
    """``--streams`` streams decode; once each has ``--warm-chunks`` chunks the long prompt
    arrives. Their gaps that overlap its prefill (sent → first token) are compared with
    their gaps before it arrived."""
    url = f"{base}/v1/chat/completions"
    streams = [Stream(sent=time.perf_counter()) for _ in work.stream_prompts]
    async with client() as session:
        tasks = [asyncio.create_task(stream_chat(session, url, model, m, args.stream_tokens, s))
                 for m, s in zip(work.stream_prompts, streams, strict=True)]

        async def until(cond: Callable[[], bool], timeout: float) -> None:
            deadline = time.perf_counter() + timeout
            while not cond() and time.perf_counter() < deadline:
                await asyncio.sleep(0.01)

        await until(lambda: all(s.done or len(s.chunk_times) >= args.warm_chunks
                                for s in streams), 1800)
        long = await stream_chat(session, url, model, work.late_prompt, 4)
        arrived, prefilled = long.sent, long.first_token
        if prefilled is not None:
            # One more chunk per live stream, so the gap that spans the prefill's end counts.
            await until(lambda: all(s.done or (s.chunk_times and s.chunk_times[-1] > prefilled)
                                    for s in streams), 300)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    before, during = split_gaps(streams, arrived,
                                prefilled if prefilled is not None else time.perf_counter())
    p50_before = percentile(before, 50)
    p99_during = percentile(during, 99)
    return {
        "long_ttft": long.ttft, "long_error": long.error,
        "streams_live": sum(1 for s in streams if s.chunk_times and s.chunk_times[-1] > arrived),
        "itl_p50_before": p50_before, "itl_p99_before": percentile(before, 99),
        "itl_p50_during": percentile(during, 50), "itl_p99_during": p99_during,
        "itl_max_during": max(during, default=None),
        "p99_during_over_p50_before": ratio(p99_during, p50_before),
        "errors": sum(1 for s in streams if s.error) + (1 if long.error else 0),
    }


def split_gaps(streams: list[Stream], arrived: float, prefilled: float
               ) -> tuple[list[float], list[float]]:
    """The streams' inter-token gaps (s) before the long prompt arrived (once every stream
    is decoding) and those that overlap its prefill, ``arrived`` to ``prefilled``: a stall
    that spans the whole prefill counts, however long."""
    steady_from = max((s.chunk_times[0] for s in streams if s.chunk_times), default=arrived)
    before = [b - a for s in streams for a, b in s.gaps() if a >= steady_from and b <= arrived]
    during = [b - a for s in streams for a, b in s.gaps() if b > arrived and a < prefilled]
    return before, during


# --- servers -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(base: str, proc: subprocess.Popen, deadline_s: float = 600) -> list[str]:
    """Wait until GET /v1/models answers; return the model ids it lists."""
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up (status {proc.returncode})")
            try:
                async with session.get(f"{base}/v1/models") as resp:
                    if resp.status == 200:
                        body = await resp.json(content_type=None)
                        return [m["id"] for m in (body or {}).get("data") or []]
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError("server did not start in time")


def server_command(name: str, model_dir: str, port: int, cache_dir: str,
                   args: argparse.Namespace) -> list[str]:
    if name in (TROUPE, BASELINE):
        extra = (args.baseline_args if name == BASELINE and args.baseline_args is not None
                 else args.troupe_args)
        # A checkout from before the folders installed as troupe.* serves as `api.cli`.
        root = Path(args.baseline) if name == BASELINE else REPO
        cli = "troupe.api.cli" if (root / "troupe").is_dir() else "api.cli"
        return [sys.executable, "-m", cli, "serve", "--model", model_dir, "--port",
                str(port), "--cache-dir", cache_dir, "--log-level", "warning",
                *shlex.split(extra)]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port",
            str(port), "--log-level", "WARNING", *shlex.split(args.peer_args)]


def start_py_spy(pid: int, path: Path, log: IO[str]) -> subprocess.Popen:
    """Sample a server's stacks, every thread, idle ones too (a thread inside MLX has let go
    of the GIL), into ``path`` as collapsed stacks ("frame;frame;... count" per line).
    Non-blocking: the server is never paused."""
    exe = Path(sys.executable).with_name("py-spy")
    cmd = [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid), "--format",
           "raw", "--rate", "50", "--nonblocking", "--threads", "--idle", "--output", str(path)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def cpu_seconds(pid: int) -> float | None:
    """CPU time a process has used so far (Linux /proc), None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


async def quiesce(pids: list[int], timeout: float = 60) -> None:
    """Wait until the servers are idle (under 5% of a core for half a second): work one left
    behind, such as KV blocks still going to disk, must not land on the next measurement."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = [cpu_seconds(p) for p in pids]
        await asyncio.sleep(0.5)
        after = [cpu_seconds(p) for p in pids]
        if any(b is None or a is None for a, b in zip(after, before, strict=True)):
            return
        if sum(a - b for a, b in zip(after, before, strict=True)) < 0.025:
            return


@dataclass
class Live:
    """A started server: where to send requests, and what to call the model."""

    name: str
    base: str
    model: str
    pid: int


@contextlib.asynccontextmanager
async def running(name: str, model_dir: str, args: argparse.Namespace,
                  rep: int) -> AsyncIterator[Live]:
    """Start a server (troupe with a fresh cache directory), warm it up, stop it after."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    out_dir = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="harness-cache-") as cache_dir, \
            open(out_dir / f"{name}-rep{rep}.log", "w") as log:
        # The environment the harness started with: not the JIT settings the in-process
        # ceiling put into this process (troupe makes its own; the peer runs MLX's).
        # `python -m` puts its working directory first on sys.path: the baseline's checkout
        # serves its own code (this venv's packages).
        cwd = args.baseline if name == BASELINE else REPO
        env = START_ENV if name == TROUPE else without_troupe_gemv(START_ENV)
        proc = subprocess.Popen(server_command(name, model_dir, port, cache_dir, args),
                                stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        spy = None
        try:
            ids = await wait_healthy(base, proc)
            if args.profile:
                spy = start_py_spy(proc.pid, out_dir / f"{name}-rep{rep}.pyspy.txt", log)
            # mlx_lm.server loads whatever the model field names: send the directory it serves.
            model = ids[0] if name in (TROUPE, BASELINE) and ids else model_dir
            await run_level(base, model, [[{"role": "user", "content": "Hello!"}]], 1, 8)
            yield Live(name, base, model, proc.pid)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                spy.wait(timeout=60)
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def bench_servers(names: list[str], model_dir: str, work: Workload,
                        args: argparse.Namespace, rep: int) -> dict[str, dict[str, Any]]:
    """Start every server, then run each step (a concurrency level, the prefix scenario, the
    interference scenario) on one server after the other, alternating which goes first.
    Idle servers cost nothing, and two measurements of a step minutes apart would each see
    a different load on a shared machine; a minute apart, much the same."""
    steps: list[tuple[str, int]] = []
    if "serving" in args.scenarios:
        steps += [("serving", c) for c in args.concurrency]
    steps += [(s, 0) for s in ("prefix", "interference") if s in args.scenarios]
    results: dict[str, dict[str, Any]] = {n: {"serving": {}} for n in names}
    kernels = troupe_kernels(args.troupe_args)
    ceiling = None if args.no_ceiling or "serving" not in args.scenarios \
        else load_ceiling(model_dir, kernels)
    if ceiling is not None:
        results[CEILING] = {"serving": {}}
    async with contextlib.AsyncExitStack() as stack:
        live = [await stack.enter_async_context(running(n, model_dir, args, rep)) for n in names]
        for i, (scenario, c) in enumerate(steps):
            for server in live if (rep + i) % 2 == 0 else live[::-1]:
                await quiesce([s.pid for s in live])
                results[server.name].setdefault("loadavg", os.getloadavg()[0])
                await run_step(server, scenario, c, work, args, rep, results[server.name])
            if scenario == "serving" and ceiling is not None:
                await quiesce([s.pid for s in live])
                # Blocks the event loop, on purpose: nothing else may run meanwhile.
                r = ceiling_level(*ceiling, work.serving[c], c, args.max_tokens,
                                  mixed=troupe_mixed(args.troupe_args))
                results[CEILING]["serving"][str(c)] = r
                print(f"  rep {rep} {CEILING:>13} c={c:<3} {fmt(r['tokens_per_s'], 1):>7} tok/s"
                      f"  TTFT p50 {ms(r['ttft_p50'])} p99 {ms(r['ttft_p99'])} ms", flush=True)
    return results


async def run_step(server: Live, scenario: str, c: int, work: Workload,
                   args: argparse.Namespace, rep: int, result: dict[str, Any]) -> None:
    """One scenario (at one concurrency for "serving") on one server, into ``result``."""
    base, model, tag = server.base, server.model, f"  rep {rep} {server.name:>13}"
    if scenario == "serving":
        result["serving"][str(c)] = r = await run_level(base, model, work.serving[c], c,
                                                        args.max_tokens)
        print(f"{tag} c={c:<3} {fmt(r['tokens_per_s'], 1):>7} tok/s"
              f"  TTFT p50 {ms(r['ttft_p50'])} p99 {ms(r['ttft_p99'])} ms"
              f"  ITL p50 {ms(r['itl_p50'])} p99 {ms(r['itl_p99'])} ms"
              f"  errors {r['errors']}", flush=True)
    elif scenario == "prefix":
        result["prefix"] = p = await run_prefix(base, model, work)
        print(f"{tag} prefix ({p['prompt_tokens']} tokens) TTFT cold {fmt(p['cold'])} s, "
              f"repeat {fmt(p['repeat'])} s, new ending {fmt(p['new_ending'])} s", flush=True)
    else:
        result["interference"] = i = await run_interference(base, model, work, args)
        print(f"{tag} {args.streams} streams, long prompt arrives: ITL p50 before "
              f"{ms(i['itl_p50_before'])} ms, during p50 {ms(i['itl_p50_during'])} p99 "
              f"{ms(i['itl_p99_during'])} ms (long TTFT {fmt(i['long_ttft'])} s)", flush=True)


# --- the in-process ceiling ----------------------------------------------------------------


def troupe_kernels(troupe_args: str) -> str:
    """The ``--cpu-kernels`` value in the flags passed to troupe (default native)."""
    words = shlex.split(troupe_args)
    for i, word in enumerate(words):
        if word.startswith("--cpu-kernels="):
            return word.split("=", 1)[1]
        if word == "--cpu-kernels" and i + 1 < len(words):
            return words[i + 1]
    return "native"


def troupe_mixed(troupe_args: str) -> bool:
    """Whether troupe runs mixed steps with the flags passed to it (default: yes)."""
    words = shlex.split(troupe_args)
    flags = [w for w in words if w in ("--mixed-step", "--no-mixed-step")]
    return not flags or flags[-1] == "--mixed-step"


def load_ceiling(model_dir: str, kernels: str = "native") -> tuple[Any, Any]:
    """The model and tokenizer, loaded in this process for the in-process ceiling, on the
    CPU kernels troupe serves with (``--troupe-args='--cpu-kernels mlx'`` gives MLX's to
    both), so the ceiling measures what serving costs, not the kernels."""
    from mlx_lm import load  # lazy: the harness drives servers without MLX loaded

    from troupe.actors.engine import cpu_kernels
    from troupe.actors.models.store import troupe_home

    cpu_kernels.enable(kernels, troupe_home())
    return load(model_dir)


def ceiling_level(model: Any, tok: Any, messages: list[Messages], concurrency: int,
                  max_tokens: int, *, mixed: bool = True) -> dict[str, Any]:
    """One serving level through troupe's batch runner directly (``actors.engine.runner``),
    batched as troupe batches, with mixed steps as troupe runs them, in a closed loop like the
    HTTP clients: the most any server could do on this machine, so that the ceiling measures
    what serving costs, not the step."""
    from mlx_lm.sample_utils import greedy_sampler

    from troupe.actors.config import ServeConfig
    from troupe.actors.engine.config import EngineConfig
    from troupe.actors.engine.runner import Runner

    cfg = ServeConfig().engine
    runner = Runner(model, EngineConfig(max_batch_size=cfg.max_batch_size,
                                        prefill_batch_size=cfg.prefill_batch_size,
                                        prefill_step_size=cfg.prefill_step_size,
                                        mixed_step=mixed))
    stop_ids = frozenset(tok.eos_token_ids)
    streams: dict[int, Stream] = {}
    pending = [chat_tokens(tok, m) for m in reversed(messages)]
    live = 0
    start = time.perf_counter()
    while pending or live:
        while pending and live < concurrency:
            uid = runner.insert([pending.pop()], max_tokens=max_tokens, cache=None, done=[],
                                sampler=greedy_sampler, processors=[], stop_ids=stop_ids)
            streams[uid] = Stream(sent=time.perf_counter())
            live += 1
        responses = runner.execute(runner.whole_chunks()).responses
        now = time.perf_counter()
        for resp in responses:
            s = streams[resp.uid]
            s.chunk_times.append(now)
            s.tokens += 1
            if resp.finish_reason is not None:
                live -= 1
    wall = time.perf_counter() - start
    runner.close()
    return summarize(list(streams.values()), wall)


# --- goals and the report ------------------------------------------------------------------


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f}"


def spread(median: float | None, per_rep: list[float | None]) -> str:
    """A ratio of medians, with the range of the per-repetition ratios when there are
    several: how much the machine's noise moved it."""
    values = [v for v in per_rep if v is not None]
    if median is None or len(values) < 2:
        return fmt(median)
    return f"{fmt(median)} ({fmt(min(values))}–{fmt(max(values))})"


def serving_ratios(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per concurrency: troupe/peer tokens/s and TTFT p99, troupe/ceiling tokens/s; with a
    baseline, its own ratios to the peer too (before and after, each against the peer of
    the same run)."""
    out = {}
    t = result.get(TROUPE, {}).get("serving", {})
    for c, tr in t.items():
        pr = result.get(PEER, {}).get("serving", {}).get(c, {})
        ce = result.get(CEILING, {}).get("serving", {}).get(c, {})
        out[c] = {
            "tokens_per_s_vs_peer": ratio(tr["tokens_per_s"], pr.get("tokens_per_s")),
            "ttft_p99_vs_peer": ratio(tr["ttft_p99"], pr.get("ttft_p99")),
            "tokens_per_s_vs_ceiling": ratio(tr["tokens_per_s"], ce.get("tokens_per_s")),
        }
        if ba := result.get(BASELINE, {}).get("serving", {}).get(c):
            out[c].update({
                "baseline_tokens_per_s_vs_peer": ratio(ba["tokens_per_s"],
                                                       pr.get("tokens_per_s")),
                "baseline_ttft_p99_vs_peer": ratio(ba["ttft_p99"], pr.get("ttft_p99")),
            })
    return out


def goals(med: dict[str, Any], ratios: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals, each with the measured value and whether it holds (None: not
    measured in this run)."""
    rows: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, ok: Callable[[float], bool]) -> None:
        rows.append({"goal": goal, "value": value,
                     "holds": None if value is None else bool(ok(value))})

    def r(c: int, key: str) -> float | None:
        return ratios.get(str(c), {}).get(key)

    add("tok/s vs mlx_lm.server at c=1 ≥ 1.0x", r(1, "tokens_per_s_vs_peer"),
        lambda v: v >= 1.0)
    for c in (16, 32):
        add(f"tok/s vs mlx_lm.server at c={c} ≥ 1.3x", r(c, "tokens_per_s_vs_peer"),
            lambda v: v >= 1.3)
    add("TTFT p99 vs mlx_lm.server at c=16 ≤ 0.25x", r(16, "ttft_p99_vs_peer"),
        lambda v: v <= 0.25)
    for c in sorted(ratios, key=int):
        add(f"tok/s vs in-process ceiling at c={c} ≥ 0.9x", r(int(c), "tokens_per_s_vs_ceiling"),
            lambda v: v >= 0.9)
    tp, pp = med.get(TROUPE, {}).get("prefix", {}), med.get(PEER, {}).get("prefix", {})
    for case in ("repeat", "new_ending"):
        add(f"long prompt, {case.replace('_', ' ')}: TTFT vs mlx_lm.server ≤ 1.0x",
            ratio(tp.get(case), pp.get(case)), lambda v: v <= 1.0)
    ti = med.get(TROUPE, {}).get("interference", {})
    add("ITL p99 of decoding streams during a long prefill ≤ 3x their median",
        ti.get("p99_during_over_p50_before"), lambda v: v <= 3.0)
    return rows


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown tables: what docs/benchmarks.md shows."""
    med, meta = report["median"], report["meta"]
    lines = [
        f"Model `{meta['model']}`, BLAS {meta['blas']}, {meta['cpus']} CPUs ({meta['cpu']}), "
        f"load average {fmt(meta['loadavg_start'])} at start, {fmt(meta['loadavg_end'])} at "
        f"end; {meta['reps']} repetition(s), medians; {meta['requests_per_client']} requests per "
        f"client, {meta['max_tokens']} new tokens each, greedy. Run took "
        f"{meta['wall_s'] / 60:.1f} min.",
        "",
        "| server | concurrency | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) "
        "| ITL p50 (ms) | ITL p99 (ms) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels = {CEILING: "in-process runner (ceiling)",
              BASELINE: f"mlx-troupe at {meta.get('baseline_rev')} (baseline)"}
    for name in (*SERVERS, CEILING):
        for c, r in med.get(name, {}).get("serving", {}).items():
            label = labels.get(name, name)
            lines.append(f"| {label} | {c} | {fmt(r['tokens_per_s'], 1)} | {ms(r['ttft_p50'])} "
                         f"| {ms(r['ttft_p99'])} | {ms(r['itl_p50'])} | {ms(r['itl_p99'])} "
                         f"| {r['errors']:.0f} |")
    if report["ratios"]:
        lines += ["", "| concurrency | troupe / mlx_lm.server tok/s | troupe / mlx_lm.server "
                  "TTFT p99 | troupe / ceiling tok/s |", "|---|---|---|---|"]
        for c, r in report["ratios"].items():
            cells = [spread(r[k], [p.get(c, {}).get(k) for p in report["ratios_per_rep"]])
                     for k in ("tokens_per_s_vs_peer", "ttft_p99_vs_peer",
                               "tokens_per_s_vs_ceiling")]
            lines.append(f"| {c} | {' | '.join(cells)} |")
    if any("baseline_tokens_per_s_vs_peer" in r for r in report["ratios"].values()):
        lines += ["", f"| concurrency | tok/s / mlx_lm.server: troupe | at "
                  f"{meta.get('baseline_rev')} | TTFT p99 / mlx_lm.server: troupe | at "
                  f"{meta.get('baseline_rev')} |", "|---|---|---|---|---|"]
        for c, r in report["ratios"].items():
            cells = [spread(r.get(k), [p.get(c, {}).get(k) for p in report["ratios_per_rep"]])
                     for k in ("tokens_per_s_vs_peer", "baseline_tokens_per_s_vs_peer",
                               "ttft_p99_vs_peer", "baseline_ttft_p99_vs_peer")]
            lines.append(f"| {c} | {' | '.join(cells)} |")
    if prefixes := [med[n]["prefix"] for n in SERVERS if "prefix" in med.get(n, {})]:
        tokens = prefixes[0]["prompt_tokens"]
        lines += ["", f"| server | {tokens:.0f}-token prompt TTFT: cold (s) | repeated (s) "
                  "| new ending (s) |", "|---|---|---|---|"]
        for name in SERVERS:
            if p := med.get(name, {}).get("prefix"):
                lines.append(f"| {labels.get(name, name)} | {fmt(p['cold'])} | {fmt(p['repeat'])} "
                             f"| {fmt(p['new_ending'])} |")
    if any("interference" in med.get(n, {}) for n in SERVERS):
        lines += ["", f"| server | {meta['streams']} streams' ITL before (p50 / p99 ms) "
                  "| during the long prefill (p50 / p99 / max ms) | p99 during / p50 before "
                  "| long prompt TTFT (s) |", "|---|---|---|---|---|"]
        for name in SERVERS:
            if i := med.get(name, {}).get("interference"):
                lines.append(
                    f"| {labels.get(name, name)} "
                    f"| {ms(i['itl_p50_before'])} / {ms(i['itl_p99_before'])} "
                    f"| {ms(i['itl_p50_during'])} / {ms(i['itl_p99_during'])} / "
                    f"{ms(i['itl_max_during'])} | {fmt(i['p99_during_over_p50_before'], 1)} "
                    f"| {fmt(i['long_ttft'])} |")
    lines += ["", "| goal | measured | holds |", "|---|---|---|"]
    for g in report["goals"]:
        holds = {True: "yes", False: "**no**", None: "not measured"}[g["holds"]]
        lines.append(f"| {g['goal']} | {fmt(g['value'], 3)} | {holds} |")
    return "\n".join(lines) + "\n"


# --- main ----------------------------------------------------------------------------------


def same_blas_as_troupe_serve() -> None:
    """Re-execute with OpenBLAS preloaded when ``troupe serve`` would preload it, so both
    servers (which inherit the environment) and the in-process ceiling use the same BLAS."""
    from troupe.actors.models.blas import preload_command

    # The script being run (sys.argv[0]): other benchmarks call this too.
    plan = preload_command([str(Path(sys.argv[0]).resolve()), *sys.argv[1:]])
    if plan is not None:
        os.execve(sys.executable, *plan)


def blas_name() -> str:
    """The BLAS this process preloads; the other servers a benchmark starts get it without
    troupe's matrix-vector product (``without_troupe_gemv``)."""
    preload = os.environ.get("LD_PRELOAD", "").split()
    openblas = next((p for p in preload if "openblas" in p), None)
    if openblas is None:
        return "the default MLX links (no preload)"
    gemv = any(GEMV_LIB in p for p in preload)
    return f"OpenBLAS ({openblas})" + (" with troupe's matrix-vector product" if gemv else "")


def resolve_default_model() -> str:
    out = subprocess.run([sys.executable, "-m", "troupe.api.cli", "pull"], check=True, cwd=REPO,
                         capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("1,4,16")."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32],
                   help="comma-separated client counts (default: 1,4,16,32)")
    p.add_argument("--requests-per-client", type=int, default=2,
                   help="requests each client sends, one after the other (default: 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per serving request")
    p.add_argument("--long-tokens", type=int, default=2000, help="the long prompt's length")
    p.add_argument("--streams", type=int, default=8, help="streams decoding when it arrives")
    p.add_argument("--warm-chunks", type=int, default=8,
                   help="chunks each stream has had before the long prompt is sent")
    p.add_argument("--stream-tokens", type=int, default=2048,
                   help="max_tokens of those streams (they are cancelled once it is prefilled)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; figures are medians")
    p.add_argument("--scenarios", type=lambda s: s.split(","),
                   default=["serving", "prefix", "interference"])
    p.add_argument("--no-peer", action="store_true", help="skip mlx_lm.server")
    p.add_argument("--no-ceiling", action="store_true", help="skip the in-process ceiling")
    p.add_argument("--baseline", metavar="DIR",
                   help="also serve troupe from this checkout of another commit (git worktree "
                   "add DIR REV), in the same run: before and after, side by side")
    p.add_argument("--troupe-args", default="",
                   help="extra `troupe serve` flags, with '=': --troupe-args='--block-size 0'")
    p.add_argument("--baseline-args", default=None,
                   help="the baseline's `troupe serve` flags instead of --troupe-args, with "
                        "'=': with --baseline at the same commit, a setting against another "
                        "(--baseline-args='--speculative off')")
    p.add_argument("--peer-args", default="",
                   help="extra mlx_lm.server flags, with '=': --peer-args='--temp 0'")
    p.add_argument("--profile", action="store_true",
                   help="record each server with py-spy (pip install py-spy) into --out")
    p.add_argument("--out", default="bench-results", help="directory for results and logs")
    p.add_argument("--from-json", metavar="PATH",
                   help="run nothing: rewrite the Markdown and PNG of a saved harness.json")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every repetition, then medians, ratios and goals. The report (JSON, Markdown, PNG) is
    rewritten after each repetition, so a run cut short still leaves what it measured."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    model_dir = str(Path(args.model).resolve()) if args.model else resolve_default_model()
    from transformers import AutoTokenizer  # lazy and MLX-free: only to size the prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    servers = [TROUPE, *([BASELINE] if args.baseline else []), *([] if args.no_peer else [PEER])]
    if args.baseline:
        args.baseline = str(Path(args.baseline).resolve())
        baseline_rev = subprocess.run(["git", "-C", args.baseline, "rev-parse", "--short",
                                       "HEAD"], check=True, capture_output=True,
                                      text=True).stdout.strip()
    reps: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for rep in range(args.reps):
        work = make_workload(tokenizer, args, rep)
        reps.append(asyncio.run(bench_servers(servers, model_dir, work, args, rep)))
        meta = {
            "model": model_dir, "blas": blas_name(), "cpus": os.cpu_count(), "cpu": cpu_model(),
            "python": platform.python_version(), "mlx": version("mlx"),
            "mlx_lm": version("mlx-lm"), "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0], "wall_s": time.perf_counter() - started,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": shlex.join(sys.argv),
            **{k: v for k, v in vars(args).items() if k != "model"},
            "reps": len(reps), "reps_asked": args.reps,
            "rev": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                  capture_output=True, text=True).stdout.strip(),
            **({"baseline_rev": baseline_rev} if args.baseline else {}),
        }
        report = write_report(Path(args.out), meta, reps)
    return report


def write_report(out: Path, meta: dict[str, Any], reps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians, ratios and goals of ``reps``, written as harness.json, .md and .png."""
    med = median_tree(reps)
    ratios = serving_ratios(med)
    report = {
        "meta": meta,
        "median": med,
        "ratios": ratios,
        "ratios_per_rep": [serving_ratios(r) for r in reps],
        "goals": goals(med, ratios),
        "reps": reps,
    }
    (out / "harness.json").write_text(json.dumps(report, indent=2))
    (out / "harness.md").write_text(markdown(report))
    from plot import plot  # beside this file; imports matplotlib

    plot(report, out / "harness.png")
    return report


def main() -> None:
    args = parse_args()
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_report(out, report["meta"], report["reps"])
        print((out / "harness.md").read_text())
        return
    same_blas_as_troupe_serve()
    # SIGTERM unwinds like an exception, so the servers this run started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(args)
    print()
    print((Path(args.out) / "harness.md").read_text())
    print(f"wrote {args.out}/harness.json, harness.md, harness.png "
          f"({report['meta']['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    main()
