"""The engine's settings: one typed struct with one default each, passed whole from the serve
configuration through the engine pool and the scheduler to the engine.

Each setting is declared once, with its default and its description (``setting``); the
``troupe serve`` flags are built from these declarations (api/cli.py), so a default or a help
text is never written twice.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple, get_args, get_origin

import msgspec


def setting(description: str, **cli: Any) -> msgspec.Meta:
    """A setting's description, and how its ``troupe serve`` flag reads (``cli``), for
    ``Annotated[type, setting(...)]``. The flag is ``--field-name`` and parses the field's
    type; ``cli`` may say:

    - ``flag``: another flag name (``"--arrival-window"``); ``also``: more spellings of it;
    - ``metavar``: the value's name in ``--help``;
    - ``unit``: ``"size"`` (bytes, given as ``800MB``, ``6GB``, ``1GiB``) or ``"ms"``
      (milliseconds, 0 or more);
    - ``split``: a list given comma-separated as well as repeated;
    - ``none``: what the default None means (every optional setting says);
    - ``env``: the environment variable that gives the flag its default.
    """
    return msgspec.Meta(description=description, extra=cli)


class Setting(NamedTuple):
    """One declared setting, read back from its struct."""

    type: Any  # the field's annotation, without its ``Annotated``
    default: Any
    description: str
    cli: dict[str, Any]


def settings_of(struct: type[msgspec.Struct]) -> dict[str, Setting]:
    """The settings a struct declares with ``setting``, by field name, in order (a field
    declared without one, as ``ServeConfig.engine`` is, is left out)."""
    found = {}
    for field in msgspec.structs.fields(struct):
        if get_origin(field.type) is not Annotated:
            continue
        base, *metas = get_args(field.type)
        meta = next(m for m in metas if isinstance(m, msgspec.Meta))
        default = (field.default if field.default_factory is msgspec.NODEFAULT
                   else field.default_factory())
        found[field.name] = Setting(base, default, meta.description or "", dict(meta.extra or {}))
    return found


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How one model's engine batches, schedules and caches (docs/configuration.md)."""

    # Continuous batching: most sequences decoding at once, and prompts prefilled together.
    max_batch_size: Annotated[int, setting(
        "most sequences decoding at once", metavar="N")] = 32
    prefill_batch_size: Annotated[int, setting(
        "prompts prefilled together", metavar="N")] = 8
    prefill_step_size: Annotated[int, setting(
        "prompt tokens per prefill chunk", metavar="N")] = 512
    prefill_interleave: Annotated[float, setting(
        "while sequences decode, hold a step's prefill to about R decode steps' time, so "
        "streams keep flowing past a long prompt; 0: whole chunks", metavar="R")] = 1.2
    # 200 ms keeps streams at 5 tokens/s or more and a new prompt's first token within a step
    # or two, while a 30B model's chunk on Apple silicon (a few hundred ms for 512 tokens)
    # shrinks by about half.
    step_budget_ms: Annotated[float, setting(
        "while others wait on a step (streams decoding, a short prompt beside a long one), "
        "size its prefill chunk from the measured prefill rate so the step takes about MS; "
        "0: no bound", unit="ms")] = 200.0
    arrival_window_ms: Annotated[float, setting(
        "an idle server waits this long after a request arrives before its first step, so a "
        "burst is prefilled together; 0: at once", flag="--arrival-window",
        metavar="MS")] = 20.0
    # actors/engine/forward.py names the architectures the one-pass forward runs; others take
    # mlx-lm's separate calls whatever this says.
    mixed_step: Annotated[bool, setting(
        "while sequences decode, run the prefill chunk and the last prompt token of joining "
        "sequences in the decode step's forward pass (one model call a step; llama-shaped "
        "models)")] = True
    speculative: Annotated[Literal["off", "ngram", "draft"] | None, setting(
        "draft a decoding sequence's next tokens and verify them in the step's forward pass "
        "(greedy answers unchanged; several tokens a step where the drafts are right): ngram "
        "drafts what followed its last few tokens earlier in its prompt and answer, draft "
        "asks --draft-model", none="draft with --draft-model, else ngram")] = None
    draft_model: Annotated[str | None, setting(
        "a smaller model of the same tokenizer that drafts for --speculative draft (a model "
        "directory, .gguf file or Hugging Face repo id, as --model); plain attention layers "
        "only", metavar="MODEL", none="no draft model")] = None
    max_queue: Annotated[int, setting(
        "requests waiting for a batch slot before 429 with Retry-After", metavar="N")] = 256
    block_size: Annotated[int, setting(
        "prefix-cache block size in tokens; 0 turns the prefix cache off",
        metavar="TOKENS")] = 64
    cache_ram_max: Annotated[int, setting(
        "RAM for prefix-cache blocks, e.g. 2GB; past it the least recently used go",
        unit="size")] = 1 << 30
    distributed: Annotated[Literal["tensor", "pipeline"] | None, setting(
        "shard the model over the ranks `mlx.launch` started (docs/distributed.md); rank 0 "
        "serves HTTP, the others follow its batch; every rank needs the group's shared "
        "secret in $TROUPE_DISTRIBUTED_SECRET", none="one process")] = None
    distributed_port: Annotated[int, setting(
        "port on rank 0's host where the other ranks take each step's plan",
        metavar="PORT")] = 32400
    # actors/engine/embed.py reads the task from the model's files when this is unset.
    task: Annotated[Literal["generate", "embed", "rerank"] | None, setting(
        "what a model serves: chat and completions (generate), /v1/embeddings (embed) or "
        "/v1/rerank (rerank)", none="from the model's files")] = None


DEFAULTS = EngineConfig()


def speculation(config: EngineConfig) -> Literal["off", "ngram", "draft"]:
    """How the engine drafts: ``speculative``, or by default from a draft model when one is
    given and by prompt lookup otherwise. A contradiction is a ``ValueError`` naming both
    flags."""
    mode = config.speculative
    if mode is None:
        return "draft" if config.draft_model else "ngram"
    if mode == "draft" and not config.draft_model:
        raise ValueError("--speculative draft needs a draft model (--draft-model MODEL)")
    if mode == "ngram" and config.draft_model:
        raise ValueError("--draft-model drafts with --speculative draft (the default with a "
                         "draft model), not --speculative ngram: give one or the other")
    return mode
