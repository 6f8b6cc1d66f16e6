"""The cost of a prefix-cache hit: its first step, against a decode step at the same context.

A full hit should cost at most one decode step (+10%). The hit's cache comes either from a
finished sequence's cache kept whole (a hot cache, ``actors/engine/hot_cache.py``: no copy)
or from the blocks (``kv_blocks.build_cache``: a concatenate of every block, per layer). This
times, in this process on troupe's ``Engine`` with ``troupe serve``'s settings (troupe's CPU
kernels, OpenBLAS preloaded as ``troupe serve`` does, on one thread), as CPU time of this
process (other jobs on a shared machine stretch the wall time, not this):

- **repeat, hot** / **repeat, blocks**: a ``--prompt``-token chat prompt sent again (all but
  its last token cached): ``add`` and its first step (the last prompt token and the first
  answer token); with the hot caches on, and off (blocks only);
- **decode at N**: a decode step of the repeated prompt's request (context ~N tokens), and
  of a short prompt's;
- **finish, hot** / **finish, blocks**: the step in which the repeated prompt's request
  ends (its cache cut into blocks, and with the hot caches on, kept whole:
  **of which keeping it whole**, ``PrefixCache.keep_hot``'s CPU time).
- **a disk hit** (after the repetitions): the prompt's blocks written as the SSD writer writes
  them (``block_store.encode_block``, under ``--disk-dir``), dropped from RAM and from the
  page cache (``posix_fadvise``), then read back as a restarted server reads them:
  prefetched, each file read and checked (``block_store.decode_block``) as the SSD writer
  does (**read and checked**, wall time, **of which CPU**), made MLX arrays (**to MLX**, the
  scheduler's ``from_numpy``), and the first step from those blocks; beside **the disk's
  read speed**, one file of their size read cold, so that the hit can be set against "one
  decode step plus its bytes' read time".

Each repetition runs both ways, alternating; the figures are medians over ``--reps``.

    .venv/bin/python benchmarks/bench_hit_step.py
    .venv/bin/python benchmarks/bench_hit_step.py --prompt 4000 --reps 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import (  # noqa: E402
    blas_name,
    chat_tokens,
    load_ceiling,
    long_text,
    resolve_default_model,
    same_blas_as_troupe_serve,
)

ANSWER = 16  # tokens of the first turn's answer (greedy, EOS ignored)


def run(engine: Any, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """One request to its end, from its prompt's cached blocks (as the scheduler finds
    them): the answer's tokens, and the CPU ms of each step (the first with ``add``)."""
    from troupe.actors.messages import SamplingParams, TokensGenerated

    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    blocks = engine.blocks.lookup(engine.prompt_hashes(ids))
    began = time.process_time()
    engine.add(rid, ids, sampling, cached=blocks)
    tokens: list[int] = []
    steps: list[float] = []
    while engine.has_work:
        t0 = time.process_time() if steps else began
        events = engine.step()
        steps.append((time.process_time() - t0) * 1e3)
        tokens += [t for ev in events if isinstance(ev, TokensGenerated) for t in ev.token_ids]
    engine.cut_pending()
    return tokens, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: troupe pull's)")
    p.add_argument("--prompt", type=int, default=2000, help="tokens of the long prompt")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kernels", default="native", help="troupe's --cpu-kernels: native or mlx")
    p.add_argument("--disk-dir", default=None,
                   help="where the disk hit's block files go (default: a temporary directory "
                        "under the current one, so on the disk the cache would use)")
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before the re-execution keeps it
    same_blas_as_troupe_serve()

    import mlx.core as mx

    from troupe.actors.config import ServeConfig
    from troupe.actors.engine.core import Engine
    from troupe.actors.engine.hot_cache import HOT_ENTRIES

    model_dir = args.model or resolve_default_model()
    model, tok = load_ceiling(model_dir, args.kernels)
    engine = Engine(model, tok, ServeConfig().engine, stream=mx.default_stream(mx.cpu))
    hot = engine.blocks.hot
    keeping: list[float] = []  # CPU ms of each ``keep_hot`` (in the finishing step)
    keep_hot = engine.blocks.keep_hot

    def timed_keep_hot(*a: Any) -> bool:
        began = time.process_time()
        try:
            return keep_hot(*a)
        finally:
            keeping.append((time.process_time() - began) * 1e3)

    engine.blocks.keep_hot = timed_keep_hot
    key = f"hit-{time.time()}"
    ids = chat_tokens(tok, [{"role": "user", "content": long_text(tok, args.prompt, key)}])
    short = chat_tokens(tok, [{"role": "user", "content": "Tell me a story about a cat."}])

    def hot_on(on: bool) -> None:
        hot.max_entries = HOT_ENTRIES if on else 0
        if not on:
            engine.blocks.drop_hot()

    answer, _ = run(engine, "cold", ids, ANSWER)  # the first turn, prefilled cold
    run(engine, "warm", ids, ANSWER)  # kernels built for the hit's shapes
    res: dict[str, list[float]] = {}
    outputs: set[tuple[int, ...]] = set()
    for rep in range(args.reps):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            way = "hot" if on else "blocks"
            hot_on(on)
            if on and not len(hot):
                run(engine, f"prime-{rep}", ids, ANSWER)  # a hot cache of the first turn
            hits = hot.hits
            # The first turn again: a repeat.
            got, steps = run(engine, f"repeat-{rep}-{way}", ids, ANSWER)
            assert (hot.hits > hits) == on, "the hot path was (not) taken"
            outputs.add(tuple(got))
            res.setdefault(f"repeat, {way}", []).append(steps[0])
            res.setdefault("decode at prompt", []).extend(steps[2:-1])
            res.setdefault(f"finish, {way}", []).append(steps[-1])
            if on:
                res.setdefault("of which keeping it whole", []).append(keeping[-1])
    hot_on(True)
    for rep in range(args.reps):
        _, steps = run(engine, f"short-{rep}", short, 12)
        res.setdefault("decode at short", []).extend(steps[2:-1])
    assert len(outputs) == 1, "hot and block paths answered differently"

    med = {k: statistics.median(v) for k, v in res.items()}
    decode = med["decode at prompt"]
    print(f"# The cost of a hit's first step ({Path(model_dir).name}, "
          f"{len(ids)}-token prompt, {ANSWER}-token answers; "
          f"{blas_name()}, {os.environ.get('OPENBLAS_NUM_THREADS')} BLAS thread(s), "
          f"CPU ms, medians of {args.reps} reps)\n")
    print("| step | CPU ms (median) | / decode at prompt | samples |")
    print("|---|---|---|---|")
    names = {"decode at prompt": f"decode step at ~{len(ids) + ANSWER // 2} tokens",
             "decode at short": f"decode step at ~{len(short) + 6} tokens"}
    for k in ("repeat, hot", "repeat, blocks", "decode at prompt", "decode at short",
              "finish, hot", "of which keeping it whole",
              "finish, blocks"):
        print(f"| {names.get(k, k)} | {med[k]:.1f} | {med[k] / decode:.2f} | {len(res[k])} |")
    print("\nsamples (CPU ms):")
    for k, v in res.items():
        if len(v) <= 2 * args.reps:
            print(f"- {k}: {', '.join(f'{x:.0f}' for x in v)}")
    print(f"\nhot store: {hot.stats()}")
    disk_hit(engine, ids, args, decode)


def drop_pages(path: Path) -> None:
    """Drop a file's pages from the page cache (as after a reboot, or under memory pressure)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_hit(engine: Any, ids: list[int], args: argparse.Namespace, decode: float) -> None:
    """The repeat from blocks read back from disk files, against a decode step plus the
    files' read time at the disk's measured speed (see the module's docstring)."""
    import tempfile

    from troupe.actors import block_store
    from troupe.actors.engine.kv_blocks import from_numpy, to_numpy

    engine.blocks.hot.max_entries = 0
    engine.blocks.drop_hot()
    hashes = engine.prompt_hashes(ids)
    blocks = engine.blocks.lookup(hashes)
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="hit-disk-", dir=args.disk_dir or ".") as d:
        paths = []
        for b in blocks:
            path = block_store.block_path(Path(d), b.block_hash)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(block_store.encode_block(to_numpy(b), engine.fingerprint))
            paths.append(path)
        os.sync()
        size = sum(p.stat().st_size for p in paths)
        probe = Path(d) / "speed"
        probe.write_bytes(os.urandom(size))
        os.sync()
        for rep in range(args.reps):
            engine.blocks.spill([b.block_hash for b in blocks])
            assert not engine.blocks.lookup(hashes), "the blocks are still in RAM"
            for path in paths:
                drop_pages(path)
            # As the SSD writer reads a chain (``SsdWriter._read``): prefetched, then each
            # file read and checked in turn.
            wall, cpu = time.perf_counter(), time.process_time()
            block_store.prefetch(paths)
            datas = [block_store.decode_block(path.read_bytes(), engine.fingerprint,
                                              b.block_hash)
                     for path, b in zip(paths, blocks, strict=True)]
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            began = time.process_time()
            for data, b in zip(datas, blocks, strict=True):
                block = from_numpy(data, engine.kinds, engine.state_sizes)
                block.tokens = b.tokens
                engine.blocks.store(block)
            cpu_mlx = time.process_time() - began
            _, steps = run(engine, f"disk-{rep}", ids, 4)
            drop_pages(probe)
            speed_wall = time.perf_counter()
            probe.read_bytes()
            speed_wall = time.perf_counter() - speed_wall
            for k, v in (("read and checked (wall ms)", wall * 1e3),
                         ("of which CPU (ms)", cpu * 1e3),
                         ("to MLX (CPU ms)", cpu_mlx * 1e3), ("first step (CPU ms)", steps[0]),
                         ("disk read speed (MB/s)", size / speed_wall / 1e6)):
                rows.setdefault(k, []).append(v)
    med = {k: statistics.median(v) for k, v in rows.items()}
    at_speed = size / (med["disk read speed (MB/s)"] * 1e6) * 1e3
    total = med["read and checked (wall ms)"] + med["to MLX (CPU ms)"] \
        + med["first step (CPU ms)"]
    print(f"\n# A disk hit: {len(blocks)} blocks, {size / 1e6:.1f} MB in files "
          f"(medians of {args.reps})\n")
    print("| part | median | samples |")
    print("|---|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.0f}' for x in v)} |")
    print(f"\nthe hit, all parts: {total:.1f} ms; the goal, a decode step ({decode:.1f} CPU ms) "
          f"+ 10% + the files' read time at the disk's speed ({at_speed:.1f} ms): "
          f"{decode * 1.1 + at_speed:.1f} ms")


if __name__ == "__main__":
    main()
