"""Messages and the envelope that carries them (with the reply channel kept out of the message)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

if TYPE_CHECKING:
    from troupe.runtime.reply import Reply


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag=str.lower):
    """Base class for actor messages: immutable data, tagged by class name for decoding.

    Subclass it for each command or event (``class AddRequest(Message): ...``). Any
    ``msgspec.Struct`` is accepted by ``tell``/``ask``/``stream``; this base only adds the tag.
    """


class Envelope(NamedTuple):
    """One mailbox entry: the message and where its answer goes.

    ``reply`` is None for ``tell``, a future for ``ask`` and a ``Reply`` for ``stream``.
    """

    message: msgspec.Struct
    reply: asyncio.Future[Any] | Reply | None
