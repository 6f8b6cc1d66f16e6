"""Admission's prefill guard for a model sharded over ranks (``--distributed``): it counts one
rank's share of the model against each rank's limit, as the scheduler's gate does
(``distributed.shard_memory``), not the whole model's shape and weight files.

Admission runs alone here, with a scheduler that finishes each request at once: no
``mlx.launch``; the limits are set by hand as the memory monitor would publish them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tiny_model import make_tiny_model

from troupe.actors.admission import Admission
from troupe.actors.distributed.shards import rank_memory_of
from troupe.actors.engine.memory_estimate import OK, model_memory_of, prompt_need
from troupe.actors.memory_messages import MemoryLimits
from troupe.actors.messages import (
    AddRequest,
    AdmissionError,
    AdmissionTicket,
    AdmitCompletion,
    ModelCard,
    RequestFinished,
    SamplingParams,
    Usage,
)
from troupe.runtime import Actor, ActorRef, ActorSystem

STEP = 512
PROMPT = list(range(10, 74))  # 64 token ids of the tiny vocabulary
SHARDINGS = [("tensor", 2), ("pipeline", 2), ("pipeline", 3)]


class Finishes(Actor):
    """A scheduler that records each request and finishes it at once."""

    def __init__(self) -> None:
        self.added: list[str] = []

    async def handle(self, msg: Any) -> Any:
        assert isinstance(msg, AddRequest)
        self.added.append(msg.request_id)
        reply = self.take_reply()
        reply.send(RequestFinished(request_id=msg.request_id, finish_reason="stop",
                                   usage=Usage(prompt_tokens=len(msg.prompt_tokens),
                                               completion_tokens=0)))
        reply.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose weights, not a short prompt's prefill, take most of its memory
    (about 10 MB of weights): 4 heads, 2 key/value heads, 4 layers."""
    return make_tiny_model(tmp_path_factory.mktemp("wide") / "wide", hidden=256, layers=4)


@pytest.fixture
async def system() -> AsyncIterator[ActorSystem]:
    async with ActorSystem() as running:
        yield running


async def spawn_admission(system: ActorSystem, model_dir: Path, limits: MemoryLimits,
                          **sharding: Any) -> tuple[ActorRef, Finishes]:
    """Admission of the model at ``model_dir`` (sharded as ``sharding`` says), under
    ``limits``, and the scheduler it sends to."""
    name = "-".join(str(v) for v in sharding.values()) or "one"
    scheduler = await system.spawn(Finishes, name=f"scheduler-{name}")
    card = ModelCard(id="wide", context_length=2048, source="local", path=str(model_dir))
    admission = await system.spawn(Admission, name=f"admission-{name}", thread="admission",
                                   models=[(card, scheduler)], pool=None,
                                   prefill_step_size=STEP, **sharding)
    await admission.ask(limits, timeout=5.0)
    return admission, scheduler._cell.instance  # type: ignore[return-value]


async def admit(admission: ActorRef, request_id: str, prompt: list[int]) -> AdmissionTicket:
    return await admission.ask(AdmitCompletion(
        request_id=request_id, model="wide", prompt=prompt,
        sampling=SamplingParams(max_tokens=4, temperature=0.0)), timeout=30.0)


def rank_limits(model_dir: Path, mode: str, ranks: int) -> MemoryLimits:
    """Each rank's limit just big enough for PROMPT's prefill beside one rank's share of the
    weights, which is what the fullest rank holds at rest (the monitor's floor)."""
    share = rank_memory_of(model_dir, mode, ranks)
    need = prompt_need(share, prompt_tokens=len(PROMPT), step=STEP)
    rest = share.weights_bytes
    return MemoryLimits(limit=rest + need, high_water=rest, usage=rest, pressure=OK,
                        floor=rest)


@pytest.mark.parametrize("mode,ranks", SHARDINGS)
async def test_a_prompt_that_fits_one_ranks_share_is_admitted_sharded_and_413_in_one_process(
    system: ActorSystem, model_dir: Path, mode: str, ranks: int
) -> None:
    limits = rank_limits(model_dir, mode, ranks)
    # The model people shard: its weights alone are over one rank's limit.
    assert model_memory_of(model_dir).weights_bytes > limits.limit

    sharded, scheduler = await spawn_admission(system, model_dir, limits, distributed=mode,
                                               ranks=ranks)
    ticket = await admit(sharded, "sharded", PROMPT)
    assert ticket.admitted.prompt_tokens == len(PROMPT)
    assert scheduler.added == ["sharded"]

    alone, scheduler = await spawn_admission(system, model_dir, limits)
    with pytest.raises(AdmissionError) as refused:
        await admit(alone, "alone", PROMPT)
    assert (refused.value.kind, refused.value.code) == ("too_large", "memory_limit_exceeded")
    assert scheduler.added == []


@pytest.mark.parametrize("mode,ranks", SHARDINGS)
async def test_a_prompt_over_one_ranks_share_is_still_413_when_sharded(
    system: ActorSystem, model_dir: Path, mode: str, ranks: int
) -> None:
    limits = rank_limits(model_dir, mode, ranks)
    sharded, scheduler = await spawn_admission(system, model_dir, limits, distributed=mode,
                                               ranks=ranks)
    with pytest.raises(AdmissionError) as refused:
        await admit(sharded, "long", PROMPT * 16)
    assert (refused.value.kind, refused.value.code) == ("too_large", "memory_limit_exceeded")
    assert scheduler.added == []
