"""Messages of the memory monitor and the engine pool. Plain data: no MLX here.

The monitor publishes ``MemoryLimits`` to admission and to every scheduler on every poll; the
pool loads and unloads models (one scheduler actor each) on admission's and the monitor's
behalf.
"""

from __future__ import annotations

import msgspec

from troupe.runtime import Message

# --- memory monitor -> admission, schedulers -------------------------------------------------


class MemoryLimits(Message, frozen=True, kw_only=True):
    """The monitor's latest reading and the limit it enforces (bytes of MLX memory).

    ``usage`` is MLX's active plus cache memory at the poll; ``high_water`` the most it
    reached over the last few seconds (peaks between polls included); ``floor`` the least it
    has been since the monitor started: what stays in use whatever the load (the weights, and
    whatever else the process holds). A prompt needing more than ``limit - floor`` can never
    fit (413); one that does not fit now only waits for memory (503). ``pressure`` is ``ok``,
    ``soft`` or ``hard`` (``actors.engine.memory_estimate.pressure_level`` of the usage). ``guard``
    False turns the prefill guard off (``--no-prefill-guard``).
    """

    limit: int
    high_water: int
    usage: int
    pressure: str
    floor: int = 0
    guard: bool = True


# --- to the memory monitor -------------------------------------------------------------------


class PollMemory(Message, frozen=True, kw_only=True):
    """Read memory now and publish (the monitor's own tick, or anyone wanting it sooner)."""


class SetMemoryLimit(Message, frozen=True, kw_only=True):
    """Enforce a new limit from now on, published at once (operators, tests)."""

    limit: int


class GetMemoryLimits(Message, frozen=True, kw_only=True):
    """Ask (``ask``) for the latest ``MemoryLimits``: a scheduler starting up gets them at once."""


class RanksMemory(Message, frozen=True, kw_only=True):
    """Rank 0's scheduler of a sharded model, after each step: the most MLX memory any other
    rank holds (``active_bytes``, as each last reported) and the highest peak any reported
    since the previous message (``peak_bytes``). The monitor counts the fullest rank."""

    active_bytes: int
    peak_bytes: int


# --- engine pool ---------------------------------------------------------------------------


class LoadModel(Message, frozen=True, kw_only=True):
    """Ask (``ask``) for a served model's scheduler, loading the model if it is not loaded.

    Answered with the scheduler's ``ActorRef``; raises ``AdmissionError`` (503) when the
    models memory budget cannot make room because every other model is busy or pinned.
    """

    model: str


class UnloadIdle(Message, frozen=True, kw_only=True):
    """Memory is short: unload every model with nothing in flight that is not pinned."""


class CheckIdle(Message, frozen=True, kw_only=True):
    """The pool's own tick: unload models idle for longer than ``--idle-ttl``."""


# --- engine pool -> scheduler ----------------------------------------------------------------


class DescribeLoad(Message, frozen=True, kw_only=True):
    """Ask (``ask``) a scheduler how busy it is; answered with ``EngineLoad``."""


class EngineLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A scheduler's work: requests in flight (queued, reading cache, prefilling, decoding),
    and ``idle_s``, seconds since its last request ended or arrived (0 while busy)."""

    in_flight: int
    idle_s: float


class Retire(Message, frozen=True, kw_only=True):
    """Ask (``ask``) a scheduler to stop taking requests if it is idle; answered True if it
    retired. A retired scheduler refuses what still reaches it with 503 until it stops, so a
    request that raced the unload is retried, never lost in a stopping engine."""
