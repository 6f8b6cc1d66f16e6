"""How a model is sharded over the ranks: the modes, each rank's engine settings, memory shape
and cache directory, and loading this rank's shard with mlx-lm's ``sharded_load``.

Pure functions of the model's files and the group's size, with no channel and no actor:
admission (its prefill guard) and the scheduler (its memory gate) read them on rank 0, and
every rank loads its shard with ``load_shard``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.memory_estimate import ModelMemory, model_memory_of

MODES = ("tensor", "pipeline")

def engine_config_for(config: EngineConfig, mode: str) -> EngineConfig:
    """The engine settings of a sharded model. Pipeline stages run mlx-lm's own model call: the
    one-pass forward (actors/engine/forward.py) runs every layer in one process."""
    if mode == "pipeline":
        return msgspec.structs.replace(config, mixed_step=False)
    return config


def rank_cache_dir(base: str | Path, mode: str, size: int, rank: int) -> Path:
    """Where one rank keeps its shard of the prefix cache: a directory per layout, so that a
    group of another size or mode never reads this one's shards."""
    return Path(base) / f"{mode}-{size}" / f"rank-{rank}"


def shard_memory(memory: ModelMemory, mode: str, size: int) -> ModelMemory:
    """The memory shape of one rank's shard, for its memory gate: tensor parallelism gives
    each rank 1/size of the heads and of the MLP; a pipeline stage holds the KV of its own
    layers (the largest stage's share counted). ``weights_bytes`` stays as given: the
    scheduler measures its own shard's."""
    if mode == "tensor":
        return msgspec.structs.replace(
            memory, kv_heads=math.ceil(memory.kv_heads / size),
            q_heads=math.ceil(memory.q_heads / size),
            intermediate=math.ceil(memory.intermediate / size))
    return msgspec.structs.replace(memory, kv_layers=math.ceil(memory.kv_layers / size))


def rank_memory_of(model_dir: str | Path, mode: str, size: int) -> ModelMemory:
    """One rank's share of the model in ``model_dir``, read from its files, for admission's
    prefill guard: ``shard_memory``'s shape (the scheduler's gate counts the same), and 1/size
    of the weights. That is the least the fullest rank holds (replicated embeddings, a larger
    stage); the monitor's floor, measured on the fullest rank, counts the rest."""
    whole = model_memory_of(model_dir)
    return msgspec.structs.replace(shard_memory(whole, mode, size),
                                   weights_bytes=math.ceil(whole.weights_bytes / size))


def load_shard(path: str, mode: str, group: Any) -> tuple[Any, Any]:
    """This rank's shard of the model at ``path`` and its tokenizer. Uses mlx-lm's
    ``sharded_load`` (each rank reads only its own weights) when the directory has a weight
    index; a single-file model is loaded whole, then sharded."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.utils import sharded_load

    config = json.loads((Path(path) / "config.json").read_text())
    if mode == "tensor":
        check_tensor_split(config, group.size())
    if (Path(path) / "model.safetensors.index.json").exists():
        return sharded_load(path, pipeline_group=group if mode == "pipeline" else None,
                            tensor_group=group if mode == "tensor" else None)
    model, tokenizer = load(path, lazy=True)
    if mode == "tensor":
        if not hasattr(model, "shard"):
            raise ValueError(f"mlx-lm cannot shard a {config.get('model_type')} model by tensor")
        model.shard(group)
    else:
        inner = getattr(model, "model", None)
        if not hasattr(inner, "pipeline"):
            raise ValueError(f"mlx-lm cannot split a {config.get('model_type')} model into "
                             "pipeline stages")
        inner.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # every rank loaded
    return model, tokenizer


def check_tensor_split(config: dict[str, Any], size: int) -> None:
    """Tensor parallelism gives each rank a share of the attention heads: refuse, clearly, a
    model whose head counts do not split over ``size`` ranks (mlx-lm would fail later, in a
    forward pass, on mismatched shapes)."""
    text = config.get("text_config", config)
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", heads)
    for name, n in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(n, int) and n % size:
            raise ValueError(f"the model's {n} {name} do not split over {size} ranks; use a "
                             "model whose head counts divide, or --distributed pipeline")

