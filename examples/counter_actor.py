"""A counter actor: spawn, tell, ask, stream, a pinned thread, a restart, and a snapshot.

    .venv/bin/python examples/counter_actor.py
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import msgspec

from troupe.runtime import Actor, ActorSystem, Message, Restart


class Add(Message):
    n: int


class Get(Message):
    pass


class CountTo(Message):
    n: int


class Crash(Message):
    pass


class Counter(Actor):
    """Keeps a running total; streams counts; crashes on request."""

    def __init__(self, start: int = 0) -> None:
        self.total = start

    async def on_start(self) -> None:
        print(f"{self.name}: started on thread {threading.current_thread().name}")

    async def handle(self, msg: Add | Get | CountTo | Crash) -> Any:
        match msg:
            case Add(n=n):
                self.total += n
            case Get():
                return self.total
            case CountTo(n=n):
                reply = self.take_reply()
                for i in range(1, n + 1):
                    reply.send(i)
                reply.close()
            case Crash():
                raise RuntimeError("asked to crash")
        return None

    async def on_stop(self, error: BaseException | None) -> None:
        print(f"{self.name}: stopped ({error!r})")

    def report(self) -> dict[str, Any]:
        return {"total": self.total}


async def main() -> None:
    async with ActorSystem() as system:
        counter = await system.spawn(
            Counter, name="counter", thread="counter-thread", restart=Restart.TRANSIENT,
            start=10,
        )
        await counter.tell(Add(n=5))
        print("total:", await counter.ask(Get(), timeout=5.0))
        print("stream:", [i async for i in await counter.stream(CountTo(n=3))])

        await counter.tell(Crash())  # the supervisor restarts it: fresh instance, same ref
        print("after restart:", await counter.ask(Get(), timeout=5.0))
        for snap in system.snapshot():
            print("snapshot:", msgspec.json.encode(snap).decode())


if __name__ == "__main__":
    # The runtime logs the crash (with its traceback) on the "runtime" logger.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    asyncio.run(main())
