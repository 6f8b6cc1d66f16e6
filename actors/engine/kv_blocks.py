"""Prefix-cache blocks on the MLX side: cut from a sequence's cache, rebuilt into a cache.

Runs on the scheduler's thread only. A block holds, per layer, the KV of its tokens
(``KVCache`` layers), the recurrent state at its end (``ArraysCache`` layers of hybrid
models), or for a sliding-window layer (``RotatingKVCache``) the KV of as many of its last
tokens as the layer still held when the block was cut (None: none). A sliding layer attends
to its last ``window`` tokens only and keeps no more, so a cache can be rebuilt at a block's
end only where the blocks before it hold the window's tokens for every such layer
(``usable``): at the end of each prompt and answer, the window those held. Blocks cross to
other actors only as numpy (``to_numpy``/``from_numpy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from troupe.actors.cache_messages import BlockData

KV = "kv"
ARRAYS = "arrays"
WINDOW = "window"

# A step snapshots (``to_numpy``) at most about this many bytes of new blocks for the disk, on
# every rank; the rest wait for the next steps (a 2,000-token prompt's blocks of the default
# model are ~90 MB: snapshotting them at once stalled every stream for a third of a second, and
# the ranks of a sharded model step together, so one rank's long snapshot stalls them all).
PERSIST_BYTES_PER_STEP = 8 << 20


def layer_kinds(model: Any) -> list[str] | None:
    """Per layer, how its cache is blocked; None when a layer's cache cannot be (quantized KV,
    or a rotating cache that keeps its first tokens, for example): such models run without
    the prefix cache."""
    kinds = []
    for c in make_prompt_cache(model):
        if type(c) is KVCache:
            kinds.append(KV)
        elif type(c) is ArraysCache:
            kinds.append(ARRAYS)
        elif type(c) is RotatingKVCache and c.keep == 0:
            kinds.append(WINDOW)
        else:
            return None
    return kinds


def layer_windows(model: Any) -> list[int]:
    """Per layer, the tokens a sliding-window layer attends to (0: every token)."""
    return [c.max_size if type(c) is RotatingKVCache else 0 for c in make_prompt_cache(model)]


def layout(kinds: list[str], windows: list[int]) -> str:
    """What a block of this model holds, layer by layer (``kv``, ``arrays``, ``window512``):
    written with every block on disk, and a block of another layout is never read as this
    one."""
    return ",".join(f"{WINDOW}{w}" if k == WINDOW else k for k, w in zip(kinds, windows,
                                                                        strict=True))


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
            if layer is not None:
                total += sum(a.nbytes for a in layer if a is not None)
        return total


def _kv_slice(c: Any, lo: int, hi: int) -> tuple[mx.array, mx.array]:
    """Keys and values of positions ``lo..hi-1`` of a KV layer's cache, as new arrays."""
    k, v, _ = c.state
    return mx.contiguous(k[..., lo:hi, :]), mx.contiguous(v[..., lo:hi, :])


def _in_order(c: Any) -> tuple[mx.array, mx.array, int] | None:
    """A sliding-window layer's keys and values in the order of their positions, and the
    position of the first (None: empty). The layer's buffer wraps around once it is full
    (``RotatingKVCache`` writes a decoded token over the oldest); read from its public
    state, as mlx-lm puts a wrapped buffer in order itself."""
    keys, values, offset, keep, _, idx = c.state
    if keys is None or offset == 0:
        return None
    if idx == keys.shape[2]:
        k, v = keys, values
    elif idx < offset:  # wrapped: the oldest token is the one at ``idx``
        k = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
        v = mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2)
    else:
        k, v = keys[..., :idx, :], values[..., :idx, :]
    return k, v, offset - k.shape[2]


def _window_slice(ordered: tuple[mx.array, mx.array, int] | None, lo: int,
                  hi: int) -> tuple[mx.array, mx.array] | None:
    """The KV of the last of positions ``lo..hi-1`` a sliding layer still holds (``ordered``,
    from ``_in_order``), as new arrays ending at ``hi``; None if it holds none of them."""
    if ordered is None:
        return None
    k, v, first = ordered
    a = max(lo, first)
    if a >= hi or hi > first + k.shape[2]:
        return None
    return mx.contiguous(k[..., a - first : hi - first, :]), \
        mx.contiguous(v[..., a - first : hi - first, :])


def window_parts(cache: list[Any], kinds: list[str], first: int, last: int,
                 block_size: int) -> dict[int, list[Any]]:
    """Per block ``first..last-1``, the sliding-window layers' KV of its tokens that ``cache``
    (those layers only, as extracted from the batch) holds, per layer (None for the others):
    taken as the step that completed the blocks ends, before the layers drop them."""
    ordered = [_in_order(c) if kind == WINDOW else None for c, kind in zip(cache, kinds,
                                                                              strict=True)]
    parts = {b: [None if o is None else _window_slice(o, b * block_size, (b + 1) * block_size)
                 for o in ordered] for b in range(first, last)}
    mx.eval([a for layers in parts.values() for layer in layers if layer for a in layer])
    return parts


def _longer(a: tuple[mx.array, mx.array] | None,
            b: tuple[mx.array, mx.array] | None) -> tuple[mx.array, mx.array] | None:
    if a is None or (b is not None and b[0].shape[2] > a[0].shape[2]):
        return b
    return a


def cut_blocks(
    cache: list[Any],
    kinds: list[str],
    first: int,
    last: int,
    block_size: int,
    hashes: list[str],
    tokens: Sequence[int] | None = None,
    root: str = "",
    parts: dict[int, list[Any]] | None = None,
) -> list[KVBlock]:
    """Blocks ``first..last-1`` of one sequence's cache (as extracted from the batch), of the
    chain from ``root``.

    KV layers are sliced per block; sliding-window layers give what they still hold of each
    block's tokens, or what ``parts`` (``window_parts``) took of them earlier, the longer.
    Recurrent layers only know their state at the cache's current end, so the caller cuts
    hybrid models exactly at one block boundary at a time (``last`` = the boundary just
    reached) and only the last block carries state.
    """
    ordered = [_in_order(c) if kind == WINDOW else None for c, kind in zip(cache, kinds,
                                                                              strict=True)]
    blocks = []
    for b in range(first, last):
        lo, hi = b * block_size, (b + 1) * block_size
        layers: list[Any] = []
        for c, kind, o in zip(cache, kinds, ordered, strict=True):
            if kind == KV:
                layers.append(_kv_slice(c, lo, hi))
            elif kind == WINDOW:
                part = parts.get(b) if parts else None
                layers.append(_longer(_window_slice(o, lo, hi),
                                      None if part is None else part[len(layers)]))
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


def cut_tail(cache: list[Any], kinds: list[str], start: int, tokens: Sequence[int],
             parent_hash: str | None, block_hash: str, root: str = "") -> KVBlock:
    """The KV of ``tokens[start:]`` (fewer than a block) as a tail block of the chain from
    ``root``; KV and sliding-window layers only."""
    layers = [_kv_slice(c, start, len(tokens)) if kind == KV
              else _window_slice(_in_order(c), start, len(tokens))
              for c, kind in zip(cache, kinds, strict=True)]
    mx.eval([a for layer in layers if layer for a in layer])
    return KVBlock(block_hash=block_hash, parent_hash=parent_hash,
                   n_tokens=len(tokens) - start, layers=layers,
                   tokens=tuple(tokens[start:]), tail=True, root=root)


def _head_layer(layer: tuple[mx.array, mx.array] | None, n_tokens: int,
                n: int) -> tuple[mx.array, mx.array] | None:
    # A layer's KV ends at the block's end (all its tokens, or a sliding layer's last few).
    if layer is None:
        return None
    k, v = layer
    keep = n - (n_tokens - k.shape[2])
    return (k[..., :keep, :], v[..., :keep, :]) if keep > 0 else None


def head(block: KVBlock, n: int) -> KVBlock:
    """The first ``n`` tokens of a block of KV and sliding-window layers (a partial hit):
    views, no copy."""
    return KVBlock(
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        n_tokens=n,
        layers=[_head_layer(layer, block.n_tokens, n) for layer in block.layers],
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


def covered(blocks: Sequence[KVBlock], kinds: list[str], windows: list[int]) -> bool:
    """Whether a cache can be rebuilt at the end of these consecutive blocks: for every
    sliding-window layer, the blocks hold the KV of the window's tokens before that end
    (each block's last tokens, back to the window's start without a gap)."""
    total = sum(b.n_tokens for b in blocks)
    for i, (kind, window) in enumerate(zip(kinds, windows, strict=True)):
        if kind != WINDOW:
            continue
        need, got = min(window, total), 0
        for b in reversed(blocks):
            if got >= need:
                break
            layer = b.layers[i]
            held = 0 if layer is None else layer[0].shape[2]
            got += held
            if held < b.n_tokens:
                break  # a gap before what it holds
        if got < need:
            return False
    return True


def usable(blocks: Sequence[KVBlock], kinds: list[str], windows: list[int]) -> int:
    """How many of the leading ``blocks`` (a prefix-cache hit) a cache can be rebuilt from:
    all for models without sliding windows, else as many as end where the windows are
    held."""
    n = len(blocks)
    if WINDOW in kinds:
        while n and not covered(blocks[:n], kinds, windows):
            n -= 1
    return n


def build_cache(model: Any, kinds: list[str], blocks: list[KVBlock]) -> list[Any]:
    """A fresh per-layer cache holding the prefix these consecutive blocks describe (which
    must be ``covered``)."""
    cache = make_prompt_cache(model)
    total = sum(b.n_tokens for b in blocks)
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
        elif kind == WINDOW:
            # The window's tokens before the end, in order: the rotating cache as it is
            # after a prefill of ``total`` tokens (keep 0, nothing wrapped).
            need = min(c.max_size, total)
            ks, vs, got = [], [], 0
            for blk in reversed(blocks):
                if got >= need:
                    break
                k, v = blk.layers[i]
                ks.append(k)
                vs.append(v)
                got += k.shape[2]
            k = mx.concatenate(ks[::-1], axis=2)[..., got - need :, :]
            v = mx.concatenate(vs[::-1], axis=2)[..., got - need :, :]
            c.state = (k, v, total, 0, c.max_size, need)
        else:
            c.cache = list(blocks[-1].layers[i])
    return cache


def to_numpy(block: KVBlock, layout_name: str) -> BlockData:
    """Snapshot to numpy (on the MLX thread), for a model of ``layout_name`` (``layout``).
    bfloat16 travels as its uint16 bit pattern."""
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
        layout=layout_name,
    )


def from_numpy(data: BlockData, kinds: list[str], state_sizes: list[int],
               layout_name: str) -> KVBlock:
    """Turn a block read from disk back into MLX arrays (on the MLX thread). Raises
    ValueError for a block of another layout than ``layout_name``: one that records none was
    written before layouts were, when only models without sliding windows kept blocks."""
    if data.layout != layout_name and (data.layout or WINDOW in kinds):
        raise ValueError(f"block {data.block_hash} holds {data.layout or 'no recorded'} "
                         f"layers, not {layout_name}")

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
        elif kind == WINDOW:
            k, v = get(f"{i}.keys"), get(f"{i}.values")
            layers.append(None if k is None or v is None else (k, v))
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
