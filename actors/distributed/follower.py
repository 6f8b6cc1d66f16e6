"""A follower rank of a sharded model: its connection to rank 0 and the loop that runs rank
0's batch on this rank's shard.

A follower applies what rank 0 tells it (a request added, aborted, each step's plan, a reset)
to its own ``Engine`` and runs the step; its sampled tokens are the same as rank 0's (the
same logits, the same seeded PRNG), and a digest of each step's tokens, sent back in its
``Status``, proves it. Its prefix cache is its own shard of every block
(actors/follower_cache.py): rank 0 asks it what it can supply (``Probe``) before it names the
cached blocks a request starts from (``Add``).
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from troupe.actors.distributed.protocol import (
    CONNECT_TIMEOUT_S,
    HANDSHAKE_FRAME_MAX,
    HANDSHAKE_TIMEOUT_S,
    HANDSHAKE_TO_FOLLOWER,
    HELLO_MAC,
    NONCE_BYTES,
    SECRET_ENV,
    TO_FOLLOWER,
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
    hmac_of,
    leader_host,
    recv_msg,
    send_msg,
)
from troupe.actors.engine.memory_estimate import machine_memory

if TYPE_CHECKING:
    from troupe.actors.follower_cache import Disk

log = logging.getLogger(__name__)

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
    challenge = recv_msg(sock, HANDSHAKE_TO_FOLLOWER, HANDSHAKE_FRAME_MAX, deadline)
    if not isinstance(challenge, Challenge):
        raise RuntimeError(f"rank {rank}: {where} sent no challenge")
    nonce = os.urandom(NONCE_BYTES)
    send_msg(sock, Hello(rank=rank, host=socket.gethostname(), pid=os.getpid(),
                      fingerprint=fingerprint, ram_bytes=machine_memory()[0], nonce=nonce,
                      mac=hmac_of(secret, HELLO_MAC, challenge.nonce, nonce, rank, fingerprint)))
    answer = recv_msg(sock, HANDSHAKE_TO_FOLLOWER, HANDSHAKE_FRAME_MAX, deadline)
    if isinstance(answer, Refused):
        raise RuntimeError(f"rank 0 refused rank {rank}: {answer.reason}")
    if not isinstance(answer, Welcome):
        raise RuntimeError(f"rank {rank}: {where} closed the connection during the handshake")
    if not hmac.compare_digest(answer.mac, hmac_of(secret, WELCOME_MAC, nonce, challenge.nonce,
                                                rank)):
        raise RuntimeError(f"rank {rank}: {where} did not prove it holds the group's secret "
                           f"(is ${SECRET_ENV} the same on every rank?); not following it")
    return answer


def follow(engine: Any, sock: socket.socket, rank: int, grammars: Any = None,
           disk: Disk | None = None) -> int:
    """Run rank 0's batch on this rank's shard until rank 0 says ``Bye`` or goes away.

    ``engine``: an ``Engine`` over this rank's shard, with rank 0's settings. ``grammars``:
    compiles the grammars of constrained requests (``actors.engine.grammar.Grammars``).
    ``disk``: this rank's prefix-cache files (``follower_disk.FollowerDisk``; None: RAM only).
    Returns the process's exit code: 0 when rank 0 stopped, 1 when this rank diverged or
    cannot supply the cached blocks it promised, or rank 0 sent a frame it cannot read."""
    import mlx.core as mx

    from troupe.actors.engine.schedule import SchedulerOutput
    from troupe.actors.follower_cache import FollowerCache, SupplyError

    lock = threading.Lock()  # answers to probes also go from the disk clerk's thread

    def send(msg: Any) -> None:
        try:
            with lock:
                send_msg(sock, msg)
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
            # Between messages, new blocks go to the SSD writer as fast as it takes them.
            wait = 0.0 if cache.can_persist() else 0.05
            if not select.select([sock], [], [], wait)[0]:
                cache.persist()
                continue
        try:
            msg = recv_msg(sock, TO_FOLLOWER)
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
                                       start=msg.start, tokens=msg.tokens, draft=msg.draft)
                mx.reset_peak_memory()
                engine.step(plan=plan)
                cache.after_step()
                steps += 1
                status()
