"""Memory arithmetic of the prefill guard: what a prompt will need, and how close we are.

Pure Python (no MLX, no actors): admission's estimate, the scheduler's per-chunk gate, the
memory monitor's pressure levels and the unit tests all use these functions. Sizes are bytes.

The model of a prefill, calibrated against MLX's own peak counter on CPU (docs/memory.md):

- **KV**: ``2 x kv_layers x kv_heads x head_dim x dtype`` bytes per token. mlx-lm's caches
  grow in steps of ``KV_STEP`` tokens, and a batch's cache is rectangular: every sequence of a
  batch holds as many slots as the longest one.
- **the transient of one prefill chunk**: the attention scores of a chunk of ``L`` tokens over
  a context of ``S`` tokens, ``q_heads x L x S x dtype`` per sequence, materialised once plus
  the softmax (``SCORE_FACTOR``; ``NATIVE_SCORE_FACTOR`` with troupe's CPU attention), and
  the per-token working set of one layer (projections and MLP activations, ``WORK_PER_TOKEN``
  hidden/intermediate widths at float32). Only one layer's transient is alive at a time: MLX
  frees a layer's temporaries before the next layer's.
- **the prefix cache** (when on) copies a prompt's full blocks out of the batch: at the cut,
  the sequence's KV is extracted (a copy, freed at once) and the blocks sliced from it (a copy
  kept in RAM until evicted).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

# mlx-lm's KVCache / BatchKVCache allocate this many token slots at a time.
KV_STEP = 256
# Attention scores are materialised once (on CPU MLX's SDPA is not fused) and the softmax
# makes a partial second copy: measured 1.11x the scores on the default model; 1.15 for margin.
SCORE_FACTOR = 1.15
# troupe's CPU attention (actors/engine/cpu_kernels.py): the estimate is 1.13-4.35x the peak on
# the default model, 0.89-0.95x on 16-wide heads (benchmarks/bench_prefill_memory.py,
# docs/memory.md).
NATIVE_SCORE_FACTOR = 3.2
# One layer's live activations per prompt token of a chunk, in units of (hidden, intermediate)
# widths: q/k/v/o projections, residuals and norms ~8 x hidden; gate, up, their product and
# the activation ~5 x intermediate. Measured ~45 KB/token on the default model (hidden 576,
# intermediate 1536, float32) against 49 KB from this formula.
WORK_HIDDEN = 8
WORK_INTERMEDIATE = 5
WORK_BYTES = 4  # norms and rope run in float32 whatever the weights' dtype

# Waiting sequences start prefilling only while the reservation leaves this much of the limit
# free: decoders grow and the allocator caches while a prompt prefills, and a sequence that
# started should not have to be failed for it.
ADMIT_HEADROOM = 0.05

# Pressure levels against the limit (fractions of it).
SOFT_FRACTION = 0.85
HARD_FRACTION = 0.95
OK, SOFT, HARD = "ok", "soft", "hard"
PRESSURE_HYSTERESIS = 0.03

# The default limit: a fraction of the memory available at start, or of Metal's recommended
# working set (itself already a fraction of the machine's RAM) on Apple silicon.
DEFAULT_RAM_FRACTION = 0.75
DEFAULT_WORKING_SET_FRACTION = 0.9

DTYPE_BYTES = {
    "float64": 8, "F64": 8,
    "float32": 4, "F32": 4,
    "float16": 2, "F16": 2,
    "bfloat16": 2, "BF16": 2,
}


class ModelMemory(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The shape of a model's memory use: what the estimate needs to know of it."""

    kv_layers: int  # layers that keep keys and values (not recurrent ones)
    kv_heads: int
    head_dim: int
    q_heads: int
    hidden: int
    intermediate: int
    dtype_bytes: int  # of activations and of the KV cache
    weights_bytes: int = 0  # a draft model's included (``with_draft``)
    # A draft model's cache of each drafting row (``--draft-model``): its bytes per token.
    draft_kv_per_token: int = 0

    @property
    def kv_per_token(self) -> int:
        return (2 * self.kv_layers * self.kv_heads * self.head_dim * self.dtype_bytes
                + self.draft_kv_per_token)


def with_draft(memory: ModelMemory, draft: ModelMemory | None) -> ModelMemory:
    """A served model's memory shape with its draft model's (``--draft-model``): the draft's
    weights, and its cache, which grows with every drafting row's tokens beside the served
    model's."""
    if draft is None:
        return memory
    return msgspec.structs.replace(
        memory, weights_bytes=memory.weights_bytes + draft.weights_bytes,
        draft_kv_per_token=memory.draft_kv_per_token + draft.kv_per_token)


# --- reading a model's shape -----------------------------------------------------------------

_NESTED = ("text_config", "language_config", "llm_config")


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config with a nested text model's fields (multimodal configs) laid over the top."""
    flat = dict(config)
    for key in _NESTED:
        nested = config.get(key)
        if isinstance(nested, Mapping):
            flat.update(nested)
    return flat


def _first(cfg: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = cfg.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _kv_layers(cfg: Mapping[str, Any], layers: int) -> int:
    """Layers with a KV cache: hybrid models (recurrent or convolutional layers) have fewer.
    Sliding-window layers count in full: their caches stop at the window, but with the prefix
    cache on each block's window KV is kept until its blocks are cut
    (``kv_blocks.window_parts``)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types if "attention" in str(t) and "linear" not in str(t))
    attn = cfg.get("full_attn_idxs")
    if isinstance(attn, list):
        return len(attn)
    interval = _first(cfg, "full_attention_interval")
    if interval:
        return layers // interval
    return layers


def model_memory(
    config: Mapping[str, Any], *, dtype_bytes: int | None = None, weights_bytes: int = 0
) -> ModelMemory:
    """A model's ``ModelMemory`` from its config.json (nested ``text_config`` included).

    ``dtype_bytes``: the activations' dtype, best taken from the weights
    (``weights_dtype_bytes``); else the config's ``torch_dtype``; else 2.
    """
    cfg = _flat(config)
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers") or 1
    q_heads = _first(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads") or 1
    kv_heads = _first(cfg, "num_key_value_heads", "n_kv_heads", "num_kv_heads",
                      "multi_query_group_num") or q_heads
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model", "dim") or q_heads * 64
    head_dim = _first(cfg, "head_dim") or max(1, hidden // q_heads)
    intermediate = _first(cfg, "intermediate_size", "ffn_dim", "n_inner", "block_ff_dim") \
        or 4 * hidden
    moe = _first(cfg, "moe_intermediate_size")
    if moe:
        intermediate = max(intermediate, moe * (_first(cfg, "num_experts_per_tok") or 1))
    if dtype_bytes is None:
        dtype_bytes = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype")), 2)
    return ModelMemory(
        kv_layers=_kv_layers(cfg, layers),
        kv_heads=kv_heads,
        head_dim=head_dim,
        q_heads=q_heads,
        hidden=hidden,
        intermediate=intermediate,
        dtype_bytes=dtype_bytes,
        weights_bytes=weights_bytes,
    )


def safetensors_dtypes(path: Path) -> dict[str, int]:
    """Bytes per dtype in one safetensors file, from its header alone (no tensor is read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    totals: dict[str, int] = {}
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = info.get("data_offsets", (0, 0))
        totals[info.get("dtype", "")] = totals.get(info.get("dtype", ""), 0) + end - start
    return totals


def weights_dtype_bytes(totals: Mapping[str, int]) -> int | None:
    """The activations' dtype: the floating dtype holding most weight bytes. Quantized
    weights are integers; their scales carry the dtype the model computes in."""
    floats = {k: v for k, v in totals.items() if k in DTYPE_BYTES}
    if not floats:
        return None
    return DTYPE_BYTES[max(floats, key=lambda k: floats[k])]


def model_memory_of(model_dir: str | Path) -> ModelMemory:
    """``model_memory`` for an mlx-lm model directory: config.json plus the weights' headers."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    totals: dict[str, int] = {}
    weights = 0
    # The files mlx-lm loads (its load_model's glob): a repo cloned whole may also hold its
    # weights again in another file (Mistral's consolidated.safetensors), never loaded.
    for f in sorted(model_dir.glob("model*.safetensors")):
        weights += f.stat().st_size
        try:
            for k, v in safetensors_dtypes(f).items():
                totals[k] = totals.get(k, 0) + v
        except (OSError, ValueError, struct.error):
            continue  # an unreadable header: the config's dtype stands in
    return model_memory(config, dtype_bytes=weights_dtype_bytes(totals), weights_bytes=weights)


def parameter_count(model_dir: str | Path) -> int | None:
    """The model's parameters, from its weights' headers (no tensor is read): a quantized
    weight's packed words count ``32 / bits`` parameters each (its layer's bits in the
    config), its scales and biases none. None when no header can be read."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    quant = config.get("quantization") or config.get("quantization_config") or {}
    default_bits = quant.get("bits") if isinstance(quant, dict) else None
    total, read = 0, False
    for f in sorted(model_dir.glob("model*.safetensors")):
        try:
            with open(f, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
        except (OSError, ValueError, struct.error):
            continue
        read = True
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            layer = name.rpartition(".")[0]
            if name.endswith((".scales", ".biases")) and f"{layer}.weight" in header:
                continue
            n = math.prod(info.get("shape") or [0])
            if info.get("dtype") == "U32" and f"{layer}.scales" in header:
                own = quant.get(layer) if isinstance(quant, dict) else None
                bits = own.get("bits", default_bits) if isinstance(own, dict) else default_bits
                n = n * 32 // int(bits or 32)
            total += n
    return total if read else None


# --- what a prompt needs ---------------------------------------------------------------------



def served_memory(model_dir: str | Path, draft_dir: str | Path | None = None) -> ModelMemory:
    """``model_memory_of`` a served model, with its draft model's (``with_draft``) when it
    has one."""
    memory = model_memory_of(model_dir)
    return with_draft(memory, model_memory_of(draft_dir) if draft_dir else None)


def kv_slots(tokens: int) -> int:
    """Token slots a cache holding ``tokens`` has allocated (it grows KV_STEP at a time)."""
    return KV_STEP * math.ceil(max(0, tokens) / KV_STEP)


def kv_bytes(m: ModelMemory, tokens: int, batch: int = 1) -> int:
    return batch * tokens * m.kv_per_token


def score_factor() -> float:
    """How many copies of the attention scores a prefill chunk holds with this process's
    attention: troupe's CPU kernels, or MLX's."""
    from troupe.actors.engine import cpu_kernels  # MLX-free until it is enabled

    return NATIVE_SCORE_FACTOR if cpu_kernels.enabled() else SCORE_FACTOR


def prefill_transient(m: ModelMemory, *, chunk: int, context: int, batch: int = 1,
                      factor: float | None = None) -> int:
    """Temporaries of one prefill chunk of ``chunk`` tokens attending over ``context`` tokens
    (the chunk included), for ``batch`` sequences padded to the same shape; ``factor`` copies
    of the scores (default: those of the attention in use, ``score_factor()``)."""
    if chunk <= 0 or batch <= 0:
        return 0
    scores = batch * m.q_heads * chunk * context * m.dtype_bytes
    work = batch * chunk * (WORK_HIDDEN * m.hidden + WORK_INTERMEDIATE * m.intermediate)
    return int(scores * (score_factor() if factor is None else factor)) + work * WORK_BYTES


def tower_transient(vision: dict, pixels_shape: tuple[int, ...], dtype_bytes: int = 4) -> int:
    """Temporaries of a vision tower reading one image (``vision``: the checkpoint's
    ``vision_config``; ``pixels_shape``: the image as its processor made it, channels by
    height by width, or one row per patch): every layer's attention scores over the image's
    patches and its token-wise work, as ``prefill_transient`` counts a chunk's."""
    patch = int(vision.get("patch_size") or 14)
    if len(pixels_shape) == 3:
        patches = (pixels_shape[1] // patch) * (pixels_shape[2] // patch)
    else:
        patches = pixels_shape[0] if pixels_shape else 0
    hidden = int(vision.get("hidden_size") or 0)
    intermediate = int(vision.get("intermediate_size") or 4 * hidden)
    heads = int(vision.get("num_attention_heads") or vision.get("num_heads") or 1)
    scores = heads * patches * patches * dtype_bytes * score_factor()
    work = patches * (WORK_HIDDEN * hidden + WORK_INTERMEDIATE * intermediate) * WORK_BYTES
    return int(scores) + work


def prompt_need(
    m: ModelMemory,
    *,
    prompt_tokens: int,
    step: int,
    cached_tokens: int = 0,
    block_size: int = 0,
    tower: int = 0,
) -> int:
    """New memory one prompt needs at its worst moment when prefilled alone.

    Its whole KV (cached tokens included: the engine copies cached blocks into the request's
    own cache), the prefix cache's copy of its full blocks (``block_size`` > 0), and the largest
    of the transients: the last chunk's attention, the extra copy made while cutting blocks,
    or ``tower``, a vision tower's reading one of its images (``tower_transient``; it runs
    before the chunk that takes the image's tokens, not beside it). It does not depend on
    ``max_tokens``: decoding adds one token's KV per step.
    """
    uncached = max(1, prompt_tokens - cached_tokens)
    chunk = min(step, uncached)
    kv = kv_bytes(m, kv_slots(prompt_tokens))
    blocks = 0
    if block_size > 0:
        blocks = kv_bytes(m, block_size * max(0, (prompt_tokens - 1) // block_size))
    transient = prefill_transient(m, chunk=chunk, context=prompt_tokens)
    return kv + blocks + max(blocks, transient, tower)


def embed_step_need(m: ModelMemory, *, rows: int, tokens: int, context: int,
                    kv: int = 0) -> int:
    """New memory one embedding or rerank step needs: ``rows`` inputs of ``tokens`` new
    tokens each (padded to the longest) attending over ``context`` tokens, the KV cache the
    rows hold (``kv`` tokens a row: a long input's chunks so far, or a rerank query's shared
    prefix copied into each row; 0: a pass without a cache, whose keys and values go with each
    layer) and the chunk's transient."""
    cache = kv_bytes(m, kv_slots(kv), rows) if kv else 0
    return cache + prefill_transient(m, chunk=tokens, context=context, batch=rows)


def embed_need(m: ModelMemory, *, longest: int, step: int, shared: int = 0,
               whole: bool = False) -> int:
    """New memory the worst step of an embedding or rerank job needs, its longest input
    ``longest`` tokens, ``shared`` of them a prefix every input shares (a rerank query's),
    ``step`` tokens a step at most (padding included), as ``embed_step_need`` counts a step:
    an input over the step runs alone in chunks over its own cache, its last chunk attending
    over all of it; shorter ones (an encoder's, ``whole``: all of them) run together, as many
    as the step holds, each from a copy of the shared prefix."""
    if whole:
        return embed_step_need(m, rows=max(1, step // longest), tokens=longest,
                               context=longest)
    own = max(1, longest - shared)
    if own > step:
        return embed_step_need(m, rows=1, tokens=step, context=longest, kv=longest)
    return embed_step_need(m, rows=max(1, step // own), tokens=own, context=longest,
                           kv=longest if shared else 0)


def admission_estimate(
    m: ModelMemory,
    *,
    high_water: int,
    prompt_tokens: int,
    step: int,
    block_size: int = 0,
    loaded: bool = True,
    tower: int = 0,
    need: int | None = None,
) -> int:
    """The peak MLX memory if this prompt is admitted now: the recent high-water mark, the
    model's weights if it still has to be loaded, and the prompt's own need (``need`` when
    it is counted otherwise: an embedding job's, ``embed_need``)."""
    weights = 0 if loaded else m.weights_bytes
    if need is None:
        need = prompt_need(m, prompt_tokens=prompt_tokens, step=step, block_size=block_size,
                           tower=tower)
    return high_water + weights + need


def idle_floor(m: ModelMemory, floor: int, *, loaded: bool = True) -> int:
    """Bytes that stay in use when nothing runs: the measured floor, at least this model's
    weights, and its weights once more while it still has to be loaded."""
    return max(floor, m.weights_bytes) + (0 if loaded else m.weights_bytes)


def too_large(need: int, *, limit: int, idle: int) -> bool:
    """Whether a prompt needing ``need`` new bytes could never be served under ``limit``, even
    with nothing else running (``idle``: ``idle_floor``): refused for good, not "retry"."""
    return need > limit - idle


# --- the per-step gate -----------------------------------------------------------------------


class Member(NamedTuple):
    """A sequence being prefilled (or waiting to be): where it stands in token counts."""

    in_cache: int  # tokens its cache holds now (a cached prefix included)
    remaining: int  # prompt tokens still to run through the model (the last one included)
    chunk: int  # tokens the next step runs for it
    cut_now: int = 0  # tokens of prefix-cache blocks the next step cuts from it
    blocks_left: int = 0  # tokens of prefix-cache blocks it will cut until its prompt ends


class GatePlan(NamedTuple):
    """What the next step may do: ``fail`` (indices into the prefilling list, which no longer
    fit), how many waiting sequences may ``admit``, and whether the first waiting one can
    never fit while nothing else runs (``reject_waiting``)."""

    fail: list[int]
    admit: int
    reject_waiting: bool
    step_need: int
    reserve_need: int


def _join_increment(m: ModelMemory, decoding: int, decode_len: int, joining: int,
                    length: int) -> int:
    """Growth of the generation batch when ``joining`` sequences of ``length`` tokens join
    ``decoding`` ones of ``decode_len``: the batch is rebuilt rectangular, padded to the
    longest (old buffers freed layer by layer, so one layer of the new one is extra)."""
    if joining <= 0:
        return 0
    longest = kv_slots(max(decode_len, length))
    new = (decoding + joining) * longest
    old = decoding * kv_slots(decode_len) + joining * kv_slots(length)
    grow = max(0, new - old) * m.kv_per_token
    return grow + new * m.kv_per_token // max(1, m.kv_layers)


def _decode_need(m: ModelMemory, decoding: int, decode_len: int) -> int:
    """One decode step: at worst every cache grows by KV_STEP slots, plus its attention."""
    if decoding <= 0:
        return 0
    return kv_bytes(m, KV_STEP, decoding) + prefill_transient(
        m, chunk=1, context=decode_len + 1, batch=decoding
    )


def step_need(
    m: ModelMemory, *, decoding: int, decode_len: int, members: Iterable[Member]
) -> int:
    """New memory the next step needs: one decode step, one prefill chunk for every member
    (padded to the longest chunk, over the longest context), the blocks it cuts, and the
    generation batch rebuilt for members that finish their prompt in this step."""
    members = list(members)
    need = _decode_need(m, decoding, decode_len)
    chunking = [x for x in members if x.remaining > 1]
    if chunking:
        chunk = max(x.chunk for x in chunking)
        context = max(x.in_cache for x in chunking) + chunk
        need += kv_bytes(m, kv_slots(chunk), len(chunking))
        need += prefill_transient(m, chunk=chunk, context=context, batch=len(chunking))
        # A cut extracts the sequence's whole cache (a copy, freed at once) and keeps the
        # blocks sliced from it.
        need += sum(kv_bytes(m, x.in_cache + x.chunk + x.cut_now) for x in chunking if x.cut_now)
    joining = [x for x in members if x.remaining <= 1]
    if joining:
        need += _join_increment(m, decoding, decode_len, len(joining),
                                max(x.in_cache + 1 for x in joining))
    return need


def reserve_need(
    m: ModelMemory, *, decoding: int, decode_len: int, members: Iterable[Member], step: int
) -> int:
    """New memory these members need until they all decode: their KV grown to the longest
    prompt (the batch is rectangular), the prefix cache's block copies, and the worse of the
    last chunk's transient and the generation batch rebuilt to take them."""
    members = list(members)
    if not members:
        return _decode_need(m, decoding, decode_len)
    longest = max(x.in_cache + x.remaining for x in members)
    if len(members) > 1:
        # Out of step, a sequence's short last chunk is padded to the others' full one: its
        # cache (and the batch's attention context) grows by whole chunks.
        longest = max(x.in_cache + step * math.ceil((x.remaining - 1) / step) + 1
                      for x in members)
    grow = sum(kv_slots(longest) - min(kv_slots(longest), x.in_cache) for x in members)
    blocks = sum(kv_bytes(m, x.blocks_left) for x in members)
    cut = kv_bytes(m, longest) if blocks else 0  # the extracted copy at a cut
    chunk = min(step, max(x.remaining for x in members))
    transient = prefill_transient(m, chunk=chunk, context=longest, batch=len(members))
    # One member may join the generation batch while the others still prefill.
    join = _join_increment(m, decoding, decode_len, len(members), longest)
    return (
        _decode_need(m, decoding, decode_len)
        + kv_bytes(m, grow)
        + blocks
        + max(transient + join, cut)
    )


def plan_step(
    m: ModelMemory,
    *,
    usage: int,
    limit: int,
    decoding: int,
    decode_len: int,
    prefilling: list[Member],
    waiting: list[Member],
    step: int,
) -> GatePlan:
    """The per-chunk gate. ``prefilling`` oldest first; ``waiting`` in arrival order, only as
    many as may join the prefill batch this step.

    1. While the next step does not fit under ``limit``, the youngest prefilling sequence
       fails (the older ones have the most work done).
    2. Waiting sequences join, in order, while the next step fits and the reservation of
       everything prefilling (to the end of their prompts) fits with ``ADMIT_HEADROOM`` to
       spare: a sequence that starts is not failed later unless the limit drops or other
       memory grows.
    3. A waiting sequence that does not fit while nothing else runs will never fit by waiting.
    """
    keep = list(prefilling)
    fail: list[int] = []

    def step_fits(members: list[Member]) -> int:
        return usage + step_need(m, decoding=decoding, decode_len=decode_len, members=members)

    while keep and step_fits(keep) > limit:
        keep.pop()
        fail.append(len(keep))
    admitted: list[Member] = []
    reserve = usage + reserve_need(m, decoding=decoding, decode_len=decode_len, members=keep,
                                   step=step)
    for w in waiting:
        members = [*keep, *admitted, w]
        candidate = usage + reserve_need(m, decoding=decoding, decode_len=decode_len,
                                         members=members, step=step)
        if candidate > limit * (1 - ADMIT_HEADROOM) or step_fits(members) > limit:
            break
        admitted.append(w)
        reserve = candidate
    idle = decoding == 0 and not keep
    reject = bool(waiting) and not admitted and idle
    return GatePlan(
        fail=fail,
        admit=len(admitted),
        reject_waiting=reject,
        step_need=step_fits([*keep, *admitted]) - usage,
        reserve_need=reserve - usage,
    )


# --- pressure and the default limit ----------------------------------------------------------


def pressure_level(usage: int, limit: int, *, previous: str = OK,
                   soft: float = SOFT_FRACTION, hard: float = HARD_FRACTION) -> str:
    """``ok`` below ``soft`` of the limit, ``soft`` below ``hard``, else ``hard``.

    Coming from a higher ``previous`` level, usage must fall ``PRESSURE_HYSTERESIS`` of the
    limit below a threshold to leave it: a usage hovering at a threshold does not flap."""
    if limit <= 0 or usage >= hard * limit:
        return HARD
    down = PRESSURE_HYSTERESIS * limit
    if previous == HARD and usage >= hard * limit - down:
        return HARD
    if usage >= soft * limit or (previous != OK and usage >= soft * limit - down):
        return SOFT
    return OK


def default_memory_limit(
    *, total: int, available: int | None = None, working_set: int | None = None
) -> int:
    """The limit when ``--memory-limit`` is not given: 90% of Metal's recommended working set
    where there is one, else 75% of the memory available at start (of the total if unknown)."""
    if working_set:
        return int(DEFAULT_WORKING_SET_FRACTION * working_set)
    base = min(total, available) if available else total
    return int(DEFAULT_RAM_FRACTION * base)


def machine_memory() -> tuple[int, int | None]:
    """(total, available) bytes of RAM: /proc/meminfo on Linux, sysconf elsewhere."""
    try:
        fields = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                fields[key] = int(rest.split()[0]) * 1024
        return fields["MemTotal"], fields.get("MemAvailable")
    except (OSError, KeyError, ValueError, IndexError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, None
