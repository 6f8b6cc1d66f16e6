"""Actor runtime speed: tell throughput (event-loop actor) and ask latency (thread-pinned actor).

    .venv/bin/python benchmarks/bench_runtime.py [--messages N] [--asks N]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from troupe.runtime import Actor, ActorSystem, Message  # noqa: E402


class Bump(Message):
    n: int = 1


class Total(Message):
    pass


class Counter(Actor):
    def __init__(self) -> None:
        self.total = 0

    async def handle(self, msg: Any) -> int | None:
        match msg:
            case Bump(n=n):
                self.total += n
            case Total():
                return self.total
        return None


async def tell_throughput(messages: int, mailbox_size: int) -> float:
    """Messages per second through ``await ref.tell`` + ``handle``, one sender, loop actor."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, name="counter", mailbox_size=mailbox_size)
        msg = Bump()
        started = time.perf_counter()
        for _ in range(messages):
            await ref.tell(msg)
        total = await ref.ask(Total())
        elapsed = time.perf_counter() - started
    assert total == messages
    return messages / elapsed


async def ask_latency(asks: int, thread: str | None) -> list[float]:
    """Round-trip seconds of ``await ref.ask`` from the event loop, one ask at a time."""
    async with ActorSystem() as system:
        ref = await system.spawn(Counter, name="counter", thread=thread)
        msg = Total()
        for _ in range(min(1000, asks)):
            await ref.ask(msg)
        times = []
        for _ in range(asks):
            started = time.perf_counter()
            await ref.ask(msg)
            times.append(time.perf_counter() - started)
    return times


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--asks", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3, help="best of N for throughput")
    args = parser.parse_args()

    print(f"python {platform.python_version()} on {platform.machine()}, {platform.system()}")
    for size in (64, 1024):
        rate = max(
            asyncio.run(tell_throughput(args.messages, size)) for _ in range(args.repeats)
        )
        print(f"tell + handle, loop actor, mailbox {size}: {rate:,.0f} messages/s")
    for label, thread in (("loop actor", None), ("thread-pinned actor", "pinned")):
        times = sorted(asyncio.run(ask_latency(args.asks, thread)))
        p50 = statistics.median(times)
        p99 = times[int(len(times) * 0.99)]
        print(f"ask round trip, {label}: p50 {_us(p50)}, p99 {_us(p99)}")


if __name__ == "__main__":
    main()
