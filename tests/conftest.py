"""Shared fixtures: tiny random-weight model directories made once per test session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# The agents' request shapes (agent_shapes) live beside the benchmark that replays them.
sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

# Tests never write into the user's ~/.cache: converted models and KV-cache blocks go to a
# directory of this run (subprocess servers inherit it). A caller may point it elsewhere.
if "TROUPE_HOME" not in os.environ:
    os.environ["TROUPE_HOME"] = tempfile.mkdtemp(prefix="troupe-test-home-")
    # Gone with the run: it holds a converted default model (about 500 MB) and every
    # session left one behind.
    atexit.register(shutil.rmtree, os.environ["TROUPE_HOME"], ignore_errors=True)

import http_stack  # noqa: E402
from tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama with a real BPE tokenizer and ChatML template."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path):
    """The tiny llama loaded with mlx-lm: (model, tokenizer)."""
    from mlx_lm import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def tiny_short_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama under another name ("tiny-short"), with a context of 64 tokens."""
    out = tmp_path_factory.mktemp("tiny-short") / "tiny-short"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 64
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer qwen3 whose template renders tools and reasoning as the Qwen3 family's does
    (``tiny_model.QWEN3_TEMPLATE``: mlx-lm reads the json_tools format and <think> tags),
    with a 32k context (its small vocabulary takes about 1.5 characters a token) and answers
    that end by themselves, as an agent's conversation needs."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3") / "tiny-qwen3", arch="qwen3",
                           template="qwen3", context=32768, eos_head=6.0)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer lfm2 (ArraysCache and KVCache layers mixed)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-lfm2") / "tiny-lfm2", arch="lfm2", layers=4
    )


# --- the default model's tokenizer and grammar compiler ----------------------------------------


@pytest.fixture(scope="session")
def tokenizer():
    """The default model's tokenizer (SmolLM2's 49k vocabulary), as mlx-lm loads it."""
    from mlx_lm.utils import load_tokenizer

    from troupe.actors.models.store import resolve_model

    return load_tokenizer(resolve_model(None).path)


@pytest.fixture(scope="session")
def grammars(tokenizer):
    """The default model's grammar compiler (``actors.engine.grammar.Grammars``)."""
    from troupe.actors.engine.grammar import Grammars

    return Grammars(tokenizer)


# --- the end-to-end server: the real default model over HTTP, one for the whole run ---------


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("e2e") / "server.log"


@pytest.fixture(scope="session")
def server(server_log: Path) -> Iterator[str]:
    """`troupe serve` on the bundled default model (a subprocess on 127.0.0.1): its base URL."""
    with http_stack.serve_default_model(server_log) as base:
        yield base
