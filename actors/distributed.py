"""One model sharded over several processes (``troupe serve --distributed``, under
``mlx.launch``): rank 0 serves, every other rank follows.

Every rank loads its shard with mlx-lm's ``sharded_load`` (tensor parallel, or pipeline) and
runs the same ``Engine``. Rank 0 runs the whole server; the model's own collectives exchange
activations inside each forward pass, so every rank must run the same forward pass at the same
time. Rank 0's scheduler therefore tells the followers, over a TCP side channel, everything
that changes the batch, in order: a request added (its tokens, sampling, output spec and
grammar source), a request aborted, and each step's plan (``schedule``'s decisions, which
depend on rank 0's clock and memory). A follower applies them to its own engine and runs the
step; its sampled tokens are the same as rank 0's (the same logits, the same seeded PRNG), and
a digest of each step's tokens, sent back, proves it.

The prefix cache is per rank: each rank cuts, keeps and writes its own shard of every block,
under a directory of its own (``rank_cache_dir``). A hit must be a hit on every rank, so rank 0
asks the followers how many of a prompt's cached blocks they can supply (``Probe``), takes as
many as every rank can (``combine``), and names them in the ``Add``; each follower holds what it
offered until then (actors/follower_cache.py).

Why a side channel and not a collective (as mlx_lm.server sends its prompts): measured on
loopback with the ring backend, a round trip of a step message over TCP took ~0.1 ms and a
single ``all_sum`` of a scalar ~1.7 ms (docs/distributed.md); the socket also tells at once
when a follower is gone.

The channel listens on rank 0's network address, so nothing crosses it before both ends prove
they hold the group's shared secret (``read_secret``): rank 0 challenges each connection with
a nonce and checks the follower's HMAC of it, then answers the follower's own nonce with one of
its own. A connection that fails (a bad frame, a bad MAC, another model, a rank that is not a
free follower's, silence) is dropped and logged while rank 0 goes on waiting for the real
followers. Frames are not encrypted and carry no MAC after the handshake (docs/distributed.md
says to use a trusted network or a tunnel).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import select
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from actors.engine.config import EngineConfig
from actors.engine.memory_estimate import ModelMemory, machine_memory, model_memory_of
from actors.messages import OutputSpec, SamplingParams

if TYPE_CHECKING:
    from actors.follower_cache import ShardDisk

log = logging.getLogger(__name__)

MODES = ("tensor", "pipeline")
# How long rank 0 waits for every follower to connect, and a follower for rank 0 to listen
# (loading a large shard can take minutes on either side).
CONNECT_TIMEOUT_S = 600.0
# How long rank 0 waits for every follower's answer to a probe before it takes no cached
# blocks for the request (a follower reading many blocks from a slow disk, or gone).
PROBE_TIMEOUT_S = 5.0
# How long rank 0's step may go on after a follower is lost before it counts as stuck: the
# ring backend fails the collective in flight within about a second, but one queued after it
# gave up can wait forever.
STUCK_AFTER_S = 5.0
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
_HELLO_MAC = b"mlx-troupe distributed hello"
_WELCOME_MAC = b"mlx-troupe distributed welcome"
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
_to_follower = msgspec.msgpack.Decoder(ToFollower)
_to_leader = msgspec.msgpack.Decoder(ToLeader)
_hello = msgspec.msgpack.Decoder(Hello)
_handshake_to_follower = msgspec.msgpack.Decoder(Challenge | Welcome | Refused)


class ChannelError(Exception):
    """A peer sent what the channel does not carry: a frame above the size bound, or one that
    does not decode as a message expected there."""


def _send(sock: socket.socket, msg: Any) -> None:
    body = _encoder.encode(msg)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv(sock: socket.socket, decoder: msgspec.msgpack.Decoder, limit: int = FRAME_MAX,
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


def _mac(secret: bytes, label: bytes, *parts: bytes | int | str) -> bytes:
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


# -- where the ranks are -----------------------------------------------------------------------


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


def engine_config_for(config: EngineConfig, mode: str) -> EngineConfig:
    """The engine settings of a sharded model. Pipeline stages run mlx-lm's own model call: the
    one-pass forward (actors/engine/forward.py) runs every layer in one process."""
    if mode == "pipeline":
        return msgspec.structs.replace(config, mixed_step=False)
    return config


def rank_cache_dir(base: str | Path, mode: str, size: int, rank: int) -> Path:
    """Where one rank keeps its shard of the prefix cache: a directory per layout, so that a
    group of another size or mode never reads this one's shards."""
    return Path(base) / f"{mode}-{size}" / f"rank-{rank}"


def shard_memory(memory: ModelMemory, mode: str, size: int) -> ModelMemory:
    """The memory shape of one rank's shard, for its memory gate: tensor parallelism gives
    each rank 1/size of the heads and of the MLP; a pipeline stage holds the KV of its own
    layers (the largest stage's share counted). ``weights_bytes`` stays as given: the
    scheduler measures its own shard's."""
    if mode == "tensor":
        return msgspec.structs.replace(
            memory, kv_heads=math.ceil(memory.kv_heads / size),
            q_heads=math.ceil(memory.q_heads / size),
            intermediate=math.ceil(memory.intermediate / size))
    return msgspec.structs.replace(memory, kv_layers=math.ceil(memory.kv_layers / size))


def rank_memory_of(model_dir: str | Path, mode: str, size: int) -> ModelMemory:
    """One rank's share of the model in ``model_dir``, read from its files, for admission's
    prefill guard: ``shard_memory``'s shape (the scheduler's gate counts the same), and 1/size
    of the weights. That is the least the fullest rank holds (replicated embeddings, a larger
    stage); the monitor's floor, measured on the fullest rank, counts the rest."""
    whole = model_memory_of(model_dir)
    return msgspec.structs.replace(shard_memory(whole, mode, size),
                                   weights_bytes=math.ceil(whole.weights_bytes / size))


def combine(answers: list[Supply]) -> tuple[int, list[int]]:
    """What every follower can supply: the fewest leading blocks any offers, and after j of
    them the fewest partial-hit tokens any offers."""
    if not answers:
        return 0, []
    blocks = min(a.blocks for a in answers)
    partials = [min(a.partials[j] if j < len(a.partials) else 0 for a in answers)
                for j in range(blocks + 1)]
    return blocks, partials


def follower_memory() -> tuple[int, int]:
    """The most MLX memory any follower of this process's sharded model holds (as it last
    reported, after a step), and the highest peak any reported since the last call; (0, 0)
    outside rank 0 of a sharded model. The memory monitor adds the other ranks with it."""
    leader = _leader
    if leader is None:
        return 0, 0
    return leader.usage(), leader.take_peak()


_leader: Followers | None = None  # rank 0's channel, once every follower has connected


# -- rank 0 ------------------------------------------------------------------------------------


class _Probe:
    """A probe in flight: the answers so far, and the timer that gives up on the rest."""

    def __init__(self, timer: threading.Timer) -> None:
        self.timer = timer
        self.answers: dict[int, Supply] = {}


class Followers:
    """Rank 0's side of the channel: one connection per follower, owned by the scheduler's
    MLX thread (``add``, ``abort``, ``plan`` and ``probe`` are called there, in the order the
    engine sees them). A reader thread per follower keeps its last ``Status`` and collects
    its answers to probes; a follower whose connection closes is ``dead`` (a reason naming
    its rank), and stays so.

    ``on_supply(request_id, blocks, partials)`` gets what every follower can supply for a
    probed request (``combine``), once all have answered; nothing (0, []) when one did not
    answer within PROBE_TIMEOUT_S or was lost. ``on_lost(reason)`` is called once, when the
    first follower is lost. Both are called on a reader or timer thread."""

    def __init__(self, size: int, port: int, secret: bytes, host: str | None = None) -> None:
        self.size = size
        self.host = host or leader_host()
        self.port = port
        self.status: dict[int, dict[str, Any]] = {}
        self.dead: str | None = None
        self.on_supply: Callable[[str, int, list[int]], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.probe_timeouts = 0
        self._secret = secret
        self._socks: dict[int, socket.socket] = {}
        self._joining: set[int] = set()  # ranks being welcomed: taken for any other connection
        self._ram: dict[int, int] = {}  # each follower's machine RAM, as its Hello said
        self._implausible: set[int] = set()  # ranks whose impossible reports were logged
        self._lock = threading.Lock()
        self._probes: dict[str, _Probe] = {}
        self._peaks: dict[int, int] = {}  # the highest peak each reported since take_peak

    def accept(self, fingerprint: str, seed: int, config: EngineConfig,
               timeout: float = CONNECT_TIMEOUT_S,
               handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        """Wait until every follower has joined: proved it holds the secret, loaded the same
        model and claimed a rank of the group no other holds (``_join``). Each connection's
        handshake runs on a thread of its own, so one that fails or stays silent (dropped,
        after ``handshake_timeout`` at most) holds up no other; rank 0 stops listening once
        the group is whole, and raises, naming the missing ranks, after ``timeout``."""
        global _leader
        server = socket.create_server((self.host, self.port))
        deadline = time.monotonic() + timeout
        slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        try:
            while True:
                with self._lock:
                    missing = sorted(set(range(1, self.size)) - set(self._socks))
                if not missing:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"distributed: ranks {missing} did not connect to "
                                       f"{self.host}:{self.port} within {timeout:.0f} s")
                # Short waits: a handshake on another thread may complete the group meanwhile.
                if not slots.acquire(timeout=min(left, 0.1)):
                    continue
                server.settimeout(min(left, 0.1))
                try:
                    sock, addr = server.accept()
                except TimeoutError:
                    slots.release()
                    continue
                threading.Thread(target=self._handshake, daemon=True, name="handshake", args=(
                    sock, f"{addr[0]}:{addr[1]}", fingerprint, seed, config, handshake_timeout,
                    slots)).start()
        finally:
            server.close()  # a complete group takes no more connections, a failed one none
        _leader = self
        log.info("distributed: %d followers connected on %s:%d", self.size - 1, self.host,
                 self.port)

    def _handshake(self, sock: socket.socket, peer: str, fingerprint: str, seed: int,
                   config: EngineConfig, timeout: float,
                   slots: threading.BoundedSemaphore) -> None:
        """One connection's handshake: the follower joins, or the connection is dropped and
        logged (with the peer's address; nothing of the secret)."""
        try:
            why = self._join(sock, fingerprint, seed, config, time.monotonic() + timeout)
        except TimeoutError:
            why = f"it did not complete the handshake within {timeout:g} s"
        except ChannelError as exc:
            why = f"it sent {exc}"
        except OSError as exc:
            why = f"the connection failed: {exc}"
        finally:
            slots.release()
        if why is not None:
            sock.close()
            log.warning("distributed: dropped a connection from %s: %s", peer, why)

    def _join(self, sock: socket.socket, fingerprint: str, seed: int, config: EngineConfig,
              deadline: float) -> str | None:
        """Challenge the peer, check its ``Hello``, and welcome it as the rank it claims; or
        say why not (a peer that sent a well-formed Hello is told, in a ``Refused``)."""
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.urandom(NONCE_BYTES)
        _send(sock, Challenge(nonce=nonce))
        hello = _recv(sock, _hello, HANDSHAKE_FRAME_MAX, deadline)
        if hello is None:
            return "it closed the connection before its Hello"
        why = self._refusal(hello, nonce, fingerprint)
        if why is None:
            with self._lock:  # the first connection to prove itself for a rank keeps it
                if hello.rank in self._socks or hello.rank in self._joining:
                    why = f"rank {hello.rank} has already joined"
                else:
                    self._joining.add(hello.rank)
        if why is not None:
            try:
                _send(sock, Refused(reason=why))
            except OSError:
                pass
            return f"rank {hello.rank} on {hello.host} (pid {hello.pid}): {why}"
        try:
            _send(sock, Welcome(seed=seed, config=config, mac=_mac(
                self._secret, _WELCOME_MAC, hello.nonce, nonce, hello.rank)))
        except OSError:
            with self._lock:
                self._joining.discard(hello.rank)
            raise
        sock.settimeout(None)
        with self._lock:
            self._joining.discard(hello.rank)
            self._socks[hello.rank] = sock
            self._ram[hello.rank] = hello.ram_bytes
            self.status[hello.rank] = {"rank": hello.rank, "host": hello.host,
                                       "pid": hello.pid, "step": 0, "connected": True}
        threading.Thread(target=self._read, args=(hello.rank, sock), daemon=True,
                         name=f"follower-{hello.rank}").start()
        return None

    def _refusal(self, hello: Hello, nonce: bytes, fingerprint: str) -> str | None:
        """Why ``hello``, answering the challenge ``nonce``, cannot join; None if it can."""
        expected = _mac(self._secret, _HELLO_MAC, nonce, hello.nonce, hello.rank,
                        hello.fingerprint)
        # compare_digest: the time taken must not reveal how much of the MAC matched.
        if not hmac.compare_digest(expected, hello.mac):
            return (f"it did not prove it holds the group's secret (is ${SECRET_ENV} the same "
                    "on every rank?)")
        if not 1 <= hello.rank < self.size:
            return f"rank {hello.rank} is not a follower's rank in a group of {self.size}"
        if hello.fingerprint != fingerprint:
            return f"it loaded a different model ({hello.fingerprint} != {fingerprint})"
        return None

    def add(self, request_id: str, prompt: list[int], sampling: SamplingParams,
            output: OutputSpec | None, grammar: str | None, blocks: int = 0,
            cached_tokens: int = 0, namespace: str = "") -> None:
        self._broadcast(Add(request_id=request_id, prompt=prompt, sampling=sampling,
                            output=output, grammar=grammar, blocks=blocks,
                            cached_tokens=cached_tokens, namespace=namespace))

    def abort(self, request_id: str) -> None:
        self._broadcast(Abort(request_id=request_id))

    def plan(self, plan: Any, step: int, digest: int) -> None:
        """Called by rank 0's engine with each step's plan (``schedule.SchedulerOutput``) before it
        runs it, and the digest of the tokens its last step sampled."""
        self._broadcast(Plan(step=step, fail=plan.fail, reject=plan.reject, admit=plan.admit,
                             budget=plan.budget, chunk=plan.chunk, previous_digest=digest,
                             start=plan.start, tokens=plan.tokens))

    def reset(self, reason: str) -> None:
        self._broadcast(Reset(reason=reason))

    def probe(self, request_id: str, prompt: list[int], blocks: int, namespace: str = "",
              timeout: float = PROBE_TIMEOUT_S) -> None:
        """Ask every follower how many of the prompt's first ``blocks`` cached blocks (in cache
        namespace ``namespace``) it can supply; ``on_supply`` gets the answer."""
        timer = threading.Timer(timeout, self._expire, (request_id, timeout))
        timer.daemon = True
        with self._lock:
            self._probes[request_id] = _Probe(timer)
        timer.start()
        self._broadcast(Probe(request_id=request_id, prompt=prompt, blocks=blocks,
                              namespace=namespace))

    def release(self, request_id: str) -> None:
        """A probed request will not be added: the followers drop what they reserved."""
        self._forget(request_id)
        self._broadcast(Release(request_id=request_id))

    def spill(self, hashes: list[str]) -> None:
        if hashes:
            self._broadcast(Spill(hashes=hashes))

    def usage(self) -> int:
        """The most MLX memory any follower holds, as it reported after its last step."""
        with self._lock:
            return max((s.get("active_bytes", 0) for s in self.status.values()), default=0)

    def take_peak(self) -> int:
        """The highest peak any follower reported since the last call."""
        with self._lock:
            peak = max(self._peaks.values(), default=0)
            self._peaks.clear()
            return peak

    def close(self) -> None:
        """Tell the followers to stop, and close the channel."""
        global _leader
        if _leader is self:
            _leader = None
        if self.dead is None:
            self._broadcast(Bye())
        for sock in list(self._socks.values()):
            try:
                sock.close()
            except OSError:
                pass
        with self._lock:
            probes, self._probes = list(self._probes.values()), {}
        for p in probes:
            p.timer.cancel()

    def report(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(s) for _, s in sorted(self.status.items())]

    def _broadcast(self, msg: Any) -> None:
        for rank, sock in list(self._socks.items()):
            try:
                _send(sock, msg)
            except OSError as exc:
                self._lost(rank, f"could not send: {exc}")

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                msg = _recv(sock, _to_leader)
            except ChannelError as exc:
                self._lost(rank, f"sent {exc}")
                return
            if msg is None:
                self._lost(rank, "closed its connection")
                return
            if isinstance(msg, Status) and self._plausible(rank, msg):
                fields = msgspec.structs.asdict(msg)
                del fields["rank"]
                with self._lock:
                    self._peaks[rank] = max(self._peaks.get(rank, 0), msg.peak_bytes)
                    status = self.status[rank]
                    # The highest peak it reached, as the memory monitor reports rank 0's.
                    fields["peak_bytes"] = max(status.get("peak_bytes", 0), msg.peak_bytes)
                    status.update(fields, seen=time.time())
            elif isinstance(msg, Supply):
                self._supplied(rank, msg)

    def _plausible(self, rank: int, msg: Status) -> bool:
        """Whether a follower's memory figures can be true: none negative, none above its
        machine's RAM. Counted, an impossible one would starve the memory gate (or hide a
        real shortage), so it is ignored, and logged once per rank."""
        ram = self._ram[rank]
        if 0 <= msg.active_bytes <= ram and 0 <= msg.peak_bytes <= ram:
            return True
        if rank not in self._implausible:
            self._implausible.add(rank)
            log.warning("distributed: rank %d reported %d bytes of memory in use (peak %d) on a "
                        "machine of %d; such reports are ignored", rank, msg.active_bytes,
                        msg.peak_bytes, ram)
        return False

    def _supplied(self, rank: int, msg: Supply) -> None:
        with self._lock:
            probe = self._probes.get(msg.request_id)
            if probe is None:
                return  # it timed out, or was released, before this answer came
            probe.answers[rank] = msg
            if len(probe.answers) < len(self._socks):
                return
            del self._probes[msg.request_id]
        probe.timer.cancel()
        self._deliver(msg.request_id, *combine(list(probe.answers.values())))

    def _expire(self, request_id: str, timeout: float) -> None:
        with self._lock:
            probe = self._probes.pop(request_id, None)
            if probe is None:
                return
            missing = sorted(set(self._socks) - set(probe.answers))
            self.probe_timeouts += 1
        log.warning("distributed: ranks %s did not say within %.1f s which cached blocks of %s "
                    "they hold; its prompt is prefilled without them", missing, timeout,
                    request_id)
        self._deliver(request_id, 0, [])

    def _forget(self, request_id: str) -> None:
        with self._lock:
            probe = self._probes.pop(request_id, None)
        if probe is not None:
            probe.timer.cancel()

    def _deliver(self, request_id: str, blocks: int, partials: list[int]) -> None:
        if self.on_supply is not None:
            self.on_supply(request_id, blocks, partials)

    def _lost(self, rank: int, why: str) -> None:
        with self._lock:
            if rank in self.status:
                self.status[rank]["connected"] = False
            first = self.dead is None
            if first:
                host = self.status.get(rank, {}).get("host", "?")
                self.dead = f"distributed rank {rank} ({host}) {why}"
            probes, self._probes = list(self._probes.items()), {}
        if first:
            log.error("%s: requests fail and new ones get 503 until the group restarts",
                      self.dead)
            if self.on_lost is not None:
                self.on_lost(self.dead)
        for request_id, probe in probes:  # a lost rank supplies nothing
            probe.timer.cancel()
            self._deliver(request_id, 0, [])


# -- the other ranks ---------------------------------------------------------------------------


def connect(rank: int, port: int, fingerprint: str, secret: bytes, host: str | None = None,
            timeout: float = CONNECT_TIMEOUT_S,
            handshake_timeout: float = HANDSHAKE_TIMEOUT_S) -> tuple[socket.socket, Welcome]:
    """A follower's connection to rank 0 (retried while rank 0 is still loading). Nothing of
    this rank's reaches the peer but its Hello before the peer has proved it holds ``secret``
    (``_introduce``); raises RuntimeError, saying why, when it does not or refuses this rank."""
    host = host or leader_host()
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5.0)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"distributed: rank {rank} could not reach rank 0 at "
                                   f"{host}:{port} within {timeout:.0f} s") from None
            time.sleep(0.2)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    where = f"{host}:{port}"
    try:
        welcome = _introduce(sock, rank, fingerprint, secret, where,
                             time.monotonic() + handshake_timeout)
    except TimeoutError:
        why = f"rank {rank}: the handshake with {where} took over {handshake_timeout:g} s"
    except ChannelError as exc:
        why = f"rank {rank}: {where} sent {exc}"
    except OSError as exc:
        why = f"rank {rank}: the connection to {where} failed: {exc}"
    except RuntimeError as exc:
        why = str(exc)
    else:
        sock.settimeout(None)
        return sock, welcome
    sock.close()
    raise RuntimeError(f"distributed: {why}")


def _introduce(sock: socket.socket, rank: int, fingerprint: str, secret: bytes, where: str,
               deadline: float) -> Welcome:
    """A follower's side of the handshake: answer rank 0's challenge, and take its
    ``Welcome`` only with a MAC of this rank's own nonce under the secret."""
    challenge = _recv(sock, _handshake_to_follower, HANDSHAKE_FRAME_MAX, deadline)
    if not isinstance(challenge, Challenge):
        raise RuntimeError(f"rank {rank}: {where} sent no challenge")
    nonce = os.urandom(NONCE_BYTES)
    _send(sock, Hello(rank=rank, host=socket.gethostname(), pid=os.getpid(),
                      fingerprint=fingerprint, ram_bytes=machine_memory()[0], nonce=nonce,
                      mac=_mac(secret, _HELLO_MAC, challenge.nonce, nonce, rank, fingerprint)))
    answer = _recv(sock, _handshake_to_follower, HANDSHAKE_FRAME_MAX, deadline)
    if isinstance(answer, Refused):
        raise RuntimeError(f"rank 0 refused rank {rank}: {answer.reason}")
    if not isinstance(answer, Welcome):
        raise RuntimeError(f"rank {rank}: {where} closed the connection during the handshake")
    if not hmac.compare_digest(answer.mac, _mac(secret, _WELCOME_MAC, nonce, challenge.nonce,
                                                rank)):
        raise RuntimeError(f"rank {rank}: {where} did not prove it holds the group's secret "
                           f"(is ${SECRET_ENV} the same on every rank?); not following it")
    return answer


def follow(engine: Any, sock: socket.socket, rank: int, grammars: Any = None,
           disk: ShardDisk | None = None) -> int:
    """Run rank 0's batch on this rank's shard until rank 0 says ``Bye`` or goes away.

    ``engine``: an ``Engine`` over this rank's shard, with rank 0's settings. ``grammars``:
    compiles the grammars of constrained requests (``actors.engine.grammar.Grammars``).
    ``disk``: this rank's prefix-cache files (``follower_cache.ShardDisk``; None: RAM only).
    Returns the process's exit code: 0 when rank 0 stopped, 1 when this rank diverged or
    cannot supply the cached blocks it promised, or rank 0 sent a frame it cannot read."""
    import mlx.core as mx

    from actors.engine.schedule import SchedulerOutput
    from actors.follower_cache import FollowerCache, SupplyError

    lock = threading.Lock()  # answers to probes also go from the disk thread

    def send(msg: Any) -> None:
        try:
            with lock:
                _send(sock, msg)
        except OSError:
            pass  # rank 0 is gone: the next receive says so

    def answer(request_id: str, blocks: int, partials: list[int]) -> None:
        send(Supply(request_id=request_id, blocks=blocks, partials=partials))

    def status() -> None:
        send(Status(rank=rank, step=steps, digest=engine.last_digest,
                    active_bytes=mx.get_active_memory(), peak_bytes=mx.get_peak_memory(),
                    **cache.stats()))

    cache = FollowerCache(engine, answer, disk)
    steps = 0
    status()  # rank 0 counts this rank's memory from the start (its weights)
    while True:
        if cache.unsaved:
            # Between messages, new blocks go to the disk thread as fast as it takes them.
            wait = 0.0 if cache.can_persist() else 0.05
            if not select.select([sock], [], [], wait)[0]:
                cache.persist()
                continue
        try:
            msg = _recv(sock, _to_follower)
        except ChannelError as exc:
            log.error("distributed rank %d: rank 0 sent %s; exiting", rank, exc)
            return 1
        match msg:
            case None | Bye():
                cache.persist(everything=True)
                log.info("distributed rank %d: rank 0 stopped; exiting", rank)
                return 0
            case Probe():
                cache.probe(msg.request_id, msg.prompt, msg.blocks, msg.namespace)
            case Release():
                cache.release(msg.request_id)
            case Spill():
                cache.spill(msg.hashes)
            case Add():
                constraint = grammars.compile(msg.grammar) if msg.grammar else None
                try:
                    cached, partial = cache.claim(msg.request_id, msg.prompt, msg.blocks,
                                                  msg.cached_tokens, msg.namespace)
                except SupplyError as exc:
                    log.error("distributed rank %d cannot supply the cache rank 0 took: %s; "
                              "exiting", rank, exc)
                    return 1
                req = engine.add(msg.request_id, msg.prompt, msg.sampling, cached=cached,
                                 partial_max=partial, output=msg.output, constraint=constraint,
                                 namespace=msg.namespace)
                if req.cached_tokens != msg.cached_tokens:
                    log.error("distributed rank %d starts %s from %d cached tokens, rank 0 "
                              "from %d; exiting", rank, msg.request_id, req.cached_tokens,
                              msg.cached_tokens)
                    return 1
            case Abort():
                engine.abort(msg.request_id)
                cache.forget(msg.request_id)
            case Reset():
                engine.reset(msg.reason)
            case Plan():
                if msg.previous_digest != engine.last_digest:
                    log.error("distributed rank %d diverged from rank 0 before step %d "
                              "(token digest %d != %d); exiting", rank, msg.step,
                              engine.last_digest, msg.previous_digest)
                    return 1
                plan = SchedulerOutput(fail=msg.fail, reject=msg.reject, admit=msg.admit,
                                       budget=msg.budget, chunk=msg.chunk, held=False,
                                       start=msg.start, tokens=msg.tokens)
                mx.reset_peak_memory()
                engine.step(plan=plan)
                cache.after_step()
                steps += 1
                status()


# -- starting a rank ---------------------------------------------------------------------------


def start_rank(config: Any) -> tuple[Any, int | None]:
    """Join the group ``mlx.launch`` started, for ``troupe serve --distributed``.

    Every rank's prefix cache lives in its own directory under the cache directory
    (``rank_cache_dir``). Rank 0 gets back the configuration to serve with (that directory,
    and for pipeline stages mlx-lm's own model call: ``engine_config_for``) and None; every
    other rank follows rank 0 until it stops and gets back its exit code. Raises ValueError
    when this rank has no usable shared secret (``read_secret``)."""
    import mlx.core as mx

    from actors.config import model_specs
    from actors.serving import cache_dir

    if config.distributed not in MODES:
        raise ValueError(f"--distributed must be one of {MODES}, not {config.distributed!r}")
    specs = model_specs(config)
    if len(specs) != 1:
        raise ValueError("--distributed serves one model; give --model once")
    group = mx.distributed.init()
    if group.size() < 2:
        raise RuntimeError("--distributed needs the ranks of `mlx.launch` (this process is "
                           "alone in its group); see docs/distributed.md")
    read_secret()  # every rank stops here, saying why, before it loads its shard
    engine = engine_config_for(config.engine(), config.distributed)
    here = rank_cache_dir(cache_dir(config), config.distributed, group.size(), group.rank())
    config = msgspec.structs.replace(config, mixed_step=engine.mixed_step, cache_dir=str(here))
    if group.rank() == 0:
        log.info("distributed: rank 0 of %d (%s parallel); prefix cache in %s",
                 group.size(), config.distributed, here if config.block_size else "(off)")
        return config, None
    return config, _serve_follower(config, specs[0], group)


def load_shard(path: str, mode: str, group: Any) -> tuple[Any, Any]:
    """This rank's shard of the model at ``path`` and its tokenizer. Uses mlx-lm's
    ``sharded_load`` (each rank reads only its own weights) when the directory has a weight
    index; a single-file model is loaded whole, then sharded."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import sharded_load

    config = json.loads((Path(path) / "config.json").read_text())
    if mode == "tensor":
        check_tensor_split(config, group.size())
    if (Path(path) / "model.safetensors.index.json").exists():
        return sharded_load(path, pipeline_group=group if mode == "pipeline" else None,
                            tensor_group=group if mode == "tensor" else None)
    model, tokenizer = load(path, lazy=True)
    if mode == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"mlx-lm cannot shard a {config.get('model_type')} model by tensor")
        model.shard(group)
    else:
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ValueError(f"mlx-lm cannot split a {config.get('model_type')} model into "
                             "pipeline stages")
        inner.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank loaded
    return model, tokenizer


def check_tensor_split(config: dict[str, Any], size: int) -> None:
    """Tensor parallelism gives each rank a share of the attention heads: refuse, clearly, a
    model whose head counts do not split over ``size`` ranks (mlx-lm would fail later, in a
    forward pass, on mismatched shapes)."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    for name, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(n, int) and n % size:
            raise ValueError(f"the model's {n} {name} do not split over {size} ranks; use a "
                             "model whose head counts divide, or --distributed pipeline")


def _serve_follower(config: Any, spec: str | None, group: Any) -> int:
    """A follower rank: load its shard, connect to rank 0, run its batch until it stops."""
    import mlx.core as mx

    from actors.engine.core import Engine
    from actors.engine.grammar import Grammars
    from actors.engine.prefix import model_fingerprint
    from actors.follower_cache import ShardDisk
    from actors.models.store import resolve_model

    rank = group.rank()
    signals = 0

    def on_signal(signum: int, frame: Any) -> None:
        # mlx.launch signals every rank at once: a follower stops when rank 0 has finished
        # what is in flight and says so (or goes away); a second signal stops it now.
        nonlocal signals
        signals += 1
        if signals > 1:
            raise SystemExit(1)
        log.info("distributed rank %d: stopping when rank 0 stops", rank)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    resolved = resolve_model(spec)
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):
        model, tokenizer = load_shard(str(resolved.path), config.distributed, group)
    fingerprint = model_fingerprint(resolved.path)
    sock, welcome = connect(rank, config.distributed_port, fingerprint, read_secret())
    log.info("distributed: rank %d of %d follows rank 0 (%s parallel)", rank, group.size(),
             config.distributed)
    mx.random.seed(welcome.seed)
    with mx.stream(stream):
        # The fingerprint names the blocks: every rank's hashes of a prompt are rank 0's.
        engine = Engine(model, tokenizer, welcome.config, stream=stream,
                        fingerprint=fingerprint)
        disk = (ShardDisk(config.cache_dir, fingerprint, config.cache_disk_max)
                if engine.caching else None)
        engine.warm_up()  # rank 0 warms up too: the same forward passes, in step
        try:
            return follow(engine, sock, rank, Grammars(tokenizer), disk)
        finally:
            # Exiting now: a signal still on its way (mlx.launch signals every rank, and rank 0
            # may finish first) must not land after the interpreter has restored the default
            # handlers at exit, which would end this rank with -SIGTERM instead of its code.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
            if disk is not None:
                disk.close()
            engine.close()
            sock.close()
