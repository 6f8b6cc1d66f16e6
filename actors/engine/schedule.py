"""The step policy as a pure function: ``schedule(state) -> SchedulerOutput``.

Each step the engine describes where its sequences stand in plain numbers (``StepState``) and
this module decides what the step does: which prefilling sequences fail for want of memory,
which waiting ones start (``start_order``, then how many of them), and how many tokens each
sequence runs, by uid (a decoding one 1, a prefilling one its chunk). No MLX, no clock: the
timings it needs are measured by the engine and passed in, so every rule here is unit tested
with numbers alone (tests/test_schedule.py).
"""

from __future__ import annotations

from typing import NamedTuple

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.memory_estimate import Member, ModelMemory, plan_step

# The fewest prompt tokens a prefilling sequence gets per step while sequences decode. Each
# step a prompt takes carries the decode rows' time too, so a prompt in small chunks reaches
# its first token late: on a CPU, where a decode step costs about 20 prompt tokens, chunks of
# 8-20 tokens (one forward pass held to --prefill-interleave, under an older floor of 8) made
# a 2,000-token prompt's TTFT beside 8 streams 1.0-2.1x that of two calls' 32-token chunks
# (docs/benchmarks.md, "The moved families served"). On Apple silicon the interleave's budget
# is hundreds of tokens and this floor is not reached.
MIN_PREFILL_CHUNK = 32
# How fast a step-time estimate (a decode step, a prompt token, a model's step beside others)
# follows new measurements.
EMA = 0.3
# The fewest prompt tokens a step under the step budget prefills: a prompt of 6,000 tokens
# still progresses when one token costs more than the budget (a CPU at long contexts), and a
# forward pass's fixed cost is spread over enough tokens that its TTFT is not multiplied.
STEP_BUDGET_FLOOR = 32
# A prompt whose whole rest is within this many step budgets is prefilled in one piece.
SHORT_PROMPT = 4
# A prompt with more prompt tokens than this to prefill is long. On a CPU a prefill token
# costs about the same batched or alone once a chunk is a few hundred tokens, so long prompts
# are prefilled one after the other, shortest first (each gets its first token after its own
# prefill, not after the whole round's), while short ones are batched, which is what makes
# them cheap.
LONG_PROMPT = 256
# A sequence that has waited while others prefilled this many full steps of prompt tokens
# (prefill_step_size each) starts first, whatever its length: none starves behind a stream
# of shorter prompts. Counted in tokens, not time, so every rank of a sharded model agrees.
STARVED_STEPS = 8


class Pending(NamedTuple):
    """A sequence prefilling, or waiting to start: the gate's view of it (``member``),
    ``whole``, its whole uncached prompt (a short prompt is never split), ``segments``: the
    lengths of its prompt's segments still to run (the last token is one of its own), and
    for a waiting one, ``waited``: the prompt tokens others prefilled since it arrived."""

    uid: int
    member: Member
    whole: int
    segments: tuple[int, ...]
    waited: int = 0


class Waiting(NamedTuple):
    """A sequence not started yet, as ``start_order`` sees it."""

    uid: int  # uids grow in arrival order
    remaining: int  # prompt tokens to prefill
    waited: int  # prompt tokens others prefilled since it arrived


class Memory(NamedTuple):
    """The gate's inputs: the model's memory shape, bytes in use, and the limit to stay under."""

    model: ModelMemory
    usage: int
    limit: int


class StepState(NamedTuple):
    """Where the engine stands before a step."""

    config: EngineConfig
    mixed: bool  # the prefill chunk rides in the decode step's forward pass
    decoding: int  # sequences generating
    decode_len: int  # the longest of their contexts
    prefilling: list[Pending]  # oldest first
    waiting: list[Pending]  # in start_order, at most prefill_batch_size of them
    decode_s: float | None  # a decode step's time, smoothed (None: not measured yet)
    token_s: float | None  # one prompt token's prefill time, smoothed
    memory: Memory | None = None  # None: no memory gate
    decode_uids: tuple[int, ...] = ()  # the decoding sequences
    # With mixed steps, a prompt's first token is sampled from the chunk that runs its last
    # token (``chunk_of``); False: that token waits for a decode step.
    first_token_in_chunk: bool = True


class SchedulerOutput(NamedTuple):
    """What the next step does: who starts and how many tokens each sequence runs, by uid.
    A plain value: rank 0 sends it to the other ranks of a sharded model, which run it."""

    fail: list[int]  # uids of prefilling sequences that no longer fit in memory
    reject: int | None  # uid of a waiting sequence that can never fit, even alone
    admit: int  # waiting sequences that may start prefilling
    budget: int | None  # prompt tokens the step may prefill (None: whole chunks)
    chunk: int  # prompt tokens each prefilling sequence runs
    held: bool  # the gate held something back (failed, rejected or kept waiting)
    start: list[int]  # uids of the waiting sequences that start, in order
    # Tokens each sequence runs (uid -> n): 1 decoding, or joining the decode rows with its
    # last prompt token; its next chunk prefilling (``chunk_of``).
    tokens: dict[int, int]
    # Whether decoding rows may verify drafts (speculative decoding) in the step: not while
    # prompts are prefilled first (``drafts_allowed``).
    draft: bool = True


def schedule(state: StepState) -> SchedulerOutput:
    """Decide the next step: the memory gate first, then who of the waiting may start
    (``startable``: never more than the gate admits), then the prefill budget and the
    chunk, and what each sequence runs (``name_tokens``)."""
    cfg = state.config
    free = max(0, cfg.prefill_batch_size - len(state.prefilling))
    fail: list[int] = []
    reject: int | None = None
    admit = free
    held = False
    if state.memory is not None:
        mem = state.memory
        candidates = state.waiting[:free]
        gate = plan_step(mem.model, usage=mem.usage, limit=mem.limit, decoding=state.decoding,
                         decode_len=state.decode_len,
                         prefilling=[p.member for p in state.prefilling],
                         waiting=[p.member for p in candidates], step=cfg.prefill_step_size)
        fail = [state.prefilling[i].uid for i in gate.fail]
        if gate.reject_waiting:
            reject = candidates[0].uid
        admit = gate.admit
        held = bool(fail) or gate.reject_waiting or gate.admit < len(candidates)
    prefilling = [p for p in state.prefilling if p.uid not in fail]
    waiting = [p for p in state.waiting if p.uid != reject]
    admit = startable(cfg, prefilling, waiting, admit)
    joining = max(0, min(admit, cfg.max_batch_size - state.decoding, len(waiting)))
    work = [*prefilling, *waiting[:joining]]
    budgets = [b for b in (prefill_budget(state), step_budget(state, work))
               if b is not None]
    budget = min(budgets, default=None)
    chunk = cfg.prefill_step_size if budget is None else chunk_for(budget, work, state)
    start, tokens = name_tokens(state, prefilling, waiting, admit, chunk)
    return SchedulerOutput(fail=fail, reject=reject, admit=admit, budget=budget, chunk=chunk,
                           held=held, start=start, tokens=tokens,
                           draft=drafts_allowed(state, tokens))


def drafts_allowed(state: StepState, tokens: dict[int, int]) -> bool:
    """Whether the step's decoding rows may verify drafts: not in a step that runs prompt
    tokens (``tokens``, the step's own plan) while as many sequences wait for their first
    token as there are streams, or more (``first_tokens_first``): such a step is held to
    ``step_budget_ms``, and the drafts' positions would take the prompt tokens' share of it.
    A full batch runs no prompt token (nothing can start) and drafts: its rows finishing
    sooner is what frees a place."""
    decoding = set(state.decode_uids)
    prompts = any(uid not in decoding for uid in tokens)
    return not (prompts and first_tokens_first(state))


def max_decoding(config: EngineConfig) -> int:
    """Sequences decoding at which a step only decodes (nothing starts or prefills)."""
    return max(config.max_batch_size, config.prefill_batch_size)


def name_tokens(state: StepState, prefilling: list[Pending], waiting: list[Pending],
                admit: int, chunk: int) -> tuple[list[int], dict[int, int]]:
    """Who starts (the first ``admit`` waiting, while fewer than ``max_decoding`` decode) and
    the tokens each sequence runs: 1 for a decoding one and for one down to its last prompt
    token (that token joins the decode rows), else its next chunk of at most ``chunk``
    tokens (``chunk_of``). At ``max_decoding`` the step only decodes."""
    tokens = dict.fromkeys(state.decode_uids, 1)
    room = max_decoding(state.config) - state.decoding
    if room <= 0:
        return [], tokens
    starting = waiting[:max(0, min(admit, room))]
    mixed = state.mixed and state.first_token_in_chunk
    for p in (*prefilling, *starting):
        segments = list(p.segments)
        last_only = len(segments) == 1 and segments[0] == 1
        tokens[p.uid] = 1 if last_only else chunk_of(segments, chunk, mixed)[0]
    return [p.uid for p in starting], tokens


def chunk_of(segments: list[int], step: int, mixed: bool) -> tuple[int, bool]:
    """The prompt tokens a sequence's next prefill chunk runs (at most ``step`` of its first
    segment; ``segments``: the lengths of the segments still to run), and whether that chunk
    also takes the prompt's last token: with mixed steps, a chunk that ends its segment with
    only that token left, and room to spare, runs it too, so the step samples the prompt's
    first token from the chunk (else the last token waits for a decode step: one more step
    before the first token). The memory gate counts the same."""
    k = min(segments[0], step)
    takes_last = (mixed and k == segments[0] and len(segments) == 2 and segments[1] == 1
                  and k < step)
    return k + takes_last, takes_last


def starved(config: EngineConfig, waited: int) -> bool:
    """Whether a sequence that waited while ``waited`` prompt tokens were prefilled goes
    first."""
    return waited >= STARVED_STEPS * config.prefill_step_size


def start_order(waiting: list[Waiting], config: EngineConfig) -> list[int]:
    """The uids of the waiting sequences in the order they start (the plan's ``admit``
    counts from the front): the starved first, oldest first; then short prompts in arrival
    order, as they always were (they are batched, so their order matters only when prefill
    slots run out); then long ones by ``much_shorter_first``."""
    starving = sorted((w for w in waiting if starved(config, w.waited)), key=lambda w: w.uid)
    rest = [w for w in waiting if not starved(config, w.waited)]
    short = sorted((w for w in rest if w.remaining <= LONG_PROMPT), key=lambda w: w.uid)
    long = much_shorter_first([w for w in rest if w.remaining > LONG_PROMPT])
    return [w.uid for w in (*starving, *short, *long)]


def much_shorter_first(waiting: list[Waiting]) -> list[Waiting]:
    """Long prompts in arrival order, except that one with at most half the tokens of the
    prompt it would wait behind goes before it (the oldest such, and before that one, the
    oldest with half of its tokens, and so on). Putting a much shorter prompt first is what
    saves time; between turns of about the same size it saves little, and the longest of them
    waited behind every later, slightly shorter one. Pure shortest-first made a 675-token turn
    wait 62 s (4 agents' sessions); size classes (powers of two), whose edges put 512 tokens
    before 513, made two or three of the four turns of 519-594 tokens wait 95-155 s at 8
    sessions (median 22-23 s).
    Half is the margin ``startable`` keeps for a prompt started beside another."""
    rest = sorted(waiting, key=lambda w: w.uid)
    order: list[Waiting] = []
    while rest:
        pick = rest[0]
        while (shorter := next((w for w in rest if 2 * w.remaining <= pick.remaining),
                               None)) is not None:
            pick = shorter
        order.append(pick)
        rest.remove(pick)
    return order


def startable(config: EngineConfig, prefilling: list[Pending], waiting: list[Pending],
              admit: int) -> int:
    """How many of ``waiting`` (in ``start_order``) start beside ``prefilling``: ``admit``
    (the free prefill slots, or what the memory gate admits) or fewer.

    Short prompts and starved sequences always start. A long one starts only if each long
    prompt prefilling, or starting before it, has at least twice its tokens left, so that it
    finishes well before them (shortest first, as near as prompts already started allow);
    else it waits its turn (with nothing prefilling, the first always starts). Prefilled
    together, two long prompts of T tokens both get their first token after 2T; one after
    the other, after T and 2T."""
    # Tokens left of each long prompt prefilling (one down to its last token is done).
    left = [p.member.remaining for p in prefilling
            if p.whole > LONG_PROMPT and p.member.remaining > 1]
    for n, w in enumerate(waiting[:admit]):
        tokens = w.member.remaining
        if tokens <= LONG_PROMPT:
            continue
        if not starved(config, w.waited) and any(rest < 2 * tokens for rest in left):
            return n
        left.append(tokens)
    return admit


def ema(old: float | None, new: float) -> float:
    """A timing smoothed over steps: ``new`` weighted ``EMA`` against the estimate so far."""
    return new if old is None else EMA * new + (1 - EMA) * old


def min_chunk(config: EngineConfig) -> int:
    return min(MIN_PREFILL_CHUNK, config.prefill_step_size)


def prefill_budget(state: StepState) -> int | None:
    """Prompt tokens this step may prefill (None: no limit beyond the chunk size).

    While sequences decode, the step's prefill is held to ``prefill_interleave`` times a
    decode step, from the measured time of a decode step and of one prompt token (which grows
    with the context, so it is re-measured every step): a 2,000-token prompt then arrives
    without stalling the streams. With nothing decoding, prefill runs flat out, and so it does
    while as many sequences wait for their first token as there are streams, or more
    (``first_tokens_first``)."""
    cfg = state.config
    if (cfg.prefill_interleave <= 0 or not state.decoding or first_tokens_first(state)
            or state.decode_s is None or state.token_s is None):
        return None
    tokens = int(cfg.prefill_interleave * state.decode_s / state.token_s)
    return max(min_chunk(cfg), min(tokens, cfg.prefill_step_size))


def step_budget(state: StepState, work: list[Pending]) -> int | None:
    """Prompt tokens the step may prefill so that it lasts about ``step_budget_ms`` (None:
    no limit from it), while others wait on the step for a token: sequences decoding, or a
    short prompt prefilling beside a long one (``work``: the sequences prefilling this step).
    A long prefill with nobody waiting on it runs whole chunks: alone, or beside other long
    ones (smaller chunks would only delay each of them).

    The tokens are the budget less a decode step's time, at the measured time of a prompt
    token (both smoothed, ``Engine._measure``; before a prompt token is measured, whole
    chunks), within ``STEP_BUDGET_FLOOR`` (every prefill progresses, however slow) and the
    chunk size, and a whole number of prefix-cache blocks when over one. It bounds every
    step, ``first_tokens_first`` included: one chat answering beside an agent's long prompt
    got 8 tokens in 47.5 s with whole chunks of 4.6-6.7 s each on a CPU."""
    cfg = state.config
    beside_long = (any(p.whole > LONG_PROMPT for p in work)
                   and any(p.whole <= LONG_PROMPT for p in work))
    if cfg.step_budget_ms <= 0 or state.token_s is None or not (state.decoding or beside_long):
        return None
    # A decode step not measured yet (no step without prefill so far) counts as free.
    decode_s = (state.decode_s or 0.0) if state.decoding else 0.0
    return budget_tokens(cfg, state.token_s, cfg.step_budget_ms / 1e3 - decode_s)


def budget_tokens(config: EngineConfig, token_s: float, spare_s: float) -> int:
    """Prompt tokens that fill ``spare_s`` seconds at ``token_s`` a token, within
    ``STEP_BUDGET_FLOOR`` and the chunk size, and a whole number of prefix-cache blocks when
    over one (``step_budget``'s arithmetic, and ``embed_budget``'s)."""
    tokens = int(spare_s / max(token_s, 1e-9))
    tokens = max(min(STEP_BUDGET_FLOOR, config.prefill_step_size),
                 min(tokens, config.prefill_step_size))
    if config.block_size and tokens > config.block_size:
        tokens -= tokens % config.block_size
    return tokens


def embed_budget(config: EngineConfig, token_s: float | None, *,
                 others_step_s: float | None) -> int:
    """Tokens (padding included) the next embedding or rerank step of a model runs, as a
    prefill chunk gets them (``step_budget``): whole chunks while nobody waits on the step;
    while others do (``others_step_s``: the time the steps of the other models on the same
    MLX thread take, whose streams or prompts wait on this step as they wait on their own;
    None: none has requests), what fills ``step_budget_ms`` less that time at ``token_s`` a
    token, as a chat chunk fills it less its streams' decode step; ``STEP_BUDGET_FLOOR``
    before a token is timed (a step short enough to time one by)."""
    if config.step_budget_ms <= 0 or others_step_s is None:
        return config.prefill_step_size
    if token_s is None:
        return min(STEP_BUDGET_FLOOR, config.prefill_step_size)
    return budget_tokens(config, token_s, config.step_budget_ms / 1e3 - others_step_s)


def first_tokens_first(state: StepState) -> bool:
    """Whether as many sequences wait for their first token (prefilling, or waiting to start)
    as there are streams decoding, or more: the step then prefills whole chunks, the streams'
    tokens riding in it. Held to the budget, a step's few prompt tokens cost 1.6-1.8x a
    whole chunk's per token (a forward pass's fixed cost, paid every step): four agents'
    sessions (answers decoding while other turns wait) waited 31.2 s for a first token
    (median) with the budget always on, 18.5 s with this rule, 9.6 s with whole chunks
    always; the streams keep their share while they outnumber the prompts (a long prompt
    arriving while eight chats stream). docs/benchmarks.md, "Agent sessions"."""
    return len(state.prefilling) + len(state.waiting) >= state.decoding


def chunk_for(budget: int, work: list[Pending], state: StepState) -> int:
    """The chunk each prefilling sequence gets this step under ``budget`` tokens: the budget
    shared out, except that a short prompt (all of it to prefill within SHORT_PROMPT budgets)
    is never split: a chat message stalls the streams once, briefly, and gets its first token
    without waiting for the long prompt beside it. (The end of a long prompt is not short.)"""
    short = max((p.member.remaining for p in work if p.whole <= SHORT_PROMPT * budget),
                default=0)
    floor = min_chunk(state.config)
    chunk = max(budget // max(1, len(work)), short, floor)
    return min(chunk, state.config.prefill_step_size)
