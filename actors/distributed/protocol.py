"""The side channel between rank 0 and the other ranks: its messages, their frames, the
handshake that proves both ends hold the group's shared secret, and where rank 0 listens.

Why a side channel and not a collective (as mlx_lm.server sends its prompts): measured on
loopback with the ring backend, a round trip of a step message over TCP took ~0.1 ms and a
single ``all_sum`` of a scalar ~1.7 ms (docs/distributed.md); the socket also tells at once
when a follower is gone.

The channel listens on rank 0's network address, so nothing crosses it before both ends prove
they hold the group's shared secret (``read_secret``): rank 0 challenges each connection with
a nonce and checks the follower's HMAC of it, then answers the follower's own nonce with one of
its own. Frames are not encrypted and carry no MAC after the handshake (docs/distributed.md
says to use a trusted network or a tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from troupe.actors.engine.config import EngineConfig
from troupe.actors.messages import OutputSpec, SamplingParams

# How long rank 0 waits for every follower to connect, and a follower for rank 0 to listen
# (loading a large shard can take minutes on either side).
CONNECT_TIMEOUT_S = 600.0
# How long one connection may take to prove itself, on either side: a peer that sends nothing,
# or too slowly, is dropped after this.
HANDSHAKE_TIMEOUT_S = 10.0
# The most handshakes rank 0 runs at once; further connections wait in the listen backlog.
MAX_HANDSHAKES = 32
# The largest frame before its sender has proved it holds the secret (a Hello is ~200 bytes),
# and after it (rank 0's Add carries a prompt's token ids and a grammar's source): a length
# prefix above it is refused before anything is read or allocated.
HANDSHAKE_FRAME_MAX = 64 * 1024
FRAME_MAX = 256 * 1024 * 1024
# Where every rank finds the group's shared secret: the secret itself, or a file holding it
# that only its owner may read. ``make serve-distributed`` makes one per launch.
SECRET_ENV = "TROUPE_DISTRIBUTED_SECRET"
SECRET_FILE_ENV = "TROUPE_DISTRIBUTED_SECRET_FILE"
# 128 bits as hex: someone who saw a handshake must not be able to guess the secret from it.
MIN_SECRET_CHARS = 32
NONCE_BYTES = 32
HELLO_MAC = b"mlx-troupe distributed hello"
WELCOME_MAC = b"mlx-troupe distributed welcome"
_HEADER = struct.Struct("<I")


# -- the channel's messages --------------------------------------------------------------------


class Challenge(msgspec.Struct, tag=True, frozen=True):
    """Rank 0's first message on a new connection: a fresh nonce for the follower's MAC."""

    nonce: bytes


class Hello(msgspec.Struct, tag=True, frozen=True):
    """A follower's answer to the challenge: who it is, the model it loaded, its machine's RAM
    (the most memory its reports may claim), a nonce of its own for rank 0's MAC, and ``mac``:
    HMAC-SHA256 under the secret of rank 0's nonce, its own, its rank and its fingerprint."""

    rank: int
    host: str
    pid: int
    fingerprint: str
    ram_bytes: int
    nonce: bytes
    mac: bytes


class Welcome(msgspec.Struct, tag=True, frozen=True):
    """Rank 0's answer: the PRNG seed every rank starts from (unseeded sampling draws from
    it), the engine settings every rank runs with, and ``mac``: HMAC-SHA256 under the secret
    of the follower's nonce, rank 0's and the rank, which proves rank 0 holds the secret."""

    seed: int
    config: EngineConfig
    mac: bytes


class Refused(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 will not take this connection: why (a bad MAC, another model, a rank taken)."""

    reason: str


class Add(msgspec.Struct, tag=True, frozen=True):
    """A request joins the batch. ``blocks``: the prompt's leading cached blocks rank 0 took,
    and ``cached_tokens``: those blocks' tokens and those of the partial hit after them; every
    rank starts the request from exactly that much cache. ``namespace``: its cache namespace
    (``AddRequest.cache_namespace``), which names its blocks on every rank."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    output: OutputSpec | None = None
    grammar: str | None = None  # the source of the request's grammar, compiled by each rank
    blocks: int = 0
    cached_tokens: int = 0
    namespace: str = ""


class Probe(msgspec.Struct, tag=True, frozen=True):
    """How many of the prompt's first ``blocks`` cached blocks can this rank supply? The
    follower reserves what it answers (``Supply``) for the request until its ``Add`` or
    ``Release``. ``namespace``: the request's cache namespace, as in ``Add``."""

    request_id: str
    prompt: list[int]
    blocks: int
    namespace: str = ""


class Release(msgspec.Struct, tag=True, frozen=True):
    """A probed request will not be added (refused, aborted, its client gone)."""

    request_id: str


class Spill(msgspec.Struct, tag=True, frozen=True):
    """Memory is short: rank 0 freed these prefix-cache blocks from RAM; so does each rank."""

    hashes: list[str]


class Abort(msgspec.Struct, tag=True, frozen=True):
    request_id: str


class Plan(msgspec.Struct, tag=True, frozen=True):
    """One step: ``schedule``'s plan as rank 0 made it, and the digest of the tokens rank 0
    sampled in the step before (``Engine.last_digest``)."""

    step: int
    fail: list[int]
    reject: int | None
    admit: int
    budget: int | None
    chunk: int
    previous_digest: int
    start: list[int]
    tokens: dict[int, int]
    draft: bool


class Reset(msgspec.Struct, tag=True, frozen=True):
    """Rank 0's step failed: every request fails and the engine starts a fresh batch."""

    reason: str


class Bye(msgspec.Struct, tag=True, frozen=True):
    """Rank 0 is stopping: followers exit cleanly."""


class Status(msgspec.Struct, tag=True, frozen=True):
    """A follower after each step: where it stands, for ``/actors`` on rank 0, and its memory,
    which rank 0's memory gate and monitor count (the fullest rank is the one that runs out).
    ``peak_bytes``: the most MLX memory it held during the step. Then its prefix cache
    (``FollowerCache.stats``)."""

    rank: int
    step: int
    digest: int
    active_bytes: int
    peak_bytes: int
    ram_blocks: int = 0
    ram_block_bytes: int = 0
    reserved: int = 0
    hit_tokens: int = 0
    disk_blocks: int = 0
    disk_read_blocks: int = 0
    disk_written: int = 0
    disk_dropped: int = 0


class Supply(msgspec.Struct, tag=True, frozen=True):
    """A follower's answer to a ``Probe``: it can supply the prompt's first ``blocks`` cached
    blocks, and after j of them (j from 0) ``partials[j]`` tokens of a partial hit."""

    request_id: str
    blocks: int
    partials: list[int]


ToFollower = Add | Abort | Plan | Reset | Bye | Probe | Release | Spill
ToLeader = Status | Supply

_encoder = msgspec.msgpack.Encoder()
TO_FOLLOWER = msgspec.msgpack.Decoder(ToFollower)
TO_LEADER = msgspec.msgpack.Decoder(ToLeader)
HELLO = msgspec.msgpack.Decoder(Hello)
HANDSHAKE_TO_FOLLOWER = msgspec.msgpack.Decoder(Challenge | Welcome | Refused)


class ChannelError(Exception):
    """A peer sent what the channel does not carry: a frame above the size bound, or one that
    does not decode as a message expected there."""


def send_msg(sock: socket.socket, msg: Any) -> None:
    body = _encoder.encode(msg)
    sock.sendall(_HEADER.pack(len(body)) + body)


def recv_msg(sock: socket.socket, decoder: msgspec.msgpack.Decoder, limit: int = FRAME_MAX,
          deadline: float | None = None) -> Any | None:
    """The next message, or None when the peer closed the connection. Raises ChannelError for
    a frame above ``limit`` bytes (before reading it) or one that does not decode, and
    TimeoutError when ``deadline`` (``time.monotonic``) passes first."""
    header = _read_exactly(sock, _HEADER.size, deadline)
    if header is None:
        return None
    size = _HEADER.unpack(header)[0]
    if size > limit:
        raise ChannelError(f"a frame of {size} bytes (at most {limit})")
    body = _read_exactly(sock, size, deadline)
    if body is None:
        return None
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ChannelError(f"a frame that is not a message expected there ({exc})") from None


def _read_exactly(sock: socket.socket, n: int, deadline: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def hmac_of(secret: bytes, label: bytes, *parts: bytes | int | str) -> bytes:
    """HMAC-SHA256 under ``secret`` of ``label`` and ``parts``, each part length-prefixed so
    that no two lists of parts read the same."""
    mac = hmac.new(secret, label, hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        mac.update(_HEADER.pack(len(data)) + data)
    return mac.digest()


def read_secret(env: Mapping[str, str] = os.environ) -> bytes:
    """The group's shared secret, which every rank must hold: ``$TROUPE_DISTRIBUTED_SECRET``,
    or the contents of the file ``$TROUPE_DISTRIBUTED_SECRET_FILE`` names (refused when other
    users may read or write it), without surrounding whitespace. Raises ValueError, saying
    what to do, when there is none, both are set, or it is shorter than MIN_SECRET_CHARS."""
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if value and path:
        raise ValueError(f"set ${SECRET_ENV} or ${SECRET_FILE_ENV}, not both")
    if path:
        try:
            mode = os.stat(path).st_mode
            value = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"${SECRET_FILE_ENV}: cannot read {path}: {exc}") from None
        if mode & 0o077:
            raise ValueError(f"${SECRET_FILE_ENV}: other users may read or write {path} (mode "
                             f"{mode & 0o777:o}); chmod 600 it")
    value = (value or "").strip()
    if not value:
        raise ValueError(f"--distributed needs the group's shared secret on every rank, in "
                         f"${SECRET_ENV} or a file named by ${SECRET_FILE_ENV}: e.g. export "
                         f"{SECRET_ENV}=$(openssl rand -hex 32) before mlx.launch; `make "
                         "serve-distributed` makes one (docs/distributed.md)")
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"the distributed secret has {len(value)} characters; it needs at "
                         f"least {MIN_SECRET_CHARS} (e.g. openssl rand -hex 32)")
    return value.encode()


def leader_host() -> str:
    """Rank 0's address, from the host file ``mlx.launch`` gives every rank (``MLX_HOSTFILE``:
    a JSON list of each rank's "host:port" list); 127.0.0.1 without one."""
    path = os.environ.get("MLX_HOSTFILE")
    if not path:
        return "127.0.0.1"
    with open(path) as f:
        hosts = json.load(f)
    first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
    return first.rsplit(":", 1)[0] if isinstance(first, str) else "127.0.0.1"


def combine(answers: list[Supply]) -> tuple[int, list[int]]:
    """What every follower can supply: the fewest leading blocks any offers, and after j of
    them the fewest partial-hit tokens any offers."""
    if not answers:
        return 0, []
    blocks = min(a.blocks for a in answers)
    partials = [min(a.partials[j] if j < len(a.partials) else 0 for a in answers)
                for j in range(blocks + 1)]
    return blocks, partials

