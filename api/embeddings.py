"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (also ``/rerank`` and
``/v2/rerank``, the Cohere/Jina shape RAG tools call), answered through the admission actor by
an embedding or reranker model (actors/engine/embed.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from typing import Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from troupe.actors.messages import AbortRequest, AdmitEmbed, AdmitRerank, EmbedAnswer
from troupe.api.cache_namespace import request_namespace
from troupe.api.decode import decode_body
from troupe.api.errors import ApiError, ask_admission
from troupe.api.shutdown import generation
from troupe.api.telemetry import RECORD
from troupe.runtime import ActorDead, ActorRef, MailboxFull


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings request; ``input_type`` and ``truncate`` are troupe's extensions."""

    model: str = ""
    # A string, a list of strings, a list of token ids or a list of lists (``_inputs``).
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # "query": the model's query prompt goes before each input (documents get none).
    input_type: str | None = None
    # Cut an input over the model's context instead of refusing it.
    truncate: bool = False


class RerankDocument(msgspec.Struct, kw_only=True):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    """The Cohere/Jina rerank request; ``instruction`` (the reranker's task line) and
    ``truncate`` are troupe's extensions. A document over the context is cut by default, as
    Cohere's and Jina's rerank APIs cut it; ``truncate: false`` refuses it instead."""

    query: str
    documents: list[str | RerankDocument]
    model: str = ""
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None
    truncate: bool = True


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
_rerank_decoder = msgspec.json.Decoder(RerankRequest)
_encoder = msgspec.json.Encoder()


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _inputs(value: Any) -> list[str] | list[list[int]]:
    """The request's ``input`` as a list of strings or a list of token id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(x, str) for x in value):
            return value
        if all(_is_id(x) for x in value):
            return [value]
        if all(isinstance(x, list) and x and all(_is_id(t) for t in x) for x in value):
            return value
    raise ApiError(400, "'input' must be a non-empty string, list of strings, list of token "
                   "ids or list of lists of token ids.", param="input")


def shorten(vector: list[float], dimensions: int) -> list[float]:
    """A unit vector's first ``dimensions`` entries, scaled back to unit length (Matryoshka
    embeddings keep their meaning in their leading dimensions)."""
    head = np.asarray(vector[:dimensions], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return (head / norm if norm > 0 else head).tolist()


def shortened(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """The vectors cut to ``dimensions`` (``shorten``; None: as they are); more dimensions
    than the model's is a 400."""
    if dimensions is None:
        return vectors
    size = len(vectors[0])
    if dimensions > size:
        raise ApiError(400, f"'dimensions' is {dimensions}, over this model's {size}.",
                       param="dimensions")
    return [shorten(v, dimensions) for v in vectors]


async def ask_embedding(admission: ActorRef, msg: AdmitEmbed | AdmitRerank) -> EmbedAnswer:
    """Ask admission; a client that goes away meanwhile (the handler is cancelled) has its
    inputs dropped from the model's queue."""
    try:
        return await ask_admission(admission, msg)
    except asyncio.CancelledError:
        with contextlib.suppress(MailboxFull, ActorDead):
            admission.try_tell(AbortRequest(request_id=msg.request_id))
        raise


def as_base64(vector: list[float]) -> str:
    """A vector as OpenAI's base64 encoding: little-endian float32s."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


class EmbeddingRoutes:
    """The embedding and rerank routes."""

    def __init__(self, admission: ActorRef) -> None:
        self.admission = admission

    def register(self, router: web.UrlDispatcher) -> None:
        """Add the routes to an application's router."""
        router.add_post("/v1/embeddings", self.embeddings)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            router.add_post(path, self.rerank)

    async def _ask(self, msg: AdmitEmbed | AdmitRerank) -> EmbedAnswer:
        return await ask_embedding(self.admission, msg)

    @generation
    async def embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``."""
        req = decode_body(await request.read(), _embedding_decoder)
        inputs = _inputs(req.input)
        if req.dimensions is not None and req.dimensions < 1:
            raise ApiError(400, "'dimensions' must be at least 1.", param="dimensions")
        request_id = f"embd-{uuid.uuid4().hex}"
        request[RECORD].request_id, request[RECORD].model = request_id, req.model
        answer = await self._ask(AdmitEmbed(
            request_id=request_id, model=req.model, inputs=inputs, input_type=req.input_type,
            truncate=req.truncate))
        vectors = shortened(answer.results, req.dimensions)
        encode = as_base64 if req.encoding_format == "base64" else (lambda v: v)
        body = EmbeddingResponse(
            object="list", model=answer.model,
            data=[EmbeddingData(object="embedding", index=i, embedding=encode(v))
                  for i, v in enumerate(vectors)],
            usage=EmbeddingUsage(prompt_tokens=answer.prompt_tokens,
                                 total_tokens=answer.prompt_tokens))
        return web.Response(body=_encoder.encode(body), content_type="application/json")

    @generation
    async def rerank(self, request: web.Request) -> web.Response:
        """``POST /v1/rerank``: the documents by relevance to the query, best first."""
        req = decode_body(await request.read(), _rerank_decoder)
        if req.top_n is not None and req.top_n < 1:
            raise ApiError(400, "'top_n' must be at least 1.", param="top_n")
        texts = [d if isinstance(d, str) else d.text for d in req.documents]
        request_id = f"rerank-{uuid.uuid4().hex}"
        request[RECORD].request_id, request[RECORD].model = request_id, req.model
        answer = await self._ask(AdmitRerank(
            request_id=request_id, model=req.model, query=req.query, documents=texts,
            instruction=req.instruction, truncate=req.truncate,
            cache_namespace=request_namespace(request, None)))
        order = sorted(range(len(texts)), key=lambda i: answer.results[i], reverse=True)
        results = [RerankResult(index=i, relevance_score=answer.results[i],
                                document=RerankDocument(text=texts[i])
                                if req.return_documents else None)
                   for i in order[:req.top_n]]
        body = RerankResponse(id=request_id, model=answer.model, results=results,
                              usage=EmbeddingUsage(prompt_tokens=answer.prompt_tokens,
                                                   total_tokens=answer.prompt_tokens))
        return web.Response(body=_encoder.encode(body), content_type="application/json")
