"""Each agent's turns against troupe: the share of the previous turn's prompt read from the
prefix cache, turn by turn.

Claude Code, Codex CLI, OpenCode and Cline (``benchmarks/agent_shapes.py``) each play
``--turns`` turns in their own request shapes through the official clients
(``tests/agents/replay.py``), every answer kept as the script writes it in that agent's terms
(a line and one call of its own tools: the same conversation on every run) and every call
answered with a result of 300-900 characters. The server answers each request with at most
``--max-tokens-limit`` tokens (it is not the answer that is measured). On the default model,
or with ``--tiny-qwen3`` on a random-weight qwen3 whose template renders tools and reasoning
as the Qwen3 family's does (tests/tiny_model.py, what the replay suite runs on).

    .venv/bin/python benchmarks/agents_reuse.py
    .venv/bin/python benchmarks/agents_reuse.py --tiny-qwen3

Prints a table (agent, then each turn's read share) and writes it to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO / "tests" / "agents")]

import harness  # noqa: E402
from agent_shapes import ClaudeCode, Cline, Codex, OpenCode, Script, reuse  # noqa: E402
from replay import turn  # noqa: E402  (the replay suite's official-client driver)

AGENTS = {"claude-code": ClaudeCode, "codex": Codex, "opencode": OpenCode, "cline": Cline}


async def play(base: str, name: str, turns: int) -> list[float]:
    """One agent's session: the read share of each turn after the first."""
    script = Script(seed=7, result_chars=(300, 900))
    session = AGENTS[name](script, resumed=2)
    shares: list[float] = []
    previous = None
    for t in range(1, turns + 1):
        answer = await turn(base, session)
        if previous is not None:
            shares.append(reuse(previous, answer))
        previous = answer
        session.take(session.scripted(t))
    return shares


async def run(args: argparse.Namespace, model_dir: str) -> dict[str, list[float]]:
    port = harness.free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="agents-reuse-") as cache_dir:
        proc = subprocess.Popen(
            [sys.executable, "-m", "troupe.api.cli", "serve", "--model", model_dir, "--port",
             str(port),
             "--cache-dir", cache_dir, "--max-tokens-limit", str(args.max_tokens_limit),
             "--log-level", "warning"], cwd=REPO)
        try:
            await harness.wait_healthy(base, proc)
            return {name: await play(base, name, args.turns) for name in args.agents.split(",")}
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", default=",".join(AGENTS))
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens-limit", type=int, default=16)
    p.add_argument("--tiny-qwen3", action="store_true",
                   help="a random-weight qwen3 with a Qwen3-style template (made here)")
    p.add_argument("--out", default="bench-results/agents-reuse")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny_qwen3:
        from tiny_model import make_tiny_model

        model_dir = str(make_tiny_model(out / "tiny-qwen3", arch="qwen3", template="qwen3",
                                        context=32768, eos_head=6.0))
    else:
        model_dir = harness.resolve_default_model()
    shares = asyncio.run(run(args, model_dir))
    model = "tiny qwen3 (Qwen3-style template)" if args.tiny_qwen3 else "the default model"
    lines = [f"Read share of the previous turn's prompt, {model}, turns 2-{args.turns}:", "",
             "| agent | " + " | ".join(f"turn {t}" for t in range(2, args.turns + 1))
             + " | lowest |", "|---|" + "---|" * args.turns]
    for name, values in shares.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values)
                     + f" | {min(values):.3f} |")
    table = "\n".join(lines) + "\n"
    (out / ("tiny-qwen3.md" if args.tiny_qwen3 else "default.md")).write_text(table)
    print(table)


if __name__ == "__main__":
    main()
