"""Images in the API requests: the content parts the routes make of them, and what every
request's images go through before admission (``ImageInput.resolve``).

Each route turns its API's image parts into the one part admission reads
(``actors.images``): inline base64 as it is, a ``data:`` URL's data, or, for an ``http(s)``
URL, a part to fetch. ``resolve`` then bounds the request's images in count and bytes, checks
their base64, and fetches the URLs: only with ``--allow-image-urls`` (a server that fetches
what requests name can be made to reach hosts only it can reach), within ``FETCH_TIMEOUT_S``
and ``--max-image-bytes``, never from a private, loopback or link-local address (each
address a host resolves to is checked, after every redirect too), following at most
``MAX_REDIRECTS`` redirects, and taking only a PNG, JPEG, WebP or GIF content type. Every
refusal is a 400 naming the part. Nothing is decoded here: admission decodes the pixels on its
worker threads.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from troupe.actors.config import ServeConfig
from troupe.actors.images import (
    MEDIA_TYPES,
    SUPPORTED,
    ImageError,
    encode_base64,
    image_bytes,
    image_part,
    image_parts,
)
from troupe.api.errors import ApiError

# A whole fetch (every redirect and the body) must end within this.
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 3
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
# What clients write for a media type that is one of MEDIA_TYPES.
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}
# Declared types that say nothing of the format: the decoder finds it.
_UNKNOWN = frozenset({"", "application/octet-stream"})


def media_type(declared: str | None, param: str) -> str | None:
    """An image's declared media type as its part carries it: one of ``MEDIA_TYPES``, or
    None when none was named. Raises a 400 ApiError naming ``param`` for another type."""
    if declared is None:
        return None
    kind = declared.split(";")[0].strip().lower()
    kind = _ALIASES.get(kind, kind)
    if kind in MEDIA_TYPES:
        return kind
    if kind in _UNKNOWN:
        return None
    raise ApiError(400, f"Images of type '{declared}' are not supported; send a {SUPPORTED} "
                   "image.", param=param)


def url_image(url: str, param: str) -> dict[str, Any]:
    """The part of an image given by URL: a ``data:`` URL's image, or an ``http(s)`` URL's
    part for ``ImageInput.resolve`` to fetch. Raises a 400 ApiError naming ``param`` for a
    malformed ``data:`` URL or another scheme."""
    if url[:5].lower() == "data:":
        head, comma, data = url[5:].partition(",")
        fields = head.split(";")
        if not comma or fields[-1].strip().lower() != "base64":
            raise ApiError(400, "An image data: URL must hold base64 data, as in "
                           "'data:image/png;base64,iVBORw0...'.", param=param)
        return image_part(data, media_type(fields[0] if len(fields) > 1 else None, param),
                          param)
    if _parsed(url, param).scheme in ("http", "https"):
        return {"type": "image", "image": {"url": url, "param": param}}
    raise ApiError(400, "An image URL must be a data: URL holding base64 data, or an http(s) "
                   "URL (fetched only when the server runs with --allow-image-urls).",
                   param=param)


def content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content from its text and image parts: the parts, in order, when there
    is an image among them; the texts joined by newlines otherwise (what text models get)."""
    if any(part["type"] == "image" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def address_allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an image URL may be fetched from ``address``: only from a public one (not
    private, loopback, link-local, multicast or reserved). Tests replace this function to
    fetch from a server of their own on 127.0.0.1."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


class _PrivateAddress(Exception):
    """A fetch's host is, or resolves to, an address ``address_allowed`` refuses."""

    def __init__(self, host: str, address: str) -> None:
        super().__init__(f"{host} is {address}" if host != address else address)


class _PublicResolver(AbstractResolver):
    """Resolves as aiohttp does, refusing a host with any address not allowed: the
    connection is made to the addresses checked here, so a host cannot answer the check
    with one address and the connection with another."""

    def __init__(self) -> None:
        self._resolver = ThreadedResolver()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self._resolver.resolve(host, port, family)
        for result in found:
            if not address_allowed(ipaddress.ip_address(result["host"])):
                raise _PrivateAddress(host, result["host"])
        return found

    async def close(self) -> None:
        await self._resolver.close()


class ImageInput:
    """Every request's images before admission, by the server's image settings."""

    def __init__(self, config: ServeConfig) -> None:
        self.allow_urls = config.allow_image_urls
        self.max_images = config.max_images_per_request
        self.max_bytes = config.max_image_bytes

    async def resolve(self, messages: list[dict[str, Any]]) -> None:
        """Check the images of ``messages`` and fetch those given by URL, in place: each
        part then holds its data. Raises a 400 ApiError naming the part at fault."""
        parts = image_parts(messages)
        if len(parts) > self.max_images:
            raise ApiError(400, f"A request may hold at most {self.max_images} images (the "
                           "server's --max-images-per-request).",
                           param=parts[self.max_images]["image"]["param"])
        # Everything that needs no fetch is checked before any fetch starts.
        for part in parts:
            image = part["image"]
            if "url" not in image:
                self._check_size(len(_decoded(image["data"], image["param"])), image["param"])
            elif not self.allow_urls:
                raise ApiError(400, "Image URLs are fetched only when the server runs with "
                               "--allow-image-urls; send the image inline, as base64 (a data: "
                               "URL).", param=image["param"])
        for part in parts:
            image = part["image"]
            if "url" in image:
                data, kind = await self._fetch(image["url"], image["param"])
                part["image"] = {"data": encode_base64(data), "media_type": kind,
                                 "param": image["param"]}

    def _check_size(self, size: int, param: str) -> None:
        if size > self.max_bytes:
            raise ApiError(400, f"The image is larger than {self.max_bytes} bytes (the "
                           "server's --max-image-bytes).", param=param)

    async def _fetch(self, url: str, param: str) -> tuple[bytes, str]:
        """The bytes and media type at ``url``, within the fetch's bounds."""
        connector = aiohttp.TCPConnector(resolver=_PublicResolver(), use_dns_cache=False)
        try:
            async with (asyncio.timeout(FETCH_TIMEOUT_S),
                        aiohttp.ClientSession(connector=connector) as session):
                return await self._follow(session, _parsed(url, param), param)
        except TimeoutError:
            raise ApiError(400, f"The image URL did not answer in full within "
                           f"{FETCH_TIMEOUT_S:g} seconds.", param=param) from None
        except _PrivateAddress as exc:
            raise _private(str(exc), param) from None
        except aiohttp.ClientError as exc:
            raise ApiError(400, f"The image URL could not be fetched: {exc}.",
                           param=param) from None

    async def _follow(self, session: aiohttp.ClientSession, url: URL,
                      param: str) -> tuple[bytes, str]:
        for _ in range(MAX_REDIRECTS + 1):
            _check_target(url, param)
            async with session.get(url, allow_redirects=False) as response:
                location = response.headers.get("Location")
                if response.status in _REDIRECT_STATUSES and location:
                    url = response.url.join(_parsed(location, param))
                    continue
                if response.status != 200:
                    raise ApiError(400, f"Fetching the image URL answered HTTP "
                                   f"{response.status}.", param=param)
                kind = _ALIASES.get(response.content_type, response.content_type)
                if kind not in MEDIA_TYPES:
                    raise ApiError(400, f"The image URL answered with content type "
                                   f"'{response.content_type}', not a {SUPPORTED} image.",
                                   param=param)
                self._check_size(response.content_length or 0, param)
                body = bytearray()
                async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
                    body += chunk
                    self._check_size(len(body), param)
                return bytes(body), kind
        raise ApiError(400, f"The image URL redirected more than {MAX_REDIRECTS} times.",
                       param=param)


def _parsed(url: str, param: str) -> URL:
    try:
        return URL(url)
    except ValueError as exc:
        raise ApiError(400, f"The image URL (or a redirect) is not a valid URL: {exc}.",
                       param=param) from None


def _check_target(url: URL, param: str) -> None:
    """Refuse a URL (the first, or a redirect's) that is not http(s), or whose host is an
    address not allowed (a host name's addresses are checked as it is resolved)."""
    if url.scheme not in ("http", "https") or not url.host:
        raise ApiError(400, "The image URL (or a redirect) is not an http(s) URL.", param=param)
    try:
        address = ipaddress.ip_address(url.host)
    except ValueError:
        return  # a name: _PublicResolver checks what it resolves to
    if not address_allowed(address):
        raise _private(url.host, param)


def _private(where: str, param: str) -> ApiError:
    return ApiError(400, f"The image URL leads to a private, loopback or link-local address "
                    f"({where}), which is not fetched.", param=param)


def _decoded(data: str, param: str) -> bytes:
    try:
        return image_bytes(data, param=param)
    except ImageError as err:
        raise ApiError(400, err.message, param=err.param) from None
