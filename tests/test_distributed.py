"""Serving one model over several ranks (actors/distributed.py).

The channel between rank 0 and its followers is tested with stand-in engines; the whole thing
runs as two `troupe serve --distributed` processes on loopback (ranks started the way
`mlx.launch` starts them), compared with one process over HTTP.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from actors.distributed import (
    MODES,
    Followers,
    check_tensor_split,
    connect,
    engine_config_for,
    follow,
    rank_cache_dir,
    shard_memory,
)
from actors.engine.config import EngineConfig
from actors.engine.memory_estimate import ModelMemory
from actors.engine.prefix_cache import PrefixCache
from actors.engine.schedule import StepPlan
from actors.messages import SamplingParams

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
        self.calls.append(("step", plan.admit, plan.chunk, plan.fail))
        self.last_digest += 1

    def take_new_blocks(self):
        return []


class Grammars:
    def compile(self, source):
        return f"compiled:{source}"


def _pair(port: int, fingerprint: str = "fp") -> tuple[Followers, socket.socket]:
    followers = Followers(size=2, port=port, host="127.0.0.1")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault(
        "sock", connect(1, port, fingerprint, host="127.0.0.1", timeout=10)))
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


def _plan(admit: int = 1, chunk: int = 64, fail: list[int] | None = None) -> StepPlan:
    return StepPlan(fail=fail or [], reject=None, admit=admit, budget=None, chunk=chunk,
                    held=False)


def test_a_follower_applies_rank_0s_requests_and_plans_in_order_then_stops_on_bye():
    followers, sock = _pair(free_port())
    engine = Recorder()
    t, out = _following(engine, sock)
    sampling = SamplingParams(max_tokens=5, temperature=0.0)
    followers.add("a", [1, 2, 3], sampling, None, None)
    followers.add("b", [4], sampling, None, '{"grammars": []}')
    followers.plan(_plan(admit=2, chunk=32), step=0, digest=0)
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
        ("step", 2, 32, []),
        ("abort", "a"),
        ("step", 0, 16, [3]),
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


def test_a_follower_with_another_model_is_refused():
    port = free_port()
    followers = Followers(size=2, port=port, host="127.0.0.1")
    refused = {}

    def other_model() -> None:
        with pytest.raises(RuntimeError, match="rank 0 refused rank 1") as caught:
            connect(1, port, "other", host="127.0.0.1", timeout=10)
        refused["error"] = caught.value

    t = threading.Thread(target=other_model)
    t.start()
    with pytest.raises(RuntimeError, match="different model"):
        followers.accept("fp", seed=1, config=EngineConfig(), timeout=10)
    t.join(10)
    followers.close()
    assert "error" in refused


def test_rank_0_names_the_ranks_that_never_connected():
    followers = Followers(size=3, port=free_port(), host="127.0.0.1")
    with pytest.raises(RuntimeError, match=r"ranks \[1, 2\] did not connect"):
        followers.accept("fp", seed=1, config=EngineConfig(), timeout=0.5)
    followers.close()


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


class Ranks:
    """``troupe serve --distributed`` as two processes on loopback, started as ``mlx.launch``
    starts them (MLX_RANK and a host file), so a test can kill one and watch the other."""

    def __init__(self, tmp: Path, model: Path, mode: str, log: Path,
                 extra: tuple[str, ...] = ()) -> None:
        ring = [free_port(), free_port()]
        hostfile = tmp / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ring]))
        self.port = free_port()
        # A cache directory of the test's own unless ``extra`` names one (never ~/.cache).
        cache = () if "--cache-dir" in extra else ("--cache-dir", str(tmp / "kv-cache"))
        args = [sys.executable, "-m", "api.cli", "serve", "--model", str(model),
                "--distributed", mode, "--distributed-port", str(free_port()),
                "--port", str(self.port), "--arrival-window", "0", *cache, *extra]
        self.procs = []
        self.logs = []
        for rank in (0, 1):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
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
            [sys.executable, "-m", "api.cli", "serve", "--model", str(model), "--port",
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
