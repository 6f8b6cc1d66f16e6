"""Choose the prefix cache's block size: cost on a cold prompt, gain on a repeated one.

In process, on the default model (or --model DIR): for each block size, the time to the first
token of a ~2,000-token prompt with no cache (which also cuts its blocks), then the same
prompt served from the RAM blocks, then the time to snapshot all its blocks to numpy (what the
scheduler's thread spends before the SSD writer takes over). Block size 0 is the cache off.

    .venv/bin/python benchmarks/bench_block_size.py --sizes 0,64,128,256,512 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlx_lm import load

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.core import Engine
from troupe.actors.engine.kv_blocks import to_numpy
from troupe.actors.engine.prefix import model_fingerprint
from troupe.actors.messages import SamplingParams, TokensGenerated
from troupe.actors.models.blas import preload_command

TEXT = ("In a quiet valley a river carved its way through layers of ancient stone, and every "
        "season it carried a little more of the mountain to the sea. ")


def first_token_s(engine: Engine, rid: str, prompt: list[int], cached=()) -> float:
    start = time.perf_counter()
    engine.add(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), cached=cached)
    elapsed = None
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokensGenerated) and elapsed is None:
                elapsed = time.perf_counter() - start
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--sizes", default="0,64,128,256,512",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    plan = preload_command([sys.argv[0], *sys.argv[1:]])  # the BLAS troupe serve runs on
    if plan is not None:
        os.execve(sys.executable, *plan)
    model_dir = args.model or subprocess.run(
        [sys.executable, "-m", "troupe.api.cli", "pull"], check=True, capture_output=True, text=True
    ).stdout.strip().splitlines()[-1]
    model, tok = load(model_dir)
    fp = model_fingerprint(Path(model_dir))
    base = tok.encode(TEXT * (args.prompt_tokens // 20))
    print(f"model {model_dir}, prompt {args.prompt_tokens} tokens")
    print("| block size | cold TTFT (ms) | RAM-hit TTFT (ms) | hit / cold | blocks -> numpy (ms) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        colds, warms, snaps = [], [], []
        for r in range(args.reps):
            engine = Engine(model, tok, EngineConfig(block_size=size, prefill_step_size=512,
                                                      prefill_interleave=0.0), fingerprint=fp)
            prompt = tok.encode(f"Run {size}-{r}. ") + base[: args.prompt_tokens]
            colds.append(first_token_s(engine, "cold", prompt))
            if size:
                cached = [engine.blocks[h] for h in engine.prompt_hashes(prompt)
                          if h in engine.blocks]
                warms.append(first_token_s(engine, "warm", prompt, cached=cached))
                start = time.perf_counter()
                for block in cached:
                    to_numpy(block)
                snaps.append(time.perf_counter() - start)
        cold = statistics.median(colds) * 1000
        if size:
            warm = statistics.median(warms) * 1000
            snap = statistics.median(snaps) * 1000
            print(f"| {size} | {cold:.0f} | {warm:.0f} | {warm / cold:.3f} | {snap:.0f} |")
        else:
            print(f"| off | {cold:.0f} | | | |")


if __name__ == "__main__":
    main()
