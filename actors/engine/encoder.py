"""Encoder models (the BERT family) for embeddings and cross-encoder reranking, on the MLX
thread, through mlx-vlm.

mlx-lm has no encoders. mlx-vlm (MIT; troupe's optional extra ``mlx-troupe[vision]``) carries
bert, xlm_roberta and modernbert with loaders for embedding and sequence-classification
checkpoints and sentence-transformers' pooling: troupe loads and runs those, through their
public names. An encoder attends both ways, so there is no KV cache to reuse or to run an input
in chunks: each input runs whole (bounded by the model's positions), inputs padded together
under an attention mask, and nothing is kept when they end (no prefix cache).

An embedder's vector is its pooled last hidden states (``1_Pooling/config.json``: cls, mean,
max or last token; mean without one), L2-normalised; a cross-encoder's relevance score is the
sigmoid of its one classifier logit on the (query, document) pair, encoded as its tokenizer
encodes pairs.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from troupe.actors.engine.dense import Dense, apply_dense, dense_folders
from troupe.actors.engine.embed_gate import StepShape, gate_step
from troupe.actors.engine.memory_estimate import ModelMemory
from troupe.actors.engine.schedule import ema

if TYPE_CHECKING:
    from troupe.actors.engine.embed import EmbedJob, Task

# Encoder families as configs name them (``model_type``). Those mlx-vlm serves, by its module
# name: roberta is XLM-RoBERTa's architecture (the same layers, position offset and head).
SERVED = {"bert": "bert", "xlm-roberta": "xlm_roberta", "xlm_roberta": "xlm_roberta",
          "roberta": "xlm_roberta", "modernbert": "modernbert"}
# Others that are encoders too: refused at start with a clear error, not sent to mlx-lm.
UNSERVED = frozenset({"nomic_bert", "distilbert", "mpnet", "electra", "deberta", "deberta-v2",
                      "new", "camembert", "albert", "jina_bert"})
# Families whose positions start after the padding index (RoBERTa's): a model of
# ``max_position_embeddings`` P takes P - pad_token_id - 1 tokens.
OFFSET_POSITIONS = frozenset({"xlm-roberta", "xlm_roberta", "roberta"})
EXTRA = "pip install 'mlx-troupe[vision]'"


class EncoderUnavailable(ValueError):
    """An encoder model that this installation cannot serve (mlx-vlm missing, or a family or
    task it does not run)."""


def read_config(path: str | Path) -> dict[str, Any]:
    """A model directory's ``config.json`` ({} without one)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_type(config: dict[str, Any]) -> str:
    return str(config.get("model_type", "")).lower()


def is_cross_encoder(config: dict[str, Any]) -> bool:
    """Whether an encoder config is a sequence classifier (a cross-encoder reranker)."""
    return any(str(a).endswith("ForSequenceClassification")
               for a in config.get("architectures") or ())


def encoder_task(config: dict[str, Any]) -> Task | None:
    """What an encoder config serves: reranking for a ``*ForSequenceClassification``, else
    embeddings; None for a model that is no encoder."""
    kind = _model_type(config)
    if kind not in SERVED and kind not in UNSERVED:
        return None
    return "rerank" if is_cross_encoder(config) else "embed"


@lru_cache(maxsize=64)
def is_encoder(path: str | Path) -> bool:
    """Whether the model directory at ``path`` holds an encoder (read once per path: a served
    model's files do not change)."""
    return encoder_task(read_config(path)) is not None


def encoder_positions(config: dict[str, Any]) -> int | None:
    """The most tokens an encoder input may have (its position table, less RoBERTa's offset);
    None for a model that is no encoder."""
    if encoder_task(config) is None or not isinstance(config.get("max_position_embeddings"),
                                                      int):
        return None
    positions = config["max_position_embeddings"]
    if _model_type(config) in OFFSET_POSITIONS:
        positions -= int(config.get("pad_token_id", 1)) + 1
    return positions


def check_encoder(path: str | Path, task: Task) -> None:
    """Refuse, with what to do, an encoder model this installation cannot serve as ``task``:
    mlx-vlm missing, a family it has no module for, or a task the checkpoint cannot do."""
    config = read_config(path)
    kind, name = _model_type(config), Path(path).name
    if kind not in SERVED:
        raise EncoderUnavailable(
            f"{name} is a {kind} encoder; the encoder families served are bert, roberta, "
            "xlm-roberta and modernbert (docs/models.md)")
    if find_spec("mlx_vlm") is None:
        raise EncoderUnavailable(
            f"{name} is a {kind} encoder model: encoders run through mlx-vlm, which is not "
            f"installed; install the extra: {EXTRA}")
    served = encoder_task(config)
    if task != served:
        what = {"embed": "an embedder (/v1/embeddings)",
                "rerank": "a cross-encoder reranker (/v1/rerank)"}[served]
        raise EncoderUnavailable(
            f"{name} is {what}: it cannot serve --task {task}; serve it without --task, or "
            f"with --task {served}")


def load_encoder(path: str | Path, task: Task) -> tuple[Any, Any, dict[str, Any]]:
    """The encoder model at ``path`` (mlx-vlm's class for its family: the embedding model
    with its pooling config, or the sequence classifier), its tokenizer and its config."""
    check_encoder(path, task)
    # mlx-vlm is optional: imported only when an encoder is served.
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.encoder_loader import load_encoder_model
    from mlx_vlm.models.pooling import read_pooling_config
    from mlx_vlm.reranker_loader import load_sequence_classification_model

    path = Path(path)
    config = read_config(path)
    family = {**config, "model_type": SERVED[_model_type(config)]}
    try:
        if task == "rerank":
            model = load_sequence_classification_model(path, config=family)
        else:
            # mlx-vlm's loader takes every subfolder's safetensors as the encoder's own: a
            # Dense module's too, which it has no layer for (troupe applies it, dense.py).
            model = load_encoder_model(path, model_remapping={}, config=family,
                                       strict=not dense_folders(path))
            # mlx-vlm's encoders pool by this attribute (its own server sets it so).
            model.pooling_config = read_pooling_config(path)
    except (FileNotFoundError, ValueError) as exc:
        raise EncoderUnavailable(f"{path.name}: {exc}") from exc
    return model, load_tokenizer(path), config


def pair_tokens(tokenizer: Any, query: str, document: str, limit: int | None) -> list[int]:
    """A (query, document) pair as a cross-encoder reads it: the tokenizer's own pair encoding
    (``[CLS] q [SEP] d [SEP]``, ``<s> q </s></s> d </s>``); with ``limit``, cut to that many
    tokens, the longer text first, as sentence-transformers' CrossEncoder cuts."""
    if limit is None:
        return list(tokenizer.encode(query, text_pair=document))
    return list(tokenizer.encode(query, text_pair=document, truncation=True, max_length=limit))


def text_tokens(tokenizer: Any, text: str, limit: int | None) -> list[int]:
    """A text as an encoder reads it (its special tokens around it); with ``limit``, cut to
    that many tokens keeping the closing one."""
    if limit is None:
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, truncation=True, max_length=limit))


class EncoderEmbedder:
    """The queue of one encoder model's inputs (embeddings, or rerank pairs), run a budget of
    tokens a step (padding included).

    A job's inputs queue shortest first (less padding); those that fit the budget together
    run in one right-padded forward pass under an attention mask, which keeps the padding out
    of every input's states. An input over the budget runs alone and whole: an encoder has no
    cache to run it in chunks. The interface is ``Embedder``'s (actors/engine/embed.py)."""

    def __init__(self, model: Any, tokenizer: Any, config: dict[str, Any], *,
                 memory: ModelMemory | None = None, dense: list[Dense] | None = None) -> None:
        self.model = model
        self.memory = memory  # the model's memory shape, for the per-step gate
        self.dense = dense or []  # sentence-transformers' Dense modules, after pooling
        self.pad_id = int(config.get("pad_token_id") or 0)
        # BERT's cross-encoders tell the query from the document by token type: 1 after the
        # pair's first separator. Models with one token type have none to tell.
        typed = int(config.get("type_vocab_size", 1)) > 1
        self.sep_id: int | None = getattr(tokenizer, "sep_token_id", None) if typed else None
        self.cached_tokens = 0  # an encoder has no prefix cache: always 0
        self._queue: deque[tuple[EmbedJob, int]] = deque()
        self.jobs: dict[str, EmbedJob] = {}
        self.inputs_done = 0
        self.tokens_run = 0
        self.token_s: float | None = None  # seconds a token takes, padding included (EMA)

    @property
    def has_work(self) -> bool:
        return bool(self._queue)

    def add(self, job: EmbedJob) -> None:
        """Queue a job's inputs (an empty job ends at once)."""
        if not job.inputs:
            job.on_done([], None)
            return
        self.jobs[job.request_id] = job
        order = sorted(range(len(job.inputs)), key=lambda i: len(job.inputs[i]))
        self._queue.extend((job, i) for i in order)

    def abort(self, request_id: str) -> None:
        """Drop a job whose client has gone (its answer is never given)."""
        job = self.jobs.pop(request_id, None)
        if job is not None:
            self._queue = deque(u for u in self._queue if u[0] is not job)

    def warm_up(self) -> float:
        """Run two inputs of different lengths together once, so that the first request does
        not wait for MLX to build its kernels, and a pooling mode mlx-vlm does not run fails
        at load. Returns the seconds it took."""
        began = time.perf_counter()
        ids = mx.array([[self.pad_id + 1] * 8, [self.pad_id + 1] * 4 + [self.pad_id] * 4])
        mask = mx.array([[1] * 8, [1] * 4 + [0] * 4])
        out = self.model(ids, attention_mask=mask)
        mx.eval(out.logits if hasattr(out, "logits") else out.text_embeds)
        return time.perf_counter() - began

    def step(self, budget: int, limit: int | None = None, floor: int = 0) -> None:
        """Run the next inputs that fit ``budget`` tokens together (at least one). With
        ``limit``, only if the step fits in memory (``gate_step``); else its jobs fail."""
        budget = max(1, budget)
        batch: list[tuple[EmbedJob, int]] = []
        longest = 0
        for job, i in self._queue:
            n = len(job.inputs[i])
            if batch and max(longest, n) * (len(batch) + 1) > budget:
                break
            batch.append((job, i))
            longest = max(longest, n)
        if not batch:
            return
        # Attention both ways over each input, whole: no cache.
        error = gate_step(self.memory, StepShape(len(batch), longest, longest), limit, floor)
        if error is not None:
            self._fail_jobs({job.request_id: job for job, _ in batch}.values(), error)
            return
        for _ in batch:
            self._queue.popleft()
        started = time.perf_counter()
        try:
            outs = self._run(batch, longest)
        except Exception as exc:  # noqa: BLE001 - the jobs get the error, not the actor
            self._fail_jobs(list(self.jobs.values()), exc)
            return
        per_token = (time.perf_counter() - started) / (len(batch) * longest)
        self.token_s = ema(self.token_s, per_token)
        for (job, i), out in zip(batch, outs, strict=True):
            self._done(job, i, out)

    def _run(self, batch: list[tuple[EmbedJob, int]], longest: int) -> list[Any]:
        rows = [job.inputs[i] for job, i in batch]
        self.tokens_run += sum(len(r) for r in rows)
        ids = mx.array([r + [self.pad_id] * (longest - len(r)) for r in rows])
        mask = mx.array([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
        if batch[0][0].kind == "rerank":
            types = self._types(rows, longest)
            logits = self.model(ids, attention_mask=mask, token_type_ids=types).logits
            return mx.sigmoid(logits.astype(mx.float32)[:, 0]).tolist()
        out = self.model(ids, attention_mask=mask)
        if not self.dense:  # mlx-vlm's own vectors: pooled and normalised
            return out.text_embeds.astype(mx.float32).tolist()
        from mlx_vlm.models.pooling import normalize_embeddings, pool_by_config

        pooled = pool_by_config(out.last_hidden_state, mask, self.model.pooling_config)
        return normalize_embeddings(apply_dense(self.dense, pooled.astype(mx.float32))).tolist()

    def _types(self, rows: list[list[int]], longest: int) -> mx.array | None:
        """Token types of pairs (0 to the first separator, 1 after it), for models that read
        them."""
        if self.sep_id is None:
            return None
        types = []
        for r in rows:
            first = r.index(self.sep_id) + 1 if self.sep_id in r else longest
            types.append([0] * first + [1] * (longest - first))
        return mx.array(types)

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
