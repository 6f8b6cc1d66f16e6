"""A generation route's steps, the same for OpenAI's routes and Anthropic's.

Decode the body, name the request, admit it, and answer it whole or streamed
(``api.generation.answer``). Each route brings what differs: its schema's decoder, its id
prefix, how a request becomes an admission message, and the ``Renderer`` of its shapes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar

import msgspec
from aiohttp import web

from troupe.actors.messages import AdmissionTicket, AdmitChat, AdmitCompletion, Admitted
from troupe.api.cache_namespace import request_namespace
from troupe.api.decode import decode_body
from troupe.api.errors import ask_admission
from troupe.api.generation import Renderer, answer
from troupe.api.images import ImageInput
from troupe.api.telemetry import RECORD
from troupe.runtime import ActorRef


class GenerationRequest(Protocol):
    """What every generation request body has."""

    @property
    def model(self) -> str: ...

    @property
    def stream(self) -> bool | None: ...

    @property
    def cache_salt(self) -> str | None: ...


R = TypeVar("R", bound=GenerationRequest)
M = TypeVar("M", AdmitChat, AdmitCompletion)


async def generate(
    request: web.Request,
    admission: ActorRef,
    decoder: msgspec.json.Decoder[R],
    id_prefix: str,
    admit: Callable[[R, str], M],
    renderer: Callable[[R, M, Admitted], Renderer],
    images: ImageInput | None = None,
) -> web.StreamResponse:
    """Answer a generation request: ``admit(body, request_id)`` is what admission is asked
    (in the request's cache namespace), once ``images`` checked and fetched its images;
    ``renderer(body, admit_message, admitted)`` renders the answer."""
    req = decode_body(await request.read(), decoder)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    record = request[RECORD]
    record.request_id, record.model = request_id, req.model
    msg = admit(req, request_id)
    if images is not None and isinstance(msg, AdmitChat):
        await images.resolve(msg.messages)
    namespace = request_namespace(request, req.cache_salt)
    if namespace:
        msg = msgspec.structs.replace(msg, cache_namespace=namespace)
    ticket: AdmissionTicket = await ask_admission(admission, msg)
    rendering = renderer(req, msg, ticket.admitted)
    return await answer(request, ticket, rendering, stream=bool(req.stream))
