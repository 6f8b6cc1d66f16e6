"""What it costs to send rank 0's step plan to the other ranks: a TCP round trip against MLX
collectives (docs/distributed.md).

Run it under MLX's launcher, two ranks on this machine's loopback:

    .venv/bin/mlx.launch --backend ring --hosts 127.0.0.1 -n 2 \\
        --python .venv/bin/python benchmarks/bench_distributed.py

Each rank prints one JSON line: microseconds per round trip of a message of 64 B, 1 KB and
16 KB over a TCP connection between the ranks (what ``actors/distributed/`` uses), per
``all_sum`` of a scalar, and per message sent the way mlx_lm.server sends its prompts (an
``all_sum`` of the size, then one of the bytes).
"""

from __future__ import annotations

import json
import socket
import time

import mlx.core as mx

SIZES = (64, 1024, 16384)
ROUNDS = 300
PORT = 47311


def _channel(rank: int) -> socket.socket:
    if rank == 0:
        server = socket.create_server(("127.0.0.1", PORT))
        mx.eval(mx.distributed.all_sum(mx.array([1])))  # the server listens: connect now
        sock, _ = server.accept()
    else:
        mx.eval(mx.distributed.all_sum(mx.array([1])))
        sock = socket.create_connection(("127.0.0.1", PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _tcp_round_trip(sock: socket.socket, rank: int, n: int) -> float:
    f = sock.makefile("rwb")
    payload = b"x" * n
    began = time.perf_counter()
    for _ in range(ROUNDS):
        if rank == 0:
            f.write(n.to_bytes(4, "little") + payload)
            f.flush()
            f.read(1)
        else:
            f.read(int.from_bytes(f.read(4), "little"))
            f.write(b"k")
            f.flush()
    return (time.perf_counter() - began) / ROUNDS * 1e6


def _all_sum_scalar() -> float:
    for _ in range(10):
        mx.eval(mx.distributed.all_sum(mx.array([1.0])))
    began = time.perf_counter()
    for _ in range(ROUNDS):
        mx.eval(mx.distributed.all_sum(mx.array([1.0])))
    return (time.perf_counter() - began) / ROUNDS * 1e6


def _all_sum_message(rank: int, n: int) -> float:
    def send() -> None:
        size = mx.distributed.all_sum(mx.array([n if rank == 0 else 0]))
        mx.eval(size)
        data = mx.ones((n,), mx.uint8) if rank == 0 else mx.zeros((n,), mx.uint8)
        mx.eval(mx.distributed.all_sum(data, stream=mx.cpu))

    for _ in range(10):
        send()
    began = time.perf_counter()
    for _ in range(ROUNDS):
        send()
    return (time.perf_counter() - began) / ROUNDS * 1e6


def main() -> None:
    group = mx.distributed.init()
    rank = group.rank()
    sock = _channel(rank)
    result = {
        "rank": rank,
        "tcp_round_trip_us": {n: round(_tcp_round_trip(sock, rank, n), 1) for n in SIZES},
        "all_sum_scalar_us": round(_all_sum_scalar(), 1),
        "all_sum_message_us": {n: round(_all_sum_message(rank, n), 1) for n in SIZES},
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
