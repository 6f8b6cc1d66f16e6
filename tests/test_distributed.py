"""Serving one model over several ranks (actors/distributed/).

The channel between rank 0 and its followers is tested with stand-in engines, and who may join
it with real sockets (bad frames, silence, a wrong secret, model or rank, a false rank 0); the
whole thing runs as two `troupe serve --distributed` processes on loopback (ranks started the
way `mlx.launch` starts them, and once by `mlx.launch` itself), compared with one process over
HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest

from troupe.actors.distributed.follower import connect, follow
from troupe.actors.distributed.leader import Followers
from troupe.actors.distributed.protocol import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    Abort,
    Challenge,
    Status,
    Welcome,
    read_secret,
)
from troupe.actors.distributed.shards import (
    MODES,
    check_tensor_split,
    engine_config_for,
    rank_cache_dir,
    shard_memory,
)
from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.memory_estimate import ModelMemory
from troupe.actors.engine.prefix_cache import PrefixCache
from troupe.actors.engine.schedule import SchedulerOutput
from troupe.actors.messages import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the parts ---------------------------------------------------------------------------------


def test_a_model_whose_heads_do_not_split_is_refused_with_the_reason():
    # The default model: 9 attention heads, 3 key/value heads.
    with pytest.raises(ValueError, match="9 attention heads do not split over 2 ranks"):
        check_tensor_split({"num_attention_heads": 9, "num_key_value_heads": 3}, 2)
    check_tensor_split({"num_attention_heads": 9, "num_key_value_heads": 3}, 3)
    with pytest.raises(ValueError, match="3 key/value heads"):
        check_tensor_split({"text_config": {"num_attention_heads": 12,
                                            "num_key_value_heads": 3}}, 2)


def test_sharded_engines_keep_the_prefix_cache_and_pipelines_run_without_one_pass():
    base = EngineConfig(block_size=64, mixed_step=True)
    assert engine_config_for(base, "tensor") == base
    assert engine_config_for(base, "pipeline") == msgspec.structs.replace(
        base, mixed_step=False)


def test_each_rank_keeps_its_shard_of_the_cache_where_no_other_layout_looks():
    dirs = {rank_cache_dir("/c", mode, size, rank) for mode in MODES for size in (2, 3)
            for rank in range(size)}
    assert len(dirs) == 10
    assert rank_cache_dir("/c", "tensor", 2, 1) == Path("/c/tensor-2/rank-1")


def test_a_ranks_memory_shape_is_its_shard_of_the_model():
    whole = ModelMemory(kv_layers=30, kv_heads=3, head_dim=64, q_heads=9, hidden=576,
                        intermediate=1536, dtype_bytes=2, weights_bytes=10)
    tensor = shard_memory(whole, "tensor", 3)
    assert (tensor.kv_heads, tensor.q_heads, tensor.intermediate) == (1, 3, 512)
    assert tensor.kv_per_token * 3 == whole.kv_per_token
    assert shard_memory(whole, "pipeline", 4).kv_layers == 8  # the largest stage's layers


class Recorder:
    """An engine stand-in: records what the follower applies, and 'samples' a digest that is
    the number of steps it ran (rank 0's stand-in counts the same way)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.last_digest = 0
        self.blocks = PrefixCache(0)

    def add(self, request_id, prompt, sampling, cached=(), *, partial_max=None, output=None,
            constraint=None, namespace=""):
        self.calls.append(("add", request_id, prompt, sampling.max_tokens, constraint))
        return SimpleNamespace(cached_tokens=0)

    def abort(self, request_id):
        self.calls.append(("abort", request_id))

    def reset(self, reason):
        self.calls.append(("reset", reason))

    def step(self, plan):
        self.calls.append(("step", plan.admit, plan.chunk, plan.fail, plan.start, plan.tokens))
        self.last_digest += 1

    def take_new_blocks(self):
        return []


class Grammars:
    def compile(self, source):
        return f"compiled:{source}"


SECRET = secrets.token_hex(32).encode()  # the group's shared secret in these tests


def _pair(port: int, fingerprint: str = "fp") -> tuple[Followers, socket.socket]:
    followers = Followers(size=2, port=port, secret=SECRET, host="127.0.0.1")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "sock", connect(1, port, fingerprint, SECRET, host="127.0.0.1", timeout=10)))
    t.start()
    followers.accept("fp", seed=7, config=EngineConfig(), timeout=10)
    t.join()
    sock, welcome = result["sock"]
    assert (welcome.seed, welcome.config) == (7, EngineConfig())
    return followers, sock


def _following(engine: Recorder, sock: socket.socket) -> tuple[threading.Thread, dict]:
    """``follow`` on a thread of its own; its exit code lands in the dict under "exit"."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "exit", follow(engine, sock, 1, Grammars())))
    t.start()
    return t, out


def _plan(admit: int = 1, chunk: int = 64, fail: list[int] | None = None,
          start: list[int] | None = None, tokens: dict[int, int] | None = None
          ) -> SchedulerOutput:
    return SchedulerOutput(fail=fail or [], reject=None, admit=admit, budget=None, chunk=chunk,
                           held=False, start=start or [], tokens=tokens or {})


def test_a_follower_applies_rank_0s_requests_and_plans_in_order_then_stops_on_bye():
    followers, sock = _pair(free_port())
    engine = Recorder()
    t, out = _following(engine, sock)
    sampling = SamplingParams(max_tokens=5, temperature=0.0)
    followers.add("a", [1, 2, 3], sampling, None, None)
    followers.add("b", [4], sampling, None, '{"grammars": []}')
    followers.plan(_plan(admit=2, chunk=32, start=[0, 1], tokens={0: 2, 1: 1}), step=0,
                   digest=0)
    followers.abort("a")
    followers.plan(_plan(admit=0, chunk=16, fail=[3]), step=1, digest=1)
    followers.reset("boom")
    deadline = time.monotonic() + 10
    while len(engine.calls) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    followers.close()
    t.join(10)
    assert out["exit"] == 0
    assert engine.calls == [
        ("add", "a", [1, 2, 3], 5, None),
        ("add", "b", [4], 5, 'compiled:{"grammars": []}'),
        ("step", 2, 32, [], [0, 1], {0: 2, 1: 1}),
        ("abort", "a"),
        ("step", 0, 16, [3], [], {}),
        ("reset", "boom"),
    ]
    # Each step's status came back: rank 0 shows where its follower stands.
    deadline = time.monotonic() + 10
    while followers.report()[0]["step"] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert followers.report()[0]["step"] == 2
    assert followers.report()[0]["rank"] == 1


def test_a_follower_that_diverged_from_rank_0_stops_and_rank_0_says_which_rank():
    followers, sock = _pair(free_port())
    engine = Recorder()
    t, out = _following(engine, sock)
    followers.plan(_plan(), step=0, digest=0)
    followers.plan(_plan(), step=1, digest=12345)  # rank 0 sampled other tokens
    t.join(10)
    assert out["exit"] == 1
    sock.close()
    deadline = time.monotonic() + 10
    while followers.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert followers.dead is not None and "rank 1" in followers.dead
    followers.close()


def test_rank_0_names_the_ranks_that_never_connected():
    followers = Followers(size=3, port=free_port(), secret=SECRET, host="127.0.0.1")
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] did not connect"):
        followers.accept("fp", seed=1, config=EngineConfig(), timeout=0.5)
    followers.close()


# -- who may join: the handshake over real sockets ---------------------------------------------


def _accepting(followers: Followers, **kwargs: Any) -> tuple[threading.Thread, dict]:
    """Rank 0's ``accept`` on a thread of its own; what it raised lands under "error"."""
    out: dict = {}

    def run() -> None:
        try:
            followers.accept("fp", seed=7, config=EngineConfig(), **kwargs)
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _joined(t: threading.Thread, out: dict) -> bool:
    """Whether ``accept`` returned with the group whole (it waits 30 s at most here)."""
    t.join(30)
    return not t.is_alive() and "error" not in out


def _dial(port: int) -> socket.socket:
    """A raw connection to a listening port (retried until it listens), whose reads give up
    after 30 s rather than hang the test."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _frame(msg: Any) -> bytes:
    """A message as the channel frames it: a 4-byte little-endian length, then msgpack."""
    body = msgspec.msgpack.encode(msg)
    return struct.pack("<I", len(body)) + body


def _read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            assert chunk, "the peer closed the connection"
            buf += chunk
        return buf

    return exactly(struct.unpack("<I", exactly(4))[0])


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closes the connection within the socket's timeout (what it sends
    before is read and dropped)."""
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.parametrize("sends,why", [
    pytest.param(struct.pack("<I", 5) + b"hello", "a frame that is not a message",
                 id="garbage"),
    pytest.param(struct.pack("<I", 0xFFFF_FFF0), "a frame of 4294967280 bytes",
                 id="a 4 GB length prefix"),
    pytest.param(_frame(Status(rank=1, step=9, digest=0, active_bytes=10**15,
                               peak_bytes=10**15)), "a frame that is not a message",
                 id="a status without a handshake"),
])
def test_a_peer_that_sends_no_hello_is_dropped_and_the_real_follower_still_joins(
        sends, why, caplog):
    port = free_port()
    followers = Followers(size=2, port=port, secret=SECRET, host="127.0.0.1")
    # A handshake timeout longer than the peer's socket waits: the frame itself gets it dropped.
    with caplog.at_level(logging.WARNING, logger="actors.distributed"):
        t, out = _accepting(followers, timeout=60, handshake_timeout=60)
        bad = _dial(port)
        bad.sendall(sends)
        assert _closed_by_peer(bad)
        sock, _ = connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10)
        assert _joined(t, out), out
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and why in dropped[0], dropped
    assert f"dropped a connection from 127.0.0.1:{bad.getsockname()[1]}" in dropped[0]
    assert SECRET.decode() not in caplog.text
    # Nothing the peer sent counts: rank 1 has reported nothing yet.
    assert followers.report() == [{"rank": 1, "host": socket.gethostname(), "pid": os.getpid(),
                                   "step": 0, "connected": True}]
    assert followers.usage() == 0
    followers.close()
    sock.close()
    bad.close()


@pytest.mark.parametrize("sends", [b"", struct.pack("<I", 100) + b"\x87"],
                         ids=["nothing", "half a frame"])
def test_a_silent_peer_holds_up_no_follower_and_is_dropped_after_the_handshake_timeout(sends):
    port = free_port()
    followers = Followers(size=2, port=port, secret=SECRET, host="127.0.0.1")
    t, out = _accepting(followers, timeout=60, handshake_timeout=8)
    silent = _dial(port)
    msgspec.msgpack.decode(_read_frame(silent), type=Challenge)  # rank 0 took it first
    silent.sendall(sends)
    # The follower gives up sooner than rank 0 drops the silent peer: it joins only if its
    # handshake runs beside the silent one.
    sock, _ = connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10, handshake_timeout=4)
    assert _joined(t, out), out
    assert _closed_by_peer(silent)  # after 8 s; the socket gives up after 30
    followers.close()
    sock.close()
    silent.close()


OTHER_SECRET = secrets.token_hex(32).encode()


@pytest.mark.parametrize("rank,fingerprint,secret,why", [
    (1, "fp", OTHER_SECRET, "it did not prove it holds the group's secret"),
    (1, "other", SECRET, r"it loaded a different model \(other != fp\)"),
    (0, "fp", SECRET, "rank 0 is not a follower's rank in a group of 2"),
    (2, "fp", SECRET, "rank 2 is not a follower's rank in a group of 2"),
], ids=["another secret", "another model", "rank 0", "rank 2"])
def test_a_follower_rank_0_cannot_take_is_told_why_and_the_real_one_still_joins(
        rank, fingerprint, secret, why):
    port = free_port()
    followers = Followers(size=2, port=port, secret=SECRET, host="127.0.0.1")
    t, out = _accepting(followers, timeout=60)
    with pytest.raises(RuntimeError, match=f"rank 0 refused rank {rank}: {why}"):
        connect(rank, port, fingerprint, secret, host="127.0.0.1", timeout=10)
    sock, _ = connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10)
    assert _joined(t, out), out
    assert [s["rank"] for s in followers.report()] == [1]
    followers.close()
    sock.close()


def test_a_second_connection_for_a_taken_rank_is_refused_and_the_first_keeps_it():
    port = free_port()
    followers = Followers(size=3, port=port, secret=SECRET, host="127.0.0.1")
    t, out = _accepting(followers, timeout=60)
    first, _ = connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10)
    with pytest.raises(RuntimeError, match="rank 0 refused rank 1: rank 1 has already joined"):
        connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10)
    rank2, _ = connect(2, port, "fp", SECRET, host="127.0.0.1", timeout=10)
    assert _joined(t, out), out
    followers.abort("r")
    for sock in (first, rank2):
        sock.settimeout(30)
        assert msgspec.msgpack.decode(_read_frame(sock), type=Abort) == Abort(request_id="r")
    followers.close()
    first.close()
    rank2.close()


def test_a_status_claiming_more_memory_than_the_followers_machine_has_is_not_counted():
    followers, sock = _pair(free_port())
    for step, active, peak in [(1, 10**15, 10**15), (2, -1, 5), (3, 2000, 3000)]:
        sock.sendall(_frame(Status(rank=1, step=step, digest=0, active_bytes=active,
                                   peak_bytes=peak)))
    deadline = time.monotonic() + 10
    while followers.report()[0]["step"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert followers.report()[0]["step"] == 3
    assert followers.report()[0]["peak_bytes"] == 3000
    assert (followers.usage(), followers.take_peak()) == (2000, 3000)
    followers.close()
    sock.close()


def _welcome_without_the_secret(conn: socket.socket) -> None:
    conn.sendall(_frame(Challenge(nonce=os.urandom(32))))
    _read_frame(conn)  # the follower's Hello
    conn.sendall(_frame(Welcome(seed=1, config=EngineConfig(), mac=os.urandom(32))))


@pytest.mark.parametrize("impostor,why", [
    (_welcome_without_the_secret, "did not prove it holds the group's secret"),
    (lambda conn: conn.sendall(_frame(Welcome(seed=1, config=EngineConfig(), mac=b""))),
     "sent no challenge"),
    (lambda conn: conn.sendall(struct.pack("<I", 0xFFFF_FFF0)), "sent a frame of 4294967280"),
    (lambda conn: None, "the handshake with 127.0.0.1:[0-9]+ took over 2 s"),
], ids=["a welcome without the secret", "no challenge", "a 4 GB length prefix", "silence"])
def test_a_follower_never_follows_a_rank_0_that_does_not_prove_it_holds_the_secret(
        impostor: Callable[[socket.socket], None], why: str):
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            impostor(conn)
            _closed_by_peer(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match=why):
        connect(1, port, "fp", SECRET, host="127.0.0.1", timeout=10, handshake_timeout=2)
    t.join(30)
    server.close()


def test_the_secret_comes_from_the_environment_or_a_file_only_its_owner_can_read(tmp_path):
    key = secrets.token_hex(32)
    assert read_secret({SECRET_ENV: key}) == key.encode()
    path = tmp_path / "secret"
    path.write_text(key + "\n")
    path.chmod(0o600)
    assert read_secret({SECRET_FILE_ENV: str(path)}) == key.encode()
    path.chmod(0o640)
    with pytest.raises(ValueError, match="other users may read or write .* chmod 600"):
        read_secret({SECRET_FILE_ENV: str(path)})


@pytest.mark.parametrize("env,why", [
    ({}, "needs the group's shared secret on every rank, in \\$TROUPE_DISTRIBUTED_SECRET"),
    ({SECRET_ENV: "  "}, "needs the group's shared secret"),
    ({SECRET_ENV: "too short"}, "has 9 characters; it needs at least 32"),
    ({SECRET_ENV: "k" * 32, SECRET_FILE_ENV: "/etc/hostname"}, "not both"),
    ({SECRET_FILE_ENV: "/nonexistent/secret"}, "cannot read /nonexistent/secret"),
], ids=["none", "blank", "short", "both", "a missing file"])
def test_a_rank_without_a_usable_secret_is_refused_saying_what_to_do(env, why):
    with pytest.raises(ValueError, match=why):
        read_secret(env)


# -- two ranks over HTTP -----------------------------------------------------------------------

PROMPTS = ["The quick brown fox", "What is the capital of France?", "Numbers like 12345",
           "def add(a, b):"]


def _distributed_available() -> str | None:
    code = "import mlx.core as mx; print(mx.distributed.is_available())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return None if out.stdout.strip() == "True" else "mx.distributed is not available here"


def _sharded_model(tmp: Path, arch: str) -> Path:
    """A tiny random model mlx-lm can shard both ways (4 heads, 2 key/value heads), with a
    weight index so each rank reads only its own weights."""
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_model import make_tiny_model

    out = make_tiny_model(tmp / arch, arch=arch, layers=4)
    names = subprocess.run(
        [sys.executable, "-c", "import json, sys, mlx.core as mx; "
         f"print(json.dumps(list(mx.load({str(out / 'model.safetensors')!r}))))"],
        capture_output=True, text=True, check=True).stdout
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in json.loads(names)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _wait_healthy(url: str, procs: list[subprocess.Popen], logs: Callable[[], str],
                  timeout: float = 240) -> None:
    """Until ``url`` answers /health; a process that exits meanwhile fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a server process exited with {p.returncode}: {logs()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the server did not start: " + logs())


def _environment(secret: str | None) -> dict[str, str]:
    """This process's environment with ``secret`` as the group's shared secret (none: without
    one)."""
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    if secret is not None:
        env[SECRET_ENV] = secret
    return env


class Ranks:
    """``troupe serve --distributed`` as two processes on loopback, started as ``mlx.launch``
    starts them (MLX_RANK, a host file, and the same environment: the shared secret), so a
    test can kill one and watch the other."""

    def __init__(self, tmp: Path, model: Path, mode: str, log: Path,
                 extra: tuple[str, ...] = (), secret: str | None = SECRET.decode()) -> None:
        ring = [free_port(), free_port()]
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
        self.port = free_port()
        # A cache directory of the test's own unless ``extra`` names one (never ~/.cache).
        cache = () if "--cache-dir" in extra else ("--cache-dir", str(tmp / "kv-cache"))
        args = [sys.executable, "-m", "troupe.api.cli", "serve", "--model", str(model),
                "--distributed", mode, "--distributed-port", str(free_port()),
                "--port", str(self.port), "--arrival-window", "0", *cache, *extra]
        self.procs = []
        self.logs = []
        for rank in (0, 1):
            env = {**_environment(secret), "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            out = open(log.with_suffix(f".rank{rank}.log"), "w")
            self.logs.append(out)
            self.procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        _wait_healthy(self.url, self.procs, self.tail)

    def tail(self) -> str:
        text = ""
        for f in self.logs:
            if not f.closed:
                f.flush()
            text += Path(f.name).read_text()[-3000:]
        return text

    def stop(self) -> list[int | None]:
        # As mlx.launch does on Ctrl-C: every rank gets the signal. Rank 0 finishes what is in
        # flight and then tells the followers to exit.
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(60))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(None)
        for f in self.logs:
            f.close()
        return codes


class Single:
    def __init__(self, model: Path, log: Path) -> None:
        self.port = free_port()
        self.out = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "troupe.api.cli", "serve", "--model", str(model), "--port",
             str(self.port), "--no-prefix-cache", "--arrival-window", "0"],
            cwd=ROOT, stdout=self.out, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        _wait_healthy(self.url, [self.proc], lambda: Path(self.out.name).read_text()[-3000:])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.out.close()


def _answers(url: str, model: str) -> dict[str, list[str]]:
    """Greedy answers to PROMPTS one at a time, then all four at once."""
    def ask(prompt: str) -> str:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = [ask(p) for p in PROMPTS]
    together: list[str | None] = [None] * len(PROMPTS)

    def one(i: int) -> None:
        together[i] = ask(PROMPTS[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"alone": alone, "together": together}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,arch", [("tensor", "llama"), ("pipeline", "qwen2")])
def test_two_ranks_answer_exactly_as_one_process(tmp_path, mode, arch):
    reason = _distributed_available()
    if reason:
        pytest.skip(reason)
    model = _sharded_model(tmp_path, arch)
    name = model.name
    single = Single(model, tmp_path / "single.log")
    try:
        single.wait_ready()
        expected = _answers(single.url, name)
    finally:
        single.stop()
    ranks = Ranks(tmp_path, model, mode, tmp_path / "ranks")
    try:
        ranks.wait_ready()
        got = _answers(ranks.url, name)
        actors = httpx.get(ranks.url + "/actors", timeout=10).json()
    finally:
        codes = ranks.stop()
    assert got == expected
    assert expected["alone"] == expected["together"]
    scheduler = next(a for a in actors if a["name"].startswith("scheduler"))
    followers = scheduler["report"]["followers"]
    assert [f["rank"] for f in followers] == [1] and followers[0]["step"] > 0
    assert codes == [0, 0], ranks.tail()


@pytest.mark.timeout(600)
def test_killing_a_follower_fails_the_answers_in_flight_and_new_requests_get_503(tmp_path):
    reason = _distributed_available()
    if reason:
        pytest.skip(reason)
    model = _sharded_model(tmp_path, "llama")
    ranks = Ranks(tmp_path, model, "tensor", tmp_path / "ranks")
    try:
        ranks.wait_ready()
        name = model.name
        result = {}

        def long_answer() -> None:
            with httpx.stream("POST", ranks.url + "/v1/completions", timeout=120, json={
                    "model": name, "prompt": PROMPTS[0], "max_tokens": 2000,
                    "temperature": 0, "stream": True, "ignore_eos": True}) as r:
                result["status"] = r.status_code
                result["body"] = "".join(r.iter_text())

        t = threading.Thread(target=long_answer)
        t.start()
        time.sleep(2.0)
        ranks.procs[1].kill()
        t.join(60)
        assert not t.is_alive(), "the stream in flight hung"
        assert result["status"] == 200 and '"error"' in result["body"], result
        if "has not returned" in ranks.tail():
            # The step's collective never completed (the ring backend can leave one waiting
            # when a peer dies mid-step): rank 0 answered with the error and exits 1.
            assert ranks.procs[0].wait(30) == 1
            assert "rank 1" in ranks.tail()
            return
        began = time.monotonic()
        while True:
            r = httpx.post(ranks.url + "/v1/completions", timeout=30, json={
                "model": name, "prompt": "hi", "max_tokens": 4})
            if r.status_code == 503 or time.monotonic() - began > 10:
                break
            time.sleep(0.2)
        assert r.status_code == 503, r.text
        assert "rank 1" in r.json()["error"]["message"]
        assert ranks.procs[0].poll() is None  # rank 0 keeps answering
        assert "rank 1" in ranks.tail()
    finally:
        ranks.stop()


def _complete(url: str, model: str, prompt: str) -> tuple[str, int]:
    """A greedy completion's text and its prompt's cached tokens."""
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _reports(url: str) -> tuple[dict, dict]:
    """Rank 0's scheduler report, and its follower's (rank 1) in it."""
    actors = httpx.get(url + "/actors", timeout=10).json()
    scheduler = next(a for a in actors if a["name"].startswith("scheduler"))["report"]
    return scheduler, scheduler["followers"][0]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode,arch", [("tensor", "llama"), ("pipeline", "qwen2")])
def test_two_ranks_hit_the_prefix_cache_together_and_find_it_on_disk_after_a_restart(
        tmp_path, mode, arch):
    reason = _distributed_available()
    if reason:
        pytest.skip(reason)
    model = _sharded_model(tmp_path, arch)
    name = model.name
    cache = tmp_path / "cache"
    extra = ("--cache-dir", str(cache), "--block-size", "16")
    prompt = " ".join(PROMPTS) * 2  # several blocks of 16 tokens
    ranks = Ranks(tmp_path, model, mode, tmp_path / "first", extra)
    try:
        ranks.wait_ready()
        cold, cold_cached = _complete(ranks.url, name, prompt)
        warm, warm_cached = _complete(ranks.url, name, prompt)
        scheduler, follower = _reports(ranks.url)
    finally:
        codes = ranks.stop()
    assert codes == [0, 0], ranks.tail()
    assert cold_cached == 0 and warm_cached > 0
    assert warm == cold
    assert scheduler["probes"] >= 1 and scheduler["probe_timeouts"] == 0
    assert follower["hit_tokens"] == warm_cached  # the follower started from the same cache
    # Each rank wrote its own shard, where only a group of this layout looks.
    for rank in (0, 1):
        assert list((cache / f"{mode}-2" / f"rank-{rank}").rglob("*.safetensors")), rank

    ranks = Ranks(tmp_path, model, mode, tmp_path / "again", extra)
    try:
        ranks.wait_ready()
        again, again_cached = _complete(ranks.url, name, prompt)
        scheduler, follower = _reports(ranks.url)
    finally:
        codes = ranks.stop()
    assert codes == [0, 0], ranks.tail()
    assert again == cold
    assert again_cached > 0 and again_cached % 16 == 0  # whole blocks: tails stay in RAM
    assert scheduler["disk_loads"] == 1  # rank 0 read its shard from disk
    assert follower["disk_read_blocks"] == again_cached // 16  # and so did rank 1
    assert follower["hit_tokens"] == again_cached


# -- the shared secret, from the launcher to every rank ----------------------------------------


@pytest.mark.timeout(300)
def test_ranks_without_the_shared_secret_refuse_to_start_saying_how_to_set_one(tmp_path):
    reason = _distributed_available()
    if reason:
        pytest.skip(reason)
    # Both ranks stop before they load anything: the model need not exist.
    ranks = Ranks(tmp_path, tmp_path / "model", "tensor", tmp_path / "ranks", secret=None)
    try:
        codes = [p.wait(120) for p in ranks.procs]
    finally:
        ranks.stop()
    logs = [Path(f.name).read_text() for f in ranks.logs]
    assert codes == [1, 1], logs
    for text in logs:
        assert "needs the group's shared secret on every rank, in $TROUPE_DISTRIBUTED_SECRET" \
            in text, text


@pytest.mark.timeout(600)
def test_ranks_started_by_mlx_launch_take_the_secret_from_its_environment_and_serve(tmp_path):
    reason = _distributed_available()
    if reason:
        pytest.skip(reason)
    model = _sharded_model(tmp_path, "llama")
    port = free_port()
    log = tmp_path / "launch.log"
    # As `make serve-distributed` runs it: a fresh secret in the launcher's environment.
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring",
             "--hosts", "127.0.0.1", "-n", "2", "--starting-port", str(free_port()), "--",
             sys.executable, "-m", "troupe.api.cli", "serve", "--model", str(model),
             "--distributed", "tensor", "--distributed-port", str(free_port()),
             "--port", str(port), "--arrival-window", "0",
             "--cache-dir", str(tmp_path / "kv-cache")],
            cwd=ROOT, env=_environment(secrets.token_hex(32)), stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, [launcher], lambda: log.read_text()[-3000:])
            _complete(url, model.name, PROMPTS[0])
            _, follower = _reports(url)
        finally:
            # As Ctrl-C does: the launcher and every rank get the signal.
            os.killpg(launcher.pid, signal.SIGINT)
            try:
                launcher.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    assert follower["rank"] == 1 and follower["step"] > 0
    assert "exited with code" not in log.read_text(), log.read_text()[-3000:]
