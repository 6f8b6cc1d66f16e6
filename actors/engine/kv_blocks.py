"""Prefix-cache blocks on the MLX side: cut from a sequence's cache, rebuilt into a cache.

Runs on the scheduler's thread only. A block holds, per layer, either the KV of its tokens
(``KVCache`` layers) or the recurrent state at its end (``ArraysCache`` layers of hybrid
models). Blocks cross to other actors only as numpy (``to_numpy``/``from_numpy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from actors.cache_messages import BlockData

KV = "kv"
ARRAYS = "arrays"


def layer_kinds(model: Any) -> list[str] | None:
    """Per layer, how its cache is blocked; None when a layer's cache cannot be (rotating or
    quantized KV, for example): such models run without the prefix cache."""
    kinds = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            kinds.append(KV)
        elif type(c) is ArraysCache:
            kinds.append(ARRAYS)
        else:
            return None
    return kinds


@dataclass
class KVBlock:
    """One block's cache state as MLX arrays (owned by the scheduler's thread)."""

    block_hash: str
    parent_hash: str | None
    n_tokens: int
    # Per layer: (keys, values) for KV layers, the list of state arrays for ARRAYS layers.
    layers: list[Any]
    # The token ids the block covers (None when not known): what a partial hit compares.
    tokens: tuple[int, ...] | None = None
    # A tail: the partial last block of a finished sequence. RAM only, never written to disk,
    # never part of a chain; it serves partial hits only.
    tail: bool = False
    # The root of its chain (``prefix.namespace_root``): what a block without a parent
    # follows. A partial hit at a prompt's start compares only blocks of the prompt's root,
    # so that no namespace reads another's tokens.
    root: str = ""

    @property
    def nbytes(self) -> int:
        total = 0
        for layer in self.layers:
            total += sum(a.nbytes for a in layer if a is not None)
        return total


def _kv_slice(c: Any, lo: int, hi: int) -> tuple[mx.array, mx.array]:
    """Keys and values of positions ``lo..hi-1`` of a KV layer's cache, as new arrays."""
    k, v, _ = c.state
    return mx.contiguous(k[..., lo:hi, :]), mx.contiguous(v[..., lo:hi, :])


def cut_blocks(
    cache: list[Any],
    kinds: list[str],
    first: int,
    last: int,
    block_size: int,
    hashes: list[str],
    tokens: Sequence[int] | None = None,
    root: str = "",
) -> list[KVBlock]:
    """Blocks ``first..last-1`` of one sequence's cache (as extracted from the batch), of the
    chain from ``root``.

    KV layers are sliced per block. Recurrent layers only know their state at the cache's
    current end, so the caller cuts hybrid models exactly at one block boundary at a time
    (``last`` = the boundary just reached) and only the last block carries state.
    """
    blocks = []
    for b in range(first, last):
        lo, hi = b * block_size, (b + 1) * block_size
        layers: list[Any] = []
        for c, kind in zip(cache, kinds, strict=True):
            if kind == KV:
                layers.append(_kv_slice(c, lo, hi))
            elif b == last - 1:
                layers.append([None if a is None else mx.contiguous(a) for a in c.cache])
            else:
                layers.append(None)
        blocks.append(
            KVBlock(
                block_hash=hashes[b],
                parent_hash=hashes[b - 1] if b > 0 else None,
                n_tokens=block_size,
                layers=layers,
                tokens=None if tokens is None else tuple(tokens[lo:hi]),
                root=root,
            )
        )
    mx.eval([a for blk in blocks for layer in blk.layers if layer for a in layer if a is not None])
    return blocks


def cut_tail(cache: list[Any], start: int, tokens: Sequence[int], parent_hash: str | None,
             block_hash: str, root: str = "") -> KVBlock:
    """The KV of ``tokens[start:]`` (fewer than a block) as a tail block of the chain from
    ``root``; plain KV models only."""
    layers = [_kv_slice(c, start, len(tokens)) for c in cache]
    mx.eval([a for layer in layers for a in layer])
    return KVBlock(block_hash=block_hash, parent_hash=parent_hash,
                   n_tokens=len(tokens) - start, layers=layers,
                   tokens=tuple(tokens[start:]), tail=True, root=root)


def head(block: KVBlock, n: int) -> KVBlock:
    """The first ``n`` tokens of a plain-KV block (a partial hit): views, no copy."""
    return KVBlock(
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        n_tokens=n,
        layers=[(k[..., :n, :], v[..., :n, :]) for k, v in block.layers],
        tokens=None if block.tokens is None else block.tokens[:n],
        tail=True,
        root=block.root,
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def build_cache(model: Any, kinds: list[str], blocks: list[KVBlock]) -> list[Any]:
    """A fresh per-layer cache holding the prefix these consecutive blocks describe."""
    cache = make_prompt_cache(model)
    for i, (c, kind) in enumerate(zip(cache, kinds, strict=True)):
        if kind == KV:
            # Room after the prefix (as KVCache grows it), so that the rest of the prompt
            # and the first answers are written in place instead of into a copy.
            ks = [blk.layers[i][0] for blk in blocks]
            vs = [blk.layers[i][1] for blk in blocks]
            n = sum(k.shape[2] for k in ks)
            spare = KVCache.step - n % KVCache.step
            b, h, _, dk = ks[0].shape
            ks.append(mx.zeros((b, h, spare, dk), ks[0].dtype))
            vs.append(mx.zeros((b, h, spare, vs[0].shape[3]), vs[0].dtype))
            c.state = (mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), n)
        else:
            c.cache = list(blocks[-1].layers[i])
    return cache


def complete(block: KVBlock, kinds: list[str]) -> bool:
    """Whether a block can start from cache alone: hybrid layers need their end state."""
    return all(kind == KV or layer is not None for layer, kind in zip(block.layers, kinds,
                                                                        strict=True))


def to_numpy(block: KVBlock) -> BlockData:
    """Snapshot to numpy (on the MLX thread). bfloat16 travels as its uint16 bit pattern."""
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}

    def put(name: str, a: mx.array) -> None:
        dtypes[name] = str(a.dtype).removeprefix("mlx.core.")
        tensors[name] = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)

    for i, layer in enumerate(block.layers):
        if layer is None:
            continue
        if isinstance(layer, tuple):
            put(f"{i}.keys", layer[0])
            put(f"{i}.values", layer[1])
        else:
            for j, a in enumerate(layer):
                if a is not None:
                    put(f"{i}.state.{j}", a)
    return BlockData(
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        n_tokens=block.n_tokens,
        tensors=tensors,
        dtypes=dtypes,
    )


def from_numpy(data: BlockData, kinds: list[str], state_sizes: list[int]) -> KVBlock:
    """Turn a block read from disk back into MLX arrays (on the MLX thread)."""

    def get(name: str) -> mx.array | None:
        t = data.tensors.get(name)
        if t is None:
            return None
        a = mx.array(t)
        return a.view(mx.bfloat16) if data.dtypes.get(name) == "bfloat16" else a

    layers: list[Any] = []
    for i, kind in enumerate(kinds):
        if kind == KV:
            k, v = get(f"{i}.keys"), get(f"{i}.values")
            if k is None or v is None:
                raise ValueError(f"block {data.block_hash} lacks layer {i}'s KV")
            layers.append((k, v))
        else:
            states = [get(f"{i}.state.{j}") for j in range(state_sizes[i])]
            layers.append(states if any(s is not None for s in states) else None)
    block = KVBlock(
        block_hash=data.block_hash,
        parent_hash=data.parent_hash,
        n_tokens=data.n_tokens,
        layers=layers,
    )
    mx.eval([a for layer in layers if layer for a in layer if a is not None])
    return block
