"""Tiny random-weight embedding and reranker model directories, made from ``tiny_model``'s
qwen3: the Qwen3-Embedding layout (sentence-transformers files beside the mlx-lm ones) and a
Qwen3-Reranker (a plain causal LM, told apart by its name)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tiny_model import make_tiny_model

QUERY_PROMPT = "Instruct: Given a question, find the passages that answer it\nQuery:"


def write_pooling(out: Path, pooling: str, *, width: int, normalize: bool) -> None:
    """The sentence-transformers files that name a model's pooling (``pooling``: "cls",
    "mean" or "lasttoken"), with a Normalize module after it when ``normalize``."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": width,
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }))


def write_dense(out: Path, in_features: int, out_features: int, activation: str, *,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A sentence-transformers Dense module of random weights in ``out/2_Dense``, listed in
    ``modules.json`` after the pooling (before a Normalize module); its weight and bias."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.3
    bias = rng.standard_normal(out_features).astype(np.float32) * 0.1
    (out / "2_Dense").mkdir(exist_ok=True)
    save_file({"linear.weight": weight, "linear.bias": bias},
              str(out / "2_Dense" / "model.safetensors"))
    (out / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": in_features, "out_features": out_features, "bias": True,
        "activation_function": activation}))
    modules = json.loads((out / "modules.json").read_text())
    normalize = [m for m in modules if m["type"].endswith("Normalize")]
    modules = [m for m in modules if not m["type"].endswith("Normalize")]
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"})
    for m in normalize:
        modules.append({**m, "idx": len(modules), "name": str(len(modules))})
    (out / "modules.json").write_text(json.dumps(modules))
    return weight, bias


def make_embedding_model(out: Path, *, pooling: str = "lasttoken", context: int = 2048) -> Path:
    """A tiny qwen3 with sentence-transformers files: ``pooling`` "lasttoken" (the
    Qwen3-Embedding recipe) or "mean"; the query prompt ``QUERY_PROMPT``."""
    make_tiny_model(out, arch="qwen3", template="qwen3", context=context)
    write_pooling(out, pooling, width=64, normalize=True)
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }))
    return out


def make_reranker_model(root: Path, *, context: int = 2048,
                        name: str = "tiny-qwen3-reranker") -> Path:
    """A tiny qwen3 named as a reranker (its untied head gives "yes" and "no" their own
    rows)."""
    return make_tiny_model(root / name, arch="qwen3", template="qwen3", eos_head=6.0,
                           context=context)


def run_job(embedder: Any, kind: str, inputs: list[list[int]], budget: int = 512) -> list[Any]:
    """``inputs`` as one job through ``embedder`` (an ``Embedder`` or ``EncoderEmbedder``),
    stepped ``budget`` tokens at a time; its results."""
    from troupe.actors.engine.embed import EmbedJob

    got: dict[str, Any] = {}
    embedder.add(EmbedJob("job", kind, inputs, lambda r, e: got.update(r=r, e=e)))
    while embedder.has_work:
        embedder.step(budget)
    assert got["e"] is None
    return got["r"]
