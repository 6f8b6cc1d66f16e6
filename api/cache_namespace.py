"""Cache namespaces: which requests may share prefix-cache blocks (docs/prefix-cache.md).

A prompt's cached tokens show how much of it the cache already held: one client could read
another's prompts a token at a time by guessing them. So each API key's requests use a
namespace of their own (unless ``--shared-cache``), and a request's ``cache_salt`` separates
it further. A namespace is a hash: the key itself is never kept with a request, logged or
written anywhere.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from aiohttp import web
from msgspec import Meta

# Set by the API-key middleware on requests that sent a valid key; absent: the shared one.
CACHE_NAMESPACE = web.RequestKey("cache_namespace", str)

_LABEL = b"mlx-troupe prefix-cache namespace"

# The request field (vLLM's name and meaning): any non-empty string.
CacheSalt = Annotated[str, Meta(
    min_length=1,
    description="Separates this request's prefix cache from every request that does not send "
    "the same salt (with the same API key): its prompt neither reads nor leaves blocks that "
    "theirs can use. Extension (vLLM's field).")]


def key_namespace(key: bytes) -> str:
    """The cache namespace of an API key: an HMAC under the key, the same at every start (so
    its blocks on disk serve it after a restart), from which the key cannot be recovered."""
    return hmac.new(key, _LABEL, hashlib.sha256).hexdigest()[:32]


def request_namespace(request: web.Request, salt: str | None) -> str:
    """The cache namespace of a generation request: its key's (the shared one, "", without),
    salted with its ``cache_salt`` when it sends one."""
    namespace = request.get(CACHE_NAMESPACE, "")
    if salt is None:
        return namespace
    return hashlib.sha256(f"{namespace}\0{salt}".encode()).hexdigest()[:32]
