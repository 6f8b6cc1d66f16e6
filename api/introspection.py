"""``GET /actors`` and ``GET /actors/{name}``: the actor system's snapshot, live.

Every actor of the system shows, the serving actors and any an embedding program spawned,
with its runtime figures and its own ``report()``. ``GET /actors/events``, the same live as a
stream, is the dashboard's (``api.dashboard``).
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from troupe.api.errors import ApiError
from troupe.runtime import ActorSystem


def _unencodable(value: object) -> str:
    # A report is whatever an actor returns: show what JSON cannot hold as text, never fail.
    return repr(value)


_encoder = msgspec.json.Encoder(enc_hook=_unencodable)


def encode_json(value: object) -> bytes:
    """``value`` as JSON, snapshots and reports included; what JSON cannot hold, as text."""
    return _encoder.encode(value)


class IntrospectionRoutes:
    """The introspection routes of one actor system."""

    def __init__(self, system: ActorSystem) -> None:
        self.system = system

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_get("/actors", self.actors)
        router.add_get("/actors/{name}", self.actor)

    async def actors(self, request: web.Request) -> web.Response:
        """``GET /actors``: a JSON list of every actor's snapshot, in spawn order."""
        return _json(encode_json(self.system.snapshot()))

    async def actor(self, request: web.Request) -> web.Response:
        """``GET /actors/{name}``: one actor's snapshot, its report included; 404 if unknown."""
        name = request.match_info["name"]
        for snap in self.system.snapshot():
            if snap.name == name:
                return _json(encode_json(snap))
        raise ApiError(404, f"No actor named '{name}'.", param="name", code="actor_not_found")


def _json(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")
