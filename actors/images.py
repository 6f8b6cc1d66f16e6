"""Images in requests: the part each one is in a conversation, and its decoding.

The API routes put every image of a request, in any of the three APIs, into its message's
content list as one part of the shape ``{"type": "image", "image": {"data", "media_type",
"param"}}``: ``data`` the base64 of the image file's bytes, ``media_type`` the type the client
declared (one of ``MEDIA_TYPES``, or None when it named none), ``param`` where the image was in
the request, for errors (``messages[1].content[0].image_url``). A message holding images has a
list of ``{"type": "text", "text"}`` parts and image parts, in the request's order, as the
chat templates of vision-language models read them.

Decoding reads the pixel count from the file's header before it decodes a pixel, so an image
that would take too much memory (a "decompression bomb") is refused without allocating it.
Pure functions (no MLX, no event loop): admission calls them on its worker threads. Loading
this module loads neither Pillow nor anything else the API layer does not.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

# The media types taken, and the Pillow format each names. MPO is how Pillow reads the JPEG
# files many phone cameras write (a JPEG with more pictures after the first).
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
_FORMATS = frozenset({*MEDIA_TYPES.values(), "MPO"})
SUPPORTED = "PNG, JPEG, WebP or GIF"

# 4096 x 4096: a 5K display's whole screen (5120 x 2880) fits, and one decoded image takes at
# most 48 MiB as RGB. Vision models shrink images far below this before reading them.
MAX_IMAGE_PIXELS = 4096 * 4096


class ImageError(ValueError):
    """An image a request cannot have: undecodable, of a format not taken, or too large.

    ``param`` names where the image was in the request (the part's ``param``)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def image_part(data: str, media_type: str | None, param: str) -> dict[str, Any]:
    """An image's content part: ``data`` the base64 of its file, ``media_type`` as declared."""
    return {"type": "image", "image": {"data": data, "media_type": media_type, "param": param}}


def image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image parts of a conversation, in the order they came (messages, then parts)."""
    return [
        part
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    ]


def image_bytes(data: str, *, param: str) -> bytes:
    """The file bytes of a part's base64 ``data`` (strict: no spaces or line breaks)."""
    try:
        return binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"The image's data is not valid base64: {exc}.", param=param) from None


def decode_image(data: bytes, *, param: str, max_pixels: int) -> Image.Image:
    """An image file (PNG, JPEG, WebP or GIF's first frame) as RGB pixels, turned upright as
    its EXIF orientation says (as mlx-vlm's ``load_image`` does).

    Raises ImageError naming ``param`` for data that is no image or cannot be decoded, a
    format not taken, and more than ``max_pixels`` pixels; the last is read from the file's
    header, before any pixel is decoded.
    """
    # Pillow comes with the vision extra; the API layer loads this module without it.
    from PIL import Image, ImageOps

    try:
        # Reads the header only: the pixels are decoded further down.
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        # Pillow's own bound (twice its MAX_IMAGE_PIXELS, set when this is raised) came first.
        bound = min(max_pixels, 2 * (Image.MAX_IMAGE_PIXELS or 0))
        raise _too_large(None, param, bound) from None
    except Exception as exc:  # noqa: BLE001 - any failure to parse untrusted data is "not an image"
        raise ImageError(f"The image cannot be read ({_reason(exc)}); send a {SUPPORTED} "
                         "image.", param=param) from None
    if image.format not in _FORMATS:
        raise ImageError(f"{image.format} images are not supported; send a {SUPPORTED} image.",
                         param=param)
    width, height = image.size
    if width * height > max_pixels:
        raise _too_large((width, height), param, max_pixels)
    try:
        # Pillow opens an animation (GIF, WebP) at its first frame: that frame is the image.
        upright = ImageOps.exif_transpose(image)
        return upright.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageError(f"The {image.format} image cannot be decoded ({_reason(exc)}).",
                         param=param) from None


def decode_part(part: dict[str, Any], *, max_pixels: int) -> Image.Image:
    """An image part's pixels: its base64 data decoded by ``decode_image``."""
    image = part["image"]
    return decode_image(image_bytes(image["data"], param=image["param"]),
                        param=image["param"], max_pixels=max_pixels)


def _too_large(size: tuple[int, int] | None, param: str, max_pixels: int) -> ImageError:
    shown = f" ({size[0]} x {size[1]})" if size else ""
    return ImageError(f"The image{shown} has more pixels than this server takes "
                      f"({max_pixels}, its --max-image-pixels).", param=param)


def _reason(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def encode_base64(data: bytes) -> str:
    """``data`` as the base64 text of an image part."""
    return base64.b64encode(data).decode("ascii")
