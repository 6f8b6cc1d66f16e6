"""Images in requests: each API's image parts in the one shape admission reads, decoding and
its limits (actors/images.py), and the checks and URL fetches before admission (api/images.py).

No model: the routes run against the scripted admission (tests/http_stack.py), which records
what it was asked. Images are made with Pillow in the test; URL images come from an aiohttp
server of the test's own on 127.0.0.1, reached only where the test lets ``address_allowed``
pass it.
"""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import anthropic
import http_stack
import msgspec
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from http_stack import MODEL, Scripted
from PIL import Image, ImageFile

import api.images
from troupe.actors.images import (
    MAX_IMAGE_PIXELS,
    ImageError,
    decode_image,
    decode_part,
    image_bytes,
    image_parts,
)
from troupe.actors.messages import AdmitChat, CountTokens
from troupe.api.anthropic import MessagesRequest, admit_message
from troupe.api.errors import ApiError
from troupe.api.openai import ChatCompletionRequest, admit_chat
from troupe.api.responses import ResponsesRequest, prepare_turn
from troupe.api.responses_store import ResponseStore

scripted, client = http_stack.scripted, http_stack.client

CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"


# --- images made here ----------------------------------------------------------------------


def encoded(fmt: str, colour: str = "red", size: tuple[int, int] = (3, 2), **save: Any) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


PNG = encoded("PNG")
# A PNG whose pixel data is large enough that half of the file lacks much of it.
NOISE = io.BytesIO()
Image.effect_noise((64, 64), 80).convert("RGB").save(NOISE, format="PNG")
PNG_B64 = b64(PNG)
DATA_URL = f"data:image/png;base64,{PNG_B64}"
BLUE_B64 = b64(encoded("PNG", "blue"))


def png_claiming(width: int, height: int) -> bytes:
    """A real PNG whose header (IHDR, its CRC made right) says ``width`` x ``height``."""
    ihdr = PNG.index(b"IHDR")
    fields = struct.pack(">II", width, height) + PNG[ihdr + 12:ihdr + 17]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + fields))
    return PNG[:ihdr + 4] + fields + crc + PNG[ihdr + 21:]


def part(data: str, media_type: str | None, param: str) -> dict[str, Any]:
    return {"type": "image", "image": {"data": data, "media_type": media_type, "param": param}}


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


# --- each API's parts in the admission shape ----------------------------------------------


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    req = msgspec.convert({"model": MODEL, "messages": messages}, ChatCompletionRequest)
    return admit_chat(req, "chatcmpl-1", 16).messages


def anthropic_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    req = msgspec.convert({"model": MODEL, "max_tokens": 8, "messages": messages},
                          MessagesRequest)
    return admit_message(req, "msg_1").messages


def responses_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    req = msgspec.convert({"model": MODEL, "input": items}, ResponsesRequest)
    return prepare_turn(req, "resp_1", 16, ResponseStore(0)).msg.messages


def test_openai_image_url_parts_become_image_parts_in_order_with_the_text() -> None:
    messages = chat_messages([
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "high"}},
            {"type": "text", "text": "with"},
            {"type": "image_url", "image_url": f"data:image/jpg;base64,{BLUE_B64}"},
        ]},
    ])
    assert messages[0]["content"] == "be brief"  # no image: text parts joined, as ever
    assert messages[1]["content"] == [
        text("compare"),
        part(PNG_B64, "image/png", "messages[1].content[1].image_url"),
        text("with"),
        part(BLUE_B64, "image/jpeg", "messages[1].content[3].image_url"),
    ]


def test_openai_tool_message_keeps_its_image() -> None:
    messages = chat_messages([
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "image_url", "image_url": {"url": DATA_URL}}]},
    ])
    assert messages[2]["content"] == [part(PNG_B64, "image/png",
                                           "messages[2].content[0].image_url")]


def test_openai_image_in_a_system_message_is_refused_naming_the_part() -> None:
    with pytest.raises(ApiError) as caught:
        chat_messages([{"role": "system", "content": [
            {"type": "image_url", "image_url": {"url": DATA_URL}}]},
            {"role": "user", "content": "hi"}])
    assert caught.value.status == 400 and caught.value.param == "messages[0].content[0]"
    assert "user and tool messages" in caught.value.message


def test_anthropic_image_blocks_in_user_turns_and_tool_results_become_image_parts() -> None:
    messages = anthropic_messages([
        {"role": "user", "content": [
            {"type": "text", "text": "what is"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG_B64}},
            {"type": "text", "text": "this?"},
        ]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "the screen:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": BLUE_B64}},
            ]},
            {"type": "text", "text": "and now?"},
        ]},
    ])
    assert messages[0] == {"role": "user", "content": [
        text("what is"), part(PNG_B64, "image/png", "messages[0].content[1].source"),
        text("this?")]}
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": [
        text("the screen:"),
        part(BLUE_B64, "image/png", "messages[2].content[0].content[1].source")]}
    assert messages[3] == {"role": "user", "content": "and now?"}


def test_an_image_in_a_turn_that_cannot_hold_one_is_refused_naming_it() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG_B64}}
    with pytest.raises(ApiError) as caught:
        anthropic_messages([{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": [image]}])
    assert caught.value.param == "messages[1].content[0]"
    with pytest.raises(ApiError) as caught:
        responses_messages([{"role": "system", "content": [
            {"type": "input_image", "image_url": DATA_URL}]}])
    assert caught.value.param == "input[0].content[0].type"


def test_anthropic_url_source_is_a_part_to_fetch_and_a_file_source_is_refused() -> None:
    url = "https://example.com/cat.png"
    messages = anthropic_messages([{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": url}}]}])
    assert messages[0]["content"] == [
        {"type": "image", "image": {"url": url, "param": "messages[0].content[0].source"}}]
    with pytest.raises(ApiError) as caught:
        anthropic_messages([{"role": "user", "content": [
            {"type": "image", "source": {"type": "file", "file_id": "file_1"}}]}])
    assert caught.value.param == "messages[0].content[0].source.type"


def test_responses_input_image_parts_in_messages_and_tool_outputs_become_image_parts() -> None:
    messages = responses_messages([
        {"role": "user", "content": [
            {"type": "input_text", "text": "fix the layout"},
            {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
        ]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_image", "image_url": f"data:image/png;base64,{BLUE_B64}"}]},
    ])
    assert messages[0]["content"] == [
        text("fix the layout"), part(PNG_B64, "image/png", "input[0].content[1].image_url")]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": [
        part(BLUE_B64, "image/png", "input[2].output[0].image_url")]}


def test_responses_input_image_with_a_file_id_is_a_400_naming_it() -> None:
    with pytest.raises(ApiError) as caught:
        responses_messages([{"role": "user", "content": [
            {"type": "input_image", "file_id": "file_1"}]}])
    assert caught.value.status == 400 and caught.value.param == "input[0].content[0].file_id"
    assert "data: URL" in caught.value.message


@pytest.mark.parametrize(("url", "why"), [
    ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64", "base64"),
    ("data:image/bmp;base64,Qk0=", "not supported"),
    ("ftp://example.com/a.png", "http(s)"),
    ("file:///etc/passwd", "http(s)"),
    ("http://[not-an-address/a.png", "not a valid URL"),
])
def test_a_malformed_or_unsupported_image_url_is_a_400_naming_the_part(url: str,
                                                                        why: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat_messages([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}]}])
    assert caught.value.status == 400
    assert caught.value.param == "messages[0].content[0].image_url"
    assert why in caught.value.message


def test_image_parts_lists_a_conversations_images_in_order() -> None:
    first, second = part("AA==", None, "a"), part("AQ==", None, "b")
    messages = [{"role": "system", "content": "s"},
                {"role": "user", "content": [text("x"), first]},
                {"role": "tool", "content": [second, text("y")]}]
    assert image_parts(messages) == [first, second]


# --- decoding ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_decode_image_reads_each_format_as_rgb(fmt: str) -> None:
    red, blue = (decode_image(encoded(fmt, colour, (5, 4)), param="p", max_pixels=100)
                 for colour in ("red", "blue"))
    assert red.mode == "RGB" and red.size == (5, 4)
    assert red.getpixel((0, 0)) != blue.getpixel((0, 0))
    r, g, b = red.getpixel((2, 2))
    assert r > 200 and g < 60 and b < 60  # lossy formats come close


def test_decode_image_takes_a_gifs_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), colour) for colour in ("red", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    image = decode_image(buffer.getvalue(), param="p", max_pixels=100)
    assert image.getpixel((0, 0)) == (255, 0, 0)


def test_decode_image_turns_an_image_upright_by_its_exif_orientation() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
    data = encoded("JPEG", size=(8, 4), exif=exif.tobytes())
    assert decode_image(data, param="p", max_pixels=100).size == (4, 8)


def test_decode_part_decodes_a_parts_base64() -> None:
    image = decode_part(part(PNG_B64, "image/png", "p"), max_pixels=100)
    assert image.size == (3, 2) and image.getpixel((1, 1)) == (255, 0, 0)


@pytest.mark.parametrize(("width", "height"), [(5000, 5000), (100_000, 100_000)])
def test_more_pixels_than_the_limit_are_refused_from_the_header_before_decoding(
    monkeypatch: pytest.MonkeyPatch, width: int, height: int
) -> None:
    # 5000 x 5000 passes Pillow's own bound and meets ours; 100000 x 100000 meets Pillow's.
    def no_decoding(self: Any) -> Any:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageError) as caught:
        decode_image(png_claiming(width, height), param="messages[0].content[0].image_url",
                     max_pixels=MAX_IMAGE_PIXELS)
    assert caught.value.param == "messages[0].content[0].image_url"
    assert "more pixels than this server takes" in caught.value.message
    assert str(MAX_IMAGE_PIXELS) in caught.value.message


def test_an_image_at_the_pixel_limit_is_decoded() -> None:
    assert decode_image(PNG, param="p", max_pixels=6).size == (3, 2)
    with pytest.raises(ImageError):
        decode_image(PNG, param="p", max_pixels=5)


@pytest.mark.parametrize(("data", "why"), [
    pytest.param(b"not an image at all", "cannot be read", id="garbage"),
    pytest.param(b"", "cannot be read", id="empty"),
    pytest.param(NOISE.getvalue()[:len(NOISE.getvalue()) // 2], "cannot be decoded",
                 id="truncated-png"),
])
def test_undecodable_data_is_an_image_error_naming_the_part(data: bytes, why: str) -> None:
    with pytest.raises(ImageError) as caught:
        decode_image(data, param="input[0].content[1].image_url", max_pixels=MAX_IMAGE_PIXELS)
    assert caught.value.param == "input[0].content[1].image_url"
    assert why in caught.value.message


@pytest.mark.parametrize("fmt", ["BMP", "TIFF", "ICO"])
def test_a_format_other_than_png_jpeg_webp_gif_is_refused_by_name(fmt: str) -> None:
    with pytest.raises(ImageError) as caught:
        decode_image(encoded(fmt), param="p", max_pixels=MAX_IMAGE_PIXELS)
    assert f"{fmt} images are not supported" in caught.value.message


def test_image_bytes_takes_strict_base64_only() -> None:
    assert image_bytes(PNG_B64, param="p") == PNG
    for bad in (PNG_B64[:-1], PNG_B64[:10] + "\n" + PNG_B64[10:], "@@@@"):
        with pytest.raises(ImageError, match="not valid base64"):
            image_bytes(bad, param="p")


@pytest.mark.parametrize(("address", "allowed"), [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("0.0.0.0", False), ("100.64.0.1", False),
    ("224.0.0.1", False), ("::1", False), ("fe80::1", False), ("fd00::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:8.8.8.8", True),
])
def test_only_public_addresses_are_fetched_from(address: str, allowed: bool) -> None:
    assert api.images.address_allowed(ipaddress.ip_address(address)) is allowed


# --- over HTTP -----------------------------------------------------------------------------


def chat_with(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": list(parts)}]}


def image_url(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def admitted(scripted: Scripted) -> list[AdmitChat]:
    return [m for m in scripted.seen if isinstance(m, AdmitChat)]


async def openai_error(resp: Any, param: str) -> str:
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


async def test_an_inline_image_reaches_admission_in_the_part_shape_on_each_route(
    client: TestClient, scripted: Scripted
) -> None:
    resp = await client.post(CHAT, json=chat_with(text("what?"), image_url(DATA_URL)))
    assert resp.status == 200, await resp.text()
    resp = await client.post(MESSAGES, json={"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": PNG_B64}}]}]})
    assert resp.status == 200, await resp.text()
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": [{"role": "user",
        "content": [{"type": "input_image", "image_url": DATA_URL}]}]})
    assert resp.status == 200, await resp.text()
    chat, messages, responses = (msg.messages for msg in admitted(scripted))
    assert chat[0]["content"] == [
        text("what?"), part(PNG_B64, "image/png", "messages[0].content[1].image_url")]
    assert messages[0]["content"] == [part(PNG_B64, "image/png",
                                           "messages[0].content[0].source")]
    assert responses[0]["content"] == [part(PNG_B64, "image/png",
                                            "input[0].content[0].image_url")]


async def test_a_malformed_data_url_is_a_400_naming_the_part_in_each_shape(
    client: TestClient, scripted: Scripted
) -> None:
    resp = await client.post(CHAT, json=chat_with(text("x"), image_url("data:image/png,abc")))
    assert "base64" in await openai_error(resp, "messages[0].content[1].image_url")
    resp = await client.post(CHAT, json=chat_with(image_url("data:image/png;base64,@@@@")))
    assert "not valid base64" in await openai_error(resp, "messages[0].content[0].image_url")
    resp = await client.post(MESSAGES, json={"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "@@@@"}}]}]})
    assert resp.status == 400
    body = await resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "not valid base64" in body["error"]["message"]
    assert admitted(scripted) == []
    resp = await client.post(CHAT, json=chat_with(text("hi")))
    assert resp.status == 200  # the server keeps serving


async def test_more_images_than_the_limit_is_a_400_naming_the_first_past_it(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(max_images_per_request=2))
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": [image_url(DATA_URL), image_url(DATA_URL)]},
        {"role": "assistant", "content": "two"},
        {"role": "user", "content": [text("and"), image_url(DATA_URL)]}]}
    message = await openai_error(await client.post(CHAT, json=body),
                                 "messages[2].content[1].image_url")
    assert "at most 2 images" in message and "--max-images-per-request" in message
    del body["messages"][2]
    body["messages"][-1] = {"role": "user", "content": "ok?"}
    assert (await client.post(CHAT, json=body)).status == 200
    assert len(image_parts(admitted(scripted)[-1].messages)) == 2


async def test_an_inline_image_over_the_byte_limit_is_a_400(
    aiohttp_client: Any, scripted: Scripted
) -> None:
    client = await aiohttp_client(scripted.app(max_image_bytes=len(PNG) - 1))
    message = await openai_error(await client.post(CHAT, json=chat_with(image_url(DATA_URL))),
                                 "messages[0].content[0].image_url")
    assert f"larger than {len(PNG) - 1} bytes" in message
    client = await aiohttp_client(scripted.app(max_image_bytes=len(PNG)))
    assert (await client.post(CHAT, json=chat_with(image_url(DATA_URL)))).status == 200


async def test_count_tokens_checks_its_images_too(client: TestClient,
                                                  scripted: Scripted) -> None:
    count = "/v1/messages/count_tokens"
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG_B64}}
    resp = await client.post(count, json={"model": MODEL, "messages": [
        {"role": "user", "content": [block]}]})
    assert resp.status == 200, await resp.text()
    counted = [m for m in scripted.seen if isinstance(m, CountTokens)]
    assert counted[-1].messages[0]["content"] == [
        part(PNG_B64, "image/png", "messages[0].content[0].source")]
    block["source"]["data"] = "@@@@"
    resp = await client.post(count, json={"model": MODEL, "messages": [
        {"role": "user", "content": [block]}]})
    assert resp.status == 400


async def test_the_official_clients_images_reach_admission_in_the_part_shape(
    scripted: Scripted
) -> None:
    server = await scripted.start()
    oai = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    ant = anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0)
    try:
        await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what?"},
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}]}])
        async with ant.messages.stream(model=MODEL, max_tokens=8, messages=[
                {"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": PNG_B64}},
                    {"type": "text", "text": "what?"}]}]) as stream:
            await stream.get_final_message()
        await oai.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]}])
        chat, messages, responses = (msg.messages for msg in admitted(scripted))
        assert chat[0]["content"] == [
            text("what?"), part(PNG_B64, "image/png", "messages[0].content[1].image_url")]
        assert messages[0]["content"] == [
            part(PNG_B64, "image/png", "messages[0].content[0].source"), text("what?")]
        assert responses[0]["content"] == [
            part(PNG_B64, "image/png", "input[0].content[0].image_url")]
        with pytest.raises(openai.BadRequestError) as caught:
            await oai.chat.completions.create(model=MODEL, messages=[{"role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}])
        assert caught.value.body["param"] == "messages[0].content[0].image_url"
        with pytest.raises(anthropic.BadRequestError) as refused:
            await ant.messages.create(model=MODEL, max_tokens=8, messages=[
                {"role": "user", "content": [{"type": "image", "source": {
                    "type": "url", "url": "https://example.com/a.png"}}]}])
        assert "--allow-image-urls" in refused.value.message
    finally:
        await oai.close()
        await ant.close()
        await server.close()


# --- image URLs ----------------------------------------------------------------------------


@dataclass
class ImageHost:
    """The test's own image server on 127.0.0.1, and the paths it was asked for."""

    server: TestServer
    hits: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.server.port}{path}"


BIG = b"\x89PNG" + bytes(4000)


@pytest.fixture
async def image_host(aiohttp_server: Any) -> ImageHost:
    host: ImageHost

    async def serve(request: web.Request) -> web.StreamResponse:
        path = request.path
        host.hits.append(path)
        if path == "/red.png":
            return web.Response(body=PNG, content_type="image/png")
        if path == "/hop":
            raise web.HTTPFound("/red.png")
        if path == "/loop":
            raise web.HTTPFound("/loop")
        if path == "/bad-redirect":
            return web.Response(status=302, headers={"Location": "http://[nope/"})
        if path == "/to-metadata":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if path == "/page.html":
            return web.Response(text="<html></html>", content_type="text/html")
        if path == "/big.png":
            return web.Response(body=BIG, content_type="image/png")
        if path == "/huge-declared.png":
            # Declares far more than the limit, sends a little, then nothing more.
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            response.content_length = 1 << 30
            await response.prepare(request)
            await response.write(BIG[:100])
            await asyncio.sleep(3600)
        if path == "/stall.png":
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            await response.prepare(request)
            await response.write(PNG[:10])
            await asyncio.sleep(3600)
        if path == "/big-chunked.png":
            response = web.StreamResponse(headers={"Content-Type": "image/png"})
            response.enable_chunked_encoding()
            await response.prepare(request)
            for start in range(0, len(BIG), 500):
                await response.write(BIG[start:start + 500])
            await response.write_eof()
            return response
        raise web.HTTPNotFound()

    app = web.Application()
    app.router.add_get("/{tail:.*}", serve)
    host = ImageHost(server=await aiohttp_server(app))
    return host


@pytest.fixture
def loopback_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let fetches reach 127.0.0.1 (the test's image host), and no other private address."""
    loopback = ipaddress.ip_address("127.0.0.1")
    monkeypatch.setattr(api.images, "address_allowed", lambda address: address == loopback)


async def test_an_image_url_without_allow_image_urls_is_a_400_naming_the_flag(
    client: TestClient, scripted: Scripted, image_host: ImageHost
) -> None:
    resp = await client.post(CHAT, json=chat_with(image_url(image_host.url("/red.png"))))
    assert "--allow-image-urls" in await openai_error(resp, "messages[0].content[0].image_url")
    assert image_host.hits == [] and admitted(scripted) == []


async def test_an_allowed_image_url_is_fetched_and_reaches_admission_as_data(
    aiohttp_client: Any, scripted: Scripted, image_host: ImageHost, loopback_allowed: None
) -> None:
    client = await aiohttp_client(scripted.app(allow_image_urls=True))
    body = chat_with(text("a"), image_url(image_host.url("/red.png")),
                     image_url(image_host.url("/hop")))
    resp = await client.post(CHAT, json=body)
    assert resp.status == 200, await resp.text()
    assert image_host.hits == ["/red.png", "/hop", "/red.png"]
    assert admitted(scripted)[-1].messages[0]["content"] == [
        text("a"),
        part(PNG_B64, "image/png", "messages[0].content[1].image_url"),
        part(PNG_B64, "image/png", "messages[0].content[2].image_url")]
    resp = await client.post(MESSAGES, json={"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {
            "type": "url", "url": image_host.url("/red.png")}}]}]})
    assert resp.status == 200, await resp.text()
    assert admitted(scripted)[-1].messages[0]["content"] == [
        part(PNG_B64, "image/png", "messages[0].content[0].source")]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_loopback_image_url_is_refused_without_connecting(
    aiohttp_client: Any, scripted: Scripted, image_host: ImageHost, host: str
) -> None:
    # The real check: the address itself, and a name resolving to it.
    client = await aiohttp_client(scripted.app(allow_image_urls=True))
    resp = await client.post(CHAT, json=chat_with(image_url(image_host.url("/red.png", host))))
    message = await openai_error(resp, "messages[0].content[0].image_url")
    assert "private, loopback or link-local" in message
    assert image_host.hits == [] and admitted(scripted) == []


@pytest.mark.parametrize(("path", "why"), [
    pytest.param("/to-metadata", "169.254.169.254", id="redirect-to-private"),
    pytest.param("/loop", "redirected more than 3 times", id="redirect-loop"),
    pytest.param("/bad-redirect", "not a valid URL", id="redirect-malformed"),
    pytest.param("/page.html", "content type 'text/html'", id="not-an-image"),
    pytest.param("/big.png", "larger than 1000 bytes", id="too-large"),
    pytest.param("/big-chunked.png", "larger than 1000 bytes", id="too-large-chunked"),
    # Refused on its Content-Length, before its body (which never comes).
    pytest.param("/huge-declared.png", "larger than 1000 bytes", id="too-large-declared"),
    pytest.param("/gone.png", "HTTP 404", id="not-found"),
])
async def test_a_fetch_outside_its_bounds_is_a_400_naming_the_part(
    aiohttp_client: Any, scripted: Scripted, image_host: ImageHost, loopback_allowed: None,
    path: str, why: str
) -> None:
    client = await aiohttp_client(scripted.app(allow_image_urls=True, max_image_bytes=1000))
    resp = await client.post(RESPONSES, json={"model": MODEL, "input": [{"role": "user",
        "content": [{"type": "input_image", "image_url": image_host.url(path)}]}]})
    assert why in await openai_error(resp, "input[0].content[0].image_url")
    assert admitted(scripted) == []
    assert image_host.hits[0] == path
    if path == "/loop":
        assert len(image_host.hits) == 1 + api.images.MAX_REDIRECTS


async def test_a_fetch_that_does_not_end_in_time_is_a_400(
    aiohttp_client: Any, scripted: Scripted, image_host: ImageHost, loopback_allowed: None,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api.images, "FETCH_TIMEOUT_S", 0.2)
    client = await aiohttp_client(scripted.app(allow_image_urls=True))
    resp = await client.post(CHAT, json=chat_with(image_url(image_host.url("/stall.png"))))
    message = await openai_error(resp, "messages[0].content[0].image_url")
    assert "did not answer in full within 0.2 seconds" in message
