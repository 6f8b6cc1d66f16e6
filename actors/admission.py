"""The admission actor: templates, tokenizes and validates, and decides before any header.

It runs on its own thread (tokenizing a long prompt would otherwise stall the event loop) and
never touches MLX. An admitted request goes straight into the model's scheduler with
``try_stream``; the HTTP layer gets the scheduler's event stream back in an
``AdmissionTicket``. Every refusal is an ``AdmissionError`` carrying its HTTP status.
"""

from __future__ import annotations

import logging
from typing import Any

import jinja2
from mlx_lm.utils import load_tokenizer

from actors.messages import (
    AddRequest,
    AdmissionError,
    AdmissionTicket,
    AdmitChat,
    AdmitCompletion,
    Admitted,
    CountTokens,
    ListModels,
    ModelCard,
    SamplingParams,
)
from runtime import Actor, ActorRef, MailboxFull

log = logging.getLogger("actors.admission")

ADMISSION_THREAD = "admission"
RETRY_AFTER_S = 1.0


class ModelEntry:
    """What admission knows of one served model: its card, tokenizer and scheduler."""

    def __init__(self, card: ModelCard, scheduler: ActorRef) -> None:
        self.card = card
        self.scheduler = scheduler
        self.tokenizer: Any = None


class Admission(Actor):
    """Turns API requests into scheduler requests, or into a refusal with a status code."""

    def __init__(self, *, models: list[tuple[ModelCard, ActorRef]]) -> None:
        self.models = {card.id: ModelEntry(card, ref) for card, ref in models}
        self.admitted = 0
        self.refused: dict[int, int] = {}

    async def on_start(self) -> None:
        for entry in self.models.values():
            entry.tokenizer = load_tokenizer(entry.card.path)

    async def handle(self, msg: Any) -> Any:
        match msg:
            case AdmitChat():
                entry = self._model(msg.model)
                tokens = self._apply_template(entry, msg.messages, msg.tools,
                                              msg.chat_template_kwargs)
                return self._admit(entry, msg.request_id, tokens, msg.sampling, "messages")
            case AdmitCompletion():
                entry = self._model(msg.model)
                if isinstance(msg.prompt, str):
                    tokens = entry.tokenizer.encode(msg.prompt)
                else:
                    tokens = list(msg.prompt)
                    vocab = len(entry.tokenizer)
                    if any(t < 0 or t >= vocab for t in tokens):
                        raise self._refuse(400, f"prompt token ids must be in [0, {vocab})",
                                           param="prompt")
                return self._admit(entry, msg.request_id, tokens, msg.sampling, "prompt")
            case CountTokens():
                entry = self._model(msg.model)
                return len(self._apply_template(entry, msg.messages, msg.tools, None,
                                                generation_prompt=False))
            case ListModels():
                return [entry.card for entry in self.models.values()]
            case _:
                raise TypeError(f"admission cannot handle {type(msg).__name__}")

    def _model(self, name: str) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None and len(self.models) == 1 and name in ("", "default"):
            entry = next(iter(self.models.values()))
        if entry is None:
            served = ", ".join(sorted(self.models))
            raise self._refuse(404, f"model {name!r} is not served here (served: {served})",
                               param="model", code="model_not_found")
        return entry

    def _apply_template(
        self,
        entry: ModelEntry,
        messages: list[dict],
        tools: list[dict] | None,
        extra: dict | None,
        generation_prompt: bool = True,
    ) -> list[int]:
        if not messages:
            raise self._refuse(400, "messages must not be empty", param="messages")
        tokenizer = entry.tokenizer
        if not tokenizer.has_chat_template:
            raise self._refuse(400, f"model {entry.card.id!r} has no chat template; "
                               "use /v1/completions", param="messages")
        try:
            return list(tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=generation_prompt,
                **(extra or {}),
            ))
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            # Templates reject what they cannot render (roles out of order, bad tool specs).
            raise self._refuse(400, f"the chat template rejected the messages: {exc}",
                               param="messages") from exc

    def _admit(
        self,
        entry: ModelEntry,
        request_id: str,
        tokens: list[int],
        sampling: SamplingParams,
        prompt_param: str,
    ) -> AdmissionTicket:
        if not tokens:
            raise self._refuse(400, "the prompt is empty", param=prompt_param)
        limit = entry.card.context_length
        if len(tokens) + sampling.max_tokens > limit:
            raise self._refuse(
                400,
                f"this model's context is {limit} tokens; the prompt has {len(tokens)} and "
                f"max_tokens asks for {sampling.max_tokens}",
                param="max_tokens" if len(tokens) < limit else prompt_param,
                code="context_length_exceeded",
            )
        try:
            events = entry.scheduler.try_stream(
                AddRequest(request_id=request_id, prompt_tokens=tokens, sampling=sampling)
            )
        except MailboxFull:
            raise self._refuse(429, "the server is busy; retry shortly", type="rate_limit_error",
                               code="queue_full", retry_after=RETRY_AFTER_S) from None
        self.admitted += 1
        admitted = Admitted(request_id=request_id, model=entry.card.id,
                            prompt_tokens=len(tokens))
        return AdmissionTicket(admitted=admitted, events=events)

    def _refuse(self, status: int, message: str, **kw: Any) -> AdmissionError:
        self.refused[status] = self.refused.get(status, 0) + 1
        return AdmissionError(status, message, **kw)

    def report(self) -> dict[str, Any]:
        return {
            "models": sorted(self.models),
            "admitted": self.admitted,
            "refused": {str(k): v for k, v in sorted(self.refused.items())},
        }
