"""The faults: the cache directory damaged while serving (``CacheDisk``: filled to ENOSPC,
deleted, made read-only, its block files corrupted) and the fault phases, each a function of
the run (a burst past the queue, the disk faults, ``kill -9`` while writing, SIGTERM with
streams in flight), with the evidence that each fault was reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from troupe.tools.soak.clients import Clients
from troupe.tools.soak.corpus import (
    CHAT,
    MESSAGES,
)
from troupe.tools.soak.settings import (
    BURST,
    FAULT_WINDOW_S,
    MIN_PHASE_S,
    SHUTDOWN_GRACE_S,
    TMPFS_BYTES,
)
from troupe.tools.soak.traffic import FAMILIES, WRITE_MIX, Spec

if TYPE_CHECKING:
    from troupe.tools.soak.run import Soak


@dataclass(slots=True)
class Corruption:
    """A block file the soak damaged: how, and what it held and when, right after."""

    path: Path
    how: str  # "truncate", "garbage" (every byte) or "flip" (tensor bytes only, header intact)
    digest: str
    mtime_ns: int


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CacheDisk:
    """The server's cache directory: on a small tmpfs of its own when run as root (so that
    it can fill up and be remounted read-only), else a plain directory under --out."""

    def __init__(self, out: Path) -> None:
        self.mount = out / "cache-mount"
        self.dir = self.mount / "kv"
        self.tmpfs = False  # the cache was put on a tmpfs of its own
        self.mounted = False
        self.tmpfs_reason: str | None = None
        self.filler = self.mount / "filler"
        self.corruptions: list[Corruption] = []
        self._chmodded: list[Path] = []
        self._readonly_remount = False

    def setup(self) -> None:
        self.mount.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.tmpfs_reason = "not root: cannot mount a tmpfs"
        elif shutil.which("mount") is None:
            self.tmpfs_reason = "no mount command"
        else:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755", "tmpfs",
                 str(self.mount)], capture_output=True, text=True)
            self.tmpfs = self.mounted = done.returncode == 0
            if not self.tmpfs:
                self.tmpfs_reason = f"mount -t tmpfs failed: {done.stderr.strip()[:200]}"
        self.dir.mkdir(parents=True, exist_ok=True)

    def teardown(self) -> None:
        """Put everything back: writable, unmounted, the cache's files gone (hundreds of MB
        that no later run reads). Safe to call more than once."""
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            self.set_writable()
        if self.mounted:
            done = subprocess.run(["umount", str(self.mount)], capture_output=True)
            if done.returncode != 0:  # still busy (a server that would not die): detach it
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)
            self.mounted = False
        shutil.rmtree(self.mount, ignore_errors=True)

    # -- faults --

    def fill(self) -> int:
        """Fill the file system with one file until it is full (ENOSPC); its size."""
        written = 0
        block = b"\0" * (1 << 20)
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    written += f.write(block)
                except OSError:
                    break
        return written

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def set_readonly(self) -> str | None:
        """Make the cache read-only; the reason it cannot be, or None. As root the permission
        bits do not bind, so the tmpfs is remounted read-only instead."""
        if os.geteuid() == 0:
            if not self.tmpfs:
                return f"root ignores permission bits and there is no tmpfs ({self.tmpfs_reason})"
            for _ in range(50):  # EBUSY while the writer has a temp file open: try again
                done = subprocess.run(["mount", "-o", "remount,ro", str(self.mount)],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    self._readonly_remount = True
                    return None
                time.sleep(0.1)
            return f"remount read-only failed: {done.stderr.strip()[:200]}"
        dirs = [self.dir, *(p for p in self.dir.iterdir() if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        self._chmodded = dirs
        return None

    def set_writable(self) -> None:
        if self._readonly_remount:
            subprocess.run(["mount", "-o", "remount,rw", str(self.mount)], check=True,
                           capture_output=True)
            self._readonly_remount = False
        for d in self._chmodded:
            with contextlib.suppress(FileNotFoundError):
                d.chmod(0o755)
        self._chmodded = []

    def delete(self) -> int:
        """Delete the whole cache directory; how many block files it held."""
        blocks = len(self.block_files())
        shutil.rmtree(self.dir, ignore_errors=True)
        return blocks

    def block_files(self) -> list[Path]:
        return sorted(self.dir.glob("??/*.safetensors"))

    def temp_files(self) -> list[Path]:
        return sorted(self.dir.glob("??/.*.tmp"))

    def corrupt(self, rng: random.Random, limit: int) -> list[Corruption]:
        """Damage up to ``limit`` block files in place, the three ways in turn. A file the
        server replaced or removed meanwhile is passed over."""
        files = self.block_files()
        rng.shuffle(files)
        done: list[Corruption] = []
        for i, path in enumerate(files[:limit]):
            how = ("truncate", "garbage", "flip")[i % 3]
            try:
                with open(path, "r+b") as f:
                    data = bytearray(f.read())
                    if how == "truncate":
                        data = data[: len(data) // 2]
                    elif how == "garbage":
                        data = bytearray(rng.randbytes(len(data)))
                    else:  # 4 KB of 0xFF (NaN) inside the tensor data; size and header kept
                        start = 8 + int.from_bytes(data[:8], "little")
                        at = start + max(0, (len(data) - start - 4096) // 2)
                        data[at:at + 4096] = b"\xff" * len(data[at:at + 4096])
                    f.seek(0)
                    f.write(data)
                    f.truncate(len(data))
                mtime_ns = path.stat().st_mtime_ns
            except (OSError, ValueError):
                continue
            done.append(Corruption(path, how, _digest(bytes(data)), mtime_ns))
        self.corruptions += done
        return done

    def corrupt_loaded(self) -> list[Corruption]:
        """Damaged files the server read and took: still as the soak left them, but touched
        since. The SSD writer sets a block's mtime when it serves it (the LRU order a restart
        rebuilds); nothing else touches a file without rewriting it."""
        loaded = []
        for c in self.corruptions:
            try:
                st = c.path.stat()
                if st.st_mtime_ns != c.mtime_ns and _digest(c.path.read_bytes()) == c.digest:
                    loaded.append(c)
            except OSError:
                continue
        return loaded

    def corrupt_present(self, hows: tuple[str, ...]) -> list[Corruption]:
        """Damaged files still on disk as the soak left them, of the given kinds."""
        present = []
        for c in self.corruptions:
            if c.how not in hows:
                continue
            with contextlib.suppress(OSError):
                if _digest(c.path.read_bytes()) == c.digest:
                    present.append(c)
        return present


# --- the fault phases, each a function of the run ------------------------------------------


async def burst(soak: Soak, clients: Clients) -> dict[str, Any]:
    """``BURST`` requests at once: each answered or refused with 429 and Retry-After."""
    rng = random.Random(f"{soak.seed}:burst:{len(soak.bursts)}")
    specs = []
    for _ in range(BURST):
        spec = soak.traffic.spec(rng.choice(("chat", "messages")), rng)
        specs.append(Spec("burst", spec.path, {**spec.body, "max_tokens": 8}))
    records = await asyncio.gather(*(clients.send(s) for s in specs))
    outcomes = Counter(r.outcome for r in records)
    retry = [int(r.detail.split()[-1]) for r in records if r.outcome == "rate_limited"]
    result = {"size": BURST, "outcomes": dict(outcomes),
              "retry_after_s": [min(retry), max(retry)] if retry else None,
              "overflowed": outcomes["rate_limited"] > 0}
    soak.bursts.append(result)
    return result


async def writer_delta(soak: Soak, before: dict[str, Any]) -> dict[str, int]:
    """How the SSD writer's counters moved since ``before`` (same instance)."""
    after = await soak.writer()
    keys = ("persisted", "failed", "read_blocks", "read_missing", "read_corrupt",
            "blocks_corrupt", "checksum_failures")
    delta = {k: after[k] - before[k] for k in keys}
    delta["dropped_no_space"] = (after["dropped_by_reason"]["no_space"]
                                 - before["dropped_by_reason"]["no_space"])
    return delta


async def probe_until(soak: Soak, clients: Clients, probe: Callable[[int], Spec],
                      before: dict[str, Any], reached: Callable[[dict[str, int]], bool],
                      timeout: float) -> dict[str, int]:
    """Send ``probe(i)`` one after the other until the SSD writer's counters since
    ``before`` show ``reached`` (or ``timeout``); the counters' movement."""
    deadline = time.monotonic() + timeout
    delta = await writer_delta(soak, before)
    i = 0
    while not reached(delta) and time.monotonic() < deadline:
        await clients.send(probe(i))
        i += 1
        await asyncio.sleep(0.3)  # the blocks go to the writer after the answer
        delta = await writer_delta(soak, before)
    return delta


async def disk_fault(soak: Soak, name: str, fault: str,
                     inject: Callable[[], dict[str, Any] | str],
                     undo: Callable[[], None] | None, probe: Callable[[int], Spec],
                     reached: Callable[[dict[str, int]], bool],
                     prepare: Callable[[Clients], Awaitable[None]] | None = None) -> None:
    """Traffic throughout; the fault injected once the phase is under way, held while
    probes look for its effect on the SSD writer (the evidence it was reached), then
    undone, and the traffic goes on."""
    async with soak.phase(name) as (phase, clients):
        background = asyncio.create_task(
            soak.run_traffic(clients, phase.seconds, levels=(2, 4)))
        try:
            if prepare is not None:
                await prepare(clients)
            before = await soak.writer()
            injected = inject()
            if isinstance(injected, str):
                phase.skip(fault, injected)
                return
            evidence = phase.inject(fault, **injected)
            try:
                window = max(FAULT_WINDOW_S, phase.seconds / 2)
                delta = await probe_until(soak, clients, probe, before, reached, window)
            finally:
                if undo is not None:
                    undo()
            evidence["writer"] = delta
            soak.reached(phase, reached(delta))
        finally:
            await background


async def settle_writer(soak: Soak, timeout: float = 30.0) -> None:
    """Wait until the SSD writer has nothing queued."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (await soak.writer())["pending"]:
        await asyncio.sleep(0.2)


async def phase_burst(soak: Soak) -> None:
    async with soak.phase("burst") as (phase, clients):
        evidence = phase.inject("burst_256")
        background = asyncio.create_task(
            soak.run_traffic(clients, phase.seconds, levels=(4,)))
        # Two bursts in a long run; a short one has time to drain one.
        bursts = 2 if soak.minutes >= 5 else 1
        try:
            for _ in range(bursts):
                await asyncio.sleep(phase.seconds / 4)
                await burst(soak, clients)
        finally:
            await background
        evidence["bursts"] = soak.bursts
        soak.reached(phase, all(b["overflowed"] for b in soak.bursts))


async def phase_disk_full(soak: Soak) -> None:
    def inject() -> dict[str, Any] | str:
        if not soak.disk.tmpfs:
            return f"no tmpfs to fill ({soak.disk.tmpfs_reason})"
        return {"filled_bytes": soak.disk.fill()}

    await disk_fault(soak, "disk_full", "enospc", inject, soak.disk.unfill,
                          lambda i: soak.traffic.probe(),
                          lambda w: w["failed"] + w["dropped_no_space"] > 0)


async def phase_disk_readonly(soak: Soak) -> None:
    def inject() -> dict[str, Any] | str:
        reason = soak.disk.set_readonly()
        if reason is not None:
            return reason
        return {"how": "remount,ro" if os.geteuid() == 0 else "chmod 0555"}

    await disk_fault(soak, "disk_readonly", "readonly", inject, soak.disk.set_writable,
                          lambda i: soak.traffic.probe(), lambda w: w["failed"] > 0)


async def phase_disk_deleted(soak: Soak) -> None:
    # Families whose blocks the index still places on disk (read_missing), and new
    # blocks that need the directory back (persisted).
    await disk_fault(soak,
        "disk_deleted", "deleted", lambda: {"block_files_deleted": soak.disk.delete()},
        None, lambda i: soak.traffic.probe(None if i % 3 == 2 else i),
        lambda w: w["read_missing"] > 0 and w["persisted"] > 0)


async def phase_disk_corrupt(soak: Soak) -> None:
    async def prepare(clients: Clients) -> None:
        # Every family's blocks on disk, then more families than RAM holds: reading
        # them back must come from the damaged files.
        await asyncio.gather(*(clients.send(soak.traffic.probe(i)) for i in range(FAMILIES)))
        await settle_writer(soak)

    def inject() -> dict[str, Any] | str:
        done = soak.disk.corrupt(soak.rng, limit=10_000)
        return {"corrupted": dict(Counter(c.how for c in done))}

    await disk_fault(soak, "disk_corrupt", "corrupt_blocks", inject, None,
                          lambda i: soak.traffic.probe(i), lambda w: w["read_corrupt"] > 0,
                          prepare)


async def phase_kill9(soak: Soak) -> None:
    async with soak.phase("kill9") as (phase, clients):
        evidence = phase.inject("kill9")
        stop = asyncio.Event()
        background = asyncio.create_task(soak.run_traffic(
            clients, phase.seconds, levels=(8,), mix=WRITE_MIX, stop=stop))

        async def write() -> None:
            while not stop.is_set():
                await clients.send(soak.traffic.probe())

        writers = [asyncio.create_task(write()) for _ in range(3)]
        # Kill while blocks are being written: queued in the writer, or its count moving.
        began, writing = time.monotonic(), None
        persisted = (await soak.writer())["persisted"]
        while writing is None and time.monotonic() - began < FAULT_WINDOW_S:
            await asyncio.sleep(0.05)
            report = await soak.writer()
            if report["pending"] > 0:
                writing = f"{report['pending']} blocks queued in the writer"
            elif report["persisted"] > persisted:
                writing = "a block just written"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            await soak.snapshot()  # the instance's counters, as late as can be
        stop.set()
        soak.killed.add(soak.server.instance)
        await soak.server.kill()
        evidence["writes_in_flight"] = writing
        await asyncio.gather(background, *writers)
        evidence["temp_files_left"] = len(soak.disk.temp_files())
        damaged = soak.disk.corrupt_present(("truncate", "garbage"))
        evidence["corrupt_files_at_restart"] = len(damaged)
        soak.start_s = await soak.server.start()
        skipped = (await soak.snapshot())["cache_index"].get("skipped", {})
        evidence["skipped_at_start"] = skipped
        evidence["temp_files_after_restart"] = len(soak.disk.temp_files())
        survivors = [c for c in damaged if c.path.exists()]
        if survivors:
            soak.fail("kill9", f"{len(survivors)} corrupt block files survived the "
                               f"restart's scan, e.g. {survivors[0].path.name}")
        if evidence["temp_files_after_restart"]:
            soak.fail("kill9", "temp files of the killed writer left after the restart")
        soak.reached(phase, writing is not None)
        async with Clients(soak, "kill9") as fresh:  # the old connections died with it
            await soak.run_traffic(fresh, phase.seconds / 3, levels=(8,))


async def phase_sigterm(soak: Soak) -> None:
    async with soak.phase("sigterm") as (phase, clients):
        evidence = phase.inject("sigterm")
        specs, firsts = [], []
        for i in range(8):
            # Answers longer than the grace: the shutdown ends them.
            path = CHAT if i % 2 else MESSAGES
            body: dict[str, Any] = {
                "model": soak.traffic.model, "max_tokens": 256, "stream": i < 6,
                "messages": [{"role": "user", "content": f"Write a long story ({i})."}]}
            if path == CHAT:
                body["ignore_eos"] = True
                if i < 6:
                    body["stream_options"] = {"include_usage": True}
            specs.append(Spec("sigterm", path, body))
            firsts.append(asyncio.Event())
        tasks = [asyncio.create_task(clients.send(s, f)) for s, f in zip(specs, firsts,
                                                                        strict=True)]
        with contextlib.suppress(TimeoutError):  # every stream under way, if it can be
            async with asyncio.timeout(60):
                await asyncio.gather(*(f.wait() for f in firsts[:6]))
        evidence["streams_under_way"] = sum(f.is_set() for f in firsts[:6])
        soak.terminating.add(soak.server.instance)
        code = await soak.server.terminate(SHUTDOWN_GRACE_S + 60)
        records = await asyncio.gather(*tasks)
        evidence["exit_code"] = code
        evidence["outcomes"] = dict(Counter(r.outcome for r in records))
        if code != 0:
            soak.fail("sigterm", f"exit status {code} after SIGTERM (expected 0)")
        # A stream under way must end with its answer or the shutdown's error event (one
        # not started by then may get a 503 instead, which the ledger judges).
        unclean = [r for r, first in zip(records[:6], firsts[:6], strict=True)
                   if first.is_set() and r.outcome not in ("complete", "shutdown")]
        if unclean:
            soak.fail("sigterm", f"{len(unclean)} streams did not end cleanly: "
                                 f"{unclean[0].outcome}: {unclean[0].detail}")
        soak.reached(phase, evidence["streams_under_way"] > 0)
        soak.start_s = await soak.server.start()
        async with Clients(soak, "sigterm") as fresh:
            await soak.run_traffic(fresh, max(MIN_PHASE_S, phase.seconds - soak.start_s),
                               levels=(8,))
