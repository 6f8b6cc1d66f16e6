"""Shared fixtures: tiny random-weight model directories made once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_model import make_tiny_model  # noqa: E402

# Tests never write into the user's ~/.cache: converted models and KV-cache blocks go to a
# directory of this run (subprocess servers inherit it). A caller may point it elsewhere.
if "TROUPE_HOME" not in os.environ:
    os.environ["TROUPE_HOME"] = tempfile.mkdtemp(prefix="troupe-test-home-")


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
def tiny_hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer lfm2 (ArraysCache and KVCache layers mixed)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-lfm2") / "tiny-lfm2", arch="lfm2", layers=4
    )
