"""Embeddings and reranking on decoder models (issue 33): the pooled vectors and rerank scores
of ``actors.engine.embed`` against plain mlx-lm computations of the same recipe, batched and
chunked runs against lone ones, and the model files that decide pooling and task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from embed_models import (
    QUERY_PROMPT,
    make_embedding_model,
    make_reranker_model,
    run_job,
    write_dense,
)
from mlx_lm import load
from mlx_lm.utils import load_config

from troupe.actors.engine.config import EngineConfig
from troupe.actors.engine.dense import read_dense
from troupe.actors.engine.embed import (
    RERANK_SUFFIX,
    Embedder,
    EmbedJob,
    EmbedSpec,
    answer_token,
    detect_task,
    read_embed_spec,
    rerank_tokens,
)
from troupe.actors.engine.memory_estimate import (
    KV_STEP,
    embed_step_need,
    model_memory,
    prefill_transient,
)
from troupe.actors.engine.schedule import (
    EMA,
    STEP_BUDGET_FLOOR,
    StepState,
    embed_budget,
    step_budget,
)
from troupe.actors.messages import AdmissionError
from troupe.actors.scheduler import ThreadLoad

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog",
         "def add(a, b): return a + b", "a"]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_embedding_model(tmp_path_factory.mktemp("emb") / "tiny-qwen3-embedding")


@pytest.fixture(scope="module")
def embedding(embedding_dir: Path) -> tuple[Any, Any]:
    return load(str(embedding_dir))


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reranker_model(tmp_path_factory.mktemp("rerank"))


def _reference(model: Any, tokens: list[int], pooling: str) -> np.ndarray:
    """The recipe in plain mlx-lm and numpy: one input alone, the body's states pooled and
    L2-normalised."""
    h = np.array(model.model(mx.array([tokens]))[0].astype(mx.float32))
    v = h[-1] if pooling == "last" else h.mean(axis=0)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_vectors_equal_a_plain_computation_of_the_pooling(embedding: tuple[Any, Any],
                                                          pooling: str) -> None:
    model, tok = embedding
    inputs = [tok.encode(t) for t in TEXTS]
    got = run_job(Embedder(model, EmbedSpec(pooling=pooling)), "embed", inputs)
    refs = [_reference(model, ids, pooling) for ids in inputs]
    assert not np.allclose(refs[0], refs[1], atol=1e-3)  # two inputs, two vectors
    for vec, ref in zip(got, refs, strict=True):
        np.testing.assert_allclose(vec, ref, atol=1e-5)
        assert abs(np.linalg.norm(vec) - 1) < 1e-5


def test_batched_inputs_equal_each_input_alone(embedding: tuple[Any, Any]) -> None:
    model, tok = embedding
    inputs = [tok.encode(t) for t in TEXTS]
    embedder = Embedder(model, EmbedSpec(pooling="mean"))
    together = run_job(embedder, "embed", inputs)
    alone = [run_job(embedder, "embed", [ids])[0] for ids in inputs]
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_an_input_over_the_step_budget_runs_in_chunks_to_the_same_vector(
    embedding: tuple[Any, Any], pooling: str
) -> None:
    model, tok = embedding
    ids = tok.encode(" ".join(TEXTS * 4))
    embedder = Embedder(model, EmbedSpec(pooling=pooling))
    chunked = run_job(embedder, "embed", [ids, tok.encode("a")], budget=16)
    assert len(ids) > 3 * 16
    np.testing.assert_allclose(chunked[0], _reference(model, ids, pooling), atol=1e-4)
    np.testing.assert_allclose(chunked[1], _reference(model, tok.encode("a"), pooling),
                               atol=1e-5)
    assert embedder.jobs == {} and not embedder.has_work


def test_pooling_and_query_prompt_come_from_the_model_files(tmp_path: Path,
                                                            embedding_dir: Path) -> None:
    assert read_embed_spec(embedding_dir) == EmbedSpec(pooling="last", query_prefix=QUERY_PROMPT)
    mean = make_embedding_model(tmp_path / "mean", pooling="mean")
    assert read_embed_spec(mean).pooling == "mean"
    assert read_embed_spec(tmp_path) == EmbedSpec()  # no sentence-transformers files


def test_the_task_is_read_from_the_model_files(embedding_dir: Path, reranker_dir: Path,
                                               tiny_model_dir: Path) -> None:
    assert detect_task(embedding_dir) == "embed"
    assert detect_task(reranker_dir) == "rerank"
    assert detect_task(tiny_model_dir) == "generate"


def test_a_decoders_model_card_pipeline_tag_names_its_task(tmp_path: Path) -> None:
    def card(model_dir: Path, tag: str) -> Path:
        (model_dir / "README.md").write_text(
            f"---\nlicense: apache-2.0\nlibrary_name: transformers\npipeline_tag: {tag}\n---"
            "\n# A model\n\npipeline_tag: text-generation (not front matter)\n")
        return model_dir

    ranking = make_reranker_model(tmp_path, name="tiny-qwen3-ranking")
    assert detect_task(ranking) == "generate"  # neither its name nor its files tell
    assert detect_task(card(ranking, "text-ranking")) == "rerank"
    plain = make_reranker_model(tmp_path, name="tiny-qwen3-vectors")
    assert detect_task(card(plain, "feature-extraction")) == "embed"
    # A tag that names no embedding task leaves the files to tell.
    embedder = make_embedding_model(tmp_path / "tiny-qwen3-embedding")
    assert detect_task(card(embedder, "text-generation")) == "embed"


def test_rerank_scores_are_the_yes_probability_of_the_models_own_logits(
    reranker_dir: Path,
) -> None:
    model, tok = load(str(reranker_dir))
    yes, no = answer_token(tok, "yes"), answer_token(tok, "no")
    assert yes != no
    docs = ["the fox is quick", "numbers add up", "hello there", "a lazy dog sleeps"]
    inputs = [rerank_tokens(tok, "what does the fox do?", d) for d in docs]
    embedder = Embedder(model, EmbedSpec(), yes_id=yes, no_id=no)
    scores = run_job(embedder, "rerank", inputs)
    refs = []
    for ids in inputs:
        logits = np.array(model(mx.array([ids]))[0, -1].astype(mx.float32))
        pair = np.exp(logits[[yes, no]] - logits[[yes, no]].max())
        refs.append(pair[0] / pair.sum())
    assert len(set(np.round(refs, 6))) == len(refs)  # distinct scores: the order means something
    np.testing.assert_allclose(scores, refs, atol=1e-5)
    assert np.argsort(scores).tolist() == np.argsort(refs).tolist()


def test_an_aborted_job_never_answers(embedding: tuple[Any, Any]) -> None:
    model, tok = embedding
    embedder = Embedder(model, EmbedSpec())
    answered: list[Any] = []
    embedder.add(EmbedJob("gone", "embed", [tok.encode(t) for t in TEXTS],
                          lambda r, e: answered.append(r)))
    embedder.abort("gone")
    assert not embedder.has_work and answered == []


def test_a_cut_rerank_input_keeps_the_prompt_formats_ends(reranker_dir: Path) -> None:
    _, tok = load(str(reranker_dir))
    whole = rerank_tokens(tok, "what does the fox do?", "the fox " * 200)
    limit = len(whole) - 50
    cut = rerank_tokens(tok, "what does the fox do?", "the fox " * 200, limit=limit)
    assert len(cut) == limit
    closing = len(tok.encode(RERANK_SUFFIX, add_special_tokens=False))
    assert cut[:50] == whole[:50] and cut[-closing:] == whole[-closing:]


def test_a_rerank_querys_shared_prefix_runs_once_for_all_documents(reranker_dir: Path) -> None:
    model, tok = load(str(reranker_dir))
    yes, no = answer_token(tok, "yes"), answer_token(tok, "no")
    docs = [f"document number {i} says {w}" for i, w in enumerate(["yes", "no", "maybe"] * 4)]
    inputs = [rerank_tokens(tok, "which documents say yes?", d) for d in docs]
    shared = next(n for n in range(len(inputs[0])) if len({ids[n] for ids in inputs}) > 1)
    embedder = Embedder(model, EmbedSpec(), yes_id=yes, no_id=no)
    scores = run_job(embedder, "rerank", inputs, budget=64)
    assert embedder.tokens_run == shared + sum(len(ids) - shared for ids in inputs)
    alone = Embedder(model, EmbedSpec(), yes_id=yes, no_id=no)
    np.testing.assert_allclose(scores, [run_job(alone, "rerank", [ids])[0] for ids in inputs],
                               atol=1e-5)
    assert len(set(np.round(scores, 6))) > 1
    # At most a prefill chunk of it is shared (it runs in one forward pass).
    capped = Embedder(model, EmbedSpec(), yes_id=yes, no_id=no, max_shared=shared // 2)
    np.testing.assert_allclose(run_job(capped, "rerank", inputs, budget=512), scores, atol=1e-5)
    assert capped.tokens_run == shared // 2 + sum(len(ids) - shared // 2 for ids in inputs)


def test_a_model_without_a_decoder_body_is_refused_at_load(embedding: tuple[Any, Any]) -> None:
    class Headless:
        pass

    with pytest.raises(ValueError, match="cannot embed"):
        Embedder(Headless(), EmbedSpec())
    Embedder(embedding[0], EmbedSpec())  # a qwen3 has one


def test_the_embedder_measures_the_time_a_token_takes(embedding: tuple[Any, Any]) -> None:
    model, tok = embedding
    embedder = Embedder(model, EmbedSpec())
    assert embedder.token_s is None
    run_job(embedder, "embed", [tok.encode(t) for t in TEXTS])
    assert embedder.token_s is not None and embedder.token_s > 0


def _job(embedder: Any, request_id: str, inputs: list[list[int]]) -> dict[str, Any]:
    got: dict[str, Any] = {}
    embedder.add(EmbedJob(request_id, "embed", inputs, lambda r, e: got.update(r=r, e=e)))
    return got


def test_the_memory_gate_fails_an_embedding_step_that_does_not_fit(
    embedding: tuple[Any, Any], embedding_dir: Path
) -> None:
    model, tok = embedding
    memory = model_memory(load_config(embedding_dir))
    inputs = [tok.encode(t) for t in TEXTS]
    longest = max(len(ids) for ids in inputs)
    need = embed_step_need(memory, rows=len(inputs), tokens=longest, context=longest)
    embedder = Embedder(model, EmbedSpec(), memory=memory)
    mx.clear_cache()
    in_use = mx.get_active_memory()
    # Other work holds the memory: the step's jobs fail, to be retried; the next job runs.
    busy = _job(embedder, "busy", inputs)
    embedder.step(512, limit=in_use + need // 2)
    assert isinstance(busy["e"], AdmissionError) and busy["e"].kind == "unavailable"
    assert not embedder.has_work and embedder.jobs == {} and embedder.inputs_done == 0
    # A step that could not fit even at idle (the floor: the model's weights) is too large.
    never = _job(embedder, "never", inputs)
    embedder.step(512, limit=memory.weights_bytes + need // 2)
    assert never["e"].kind == "too_large" and never["e"].code == "memory_limit_exceeded"
    fits = _job(embedder, "fits", inputs)
    embedder.step(512, limit=in_use + 4 * need + (64 << 20))
    assert fits["e"] is None and len(fits["r"]) == len(inputs)


def test_the_memory_gate_counts_what_a_long_inputs_chunk_adds_to_its_cache(
    embedding: tuple[Any, Any], embedding_dir: Path
) -> None:
    model, tok = embedding
    memory = model_memory(load_config(embedding_dir))
    ids = tok.encode(" ".join(TEXTS * 16))
    assert len(ids) > KV_STEP + 128
    embedder = Embedder(model, EmbedSpec(), memory=memory)
    job = _job(embedder, "long", [ids])
    embedder.step(128)  # its first chunk (no gate): its cache takes KV_STEP slots
    margin = KV_STEP * memory.kv_per_token // 2

    def room(context: int) -> int:
        mx.clear_cache()
        transient = prefill_transient(memory, chunk=128, context=context)
        return mx.get_active_memory() + transient + margin

    # The second chunk fits in the slots its cache holds: only its transient is new.
    embedder.step(128, limit=room(256))
    assert embedder.tokens_run == 256 and job == {}
    # The third grows the cache by KV_STEP slots, over the limit: the job fails.
    embedder.step(128, limit=room(384))
    assert job["e"].kind == "unavailable" and not embedder.has_work


def test_a_long_inputs_embedding_steps_keep_to_what_a_chat_chunk_gets(
    embedding: tuple[Any, Any]
) -> None:
    model, tok = embedding
    config = EngineConfig(prefill_step_size=128, step_budget_ms=2.0, block_size=16)
    ids = tok.encode(" ".join(TEXTS * 12))
    embedder = Embedder(model, EmbedSpec())
    job = _job(embedder, "long", [ids])
    steps = []
    while embedder.has_work:
        token_s, before = embedder.token_s, embedder.tokens_run
        embedder.step(embed_budget(config, token_s, others_step_s=0.0))
        chat = step_budget(StepState(config=config, mixed=False, decoding=1, decode_len=8,
                                     prefilling=[], waiting=[], decode_s=0.0,
                                     token_s=token_s), [])
        steps.append(embedder.tokens_run - before)
        assert steps[-1] <= (STEP_BUDGET_FLOOR if chat is None else chat)
    assert steps[0] == STEP_BUDGET_FLOOR and len(steps) > 2 and sum(steps) == len(ids)
    np.testing.assert_allclose(job["r"][0], _reference(model, ids, "mean"), atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_dense_module_applies_after_pooling_and_before_normalisation(
    tmp_path: Path, pooling: str
) -> None:
    model_dir = make_embedding_model(tmp_path / "dense",
                                     pooling="lasttoken" if pooling == "last" else "mean")
    weight, bias = write_dense(model_dir, 64, 24, "torch.nn.modules.activation.Tanh")
    model, tok = load(str(model_dir))
    embedder = Embedder(model, read_embed_spec(model_dir), dense=read_dense(model_dir))
    inputs = [tok.encode(t) for t in TEXTS]
    got = run_job(embedder, "embed", inputs)
    for vec, ids in zip(got, inputs, strict=True):
        h = np.array(model.model(mx.array([ids]))[0].astype(mx.float32))
        ref = np.tanh(weight @ (h[-1] if pooling == "last" else h.mean(axis=0)) + bias)
        np.testing.assert_allclose(vec, ref / np.linalg.norm(ref), atol=1e-5)
    assert len(got[0]) == 24 and not np.allclose(got[0], got[1], atol=1e-3)


def test_a_dense_modules_pickled_weights_are_refused_by_name(tmp_path: Path) -> None:
    model_dir = make_embedding_model(tmp_path / "pickled")
    write_dense(model_dir, 64, 24, "torch.nn.modules.linear.Identity")
    (model_dir / "2_Dense" / "model.safetensors").rename(
        model_dir / "2_Dense" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="2_Dense/pytorch_model.bin"):
        read_dense(model_dir)
    assert read_dense(tmp_path) == []  # no sentence-transformers files: no Dense


def test_the_thread_load_gives_the_smoothed_steps_of_the_other_models_with_requests() -> None:
    load = ThreadLoad()
    load.report("embed", 1)
    load.stepped("embed", 0.5)
    assert load.others_step_s("embed") is None  # nobody else waits: whole chunks
    load.report("chat", 4)
    assert load.others_step_s("embed") == 0.0  # not timed yet
    load.stepped("chat", 0.1)
    load.stepped("chat", 0.2)
    assert load.others_step_s("embed") == pytest.approx(0.1 + EMA * 0.1)
    load.report("other chat", 1)
    load.stepped("other chat", 0.05)
    assert load.others_step_s("embed") == pytest.approx(0.18)  # each waits for both
    load.report("chat", 0)
    assert load.others_step_s("embed") == pytest.approx(0.05)
    load.drop("other chat")
    assert load.others_step_s("embed") is None
