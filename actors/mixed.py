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

import copy
import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

from actors import cpu_kernels
from actors.mlx_lm_private import right_pad_prompts

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


class RaggedKVCache:
    """One layer's KV cache of a decode batch, kept as groups of rows of similar length.

    mlx-lm's ``BatchKVCache`` holds a batch as one left-padded array: when a 2,000-token
    prompt joins eight 200-token conversations, all nine rows are padded to 2,000 (a copy of
    the whole cache as it joins) and every decode step attends over 2,000 positions for each
    of them. Here a joining batch becomes a group of its own unless merging costs little
    padding; attention runs per group (``mixed_forward``) while the projections still take
    every row at once. Rows are the groups' rows in order, which ``GenerationBatch``'s
    order-keeping ``extend`` (append) and ``filter`` (sorted indices) preserve.
    """

    def __init__(self, groups: list[Any] | None = None) -> None:
        self.groups: list[Any] = [g for g in (groups or []) if _rows(g)]

    @classmethod
    def wrap(cls, cache: Any) -> RaggedKVCache:
        return cache if isinstance(cache, RaggedKVCache) else cls([cache] if cache else [])

    def spans(self) -> list[tuple[int, int, Any]]:
        """(first row, end row, group cache) of each group, in row order."""
        out, at = [], 0
        for g in self.groups:
            n = _rows(g)
            out.append((at, at + n, g))
            at += n
        return out

    def extend(self, other: Any) -> None:
        for g in RaggedKVCache.wrap(other).groups:
            if self.groups and _merge_is_cheap(self.groups[-1], g):
                _merge_into(self.groups[-1], g)
            else:
                self.groups.append(g)
        self._bound_groups()

    def filter(self, keep: list[int]) -> None:
        kept = []
        for first, end, g in self.spans():
            local = [i - first for i in keep if first <= i < end]
            if not local:
                continue
            if len(local) < end - first:
                g.filter(local)
            if kept and _merge_is_cheap(kept[-1], g):
                _merge_into(kept[-1], g)  # e.g. the long row between them finished
            else:
                kept.append(g)
        self.groups = kept

    def _bound_groups(self) -> None:
        """At most MAX_GROUPS groups: merge the neighbours whose merge pads least."""
        while len(self.groups) > MAX_GROUPS:
            i = min(range(len(self.groups) - 1),
                    key=lambda j: _padding_cost(self.groups[j], self.groups[j + 1]))
            _merge_into(self.groups[i], self.groups.pop(i + 1))

    def extract(self, idx: int) -> Any:
        for first, end, g in self.spans():
            if first <= idx < end:
                return g.extract(idx - first)
        raise IndexError(idx)

    @property
    def state(self) -> list[Any]:
        return [g.state for g in self.groups]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def size(self) -> int:
        return max((g.size() for g in self.groups), default=0)

    def empty(self) -> bool:
        return all(g.empty() for g in self.groups)


# A decode batch keeps at most this many groups (each costs a few small ops per layer), and a
# joining group merges into the last one when padding it costs at most this many positions
# per row of attention beyond what the two groups hold.
MAX_GROUPS = 4
MERGE_SLACK = 128


def _rows(cache: Any) -> int:
    return 0 if cache is None else int(cache.offset.shape[0])


def _padding_cost(a: Any, b: Any) -> int:
    """Positions of attention per step that merging ``a`` and ``b`` adds (padding)."""
    na, nb = _rows(a), _rows(b)
    return (na + nb) * max(a.size(), b.size()) - na * a.size() - nb * b.size()


def _merge_is_cheap(a: Any, b: Any) -> bool:
    return _padding_cost(a, b) <= MERGE_SLACK * (_rows(a) + _rows(b))


def _merge_into(a: Any, b: Any) -> None:
    """``a.extend(b)`` for two ``BatchKVCache`` groups, as mlx-lm's (rows right-justified at
    the longer one's length, in a buffer as large as the larger of the two), writing only
    the positions in use into one new buffer. mlx-lm's pads each whole buffer and then
    concatenates the padded copies: the join of eight short prompts to eight decoding
    streams spent ~170 ms of its step there (default model, ~80 positions in buffers of 256)."""
    if type(a) is not BatchKVCache or type(b) is not BatchKVCache or a.keys is None \
            or b.keys is None:
        a.extend(b)
        return
    na, nb = _rows(a), _rows(b)
    top = max(a._idx, b._idx)
    size = max(a.keys.shape[2], b.keys.shape[2])
    merged = []
    for xa, xb in ((a.keys, b.keys), (a.values, b.values)):
        out = mx.zeros((na + nb, *xa.shape[1:2], size, xa.shape[3]), xa.dtype)
        out[:na, :, top - a._idx:top, :] = xa[..., :a._idx, :]
        out[na:, :, top - b._idx:top, :] = xb[..., :b._idx, :]
        merged.append(out)
    a.keys, a.values = merged
    a.offset = mx.concatenate([a.offset, b.offset])
    a.left_padding = mx.concatenate([a.left_padding + (top - a._idx),
                                     b.left_padding + (top - b._idx)])
    a._idx = top


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


def _frozen(offset: Any) -> Any:
    """A copy of a cache's offset that its in-place update (``offset += n``) leaves as is."""
    return mx.array(offset) if isinstance(offset, mx.array) else offset


class _Forward:
    """The model as a decode step of ``JoiningGenerationBatch`` calls it: ``mixed_forward``,
    which reads ragged caches, with the prompt batch's next chunk riding along when one is
    set (``ride``), as ``PromptProcessingBatch.prompt`` would have run it in a call of its own
    (same bookkeeping, same right padding). The chunk rows that end a prompt leave their
    logits in ``ended`` (``ride``'s ``ends``), from which the step samples their first token."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.batch: PromptProcessingBatch | None = None
        self.tokens: mx.array | None = None
        self.padding: list[int] = []
        self.ends: list[int] = []
        self.ended: mx.array | None = None

    def ride(self, batch: PromptProcessingBatch, prompts: list[list[int]],
             ends: list[int] = ()) -> None:
        """Set the chunk: ``prompts[i]`` for the batch's row i; ``ends``: the rows whose
        chunk holds the last token of their prompt."""
        for held, new in zip(batch.tokens, prompts, strict=True):
            held += new
        lengths = [len(p) for p in prompts]
        longest = max(lengths)
        self.padding = [longest - n for n in lengths]
        if max(self.padding) > 0:
            self.tokens = right_pad_prompts(prompts, max_length=longest)
            for c in batch.prompt_cache:
                c.prepare(lengths=lengths, right_padding=self.padding)
        else:
            self.tokens = mx.array(prompts)
        # Rows of the flattened chunk: each ending prompt's last token (right padded).
        self.ends = [i * longest + lengths[i] - 1 for i in ends]
        self.batch = batch

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        if self.batch is None:
            return mixed_forward(self.model, inputs, cache)
        logits, self.ended = forward(self.model, inputs, cache, self.tokens,
                                     self.batch.prompt_cache, self.ends)
        return logits

    def prefill(self) -> None:
        """The chunk alone (nothing decodes): into the prompt cache, built now, and the
        allocator's cache of the chunk's activations given back, as mlx-lm's
        ``PromptProcessingBatch.prompt`` does."""
        _, self.ended = forward(self.model, None, None, self.tokens, self.batch.prompt_cache,
                                self.ends)
        mx.eval([c.state for c in self.batch.prompt_cache],
                [] if self.ended is None else self.ended)
        mx.clear_cache()

    def land(self) -> mx.array | None:
        """After the step: the chunk is in the prompt cache (right padding rolled away).
        Returns the logits of the rows that ended a prompt (None: none did)."""
        if self.batch is not None and max(self.padding) > 0:
            for c in self.batch.prompt_cache:
                _finalize(c)
        ended = self.ended
        self.batch, self.tokens, self.padding, self.ends, self.ended = None, None, [], [], None
        return ended


class _Given:
    """A model call that returns logits already computed (a prompt's first token, sampled
    from the prefill chunk that ran its last token)."""

    def __init__(self, logits: mx.array) -> None:
        self.logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self.logits[:, None, :]


def _finalize(cache: Any) -> None:
    """``BatchKVCache.finalize`` (each row's right padding rolled to its left), rolling only
    the positions in use: mlx-lm's rolls the whole buffer, room to grow included (a gather,
    ~2x the time here for eight short prompts in buffers of 256)."""
    pad = getattr(cache, "_right_padding", None)
    if type(cache) is not BatchKVCache or pad is None or cache.keys is None:
        cache.finalize()
        return
    n = cache._idx
    rolled = []
    for x in (cache.keys, cache.values):
        r = dynamic_roll(x[..., :n, :], pad[:, None], axis=2)
        rolled.append(mx.concatenate([r, x[..., n:, :]], axis=2) if x.shape[2] > n else r)
    cache.keys, cache.values = rolled
    cache.offset = cache.offset - pad
    cache.left_padding += pad
    cache._right_padding = None


class JoiningGenerationBatch(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` with two changes.

    - A sequence that finished its prompt joins without a model call of its own: its last
      prompt token is the input of its first step in the batch, as any sequence's previous
      token is (mlx-lm runs that token in a separate call as the sequence joins).
    - A step answers the tokens it sampled, not the ones it was given. mlx-lm's step reads
      the previous step's tokens after queueing the next forward pass, so that the two
      overlap; on the CPU, ``mx.async_eval`` of a model's graph returns only when all but
      the last few of its operations have run (measured here: 70-98 ms of a 90-120 ms decode
      step of the default model), so each token reached the client a whole step late, and a
      step carrying a prefill chunk (a second of prompt tokens) held back the first token of
      every sequence that joined the step before. Here the step waits for its own tokens.
    """

    def __init__(self, *args: Any, joining: bool = False, **kwargs: Any) -> None:
        self._deferred = joining
        super().__init__(*args, **kwargs)
        self._deferred = False
        if joining:
            # Never read (a joining sequence's inputs are prompt tokens, not answers); made
            # here, on the thread that steps: an array belongs to the thread whose stream
            # made it.
            self._next_logprobs = [mx.zeros((1,))] * len(self.uids)

    def _step(self) -> Any:
        if self._deferred:
            return None  # the constructor's step: the batch's next step runs it instead
        super()._step()  # the forward pass of the tokens answered last step
        mx.eval(self._next_tokens, self._next_logprobs)
        return self._next_tokens.tolist(), self._next_logprobs

    def extend(self, batch: GenerationBatch) -> None:
        # Decoding caches grow by mlx-lm's room again (a prompt's grew by less: growing by 64
        # positions, every stream copied its cache four times as often).
        for c in batch.prompt_cache:
            if type(c) is BatchKVCache and "step" in vars(c):
                del c.step
        # Mixed steps (``mixed_forward`` reads them) keep the decode batch's caches ragged.
        if batch.prompt_cache and isinstance(self.model, _Forward):
            if not self.prompt_cache:
                self.prompt_cache = [RaggedKVCache() for _ in batch.prompt_cache]
            else:
                self.prompt_cache = [RaggedKVCache.wrap(c) for c in self.prompt_cache]
        super().extend(batch)


def _as_batch(cache: KVCache) -> BatchKVCache:
    """A one-row ``BatchKVCache`` on a ``KVCache``'s own buffers (no padding, no copy)."""
    out = BatchKVCache([0])
    out.keys, out.values = cache.keys, cache.values
    out.offset = mx.array([cache.offset])
    out._idx = cache.offset
    return out


# Room a prompt's cache grows by while it is shorter than mlx-lm's step (256 positions, the
# room it grows by after that, and once the sequence decodes: growing by 64 past it, a long
# prompt prefilled in budgeted chunks of ~60 tokens copied its whole cache every step). A
# chunk writes into a buffer grown to fit it, and the right padding of a batch of chunks is
# then rolled over it (``_finalize``): for eight chat prompts of ~50 tokens, 64 positions of
# room instead of 256 took these copies from ~100 to ~45 ms of a ~1 s prefill step (default
# model).
PROMPT_CACHE_STEP = 64


class MixedBatchGenerator(BatchGenerator):
    """mlx-lm's ``BatchGenerator`` with fewer model calls a step, answering in the step.

    mlx-lm's step makes up to three calls: the decode step, the last prompt token of each
    sequence that finished its prompt, and the next prefill chunk. Here a sequence that
    finished its prompt joins before the step instead of after it: its last prompt token is a
    row of the decode step, and the step answers its first token (``JoiningGenerationBatch``:
    mlx-lm's would answer it one step later). With ``mixed`` (and a model ``mixed_forward``
    handles), the prefill chunk rides in the same forward pass as well, and the decode
    batch's cache is ragged: one call a step while anything decodes. Without, the prefill
    chunk is mlx-lm's call of its own after the decode step (hybrid models: their recurrent
    layers are not in ``mixed_forward``).
    """

    # With mixed steps, a prompt's first token is sampled from the chunk that runs its last
    # prompt token (False: that token waits for a decode step, as in mlx-lm; for
    # benchmarks/bench_first_token.py's comparison).
    first_token_in_chunk = True

    def __init__(self, model: Any, *, mixed: bool | None = None, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.mixed = supports_mixed(model) if mixed is None else (mixed and supports_mixed(model))
        # The decode step's model: mixed_forward (ridden by the prefill chunk) or the model.
        self._step_model = _Forward(model) if self.mixed else model
        self._generation_batch = JoiningGenerationBatch.empty(self._step_model, self.sampler)

    def _next(self) -> tuple[list[Any], list[Any]]:
        gen, batch = self._generation_batch, self._prompt_batch
        counters = self._counters
        if len(gen) >= self.completion_batch_size:
            return [], self._decode(gen)
        prompt_responses: list[Any] = []
        n = min(self.prefill_batch_size - len(batch),
                self.completion_batch_size - len(gen),
                len(self._unprocessed_sequences))
        if n > 0:
            batch.extend(self._make_batch(n))
        for c in batch.prompt_cache:
            if type(c) is BatchKVCache:
                small = c.keys is None or c.keys.shape[2] < BatchKVCache.step
                c.step = PROMPT_CACHE_STEP if small else BatchKVCache.step
        # Sequences down to their last prompt token join the generation batch now.
        done = [i for i, seq in enumerate(self._currently_processing)
                if len(seq[0]) == 1 and len(seq[0][0]) == 1]
        if done:
            last = [self._currently_processing[i][0][0][0] for i in done]
            progress = [(self._currently_processing[i][2],) * 2 for i in done]
            self._currently_processing = [seq for i, seq in enumerate(self._currently_processing)
                                          if i not in set(done)]
            part = self._split(done)
            batch = self._prompt_batch
            joined = JoiningGenerationBatch(
                self._step_model, part.uids, mx.array(last, dtype=mx.uint32), part.prompt_cache,
                part.tokens, part.samplers, part.fallback_sampler, part.logits_processors,
                part.stop_sequences, part.max_tokens, joining=True)
            for uid, p in zip(joined.uids, progress, strict=True):
                prompt_responses.append(PromptProcessingBatch.Response(uid, p, True, True))
            gen.extend(joined)
        # The next chunk of each prompt still being read (as mlx-lm's step takes it). With
        # mixed steps, a chunk that reaches the prompt's last token takes it too: the step
        # samples that prompt's first token from the chunk's logits (mlx-lm leaves the last
        # token for a decode step: one more step before the first token).
        prompts: list[list[int]] = []
        ends: list[int] = []
        for i, seq in enumerate(self._currently_processing):
            response = PromptProcessingBatch.Response(batch.uids[i], 0, False, False)
            segments = seq[0]
            k = min(len(segments[0]), self.prefill_step_size)
            prompts.append(segments[0][:k])
            segments[0] = segments[0][k:]
            if not segments[0]:
                segments.pop(0)
                response.end_of_segment = True
                if (self.mixed and self.first_token_in_chunk and len(segments) == 1
                        and len(segments[0]) == 1 and k < self.prefill_step_size):
                    prompts[-1] = prompts[-1] + segments.pop()
                    response.end_of_prompt = True
                    ends.append(i)
            seq[1] += len(prompts[-1])
            response.progress = (seq[1], seq[2])
            prompt_responses.append(response)
        counters.prompt_tokens += sum(len(p) for p in prompts)
        if not self.mixed:
            # The decode step (joining rows included), then the chunk in a call of its own.
            responses = self._decode(gen) if len(gen) else []
            tic = time.perf_counter()
            batch.prompt(prompts)
            counters.prompt_time += time.perf_counter() - tic
            return prompt_responses, responses
        responses = []
        if prompts:
            self._step_model.ride(batch, prompts, ends)
        try:
            if len(gen):
                responses = self._decode(gen)
            elif prompts:
                tic = time.perf_counter()
                self._step_model.prefill()
                counters.prompt_time += time.perf_counter() - tic
        finally:
            ended = self._step_model.land()
        if ends:
            responses += self._first_tokens(ends, ended)
        return prompt_responses, responses

    def _first_tokens(self, rows: list[int], logits: mx.array) -> list[Any]:
        """The first tokens of the prompt batch's ``rows``, whose prompts ended in this step's
        chunk, sampled from ``logits`` (the chunk's, at their last tokens) as a decode step
        samples: the same samplers, logits processors, stop sequences and token limits. The
        sequences that go on join the decode batch, whose next step runs their first token."""
        ending = set(rows)
        self._currently_processing = [seq for i, seq in enumerate(self._currently_processing)
                                      if i not in ending]
        part = self._split(rows)
        # The batch's tokens are those in the cache; the step adds the last prompt token
        # (its input) itself, as it adds every step's input.
        last = [held[-1] for held in part.tokens]
        tokens = [held[:-1] for held in part.tokens]
        first = JoiningGenerationBatch(
            _Given(logits), part.uids, mx.array(last, dtype=mx.uint32), part.prompt_cache,
            tokens, part.samplers, part.fallback_sampler, part.logits_processors,
            part.stop_sequences, part.max_tokens, joining=True)
        counters = self._counters
        responses = first.next()
        counters.generation_tokens += len(responses)
        first.model = self._step_model
        if len(first):
            self._generation_batch.extend(first)
        return responses

    def _make_batch(self, n: int) -> PromptProcessingBatch:
        """mlx-lm's, except that one sequence starting from a cached prefix keeps its cache's
        arrays: ``BatchKVCache.merge`` would copy them into a new buffer of exactly their
        length, which the next token then outgrows into a third copy (~90 MB each for a
        2,000-token prefix of the default model)."""
        first = self._unprocessed_sequences[0][3] if n == 1 else None
        batch = super()._make_batch(n)
        if first and all(type(c) is KVCache and c.keys is not None for c in first):
            batch.prompt_cache = [_as_batch(c) for c in first]  # the merge was never run
        return batch

    def _split(self, indices: list[int]) -> PromptProcessingBatch:
        """``PromptProcessingBatch.split`` without its deep copy of the whole batch's cache
        (a 2,000-token prompt's is ~90 MB on the default model): the finished rows are taken
        whole when they are the whole batch, else filtered out of shallow copies of the
        layer caches (``filter`` replaces their arrays instead of changing them)."""
        batch = self._prompt_batch
        if len(indices) == len(batch):
            self._prompt_batch = PromptProcessingBatch.empty(
                self.model, self.sampler, prefill_step_size=self.prefill_step_size)
            return batch
        part = copy.copy(batch)
        for name in ("uids", "tokens", "samplers", "logits_processors", "max_tokens",
                     "stop_sequences"):
            setattr(part, name, list(getattr(batch, name)))
        part.prompt_cache = [copy.copy(c) for c in batch.prompt_cache]
        part.filter(sorted(indices))
        batch.filter(sorted(set(range(len(batch))) - set(indices)))
        return part

    def _decode(self, gen: GenerationBatch) -> list[Any]:
        counters = self._counters
        tic = time.perf_counter()
        responses = gen.next()
        counters.decode_time += time.perf_counter() - tic
        counters.generation_tokens += len(responses)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            mx.clear_cache()
        return responses
