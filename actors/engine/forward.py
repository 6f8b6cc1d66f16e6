"""One forward pass for a decode step and a prefill chunk together (a mixed batch).

mlx-lm's ``BatchGenerator`` runs the decode step of the sequences that are generating and the
prefill chunk of the ones still reading their prompt as two model calls. On a CPU a model call
costs about a decode step whatever it carries: the weights are read once per call, and every
projection is a matrix product whose rows are the tokens in it. This module runs both groups
through each layer at once: the token-wise parts of a layer (norms, the q/k/v and output
projections, the MLP) take the decode tokens and the prefill tokens as the rows of one matrix,
and only attention, which needs each sequence's own cache and mask, runs per group.

``supports_mixed`` says which models it takes (anything else keeps mlx-lm's two calls):

- decoder layers of the llama shape (llama, mistral, qwen2: one ``self_attn`` with q/k/v/o
  projections and a rope, one ``mlp``, two RMS norms, plain KV caches; a mistral's layers
  that its ``layer_types`` name sliding attend over its window, masked per kind as
  gemma3_text's below), and qwen3's, which is that shape with a norm of each head's queries and keys
  before the rope; qwen3_moe's and glm4_moe's are those shapes with a mixture of experts as
  the MLP (the token-wise MoE takes the rows like any MLP; glm4_moe ropes part of each head
  and norms queries and keys when its config says so);
- gemma3_text's: embeddings scaled by sqrt(hidden size), per-head q/k norms, four norms a
  layer (after attention, and before and after the MLP), and local layers that attend over a
  sliding window (their own rope base, a ``RotatingKVCache``) between global ones every
  ``sliding_window_pattern`` layers. Each group's masks are made as the model's own call
  makes them, once per kind of layer (global, windowed) from the group's cache at the first
  layer of that kind, and the caches are written by their own ``update_and_fetch``, as in
  mlx-lm. The decode batch of such a model is one group (mlx-lm's batch caches, not
  ``RaggedKVCache``: see ``actors/engine/batch.py``);
- gpt_oss's: llama's layer with biased projections and a mixture of experts as the MLP, its
  own names for the head counts and scale, a learned logit per head in each softmax
  (attention sinks, passed to the attention as the model passes them), its rope (YaRN in the
  released checkpoints) and sliding-window and global layers as its ``layer_types`` name
  them, masked per kind as gemma3_text's;
- qwen3_5's and qwen3_5_moe's (hybrid): gated delta-net recurrent layers between gated
  attention layers, a dense MLP or routed and shared experts. The recurrent layers' input and
  output projections and norm take all rows; their convolution and delta-rule update run per
  group, each on its own state (``ArraysCache``), masked as the model's call masks them. The
  attention layers' query projection also gives each head's output gate, applied before the
  output projection. The decode batch is one group, as for windowed models.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import (
    create_attention_mask,
    create_ssm_mask,
    scaled_dot_product_attention,
)
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk
from mlx_lm.models.gemma3_text import clip_residual

from troupe.actors.engine import cpu_kernels
from troupe.actors.engine.ragged_cache import RaggedKVCache

# Model types whose decoder layer is exactly: x + attn(norm(x)), then h + mlp(norm(h)), or
# (SANDWICH_MODEL_TYPES) gemma3's x + norm(attn(norm(x))), then h + norm(mlp(norm(h))).
MIXED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe",
                               "gemma3_text", "gpt_oss", "qwen3_5", "qwen3_5_moe"})
# Those whose attention norms each head's queries and keys (q_norm, k_norm) before the rope.
QK_NORM_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
# Gemma 3's layer: four norms, embeddings scaled by sqrt(hidden size), sliding-window layers.
SANDWICH_MODEL_TYPES = frozenset({"gemma3_text"})
# gpt_oss's attention: sinks, its sizes named num_attention_heads, num_key_value_heads and
# sm_scale, sliding-window layers named by ``layer_types``.
SINK_MODEL_TYPES = frozenset({"gpt_oss"})
# Qwen3.5's hybrid layers: recurrent (gated delta-net) ones and gated attention ones.
HYBRID_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe"})
# Those whose layers each say whether they attend over the model's sliding window
# (``use_sliding``, from the config's ``layer_types``): mistral with a window.
LAYER_WINDOW_MODEL_TYPES = frozenset({"llama", "mistral"})
# The kind of layer (beside an attention window, or None: global) of a recurrent layer.
RECURRENT = "recurrent"


def supports_mixed(model: Any) -> bool:
    """Whether ``mixed_forward`` computes exactly what ``model(...)`` does for this model."""
    args = getattr(model, "args", None)
    inner = getattr(model, "model", None)
    if args is None or inner is None or getattr(args, "model_type", None) not in MIXED_MODEL_TYPES:
        return False
    if args.model_type in HYBRID_MODEL_TYPES:
        return _supports_hybrid(inner)
    sinks = args.model_type in SINK_MODEL_TYPES
    if sinks:
        kinds = getattr(inner, "layer_types", None)
        if (kinds is None or len(kinds) != len(inner.layers)
                or not set(kinds) <= {"sliding_attention", "full_attention"}
                or not getattr(inner, "window_size", None)):
            return False
    elif args.model_type in LAYER_WINDOW_MODEL_TYPES:
        # Each layer global or windowed by its own ``use_sliding`` (mlx-lm's llama, which
        # runs mistral too), masked per kind as the model's own call masks them.
        if not all(hasattr(layer, "use_sliding") for layer in inner.layers):
            return False
        if (any(layer.use_sliding for layer in inner.layers)
                and not getattr(inner, "sliding_window", None)):
            return False
    elif getattr(inner, "swa_idx", None) is not None or getattr(inner, "sliding_window", None):
        return False
    sandwich = args.model_type in SANDWICH_MODEL_TYPES
    if sandwich and not all(hasattr(inner, n) for n in ("window_size", "sliding_window_pattern")):
        return False
    needed = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
    if sandwich:
        needed += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj", "rope")
    attn += (("num_attention_heads", "num_key_value_heads", "sm_scale", "sinks") if sinks
             else ("n_heads", "n_kv_heads", "scale"))
    # glm4_moe norms them when its config says so.
    qk_norm = args.model_type in QK_NORM_MODEL_TYPES or bool(getattr(args, "use_qk_norm", False))
    return all(
        all(hasattr(layer, n) for n in needed) and all(hasattr(layer.self_attn, n) for n in attn)
        and hasattr(layer.self_attn, "q_norm") == qk_norm
        and hasattr(layer.self_attn, "k_norm") == qk_norm
        and hasattr(layer, "pre_feedforward_layernorm") == sandwich
        for layer in inner.layers
    )


def _supports_hybrid(inner: Any) -> bool:
    """Whether a qwen3_5 text model's layers are those ``forward`` computes (and not split
    over a pipeline or sharded)."""
    if getattr(inner, "pipeline_size", 1) != 1:
        return False
    recurrent = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm",
                 "out_proj", "A_log", "dt_bias", "conv_kernel_size", "conv_dim", "key_dim",
                 "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")
    attn = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "rope",
            "num_attention_heads", "num_key_value_heads", "scale")
    for layer in inner.layers:
        if not all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm",
                                               "mlp", "is_linear")):
            return False
        if getattr(layer.mlp, "sharding_group", None) is not None:
            return False
        if layer.is_linear:
            la = getattr(layer, "linear_attn", None)
            if (la is None or not all(hasattr(la, n) for n in recurrent)
                    or la.sharding_group is not None):
                return False
        elif not all(hasattr(getattr(layer, "self_attn", None), n) for n in attn):
            return False
    return True


def _windows(model: Any) -> list[int | str | None]:
    """Each layer's attention window as the model's own call masks it (None: global;
    ``RECURRENT``: a recurrent layer, masked as the model masks those)."""
    inner = model.model
    if model.args.model_type in HYBRID_MODEL_TYPES:
        return [RECURRENT if layer.is_linear else None for layer in inner.layers]
    if model.args.model_type in SINK_MODEL_TYPES:
        return [inner.window_size if kind == "sliding_attention" else None
                for kind in inner.layer_types]
    if model.args.model_type in LAYER_WINDOW_MODEL_TYPES:
        return [inner.sliding_window if layer.use_sliding else None for layer in inner.layers]
    if model.args.model_type not in SANDWICH_MODEL_TYPES:
        return [None] * len(inner.layers)
    # gemma3_text: every pattern-th layer global, the others local.
    pattern = inner.sliding_window_pattern
    return [None if i % pattern == pattern - 1 else inner.window_size
            for i in range(len(inner.layers))]


def _embed(model: Any, inputs: mx.array) -> mx.array:
    h = model.model.embed_tokens(inputs)
    if model.args.model_type in SANDWICH_MODEL_TYPES:
        # As gemma3_text's own call rounds it: sqrt(hidden size) in bfloat16.
        h = h * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    return h


def _group_views(h: mx.array, caches: list[Any], windows: list[int | str | None]
                 ) -> tuple[dict[int | str | None, Any], dict[int | str | None, Any]]:
    """One group's masks and rope offsets per kind of layer (its window), made from the
    group's cache at the first layer of that kind before any layer writes: what the model's
    own call gives each layer of that kind (every layer's cache holds the same positions)."""
    masks, offsets = {}, {}
    for w in dict.fromkeys(windows):
        cache = caches[windows.index(w)]
        if w == RECURRENT:
            masks[w], offsets[w] = create_ssm_mask(h, cache), None
            continue
        masks[w] = create_attention_mask(h, cache, window_size=w)
        offsets[w] = _frozen(cache.offset)
    return masks, offsets


# One group of rows in a layer: its rows of the flattened pass (start, stop), its batch and
# length, its cache of that layer, its mask and its rope offset for that layer's kind.
Group = tuple[int, int, int, int, Any, Any, Any]


def _attention_layer(attn: Any, h: mx.array, groups: list[Group], gated: bool) -> mx.array:
    """An attention layer on all rows: projections on all, attention per group. ``gated``:
    qwen3_5's query projection gives each head's queries and then its output gate."""
    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
    gate = None
    if gated:
        q, gate = mx.split(q.reshape(q.shape[0], head_sizes(attn)[0], -1), 2, axis=-1)
        q, gate = q.reshape(q.shape[0], -1), gate.reshape(gate.shape[0], -1)
    out = [_attend(attn, q[a:b], k[a:b], v[a:b], n, length, cache, mask, offset)
           for a, b, n, length, cache, mask, offset in groups]
    out = mx.concatenate(out) if len(out) > 1 else out[0]
    if gate is not None:
        out = out * mx.sigmoid(gate)
    return attn.o_proj(out)


def _recurrent_layer(la: Any, h: mx.array, groups: list[Group]) -> mx.array:
    """A gated delta-net layer (qwen3_5's ``GatedDeltaNet``) on all rows: its projections and
    gated norm on all, its convolution and recurrent update per group on the group's state."""
    qkv, z = la.in_proj_qkv(h), la.in_proj_z(h)
    b, a = la.in_proj_b(h), la.in_proj_a(h)
    out = [_recur(la, qkv[s:e], b[s:e], a[s:e], n, length, cache, mask)
           for s, e, n, length, cache, mask, _ in groups]
    out = mx.concatenate(out) if len(out) > 1 else out[0]
    out = la.norm(out, z.reshape(*out.shape))
    return la.out_proj(out.reshape(out.shape[0], -1))


def _recur(la: Any, qkv: mx.array, b: mx.array, a: mx.array, batch: int, length: int,
           cache: Any, mask: Any) -> mx.array:
    """One group's convolution and delta-rule update, as ``GatedDeltaNet.__call__`` computes
    them between its projections and its norm; the group's state (``cache``) moves on.
    Returns [batch * length, value heads, value head size]."""
    qkv = qkv.reshape(batch, length, -1)
    b, a = b.reshape(batch, length, -1), a.reshape(batch, length, -1)
    n_keep = la.conv_kernel_size - 1
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((batch, n_keep, la.conv_dim), dtype=qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache.lengths is not None:  # right-padded rows keep the state at their own ends
        ends = mx.clip(cache.lengths, 0, length)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
    else:
        cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(la.conv1d(conv_input))
    q, k, v = [
        t.reshape(batch, length, heads, dim)
        for t, heads, dim in zip(
            mx.split(conv_out, [la.key_dim, 2 * la.key_dim], -1),
            [la.num_k_heads, la.num_k_heads, la.num_v_heads],
            [la.head_k_dim, la.head_k_dim, la.head_v_dim], strict=True)
    ]
    q, k = normalize_qk(q, k, inv_scale=la.head_k_dim**-0.5, eps=1e-6)
    out, state = gated_delta_update(q, k, v, a, b, la.A_log, la.dt_bias, cache[1], mask,
                                    use_kernel=not la.training)
    cache[1] = state
    cache.advance(length)
    return out.reshape(batch * length, la.num_v_heads, la.head_v_dim)


def _attend(attn: Any, q: mx.array, k: mx.array, v: mx.array, batch: int, length: int,
            cache: Any, mask: Any, offset: Any = None) -> mx.array:
    """The attention of one group, as the layer's own ``Attention.__call__`` computes it after
    its projections. q/k/v: [batch * length, features]; returns [batch * length, features].
    ``offset``: the group's positions before this step (default: the cache's own)."""
    heads, kv_heads, scale, sinks = head_sizes(attn)
    q = q.reshape(batch, length, heads, -1)
    k = k.reshape(batch, length, kv_heads, -1)
    if hasattr(attn, "q_norm"):  # qwen3: each head's queries and keys normed, as the layer does
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
    v = v.reshape(batch, length, kv_heads, -1).transpose(0, 2, 1, 3)
    offset = cache.offset if offset is None else offset
    q = attn.rope(q, offset=offset)
    k = attn.rope(k, offset=offset)
    k, v = cache.update_and_fetch(k, v)
    if 1 < length <= FOLD_ROWS and sinks is None and _foldable(q, k, mask):
        out = chunk_attention(q, k, v, scale=scale, mask=mask)
    else:
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask,
                                           sinks=sinks)
    return out.transpose(0, 2, 1, 3).reshape(batch * length, -1)


def head_sizes(attn: Any) -> tuple[int, int, float, mx.array | None]:
    """An attention layer's query heads, key/value heads, scale and sinks (None: none), under
    its model's own names."""
    if hasattr(attn, "n_heads"):
        return attn.n_heads, attn.n_kv_heads, attn.scale, None
    if hasattr(attn, "sinks"):  # gpt_oss
        return attn.num_attention_heads, attn.num_key_value_heads, attn.sm_scale, attn.sinks
    return attn.num_attention_heads, attn.num_key_value_heads, attn.scale, None  # qwen3_5


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
    windows = _windows(model)
    parts, spans, views = [], [], []
    nd = B = Ld = 0
    if decode_inputs is not None:
        hd = _embed(model, decode_inputs)
        B, Ld, D = hd.shape
        nd = B * Ld
        if isinstance(decode_cache[0], RaggedKVCache):
            spans = [(a, b) for a, b, _ in decode_cache[0].spans()]
            per_layer = [c.groups for c in decode_cache]
        else:
            spans, per_layer = [(0, B)], [[c] for c in decode_cache]
        views = [_group_views(hd[a:b], [groups[j] for groups in per_layer], windows)
                 for j, (a, b) in enumerate(spans)]
        parts.append(hd.reshape(nd, D))
    if prefill_inputs is not None:
        hp = _embed(model, prefill_inputs)
        P, Lp, D = hp.shape
        masks_p, offsets_p = _group_views(hp, prefill_cache, windows)
        parts.append(hp.reshape(P * Lp, D))
    x = mx.concatenate(parts) if len(parts) > 1 else parts[0]
    last = len(inner.layers) - 1
    layer_caches = decode_cache if decode_cache is not None else [None] * len(inner.layers)
    sandwich = model.args.model_type in SANDWICH_MODEL_TYPES
    gated = model.args.model_type in HYBRID_MODEL_TYPES
    # Every layer's cache of a group is at the same positions: the offsets of the first layer
    # of each kind, copied before its update moves them, serve all layers of that kind, so
    # rope makes each group's angles once a step instead of once a layer.
    with cpu_kernels.shared_angles():
        for i, (layer, cd, w) in enumerate(zip(inner.layers, layer_caches, windows,
                                               strict=True)):
            groups: list[Group] = []
            if decode_inputs is not None:
                caches = cd.groups if isinstance(cd, RaggedKVCache) else [cd]
                groups = [(a * Ld, b * Ld, b - a, Ld, g, masks[w], offsets[w])
                          for (a, b), g, (masks, offsets) in zip(spans, caches, views,
                                                                 strict=True)]
            if prefill_inputs is not None:
                groups.append((nd, nd + P * Lp, P, Lp, prefill_cache[i], masks_p[w],
                               offsets_p[w]))
            h = layer.input_layernorm(x)
            if w == RECURRENT:
                r = _recurrent_layer(layer.linear_attn, h, groups)
            else:
                r = _attention_layer(layer.self_attn, h, groups, gated)
            x = clip_residual(x, layer.post_attention_layernorm(r)) if sandwich else x + r
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
            if sandwich:
                r = layer.mlp(layer.pre_feedforward_layernorm(x))
                x = clip_residual(x, layer.post_feedforward_layernorm(r))
            else:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = inner.norm(x)
    # A model has its own head exactly when it computes logits with it (glm4_moe always does;
    # the others make one, or keep it, only for untied embeddings). qwen3_5's is its text
    # model's.
    head = getattr(model, "language_model", model)
    if hasattr(head, "lm_head"):
        logits = head.lm_head(x)
    else:
        logits = inner.embed_tokens.as_linear(x)
    decode = logits[:nd].reshape(B, Ld, -1) if nd else None
    return decode, (logits[nd:] if ends else None)
