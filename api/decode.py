"""Request bodies: read within a deadline, bounded in depth, decoded straight into msgspec
Structs; every way a body is wrong is a 4xx in the API's error shape."""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from troupe.api.errors import ApiError
from troupe.api.shutdown import SHUTTING_DOWN

_AT_PATH = re.compile(r"^(?P<message>.*?) - at `\$\.?(?P<path>[^`]*)`$", re.DOTALL)
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")

# JSON nested deeper than this is refused (400) before it is decoded. msgspec, the chat
# templates and the JSON Schema tools that admission runs on untyped fields (metadata,
# chat_template_kwargs, a tool's parameters) recurse once a level, and fail near 1,000 levels
# with a RecursionError; real requests nest a few dozen at most.
MAX_JSON_DEPTH = 64

# Everything but JSON's four brackets, and braces written as square brackets: for the depth,
# an object is an array.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_SQUARE = bytes.maketrans(b"{}", b"[]")

T = TypeVar("T")


def _validation_error(err: msgspec.ValidationError) -> ApiError:
    """msgspec's "<what> - at `$.a.b`" as a 400 whose ``param`` is ``a.b``."""
    text = str(err)
    path = ""
    if match := _AT_PATH.match(text):
        text, path = match["message"], match["path"]
    if missing := _MISSING_FIELD.match(text):
        field = missing["field"]
        param = f"{path}.{field}" if path else field
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param)
    if not path:
        return ApiError(400, f"Invalid request body: {text}.")
    return ApiError(400, f"Invalid value for '{path}': {text}.", param=path)


def json_depth_exceeds(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON in ``body`` nests arrays and objects more than ``limit`` deep.

    Brackets inside strings are text and do not count (escapes honoured). Every step is a
    bytes operation in C, so a body of megabytes costs milliseconds. A malformed body may be
    let through (its decoder then refuses it, at less than twice ``limit`` levels deep).
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # too few openers to nest that deep: most bodies stop here
    # Blank escaped backslashes, then escaped quotes; the quotes left delimit the strings,
    # and every other piece between them lies outside a string.
    plain = body.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")
    brackets = b"".join(plain.split(b'"')[::2]).translate(_AS_SQUARE, _NOT_BRACKETS)
    # Removing every "[]" takes one level off each nest (a nest of height h is gone after h
    # passes) and leaves every other bracket's depth as it was, so any run of limit+1
    # openers left is a nest that deep.
    too_deep = b"[" * (limit + 1)
    for _ in range(limit):
        if not brackets or too_deep in brackets:
            return bool(brackets)
        pruned = brackets.replace(b"[]", b"")
        if len(pruned) == len(brackets):
            return False  # only unmatched brackets are left: malformed, not deep
        brackets = pruned
    return b"[]" in brackets or too_deep in brackets


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a request body, turning every way it can be wrong into a 400 ApiError."""
    if json_depth_exceeds(body):
        raise ApiError(400, f"Request body nests more than {MAX_JSON_DEPTH} levels deep.")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:  # a subclass of DecodeError: test it first
        raise _validation_error(err) from err
    except msgspec.DecodeError as err:
        raise ApiError(400, f"Request body is not valid JSON: {err}.") from err
    except UnicodeDecodeError as err:  # msgspec's error for bad UTF-8 inside a string
        raise ApiError(400, "Request body is not valid UTF-8.") from err
    except RecursionError as err:  # the depth scan lets no such body through; a backstop
        raise ApiError(400, "Request body nests too deep.") from err


async def read_body(
    request: web.Request, *, max_bytes: int, timeout: float, stopping: asyncio.Event
) -> bytes:
    """The request's whole body, read within ``timeout`` seconds.

    413 when it is, or says it is, larger than ``max_bytes``; 408 when it has not arrived in
    time; 503 as soon as ``stopping`` is set (the server is shutting down: a body still on
    its way must not hold the shutdown). These close the connection: the rest of the body
    may still be coming.
    """
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise ApiError(413, f"Request body is {declared} bytes; the limit is {max_bytes}.",
                       close=True)
    reading = asyncio.ensure_future(request.read())
    stop = asyncio.ensure_future(stopping.wait())
    try:
        done, _ = await asyncio.wait(
            (reading, stop), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        stop.cancel()
        reading.cancel()  # a no-op once it is done
    if reading in done:
        try:
            return reading.result()
        except (RequestPayloadError, HttpProcessingError) as err:
            # The body's framing broke (a bad chunk size, fewer bytes than announced).
            raise ApiError(400, "Request body is not valid HTTP (its length or chunks).",
                           close=True) from err
    if stop in done:
        raise ApiError(503, SHUTTING_DOWN, close=True)
    raise ApiError(408, f"Request body did not arrive within {timeout:g} seconds.", close=True)
