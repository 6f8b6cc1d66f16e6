"""Rank 0's side of a sharded model: its channel to the other ranks (``Followers``).

Rank 0's scheduler tells the followers, through ``Followers``, everything that changes the
batch, in order: a request added, a request aborted, each step's plan, a reset, a spill of
prefix-cache blocks. A reader thread per follower keeps its last ``Status`` (its step, its
memory, its cache) and collects its answers to probes. A connection that fails the handshake
(a bad frame, a bad MAC, another model, a rank that is not a free follower's, silence) is
dropped and logged while rank 0 goes on waiting for the real followers.

The followers' memory leaves this object only through ``usage`` and ``take_peak``, called by
its owner (the scheduler), which tells the memory monitor (``RanksMemory``): nothing here is
read by another actor.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from troupe.actors.distributed.protocol import (
    CONNECT_TIMEOUT_S,
    HANDSHAKE_FRAME_MAX,
    HANDSHAKE_TIMEOUT_S,
    HELLO,
    HELLO_MAC,
    MAX_HANDSHAKES,
    NONCE_BYTES,
    SECRET_ENV,
    TO_LEADER,
    WELCOME_MAC,
    Abort,
    Add,
    Bye,
    Challenge,
    ChannelError,
    Hello,
    Plan,
    Probe,
    Refused,
    Release,
    Reset,
    Spill,
    Status,
    Supply,
    Welcome,
    combine,
    hmac_of,
    leader_host,
    recv_msg,
    send_msg,
)
from troupe.actors.engine.config import EngineConfig
from troupe.actors.messages import OutputSpec, SamplingParams

log = logging.getLogger(__name__)

# How long rank 0 waits for every follower's answer to a probe before it takes no cached
# blocks for the request (a follower reading many blocks from a slow disk, or gone).
PROBE_TIMEOUT_S = 5.0
# How long rank 0's step may go on after a follower is lost before it counts as stuck: the
# ring backend fails the collective in flight within about a second, but one queued after it
# gave up can wait forever.
STUCK_AFTER_S = 5.0


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
        send_msg(sock, Challenge(nonce=nonce))
        hello = recv_msg(sock, HELLO, HANDSHAKE_FRAME_MAX, deadline)
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
                send_msg(sock, Refused(reason=why))
            except OSError:
                pass
            return f"rank {hello.rank} on {hello.host} (pid {hello.pid}): {why}"
        try:
            send_msg(sock, Welcome(seed=seed, config=config, mac=hmac_of(
                self._secret, WELCOME_MAC, hello.nonce, nonce, hello.rank)))
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
        expected = hmac_of(self._secret, HELLO_MAC, nonce, hello.nonce, hello.rank,
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
                             start=plan.start, tokens=plan.tokens, draft=plan.draft))

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
                send_msg(sock, msg)
            except OSError as exc:
                self._lost(rank, f"could not send: {exc}")

    def _read(self, rank: int, sock: socket.socket) -> None:
        while True:
            try:
                msg = recv_msg(sock, TO_LEADER)
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

