"""Measure the GGUF conversion dtypes: prefill and decode speed and greedy exactness.

Converts the GGUF (default: the bundled SmolLM2-135M-Instruct Q4_1) once per dtype into a
temporary directory, loads it with mlx-lm and reports, per dtype:

- prefill tok/s: one forward pass over a ``--prompt-tokens`` prompt (median of ``--reps``;
  shortened for dtypes too slow to finish a pass within ``--max-seconds``),
- decode tok/s: greedy single-token steps after a short prompt (median of ``--reps``),
- greedy: the greedy answer to "What is the capital of France?" and whether its tokens equal
  the reference dtype's (``quantized``: the GGUF's own values, float32 activations),
- max dlogit: the largest last-position logit difference from the reference (16 tokens).

Which BLAS MLX runs on is read from /proc/self/maps; run it twice to compare, e.g.::

    .venv/bin/python benchmarks/bench_dtype.py
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python benchmarks/bench_dtype.py

CPU timings are noisy: compare ratios within one run. The float16 kernels of MLX's CPU
backend are very slow, so each measurement stops after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from troupe.actors.models.gguf import DTYPES, QUANTIZED, convert_gguf  # noqa: E402
from troupe.actors.models.store import bundled_gguf_path  # noqa: E402

QUESTION = "What is the capital of France?"
# Plain prose, repeated to the requested prompt length.
FILLER = (
    "The river runs past the old mill, where the miller counts 1234 sacks of grain each "
    "autumn and writes the numbers in a ledger that his grandmother started in 1901. "
)


def blas_libraries() -> list[str]:
    """Shared libraries with 'blas' in their name mapped into this process."""
    names: set[str] = set()
    with open(f"/proc/{os.getpid()}/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "blas" in os.path.basename(path).lower():
                names.add(path)
    return sorted(names)


def _greedy_step(model, tokens: mx.array, cache) -> mx.array:
    logits = model(tokens[None], cache=cache)
    return mx.argmax(logits[0, -1], axis=-1)


def measure_prefill(model, tokens: list[int]) -> float:
    """Prompt tokens per second for one forward pass over ``tokens``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = time.perf_counter()
    mx.eval(_greedy_step(model, mx.array(tokens), cache))
    return len(tokens) / (time.perf_counter() - start)


def repeat(fn, reps: int, max_seconds: float) -> list[float]:
    """Up to ``reps`` results of ``fn()``; stops early once ``max_seconds`` have passed."""
    start = time.perf_counter()
    results = [fn()]
    while len(results) < reps and time.perf_counter() - start < max_seconds:
        results.append(fn())
    return results


def measure_decode(model, prompt: list[int], steps: int, max_seconds: float) -> float:
    """Generated tokens per second over up to ``steps`` greedy single-token steps."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = _greedy_step(model, mx.array(prompt), cache)
    mx.eval(y)
    start = time.perf_counter()
    done = 0
    while done < steps:
        y = _greedy_step(model, y[None], cache)
        mx.eval(y)
        done += 1
        if time.perf_counter() - start > max_seconds and done >= 2:
            break
    return done / (time.perf_counter() - start)


def greedy_answer(model, tokenizer, max_tokens: int, max_seconds: float) -> tuple[list[int], bool]:
    """Greedy token ids answering QUESTION (chat template applied), stopping at EOS; and
    whether it was cut short by ``max_seconds``."""
    from mlx_lm.models.cache import make_prompt_cache

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True
    )
    cache = make_prompt_cache(model)
    y = _greedy_step(model, mx.array(prompt), cache)
    out: list[int] = []
    start = time.perf_counter()
    for _ in range(max_tokens):
        token = int(y.item())
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
        if time.perf_counter() - start > max_seconds:
            return out, True
        y = _greedy_step(model, y[None], cache)
    return out, False


def fit_prompt(model, prompt: list[int], max_seconds: float) -> list[int]:
    """``prompt``, shortened for dtypes so slow that one prefill pass would exceed
    ``max_seconds`` (estimated from a 16-token probe)."""
    probe_tps = measure_prefill(model, prompt[:16])
    return prompt[: max(16, min(len(prompt), int(probe_tps * max_seconds)))]


def last_logits(model, tokens: list[int]) -> mx.array:
    """Float32 logits at the last position of ``tokens``."""
    return model(mx.array(tokens)[None])[0, -1].astype(mx.float32)


def bench_one(gguf: Path, out: Path, dtype: str, args: argparse.Namespace, reference: dict) -> dict:
    """Convert, load and measure one dtype; the first call (QUANTIZED) fills ``reference``."""
    import mlx_lm

    start = time.perf_counter()
    convert_gguf(gguf, out, dtype)
    convert_s = time.perf_counter() - start
    model, tokenizer = mlx_lm.load(str(out))
    filler = tokenizer.encode(FILLER * (args.prompt_tokens // 20 + 1))
    prompt = filler[: args.prompt_tokens]

    # Warm up (first calls allocate), then take medians.
    measure_decode(model, prompt[:16], 2, args.max_seconds)
    prompt = fit_prompt(model, prompt, args.max_seconds)
    prefill = repeat(lambda: measure_prefill(model, prompt), args.reps, args.max_seconds)
    decode = repeat(
        lambda: measure_decode(model, prompt[:16], args.decode_tokens, args.max_seconds),
        args.reps,
        args.max_seconds,
    )
    answer, cut = greedy_answer(model, tokenizer, args.answer_tokens, args.max_seconds)
    logits = last_logits(model, prompt[:16])
    if dtype == QUANTIZED:
        reference.update(answer=answer, logits=logits)
    equal = answer == reference["answer"][: len(answer)] if cut else answer == reference["answer"]
    return {
        "dtype": dtype,
        "size_mb": round((out / "model.safetensors").stat().st_size / 1e6, 1),
        "convert_s": round(convert_s, 2),
        "prompt_tokens": len(prompt),
        "prefill_tps": round(statistics.median(prefill), 1),
        "prefill_runs": len(prefill),
        "decode_tps": round(statistics.median(decode), 2),
        "decode_runs": len(decode),
        "greedy_equal": equal,
        "greedy_tokens": len(answer),
        "greedy_cut": cut,
        "max_dlogit": round(mx.abs(logits - reference["logits"]).max().item(), 4),
        "answer": tokenizer.decode(answer),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: bundled SmolLM2")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="time cap per measurement")
    parser.add_argument("--answer-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)

    gguf = args.gguf or bundled_gguf_path()
    print(f"gguf: {gguf}")
    print(f"mlx {mx.__version__}, device {mx.default_device()}, BLAS: {blas_libraries()}")
    # The reference must come first so the others can be compared with it.
    dtypes = [QUANTIZED] + [d for d in args.dtypes if d != QUANTIZED]

    rows: list[dict] = []
    reference: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as tmp:
        for dtype in dtypes:
            row = bench_one(gguf, Path(tmp) / dtype, dtype, args, reference)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print()
    print(f"BLAS: {', '.join(blas_libraries())}")
    print(
        f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} steps, "
        f"median of {args.reps}"
    )
    print(
        "| dtype | size MB | prefill tok/s (prompt) | decode tok/s "
        "| greedy = quantized | max dlogit |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        greedy = "yes" if r["greedy_equal"] else "no"
        if r["greedy_cut"]:
            greedy += f" (first {r['greedy_tokens']} tokens)"
        print(
            f"| {r['dtype']} | {r['size_mb']} | {r['prefill_tps']} ({r['prompt_tokens']}) "
            f"| {r['decode_tps']} | {greedy} | {r['max_dlogit']} |"
        )
    print(f"reference answer: {rows[0]['answer']!r}")
    if args.json:
        args.json.write_text(json.dumps({"blas": blas_libraries(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
