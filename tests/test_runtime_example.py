"""The guide's example (docs/actors.md) runs as shown and prints what the guide says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_counter_example_runs_and_prints_its_story() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "examples/counter_actor.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True,
    )
    lines = done.stdout.splitlines()
    assert lines[:6] == [
        "counter: started on thread counter-thread",
        "total: 15",
        "stream: [1, 2, 3]",
        "counter: stopped (RuntimeError('asked to crash'))",
        "counter: started on thread counter-thread",
        "after restart: 10",
    ]
    snapshot = json.loads(lines[6].removeprefix("snapshot: "))
    assert snapshot["state"] == "running"
    assert snapshot["restarts"] == 1
    assert snapshot["last_error"] == {"type": "RuntimeError", "message": "asked to crash"}
    assert snapshot["report"] == {"total": 10}
    assert lines[7:] == ["counter: stopped (None)"]
    assert "ERROR runtime: actor 'counter' failed handling a message" in done.stderr


def test_the_guide_shows_the_example_as_it_is() -> None:
    guide = (ROOT / "docs" / "actors.md").read_text()
    example = (ROOT / "examples" / "counter_actor.py").read_text()
    body = example[example.index("class Add(Message):"):example.index('\nif __name__')]
    assert body.strip() in guide
