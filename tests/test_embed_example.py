"""The embedding guide's example (docs/embedding.md) runs on the tiny model as the guide says."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "embed_server.py"


def test_embed_example_serves_spawns_its_watcher_and_shows_it_in_actors(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(tiny_model_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TROUPE_HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    assert re.fullmatch(r"serving tiny-llama on http://127\.0\.0\.1:\d+", lines[0])
    assert re.fullmatch(r"watcher: 8 tokens from tiny-llama \(length\) after a \d+-token prompt",
                        lines[1])
    names = lines[2].removeprefix("GET /actors: ").split(", ")
    assert {"scheduler", "admission", "watcher"} <= set(names)
    assert names[-1] == "watcher"  # spawned last, listed last
    state, report = lines[3].removeprefix("GET /actors/watcher: ").split(" ", 1)
    assert state == "running"
    assert json.loads(report) == {"requests": 1, "generated_tokens": 8}


def test_the_embedding_guide_shows_the_example_as_it_is() -> None:
    guide = (ROOT / "docs" / "embedding.md").read_text()
    example = EXAMPLE.read_text()
    body = example[example.index("class Watch(Message):"):example.index("\nif __name__")]
    assert body.strip() in guide
