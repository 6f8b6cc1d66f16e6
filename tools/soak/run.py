"""The run: the phases in order, the checkpoint after each (health, greedy answers, 5xx
counted by the server, actor restarts, corrupt blocks loaded, RSS and fds, the ledger, crashes
in the logs), and ``troupe soak``'s command line (``main``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from troupe.tools.soak import faults
from troupe.tools.soak.clients import Clients
from troupe.tools.soak.corpus import (
    Case,
    build_corpus,
)
from troupe.tools.soak.faults import CacheDisk
from troupe.tools.soak.judge import FAILED, Ledger, Record, json_or_none
from troupe.tools.soak.report import build_report, markdown, write_report
from troupe.tools.soak.server import Server, free_port, proc_usage
from troupe.tools.soak.settings import (
    CACHE_RAM_MAX,
    CONCURRENCY_LEVELS,
    CORPUS_EVERY_S,
    CORPUS_IN_FLIGHT,
    CRASH_MARKS,
    DEFAULT_MINUTES,
    FD_SLACK,
    MAX_BODY_BYTES,
    MAX_CONCURRENCY,
    MIN_PHASE_S,
    MIN_RATE,
    RELEASE_WAIT_S,
    RSS_SLACK,
    SHUTDOWN_GRACE_S,
)
from troupe.tools.soak.traffic import FAMILIES, LOAD_MIX, Traffic

# (phase, weight): a phase's share of the traffic time. Faults: one per phase after "burst".
PLAN = (("baseline", 1), ("load", 4), ("burst", 1), ("disk_full", 1), ("disk_deleted", 1),
        ("disk_readonly", 1), ("disk_corrupt", 1), ("kill9", 1), ("sigterm", 1), ("final", 1))
RESTARTING = ("kill9", "sigterm")


@dataclass
class Phase:
    """One phase as it ran: its traffic time, the fault it injected, what was checked after."""

    name: str
    started: float
    seconds: float
    ended: float = 0.0
    fault: dict[str, Any] | None = None
    checks: dict[str, Any] = field(default_factory=dict)
    concurrency_max: int = 0  # model requests in flight at once, at most

    def inject(self, name: str, **evidence: Any) -> dict[str, Any]:
        self.fault = {"name": name, "injected": True, "skipped": None, "evidence": evidence}
        return self.fault["evidence"]

    def skip(self, name: str, reason: str) -> None:
        self.fault = {"name": name, "injected": False, "skipped": reason, "evidence": {}}


class Soak:
    """The whole run: the server, its disk, the ledger, the phases, the checks, the report."""

    def __init__(self, minutes: float, out: Path, model: str | None, seed: int,
                 port: int, command: str = "troupe soak") -> None:
        self.minutes = minutes
        self.command = command
        self.out = out
        self.seed = seed
        self.rng = random.Random(seed)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + minutes * 60
        self.ledger = Ledger(self.clock)
        self.disk = CacheDisk(out)
        self.server = Server(out, port or free_port(), model, self.disk.dir)
        self.traffic = Traffic(model or "")
        self.corpus: list[Case] = []
        self.corpus_next = 0
        self.corpus_seen: dict[str, Counter[int]] = {}
        self.phases: list[Phase] = []
        self.failures: list[str] = []
        self.samples: list[tuple[float, int, str, float, int]] = []
        self.reference: list[str] | None = None
        self.baseline: dict[str, float] | None = None
        # RSS at the first start, and after the load once the idle engine gave memory back.
        self.rss: dict[str, Any] = {}
        self.bursts: list[dict[str, Any]] = []
        self.killed: set[int] = set()
        self.terminating: set[int] = set()
        self.counters: dict[int, dict[str, Any]] = {}
        self.crashes_seen: dict[Path, int] = {}
        self.loaded_seen: set[Path] = set()
        self.current = "start"
        self.check_s = 8.0  # a checkpoint's time, then as measured
        self.start_s = 15.0  # a restart's time, then as measured
        self.first_start_s = 0.0
        # Requests to the model in flight, the most at once this phase, and the answers per
        # second the server has kept up: how long what is in flight will take to drain.
        self.busy = 0
        self.busy_peak = 0
        self.capacity = 1.0

    def clock(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.t0

    def fail(self, phase: str, message: str) -> None:
        self.failures.append(f"{phase}: {message}")

    def reached(self, phase: Phase, reached: bool) -> None:
        """Record whether the phase's fault had its effect: one that never did tested
        nothing, and fails the run as surely as a server that did not survive it."""
        assert phase.fault is not None
        phase.fault["evidence"]["exercised"] = reached
        if not reached:
            self.fail(phase.name, f"fault {phase.fault['name']} injected, but its effect was "
                                  f"never seen: {phase.fault['evidence']}")

    def broken(self, record: Record, exc: BaseException) -> None:
        """A request whose connection failed. On an instance the soak killed, that is the
        fault it injected; anywhere else (a stream cut by SIGTERM included) it is lost."""
        if record.outcome is not None:
            return
        detail = f"{type(exc).__name__}: {exc}"
        if record.instance in self.killed:
            self.ledger.close(record, "killed", detail=detail)
        else:
            self.ledger.close(record, "lost", detail=detail)

    # -- the server's side --

    async def get_json(self, path: str) -> Any:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(self.server.base + path) as resp:
                resp.raise_for_status()
                return await resp.json(content_type=None)

    async def health(self) -> bool:
        try:
            return (await self.get_json("/health")) == {"status": "ok"}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return False

    async def writer(self) -> dict[str, Any]:
        """The SSD writer's report (counters of the running instance)."""
        return (await self.get_json("/actors/ssd_writer"))["report"]

    async def snapshot(self) -> dict[str, Any]:
        """The running instance's counters: the cache actors' reports, admission's, and the
        5xx answers /metrics counted. Kept per instance (each restart starts from zero)."""
        actors = {a["name"]: a for a in await self.get_json("/actors")}
        errors = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(self.server.base + "/metrics") as resp:
                for line in (await resp.text()).splitlines():
                    if line.startswith("troupe_http_requests_total{") and 'status="5' in line \
                            and 'status="503"' not in line:
                        errors += int(float(line.rsplit(" ", 1)[1]))
        snap = {
            "ssd_writer": actors.get("ssd_writer", {}).get("report", {}),
            "cache_index": actors.get("cache_index", {}).get("report", {}),
            "admission": actors.get("admission", {}).get("report", {}),
            "restarts": {name: a.get("restarts", 0) for name, a in actors.items()},
            "server_5xx": errors,
        }
        self.counters[self.server.instance] = snap
        return snap

    async def sample_resources(self) -> None:
        """RSS and open fds of the server every second, for the report and the plot."""
        while True:
            pid = self.server.pid
            usage = proc_usage(pid) if pid else None
            if usage is not None:
                self.samples.append((round(self.clock(), 2), self.server.instance, self.current,
                                     round(usage[0] / 2**20, 1), usage[1]))
            await asyncio.sleep(1.0)

    # -- traffic --

    def drains_by(self, end: float) -> bool:
        """Whether one more request would still be answered by ``end`` at the pace the
        server has kept: a phase adds no work its time cannot drain (machines differ)."""
        return time.monotonic() + (self.busy + 1) / max(self.capacity, MIN_RATE) <= end

    def next_case(self) -> Case:
        case = self.corpus[self.corpus_next % len(self.corpus)]
        self.corpus_next += 1
        return case

    async def run_traffic(self, clients: Clients, seconds: float, *,
                      levels: tuple[int, ...] = CONCURRENCY_LEVELS,
                      mix: dict[str, float] | None = None,
                      stop: asyncio.Event | None = None, corpus: bool = True) -> None:
        """Closed-loop clients for ``seconds`` (or until ``stop``): their number steps through
        ``levels``, each drawing requests from ``mix``; the corpus replayed beside them.
        Returns once every request started has its outcome."""
        mix = mix or LOAD_MIX
        end = time.monotonic() + seconds
        stop = stop or asyncio.Event()
        level = levels[0]
        kinds, weights = list(mix), list(mix.values())

        def going() -> bool:
            return not stop.is_set() and time.monotonic() < end

        async def client(i: int) -> None:
            rng = random.Random(f"{self.seed}:{clients.phase}:{i}")
            while going():
                if i >= level or not self.drains_by(end):
                    await asyncio.sleep(0.25)
                    continue
                await clients.send(self.traffic.spec(rng.choices(kinds, weights)[0], rng))

        async def pace() -> None:
            nonlocal level
            step = max(1.0, seconds / len(levels))
            while True:
                for n in levels:
                    level = n
                    await asyncio.sleep(step)

        async def replay() -> None:
            sent: set[asyncio.Task[Record]] = set()
            while going():
                if len(sent) < CORPUS_IN_FLIGHT:  # a case that reaches the model may queue
                    task = asyncio.create_task(clients.replay(self.next_case()))
                    sent.add(task)
                    task.add_done_callback(sent.discard)
                await asyncio.sleep(CORPUS_EVERY_S)
            await asyncio.gather(*sent)

        pacer = asyncio.create_task(pace())
        try:
            await asyncio.gather(*(client(i) for i in range(max(levels))),
                                 *([replay()] if corpus else []))
        finally:
            pacer.cancel()


    # -- phases and checks --

    def phase_seconds(self, name: str) -> float:
        """This phase's traffic time: its weight's share of what the budget has left once
        the remaining checkpoints and restarts are paid for."""
        names = [n for n, _ in PLAN]
        rest = PLAN[names.index(name):]
        overhead = len(rest) * self.check_s + sum(n in RESTARTING for n, _ in rest) * self.start_s
        left = self.deadline - time.monotonic() - overhead
        weight = dict(PLAN)[name]
        return max(MIN_PHASE_S, left * weight / sum(w for _, w in rest))

    @contextlib.asynccontextmanager
    async def phase(self, name: str) -> AsyncIterator[tuple[Phase, Clients]]:
        """Run a phase: the caller's traffic and fault, then the checkpoint."""
        phase = Phase(name, self.clock(), self.phase_seconds(name))
        self.current = name
        self.busy_peak = self.busy
        async with Clients(self, name) as clients:
            yield phase, clients
        phase.concurrency_max = self.busy_peak
        began = time.monotonic()
        phase.checks = await self.checkpoint(phase)
        self.check_s = time.monotonic() - began
        phase.checks["checkpoint_s"] = round(self.check_s, 1)
        phase.ended = self.clock()
        self.phases.append(phase)

    async def held_back(self, phase: str) -> list[str]:
        """The held-back prompts' greedy answers, one at a time, on a quiet server."""
        answers = []
        async with Clients(self, phase) as clients:
            for spec in self.traffic.held_back():
                assert clients.session is not None
                record = self.ledger.open(phase, spec.kind, None, self.server.instance)
                try:
                    async with clients.session.post(self.server.base + spec.path,
                                                    json=spec.body) as resp:
                        body = json_or_none(await resp.read())
                        status = resp.status
                except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                    self.broken(record, exc)
                    answers.append(f"<{type(exc).__name__}>")
                    continue
                if status != 200 or not isinstance(body, dict):
                    self.ledger.close(record, "server_error" if status >= 500 else "bad_answer",
                                      status=status, detail=f"held-back prompt: HTTP {status}")
                    answers.append(f"<HTTP {status}>")
                    continue
                if spec.shape == "openai":
                    text = body["choices"][0]["message"]["content"]
                else:
                    text = "".join(b.get("text", "") for b in body["content"])
                self.ledger.close(record, "complete", status=200)
                answers.append(text)
        return answers

    async def checkpoint(self, phase: Phase) -> dict[str, Any]:
        """The checks after every phase; each failure is recorded, none stops the run."""
        name = phase.name
        checks: dict[str, Any] = {}
        # The phase's connections are closed; give the server a moment to see it.
        await asyncio.sleep(0.5)
        checks["health"] = await self.health()
        if not checks["health"]:
            self.fail(name, "GET /health did not answer {'status': 'ok'}")
        answers = await self.held_back(name)
        if self.reference is None:
            self.reference = answers
        changed = [i for i, (a, b) in enumerate(zip(answers, self.reference, strict=True))
                   if a != b]
        checks["greedy_identical"] = not changed
        for i in changed:
            self.fail(name, f"held-back prompt {i}'s greedy answer changed: "
                            f"{self.reference[i]!r} -> {answers[i]!r}")
        snap = await self.snapshot()
        checks["server_5xx"] = snap["server_5xx"]
        if snap["server_5xx"]:
            self.fail(name, f"the server counted {snap['server_5xx']} 5xx answers (not 503) "
                            f"in instance {self.server.instance}")
        restarted = {name: n for name, n in snap["restarts"].items() if n}
        checks["actor_restarts"] = sum(restarted.values())
        if restarted:
            self.fail(name, f"actors crashed and were restarted: {restarted}")
        checks["corrupt_loaded"] = self.check_corrupt_loaded(name)
        # RSS is read once the quiet engine gave back what the phase freed, at every check
        # alike: the baseline's bound means nothing against a reading taken before it.
        await asyncio.sleep(RELEASE_WAIT_S)
        checks.update(self.check_resources(name))
        checks.update(self.check_ledger(name))
        checks["log_crashes"] = self.check_logs(name)
        return checks

    def check_corrupt_loaded(self, phase: str) -> int:
        """Damaged files the server served since the last look (``CacheDisk.corrupt_loaded``):
        each fails the run."""
        loaded = [c for c in self.disk.corrupt_loaded() if c.path not in self.loaded_seen]
        for c in loaded:
            self.loaded_seen.add(c.path)
            self.fail(phase, f"a corrupt block was loaded ({c.how}): {c.path.name}")
        return len(loaded)

    def check_logs(self, phase: str) -> int:
        """Crashes the server's logs show that no client saw (a traceback, an abort at
        exit), new since the last look; each fails the run."""
        found = 0
        for log in self.server.logs:
            try:
                lines = log.read_text(errors="replace").splitlines()
            except OSError:
                continue
            hits = [i for i, line in enumerate(lines) if any(m in line for m in CRASH_MARKS)]
            new = hits[self.crashes_seen.get(log, 0):]
            self.crashes_seen[log] = len(hits)
            for i in new:
                context = lines[i - 1] if i and "Traceback" in lines[i] else lines[i]
                self.fail(phase, f"{log.name}: {lines[i].strip()[:80]} after {context[:200]!r}")
            found += len(new)
        return found

    def check_resources(self, phase: str) -> dict[str, Any]:
        """RSS and open fds of the quiet server against bounds set from the warm baseline.

        The baseline is taken after the first phase, which has run every kind of request at
        the largest concurrency: the model is loaded, MLX's buffer cache and the grammar
        compiler have their working size. From there a server that does not leak stays flat
        at quiet points. RSS may grow by the RAM cache's budget (it fills over the run) plus
        RSS_SLACK of the baseline (allocator fragmentation, MLX's buffer cache at a larger
        batch); fds by FD_SLACK (log files, the odd connection still closing)."""
        pid = self.server.pid
        usage = proc_usage(pid) if pid else None
        if usage is None:
            self.fail(phase, "the server process is gone")
            return {"rss_mb": None, "fds": None}
        rss_mb, fds = usage[0] / 2**20, usage[1]
        if self.baseline is None:
            self.baseline = {"rss_mb": rss_mb, "fds": fds,
                             "rss_bound_mb": rss_mb * (1 + RSS_SLACK) + CACHE_RAM_MAX / 2**20,
                             "fd_bound": fds + FD_SLACK}
        within = rss_mb <= self.baseline["rss_bound_mb"] and fds <= self.baseline["fd_bound"]
        if not within:
            self.fail(phase, f"resources past their bound: RSS {rss_mb:.0f} MB (bound "
                             f"{self.baseline['rss_bound_mb']:.0f}), {fds} fds (bound "
                             f"{self.baseline['fd_bound']})")
        return {"rss_mb": round(rss_mb, 1), "fds": fds, "resources_within_bounds": within}

    def check_ledger(self, phase: str) -> dict[str, Any]:
        """Every request of the phase has exactly one outcome, and none failed."""
        records = self.ledger.of_phase(phase)
        for r in records:
            if r.outcome is None:
                self.ledger.close(r, "lost", detail="no outcome by the end of its phase")
        outcomes = Counter(r.outcome for r in records)
        failed = [r for r in records if r.outcome in FAILED]
        if failed:
            kinds = Counter(f"{r.outcome}/{r.kind}" for r in failed)
            self.fail(phase, f"{len(failed)} requests failed ({dict(kinds)}); first: "
                             f"{failed[0].detail}")
        return {"requests": len(records), "outcomes": dict(outcomes), "failed": len(failed)}


    async def phase_baseline(self) -> None:
        async with self.phase("baseline") as (phase, clients):
            rng = random.Random(f"{self.seed}:warm")
            # Every kind of request once, every family's blocks cached, the whole corpus.
            await asyncio.gather(
                *(clients.send(self.traffic.spec(kind, rng))
                  for kind in ("chat", "messages", "tools", "json", "unique")),
                *(clients.send(self.traffic.probe(i)) for i in range(FAMILIES)),
                *(clients.replay(case) for case in self.corpus))
            # The load's mix at its largest concurrency once, so that the warm baseline has
            # seen what the load does to memory (MLX's buffer cache keeps its high water).
            kinds = [kind for kind in LOAD_MIX if kind != "idle"]
            weights = [LOAD_MIX[kind] for kind in kinds]
            await asyncio.gather(*(clients.send(self.traffic.spec(rng.choices(kinds, weights)[0],
                                                                  rng))
                                   for _ in range(MAX_CONCURRENCY)))
            await self.run_traffic(clients, phase.seconds, levels=(1, 8))

    async def phase_load(self) -> None:
        async with self.phase("load") as (phase, clients):
            await self.run_traffic(clients, phase.seconds)
        await self.released_rss()

    async def released_rss(self) -> None:
        """The quiet server's RSS once its engine has given back the memory the load left
        (MLX's buffer cache, the C heap's free pages: the phase's checks waited for it), and
        how often it did."""
        report = (await self.get_json("/actors/scheduler"))["report"]
        usage = proc_usage(self.server.pid) if self.server.pid else None
        self.rss["after_load_mb"] = round(usage[0] / 2**20, 1) if usage else None
        self.rss["memory_releases"] = report.get("memory_releases")


    async def phase_final(self) -> None:
        async with self.phase("final") as (phase, clients):
            await self.run_traffic(clients, phase.seconds, levels=(8, 32, 1))

    async def run(self) -> dict[str, Any]:
        """Every phase, then the report; the server stopped and the disk put back whatever
        happens."""
        self.out.mkdir(parents=True, exist_ok=True)
        sampler: asyncio.Task[None] | None = None
        started = time.time()
        try:
            self.disk.setup()
            self.first_start_s = await self.server.start()
            usage = proc_usage(self.server.pid) if self.server.pid else None
            self.rss["start_mb"] = round(usage[0] / 2**20, 1) if usage else None
            # The budget counts from here: a first start may convert the model first.
            self.t0 = time.monotonic()
            self.deadline = self.t0 + self.minutes * 60
            models = await self.get_json("/v1/models")
            self.traffic = Traffic(models["data"][0]["id"])
            self.corpus = build_corpus(self.traffic.model, MAX_BODY_BYTES)
            self.corpus_seen = {case.name: Counter() for case in self.corpus}
            sampler = asyncio.create_task(self.sample_resources())
            for run_phase in (Soak.phase_baseline, Soak.phase_load, faults.phase_burst,
                              faults.phase_disk_full, faults.phase_disk_deleted,
                              faults.phase_disk_readonly, faults.phase_disk_corrupt,
                              faults.phase_kill9, faults.phase_sigterm, Soak.phase_final):
                await run_phase(self)
            self.current = "stop"
            self.terminating.add(self.server.instance)
            code = await self.server.terminate(SHUTDOWN_GRACE_S + 60)
            if code != 0:
                self.fail("final", f"exit status {code} on the final SIGTERM (expected 0)")
            self.check_logs("stop")
            self.check_corrupt_loaded("stop")
        except Exception as exc:  # the soak cannot go on: say why, and still report
            self.fail(self.current, f"the run stopped: {type(exc).__name__}: {exc}")
        finally:
            if sampler is not None:
                sampler.cancel()
            if self.server.pid is not None:
                await self.server.kill()
            self.disk.teardown()
        self.failures += [f"ledger: {v}" for v in self.ledger.violations]
        return build_report(self, started)


# --- command line ----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="troupe soak",
        description="A bounded soak-and-fault run against a real `troupe serve` (see "
                    "docs/reliability.md). Exit status 1 when anything failed.")
    p.add_argument("--minutes", type=float, default=DEFAULT_MINUTES,
                   help=f"the run's budget, after the server's first start "
                        f"(default: {DEFAULT_MINUTES:g})")
    p.add_argument("--out", default="soak-results",
                   help="directory for soak.json, soak.md, soak.png and the server logs")
    p.add_argument("--model", default=None, help="model to serve (default: the bundled one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic's draws")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``troupe soak``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.minutes <= 0:
        build_parser().error("--minutes must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["troupe", "soak", *(sys.argv[1:] if argv is None else argv)])
    soak = Soak(args.minutes, out, args.model, args.seed, args.port, command)
    print(f"troupe soak: {args.minutes:g} minutes, results in {out}/", file=sys.stderr)
    report = asyncio.run(soak.run())
    write_report(report, out)
    print(markdown(report).split("## Phases")[0].rstrip(), file=sys.stderr)
    status = "passed" if report["passed"] else f"FAILED ({len(report['failures'])} failures)"
    print(f"troupe soak {status}: {out / 'soak.md'}", file=sys.stderr)
    return 0 if report["passed"] else 1
