"""Request bodies decoded straight into msgspec Structs; every way a body is wrong is a 400."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from api.errors import ApiError

_AT_PATH = re.compile(r"^(?P<message>.*?) - at `\$\.?(?P<path>[^`]*)`$", re.DOTALL)
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")

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


def decode_body(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Decode a request body, turning every way it can be wrong into a 400 ApiError."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as err:  # a subclass of DecodeError: test it first
        raise _validation_error(err) from err
    except msgspec.DecodeError as err:
        raise ApiError(400, f"Request body is not valid JSON: {err}.") from err
    except UnicodeDecodeError as err:  # msgspec's error for bad UTF-8 inside a string
        raise ApiError(400, "Request body is not valid UTF-8.") from err
