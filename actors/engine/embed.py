"""Embeddings and reranking on a decoder model: a prefill with no decode, on the MLX thread.

An embedding input runs through the model's body (``model.model``: mlx-lm's decoder families
return the last hidden states, after the final norm, before the head), is pooled (the last
token's state, or the mean over its tokens), put through the model's Dense modules where it
has any (``dense.py``) and L2-normalised. A rerank input (a query and a
document under the reranker's prompt format) is scored from the head's logits of "yes" and
"no" at its last position (the Qwen3-Reranker recipe). Neither holds a decode slot: inputs wait
in ``Embedder``'s queue, short ones run together in one forward pass, a long one in chunks over
its own KV cache, and every cache is dropped when its input ends.

How a model embeds is read from its own files (``read_embed_spec``); what a model serves,
chat, embeddings or reranking, from its files too (``detect_task``) unless ``--task`` says.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.dense import Dense, apply_dense
from troupe.actors.engine.embed_gate import StepShape, gate_step
from troupe.actors.engine.encoder import encoder_task, read_config
from troupe.actors.engine.kv_blocks import build_cache, cut_blocks
from troupe.actors.engine.memory_estimate import ModelMemory, kv_slots
from troupe.actors.engine.prefix import block_hashes
from troupe.actors.engine.schedule import ema

Task = Literal["generate", "embed", "rerank"]
Pooling = Literal["last", "mean"]
JobKind = Literal["embed", "rerank"]

# The Qwen3-Reranker prompt format (its model card): the query and the document in a user
# turn, the answer opened with an empty reasoning block, so the next token is "yes" or "no".
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\"."
    "<|im_end|>\n<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# A rerank job's inputs share the prompt format's opening and the query: a shared prefix of at
# least this many tokens runs once, and each document runs from a copy of its KV.
MIN_SHARED_PREFIX = 8


@dataclass(frozen=True)
class EmbedSpec:
    """How a model embeds: its pooling, and the prefix a query gets (``input_type:
    "query"``; documents get none)."""

    pooling: Pooling = "mean"
    query_prefix: str = ""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pooling_dir(path: Path) -> Path | None:
    """The sentence-transformers pooling module's folder (``modules.json`` names it;
    ``1_Pooling`` by convention)."""
    modules = _read_json(path / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith("Pooling"):
                return path / str(module.get("path", "1_Pooling"))
    return path / "1_Pooling" if (path / "1_Pooling").is_dir() else None


def read_embed_spec(path: str | Path) -> EmbedSpec:
    """The pooling and query prefix from a model directory's sentence-transformers files:
    last-token pooling where ``1_Pooling/config.json`` says ``pooling_mode_lasttoken`` (the
    Qwen3-Embedding family), mean pooling otherwise; the query prefix is the ``query`` prompt
    of ``config_sentence_transformers.json``."""
    path = Path(path)
    pooling: Pooling = "mean"
    folder = _pooling_dir(path)
    config = _read_json(folder / "config.json") if folder is not None else None
    if isinstance(config, dict) and config.get("pooling_mode_lasttoken"):
        pooling = "last"
    st = _read_json(path / "config_sentence_transformers.json")
    prompts = st.get("prompts") if isinstance(st, dict) else None
    query = prompts.get("query", "") if isinstance(prompts, dict) else ""
    return EmbedSpec(pooling=pooling, query_prefix=query if isinstance(query, str) else "")


# A model card's ``pipeline_tag`` (the Hugging Face task its README's front matter names) that
# says what a decoder serves: Qwen3-Reranker's card says text-ranking, Qwen3-Embedding's
# feature-extraction or sentence-similarity.
CARD_TASKS: dict[str, Task] = {"text-ranking": "rerank", "feature-extraction": "embed",
                               "sentence-similarity": "embed"}


def card_pipeline_tag(path: str | Path) -> str | None:
    """The ``pipeline_tag`` of the model card (``README.md``'s front matter) in ``path``."""
    try:
        text = (Path(path) / "README.md").read_text(errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "pipeline_tag":
            return value.strip().strip("'\"") or None
    return None


def detect_task(path: str | Path) -> Task:
    """What a model directory serves: an encoder (BERT family), reranking when its config is
    a ``*ForSequenceClassification`` (a cross-encoder), else embeddings. A decoder: what its
    model card's ``pipeline_tag`` says (``CARD_TASKS``: text-ranking reranks); else
    reranking when its directory name says reranker (Qwen3-Reranker checkpoints are plain
    causal LMs: a conversion that left its card behind has nothing else that tells); else
    embeddings when it carries sentence-transformers files (``modules.json``,
    ``config_sentence_transformers.json``, ``1_Pooling/``); chat otherwise."""
    path = Path(path)
    encoder = encoder_task(read_config(path))
    if encoder is not None:
        return encoder
    card = CARD_TASKS.get(card_pipeline_tag(path) or "")
    if card is not None:
        return card
    if "reranker" in path.name.lower():
        return "rerank"
    if any((path / name).exists() for name in
           ("modules.json", "config_sentence_transformers.json", "1_Pooling")):
        return "embed"
    return "generate"


def model_task(config: EngineConfig, path: str | Path) -> Task:
    """What a model serves: ``--task`` when given, else what its files say."""
    return config.task or detect_task(path)


def rerank_tokens(tokenizer: Any, query: str, document: str, *,
                  instruction: str | None = None, limit: int | None = None) -> list[int]:
    """A query and document in the reranker's prompt format, as token ids. With ``limit``,
    the query and document are cut so that the whole fits in ``limit`` tokens (the format's
    opening and closing stay whole, as the model card's own code does)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    body = encode(f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
                  f"<Document>: {document}")
    prefix, suffix = encode(RERANK_PREFIX), encode(RERANK_SUFFIX)
    if limit is not None:
        body = body[:max(0, limit - len(prefix) - len(suffix))]
    return prefix + body + suffix


def answer_token(tokenizer: Any, word: str) -> int:
    """The token id a reranker answers ``word`` with (its first token, where the vocabulary
    splits it)."""
    return tokenizer.encode(word, add_special_tokens=False)[0]


# --- the computation -------------------------------------------------------------------------


def hidden_states(model: Any, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
    """The last hidden states (after the final norm, before the head) of ``inputs`` (B, L)."""
    return model.model(inputs, cache=cache)


def head_logits(model: Any, h: mx.array) -> mx.array:
    """The output head on hidden states: the model's own head, or its tied embedding."""
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None:
        return lm_head(h)
    return model.model.embed_tokens.as_linear(h)


def l2_normalize(x: mx.array) -> mx.array:
    """Rows of ``x`` scaled to unit length (a zero row stays zero)."""
    norm = mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True))
    return x / mx.maximum(norm, 1e-12)


def rerank_score(yes: float, no: float) -> float:
    """P("yes") of a softmax over the two answers' logits."""
    return 1.0 / (1.0 + math.exp(no - yes))


def shared_prefix(inputs: list[list[int]], most: int) -> int:
    """The tokens every input of a rerank job starts with that run once for all (the prompt
    format's opening and the query): at most ``most`` (they run in one forward pass), none
    under ``MIN_SHARED_PREFIX`` or with one input."""
    if len(inputs) < 2:
        return 0
    shared = min(_common_prefix(inputs), most)
    return shared if shared >= MIN_SHARED_PREFIX else 0


@dataclass
class _Long:
    """An input run in chunks over its own cache: its tokens done, its running sum of hidden
    states (mean pooling) and its last hidden state."""

    cache: list[Any]
    done: int = 0
    total: mx.array | None = None
    last: mx.array | None = None


@dataclass
class EmbedJob:
    """One request's inputs; ``results`` fills as they end (a vector, or a rerank score), and
    ``on_done`` is called once with them all, or with an error."""

    request_id: str
    kind: JobKind
    inputs: list[list[int]]
    on_done: Callable[[list[Any] | None, Exception | None], None]
    results: list[Any] = field(default_factory=list)
    left: int = 0
    # Tokens every input starts with that run once for all (rerank: the format and query),
    # and their KV per layer once run.
    shared: int = 0
    prefix_kv: list[tuple[mx.array, mx.array]] | None = None
    # The prefix-cache namespace whose blocks the shared prefix reads and adds to.
    namespace: str = ""

    def __post_init__(self) -> None:
        self.results = [None] * len(self.inputs)
        self.left = len(self.inputs)

    def record(self, i: int, out: Any, jobs: dict[str, EmbedJob]) -> None:
        """Input ``i`` gave ``out``: kept, and with the last one the job is answered and
        leaves ``jobs`` (its queue's; nothing, if it was aborted meanwhile)."""
        if jobs.get(self.request_id) is not self:
            return
        self.results[i] = out
        self.left -= 1
        if self.left == 0:
            del jobs[self.request_id]
            self.on_done(self.results, None)


class Embedder:
    """The queue of embedding and rerank inputs of one model, run a budget of tokens a step.

    Inputs start in arrival order. Those that fit the step's budget together run in one
    right-padded forward pass (causal attention: the padding after an input changes none of
    its states); an input longer than the budget runs alone, a chunk a step, over a KV cache
    made for it and dropped when it ends."""

    def __init__(self, model: Any, spec: EmbedSpec, *, yes_id: int = 0, no_id: int = 0,
                 max_shared: int = 512, engine: Any = None,
                 memory: ModelMemory | None = None, dense: list[Dense] | None = None) -> None:
        if not callable(getattr(model, "model", None)):
            raise ValueError(f"{type(model).__module__} keeps no decoder body at `model.model`: "
                             "it cannot embed or rerank")
        self.model = model
        self.spec = spec
        self.yes_id, self.no_id = yes_id, no_id
        # A shared prefix runs in one forward pass: at most a prefill chunk of it is shared.
        self.max_shared = max_shared
        # The model's ``Engine``, whose prefix cache holds shared prefixes' blocks (None, or
        # its cache off: each request runs its prefix).
        self.engine = engine
        self.memory = memory  # the model's memory shape, for the per-step gate
        self.dense = dense or []  # sentence-transformers' Dense modules, after pooling
        self.cached_tokens = 0  # shared-prefix tokens read from the prefix cache
        self._queue: deque[tuple[EmbedJob, int]] = deque()
        self._long: tuple[EmbedJob, int, _Long] | None = None
        self.jobs: dict[str, EmbedJob] = {}
        self.inputs_done = 0
        self.tokens_run = 0  # input tokens through the model (a shared prefix counts once)
        self.token_s: float | None = None  # seconds a token takes, padding included (EMA)
        self._padded = 0  # tokens through the model, padding included
        # A shared prefix's KV is copied into a plain KV cache: models with other cache
        # layers (sliding windows, recurrent state) run each input whole.
        self._plain_kv = all(type(c) is KVCache for c in make_prompt_cache(model))

    @property
    def has_work(self) -> bool:
        return bool(self._queue) or self._long is not None

    def add(self, job: EmbedJob) -> None:
        """Queue a job's inputs (an empty job ends at once)."""
        if not job.inputs:
            job.on_done([], None)
            return
        if job.kind == "rerank" and self._plain_kv:
            job.shared = shared_prefix(job.inputs, self.max_shared)
        self.jobs[job.request_id] = job
        self._queue.extend((job, i) for i in range(len(job.inputs)))

    def abort(self, request_id: str) -> None:
        """Drop a job whose client has gone (its answer is never given)."""
        job = self.jobs.pop(request_id, None)
        if job is None:
            return
        self._queue = deque(u for u in self._queue if u[0] is not job)
        if self._long is not None and self._long[0] is job:
            self._long = None

    def step(self, budget: int, limit: int | None = None, floor: int = 0) -> None:
        """Run about ``budget`` tokens of queued work: the long input in progress a chunk
        further, or the next inputs that fit together (at least one). With ``limit``, the
        step runs only if it fits in memory (``gate_step``); else the jobs in it fail."""
        budget = max(1, budget)
        units, shape, starts_long = self._plan(budget)
        error = gate_step(self.memory, shape, limit, floor)
        if error is not None:
            self._fail_jobs({job.request_id: job for job, _ in units}.values(), error)
            return
        started, ran = time.perf_counter(), self._padded
        try:
            if self._long is not None:
                self._chunk(budget)
            elif starts_long:
                job, i = self._queue.popleft()
                self._long = (job, i, _Long(make_prompt_cache(self.model)))
                self._chunk(budget)
            else:
                batch = [self._queue.popleft() for _ in units]
                self._run_batch(batch, shape.tokens)
        except Exception as exc:  # noqa: BLE001 - the jobs in the step get the error, not the actor
            self._fail_jobs(list(self.jobs.values()), exc)
            return
        # Every step ends in an evaluation (its results read back): its time is its work.
        if self._padded > ran:
            per_token = (time.perf_counter() - started) / (self._padded - ran)
            self.token_s = ema(self.token_s, per_token)

    def _plan(self, budget: int) -> tuple[list[tuple[EmbedJob, int]], StepShape, bool]:
        """The inputs the next step runs, its shape, and whether it starts a long input: the
        long input in progress, a chunk further; an input over the budget, its first chunk
        (alone, over a cache of its own); else the next inputs that fit the budget together,
        padded to the longest."""
        if self._long is not None:
            job, i, state = self._long
            end = min(len(job.inputs[i]), state.done + budget)
            # Its cache holds its chunks so far: only what the step adds is new.
            grow = kv_slots(end) - kv_slots(state.done)
            return [(job, i)], StepShape(1, end - state.done, end, grow), False
        job, i = self._queue[0]
        if len(job.inputs[i]) - job.shared > budget:
            n = min(budget, len(job.inputs[i]))
            return [(job, i)], StepShape(1, n, n, n), True
        batch: list[tuple[EmbedJob, int]] = []
        longest = 0
        for job, i in self._queue:
            n = len(job.inputs[i]) - job.shared
            first = batch[0][0] if batch else job
            # A batch runs from one shared prefix, or from none.
            apart = job is not first and (job.shared or first.shared)
            if batch and (n > budget or job.kind != first.kind or apart
                          or max(longest, n) * (len(batch) + 1) > budget):
                break
            batch.append((job, i))
            longest = max(longest, n)
        shared = batch[0][0].shared
        return batch, StepShape(len(batch), longest, shared + longest,
                                shared + longest if shared else 0), False

    def _run_batch(self, batch: list[tuple[EmbedJob, int]], longest: int) -> None:
        job = batch[0][0]
        prompts = [job.inputs[i][job.shared:] for job, i in batch]
        inputs = mx.array([p + [0] * (longest - len(p)) for p in prompts])
        lengths = mx.array([len(p) for p in prompts])
        self.tokens_run += sum(len(p) for p in prompts)
        self._padded += len(prompts) * longest
        h = hidden_states(self.model, inputs, cache=self._from_prefix(job, len(prompts)))
        last = h[mx.arange(len(prompts)), lengths - 1]
        if self.spec.pooling == "mean":
            mask = (mx.arange(longest)[None, :] < lengths[:, None]).astype(h.dtype)
            pooled = (h * mask[..., None]).sum(axis=1) / lengths[:, None].astype(h.dtype)
        else:
            pooled = last
        outs = self._outputs(batch[0][0].kind, pooled, last)
        for (job, i), out in zip(batch, outs, strict=True):
            self._done(job, i, out)

    def _from_prefix(self, job: EmbedJob, rows: int) -> list[Any] | None:
        """A cache of ``rows`` rows each holding the job's shared prefix (run on first use),
        or None when it has none."""
        if not job.shared:
            return None
        if job.prefix_kv is None:
            tokens = job.inputs[0][:job.shared]
            cache, start = self._cached(job, tokens)
            if start < len(tokens):
                hidden_states(self.model, mx.array([tokens[start:]]), cache=cache)
            job.prefix_kv = [c.keys_and_values() for c in cache]
            mx.eval(job.prefix_kv)
            self._keep_blocks(job, tokens, cache, start)
            self.tokens_run += len(tokens) - start
            self._padded += len(tokens) - start
        caches = []
        for keys, values in job.prefix_kv:
            c = KVCache()
            c.update_and_fetch(mx.repeat(keys, rows, axis=0), mx.repeat(values, rows, axis=0))
            caches.append(c)
        return caches

    def _cached(self, job: EmbedJob, tokens: list[int]) -> tuple[list[Any], int]:
        """A cache holding the leading blocks of ``tokens`` the prefix cache has (in the
        job's namespace), and how many tokens that is."""
        engine = self.engine
        if engine is None or not engine.caching:
            return make_prompt_cache(self.model), 0
        hashes = block_hashes(engine.chain_root(job.namespace), tokens, engine.block_size)
        hit = engine.blocks.lookup(hashes)
        if not hit:
            return make_prompt_cache(self.model), 0
        start = sum(b.n_tokens for b in hit)
        self.cached_tokens += start
        return build_cache(self.model, engine.kinds, hit), start

    def _keep_blocks(self, job: EmbedJob, tokens: list[int], cache: list[Any],
                     start: int) -> None:
        """Store the full blocks of a shared prefix the prefix cache did not have (they go to
        the disk tier as a chat prompt's do)."""
        engine = self.engine
        if engine is None or not engine.caching:
            return
        root = engine.chain_root(job.namespace)
        hashes = block_hashes(root, tokens, engine.block_size)
        first = start // engine.block_size
        if len(hashes) <= first:
            return
        for blk in cut_blocks(cache, engine.kinds, first, len(hashes), engine.block_size,
                              hashes, tokens, root):
            if engine.blocks.store(blk):
                engine.new_blocks.append((job.request_id, blk))

    def _chunk(self, budget: int) -> None:
        assert self._long is not None
        job, i, state = self._long
        prompt = job.inputs[i]
        chunk = prompt[state.done:state.done + budget]
        h = hidden_states(self.model, mx.array([chunk]), cache=state.cache)[0]
        self.tokens_run += len(chunk)
        self._padded += len(chunk)
        total = h.astype(mx.float32).sum(axis=0)
        state.total = total if state.total is None else state.total + total
        state.last = h[-1]
        state.done += len(chunk)
        mx.eval(state.total, state.last, [c.state for c in state.cache])
        if state.done < len(prompt):
            return
        self._long = None
        pooled = state.total / len(prompt) if self.spec.pooling == "mean" else state.last
        self._done(job, i, self._outputs(job.kind, pooled[None], state.last[None])[0])

    def _outputs(self, kind: JobKind, pooled: mx.array, last: mx.array) -> list[Any]:
        if kind == "rerank":
            logits = head_logits(self.model, last).astype(mx.float32)
            pair = logits[:, [self.yes_id, self.no_id]].tolist()
            return [rerank_score(yes, no) for yes, no in pair]
        return l2_normalize(apply_dense(self.dense, pooled.astype(mx.float32))).tolist()

    def _done(self, job: EmbedJob, i: int, out: Any) -> None:
        self.inputs_done += 1
        job.record(i, out, self.jobs)

    def _fail_jobs(self, jobs: Iterable[EmbedJob], exc: Exception) -> None:
        """``jobs`` leave the queue with ``exc`` as their answer: those of a step that does
        not fit in memory, or every job when a forward pass failed (it says nothing of which
        input caused it)."""
        for job in list(jobs):
            self.abort(job.request_id)
            job.on_done(None, exc)


def _common_prefix(inputs: list[list[int]]) -> int:
    """How many leading tokens all ``inputs`` share, leaving each at least one of its own (its
    last position is the one read)."""
    first, most = inputs[0], min(len(ids) for ids in inputs) - 1
    n = 0
    while n < most and all(ids[n] == first[n] for ids in inputs):
        n += 1
    return n
