"""One forward pass for a decode step and a prefill chunk together (a mixed batch).

mlx-lm's ``BatchGenerator`` runs the decode step of the sequences that are generating and the
prefill chunk of the ones still reading their prompt as two model calls. On a CPU a model call
costs about a decode step whatever it carries: the weights are read once per call, and every
projection is a matrix product whose rows are the tokens in it. This module runs both groups
through each layer at once: the token-wise parts of a layer (norms, the q/k/v and output
projections, the MLP) take the decode tokens and the prefill tokens as the rows of one matrix,
and only attention, which needs each sequence's own cache and mask, runs per group.

Only decoder layers of the llama shape are taken (llama, mistral, qwen2 and the like: one
``self_attn`` with q/k/v/o projections and a rope, one ``mlp``, two RMS norms, plain KV caches,
no sliding window), and qwen3's, which is that shape with a norm of each head's queries and
keys before the rope; ``supports_mixed`` says whether a model is one, and anything else keeps
mlx-lm's two calls.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from actors.engine import cpu_kernels
from actors.engine.ragged_cache import RaggedKVCache

# Model types whose decoder layer is exactly: x + attn(norm(x)), then h + mlp(norm(h)).
MIXED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Those whose attention norms each head's queries and keys (q_norm, k_norm) before the rope.
QK_NORM_MODEL_TYPES = frozenset({"qwen3"})


def supports_mixed(model: Any) -> bool:
    """Whether ``mixed_forward`` computes exactly what ``model(...)`` does for this model."""
    args = getattr(model, "args", None)
    inner = getattr(model, "model", None)
    if args is None or inner is None or getattr(args, "model_type", None) not in MIXED_MODEL_TYPES:
        return False
    if getattr(inner, "swa_idx", None) is not None or getattr(inner, "sliding_window", None):
        return False
    if getattr(args, "sliding_window", None) and getattr(args, "model_type", "") == "mistral":
        return False
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj", "rope", "n_heads", "n_kv_heads", "scale")
    qk_norm = args.model_type in QK_NORM_MODEL_TYPES
    return all(
        all(hasattr(layer, n) for n in needed) and all(hasattr(layer.self_attn, n) for n in attn)
        and hasattr(layer.self_attn, "q_norm") == qk_norm
        and hasattr(layer.self_attn, "k_norm") == qk_norm
        for layer in inner.layers
    )


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, batch: int, length: int,
            cache: Any, mask: Any, offset: Any = None) -> mx.array:
    """The attention of one group, as the layer's own ``Attention.__call__`` computes it after
    its projections. q/k/v: [batch * length, features]; returns [batch * length, features].
    ``offset``: the group's positions before this step (default: the cache's own)."""
    q = q.reshape(batch, length, attn.n_heads, -1)
    k = k.reshape(batch, length, attn.n_kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3: each head's queries and keys normed, as the layer does
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = v.reshape(batch, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if offset is None else offset
    q = attn.rope(q, offset=offset)
    k = attn.rope(k, offset=offset)
    k, v = cache.update_and_fetch(k, v)
    if 1 < length <= FOLD_ROWS and _foldable(q, k, mask):
        out = chunk_attention(q, k, v, scale=attn.scale, mask=mask)
    else:
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)
    return out.transpose(0, 2, 1, 3).reshape(batch * length, -1)


# A prefill chunk of at most this many tokens (riding in a decode step) attends with each KV
# head's query heads stacked into one product (``chunk_attention``).
FOLD_ROWS = 64


def _foldable(q: mx.array, k: mx.array, mask: Any) -> bool:
    return (q.dtype == mx.float32 and k.dtype == mx.float32 and q.shape[1] % k.shape[1] == 0
            and (mask is None or isinstance(mask, mx.array)) and mx.default_device() == mx.cpu)


def chunk_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                    mask: mx.array | None) -> mx.array:
    """Attention of a few query rows over a long cache, each KV head's query heads stacked
    into one [heads x rows, dim] product instead of a product per query head. A chunk of 16
    tokens at 2,000 keys of the default model: 3.4 ms a layer against 5.1 ms
    (benchmarks/bench_mixed.py). Rounds like MLX's attention up to the last bits (the
    products have more rows), which mixed steps do anyway."""
    b, n_q, length, dim = q.shape
    n_kv, keys = k.shape[1], k.shape[2]
    repeats = n_q // n_kv
    q = (mx.array(scale, q.dtype) * q).reshape(b, n_kv, repeats * length, dim)
    scores = (q @ k.swapaxes(-1, -2)).reshape(b, n_kv, repeats, length, keys)
    keep = None
    if mask is not None:
        if mask.dtype != mx.bool_:
            scores = scores + mx.expand_dims(mask, 2).astype(scores.dtype)
        else:
            keep = mx.broadcast_to(mx.expand_dims(mask, 2), scores.shape)
    if cpu_kernels.enabled():
        probs = cpu_kernels.softmax_rows(scores, keep)
    else:
        if keep is not None:
            scores = mx.where(keep, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        probs = mx.softmax(scores, axis=-1, precise=True)
    out = probs.reshape(b, n_kv, repeats * length, keys) @ v
    return out.reshape(b, n_q, length, dim)



def _frozen(offset: Any) -> Any:
    """A copy of a cache's offset that its in-place update (``offset += n``) leaves as is."""
    return mx.array(offset) if isinstance(offset, mx.array) else offset


def mixed_forward(model: Any, decode_inputs: mx.array, decode_cache: list[Any],
                  prefill_inputs: mx.array | None = None,
                  prefill_cache: list[Any] | None = None) -> mx.array:
    """Logits [B, 1, vocab] of the decode group's next tokens; the prefill group's tokens
    ([P, L]) are written into ``prefill_cache`` on the way, as ``model(prefill_inputs,
    cache=prefill_cache)`` would (its logits are never computed: nobody samples from them).
    ``decode_cache`` may hold ``RaggedKVCache`` layers: each group attends on its own."""
    logits, _ = forward(model, decode_inputs, decode_cache, prefill_inputs, prefill_cache)
    return logits


def forward(model: Any, decode_inputs: mx.array | None, decode_cache: list[Any] | None,
            prefill_inputs: mx.array | None = None, prefill_cache: list[Any] | None = None,
            ends: list[int] = ()) -> tuple[mx.array | None, mx.array | None]:
    """``mixed_forward`` with either group optional, and with the logits of some prefill
    rows: ``ends`` are rows of the flattened [P * L] chunk (each the last token of a prompt)
    whose next-token logits come back as the second result ([len(ends), vocab]). Every other
    prefill row leaves the pass after the last layer's attention, as in ``mixed_forward``."""
    inner = model.model
    parts, spans, masks, offsets = [], [], [], []
    nd = B = Ld = 0
    if decode_inputs is not None:
        hd = inner.embed_tokens(decode_inputs)
        B, Ld, D = hd.shape
        nd = B * Ld
        first = decode_cache[0]
        if isinstance(first, RaggedKVCache):
            spans = [(a, b) for a, b, _ in first.spans()]
            masks = [create_attention_mask(hd[a:b], g) for a, b, g in first.spans()]
            offsets = [_frozen(g.offset) for g in first.groups]
        else:
            spans, masks = [(0, B)], [create_attention_mask(hd, first)]
            offsets = [_frozen(first.offset)]
        parts.append(hd.reshape(nd, D))
    if prefill_inputs is not None:
        hp = inner.embed_tokens(prefill_inputs)
        P, Lp, D = hp.shape
        mask_p = create_attention_mask(hp, prefill_cache[0])
        offset_p = _frozen(prefill_cache[0].offset)
        parts.append(hp.reshape(P * Lp, D))
    x = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    last = len(inner.layers) - 1
    layer_caches = decode_cache if decode_cache is not None else [None] * len(inner.layers)
    # Every layer's cache of a group is at the same positions: the first layer's offsets,
    # copied before its update moves them, serve all layers, so rope makes each group's
    # angles once a step instead of once a layer.
    with cpu_kernels.shared_angles():
        for i, (layer, cd) in enumerate(zip(inner.layers, layer_caches, strict=True)):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            out = []
            if decode_inputs is not None:
                groups = cd.groups if isinstance(cd, RaggedKVCache) else [cd]
                out = [
                    _attend(attn, q[a * Ld:b * Ld], k[a * Ld:b * Ld], v[a * Ld:b * Ld], b - a,
                            Ld, g, m, off)
                    for (a, b), g, m, off in zip(spans, groups, masks, offsets, strict=True)
                ]
            if prefill_inputs is not None:
                out.append(_attend(attn, q[nd:], k[nd:], v[nd:], P, Lp, prefill_cache[i],
                                   mask_p, offset_p))
            x = x + attn.o_proj(mx.concatenate(out) if len(out) > 1 else out[0])
            if i == last and prefill_inputs is not None:
                # The prefill rows are done (their keys and values are in the cache), except
                # the prompts' last tokens, whose logits give those prompts their first tokens.
                kept = x[:nd] if nd else None
                if ends:
                    tail = x[nd + mx.array(ends, dtype=mx.uint32)]
                    kept = tail if kept is None else mx.concatenate([kept, tail])
                if kept is None:
                    return None, None
                x = kept
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = inner.norm(x)
    if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        logits = inner.embed_tokens.as_linear(x)
    else:
        logits = model.lm_head(x)
    decode = logits[:nd].reshape(B, Ld, -1) if nd else None
    return decode, (logits[nd:] if ends else None)
