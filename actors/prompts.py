"""A request's prompt built for a model: pure functions that admission calls, most in its pool.

What the client sent becomes the token ids the scheduler runs: the chat rendered by the
model's template (its images decoded and placed, tools written in where the template has no
tool format), tokenized, checked against the context, how the answer is read (``OutputSpec``)
and its grammar compiled; a completion prompt tokenized; embedding and rerank inputs turned
into token ids. Of the model they read only what a ``PromptModel`` holds, set once when
admission starts, so any thread of admission's pool may run them; a refusal is an
``AdmissionError`` carrying its HTTP status. No actor, no MLX thread: the admission actor
(``actors.admission``) calls them and sends what they build to the scheduler.

A prompt that cannot fit the context is refused from a floor on its token count, before it is
tokenized (``PromptBound``); one that fits but whose ``max_tokens`` does not is served with
``max_tokens`` cut to the room left (``fit_answer``).

The chat template is the model's: ``chat_template_kwargs`` may set the template's variables
(``enable_thinking``...), never ``apply_chat_template``'s own parameters (``chat_template``
would replace the template). A render is bounded in time (``RenderBound``: the server's
``template_timeout``; a ``Watchdog`` cuts it, which frees its worker at once) and in length
(``RENDER_CHARS_PER_TOKEN``).
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import msgspec
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from troupe.actors.engine.agent_output import FALLBACK_TOOL_FORMAT, prompt_opens_reasoning
from troupe.actors.engine.embed import read_embed_spec, rerank_tokens
from troupe.actors.engine.encoder import is_encoder, pair_tokens, text_tokens
from troupe.actors.engine.grammar import Constraint, GrammarError, Grammars
from troupe.actors.engine.vision_prompt import with_images
from troupe.actors.images import ImageError, decode_part, image_parts
from troupe.actors.messages import (
    AdmissionError,
    ImageInput,
    ModelCard,
    OutputFormat,
    OutputSpec,
    SamplingDefaults,
    SamplingParams,
    ToolChoice,
)
from troupe.actors.tool_prompt import uses_tools, with_parsed_arguments, with_tools_in_prompt
from troupe.actors.workers import Overrun, Watchdog

log = logging.getLogger("actors.prompts")

# A rendered chat longer than this many characters a token of the model's context (or than
# its tokenizer's longest token, when that is longer) could never fit: it is refused before it
# is tokenized. Tokenizers take 3 to 5 characters a token of prose, a few more of indented code.
RENDER_CHARS_PER_TOKEN = 64
# apply_chat_template's own parameters (mlx-lm's wrapper's, transformers' and those of the
# render it calls), read off their signatures so that one a new version adds is refused too,
# and the conversation itself: in chat_template_kwargs they would replace the model's template
# (chat_template), what it renders (messages, tools, documents) or what it returns (tokenize,
# return_dict...). Every other key is a variable of the template (enable_thinking...).
TEMPLATE_PARAMETERS = frozenset(
    {"messages"}
    | {name
       for fn in (TokenizerWrapper.apply_chat_template,
                  PreTrainedTokenizerBase.apply_chat_template, render_jinja_template)
       for name, p in inspect.signature(fn).parameters.items()
       if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and name != "self"}
)


class PromptModel:
    """What building a prompt reads of one served model: its card, tokenizer, agent formats,
    grammar compiler, prompt bound and image processor, set once when admission starts (the
    admission actor's ``ModelEntry`` adds what it alone reads: the scheduler, the memory)."""

    def __init__(self, card: ModelCard) -> None:
        self.card = card
        self.tokenizer: Any = None
        # Agents: the template's tool-call format (None: troupe's fallback), its reasoning
        # tags, and the grammar compiler (its llguidance tokenizer is built on first use).
        self.tool_format: str | None = None
        self.think: tuple[str, str] | None = None
        self.grammars: Grammars | None = None
        self.bound: PromptBound | None = None
        # Images: why this model reads none (None: it reads them), its processor, and the id
        # the processor writes for an image's tokens.
        self.no_images: str | None = "it is not loaded"
        self.processor: Any = None
        self.image_token = -1
        # Code completion: the fill-in-the-middle tokens of its vocabulary (None: none).
        self.fim: FimTokens | None = None


# -- a floor on a prompt's tokens, without tokenizing it ----------------------------------------

# Pre-tokenizers that keep every character of the text (they split it, or map it one to one).
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength",
                           "Split", "Punctuation", "Sequence"}


@dataclass(frozen=True)
class PromptBound:
    """The most characters one token of this tokenizer can stand for (``chars``, L), and the
    normalizer the text goes through first (None: none).

    Why ceil(C / L) tokens is a floor for a text of C characters (C counted after the
    normalizer): each token stands for one vocabulary entry, or one added token, and covers at
    most that many characters of the normalized text (a byte-level entry is one character per
    byte, and a character has at least one byte); every character is covered by some token. So
    the tokens times L reach C. ``prompt_bound`` gives None for a tokenizer whose pipeline can
    drop text or fold a run of unknown characters into one token, where this does not hold.
    """

    chars: int
    normalizer: Any = None

    def fewest_tokens(self, text: str) -> int:
        """At least this many tokens encode ``text`` (see the class)."""
        if self.normalizer is not None:
            text = self.normalizer.normalize_str(text)
        return -(-len(text) // self.chars)


def prompt_bound(tokenizer: Any) -> PromptBound | None:
    """The ``PromptBound`` of an mlx-lm ``TokenizerWrapper`` (or a Hugging Face tokenizer), read
    from its vocabulary once per model; None when no sound bound can be read off it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None  # a slow tokenizer: nothing to read the pipeline from
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # a tokenizer that cannot be serialized: tokenize everything
        return None
    model = spec.get("model") or {}
    pre = spec.get("pre_tokenizer")
    byte_level = _has(pre, "ByteLevel")
    if model.get("type") == "BPE":
        vocab = list(model.get("vocab") or ())
        # Unknown characters become bytes (byte-level, byte fallback) or one <unk> each; with
        # fuse_unk a whole run of them becomes one token.
        if not (byte_level or model.get("byte_fallback")) and model.get("fuse_unk"):
            return None
    elif model.get("type") == "Unigram" and model.get("byte_fallback"):
        vocab = [piece for piece, _ in model.get("vocab") or ()]
    else:
        return None  # WordPiece, WordLevel, Unigram without byte fallback: a word may be <unk>
    if not _keeps_text(pre) or _has(spec.get("normalizer"), "Strip"):
        # Dropped text, or a Strip that acts on each piece between added tokens rather than on
        # the whole text the floor is counted on.
        return None
    added = spec.get("added_tokens") or ()
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None  # such a token also swallows the whitespace beside it
    normalizer = backend.normalizer
    lengths = [len(piece) for piece in vocab]
    for token in added:
        content = token.get("content") or ""
        lengths.append(len(content))
        if normalizer is not None:
            lengths.append(len(normalizer.normalize_str(content)))
    if not lengths or max(lengths) < 1:
        return None
    return PromptBound(chars=max(lengths), normalizer=normalizer)


def _has(node: Any, kind: str) -> bool:
    """Whether a tokenizer.json component (or a sequence of them) contains ``kind``."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has(v, kind) for v in node)
    return False


def _keeps_text(pre: Any) -> bool:
    """Whether a pre-tokenizer (possibly a sequence) keeps every character."""
    if pre is None:
        return True
    if pre.get("type") not in _KEEPING_PRE_TOKENIZERS or pre.get("behavior") == "Removed":
        return False
    return all(_keeps_text(p) for p in pre.get("pretokenizers") or ())


# -- the context: the prompt's room, and its answer's ------------------------------------------


def check_context(entry: PromptModel, n_tokens: int, prompt_param: str, *,
                  exact: bool) -> None:
    """Refuse a prompt of ``n_tokens`` (``exact``, or at least that many) that leaves no room
    in the context for one token of answer (a ``max_tokens`` over the room is cut instead:
    ``fit_answer``)."""
    limit = entry.card.context_length
    if n_tokens >= limit:
        has = "has" if exact else "has at least"
        raise AdmissionError(
            "invalid",
            f"this model's context is {limit} tokens; the prompt {has} {n_tokens}, which "
            f"leaves no room for an answer: shorten it",
            param=prompt_param, code="context_length_exceeded",
        )


def with_model_defaults(sampling: SamplingParams, unset: tuple[str, ...],
                        defaults: SamplingDefaults) -> SamplingParams:
    """``sampling`` with the model's ``defaults`` in the fields its request left ``unset``
    (a field the model sets no default for keeps ``SamplingParams``' own)."""
    filled = {name: value for name in unset
              if (value := getattr(defaults, name)) is not None}
    return msgspec.structs.replace(sampling, **filled) if filled else sampling


def fit_answer(entry: PromptModel, n_tokens: int, sampling: SamplingParams,
               output: OutputSpec | None, request_id: str, limit: int | None = None,
               ) -> tuple[SamplingParams, OutputSpec | None]:
    """``max_tokens`` cut to the room the prompt of ``n_tokens`` leaves in the context (and to
    ``limit``, the server's ``--max-tokens-limit``), and a thinking budget kept below it
    (Anthropic's rule, on the cut value). Agents send a ``max_tokens`` of their own
    provider's models (Claude Code: 32000) whatever the model."""
    room = entry.card.context_length - n_tokens
    if limit is not None:
        room = min(room, limit)
    if sampling.max_tokens <= room:
        return sampling, output
    log.debug("%s: max_tokens %d cut to %d (the context's room, the server's limit)",
              request_id, sampling.max_tokens, room)
    sampling = msgspec.structs.replace(sampling, max_tokens=room)
    if output is not None and output.thinking_budget is not None \
            and output.thinking_budget >= room:
        output = msgspec.structs.replace(output, thinking_budget=max(1, room - 1))
    return sampling, output


def check_floor(entry: PromptModel, text: str, prompt_param: str) -> None:
    """Refuse, without tokenizing it, a text whose floor of tokens cannot fit."""
    if entry.bound is not None:
        check_context(entry, entry.bound.fewest_tokens(text), prompt_param, exact=False)


# -- the chat, rendered by the model's template ------------------------------------------------


@dataclass(frozen=True)
class RenderedChat:
    """A chat rendered by its template (in the pool), and the tool-call format its answer is
    read with."""

    text: str
    tool_format: str | None
    # The chat's images, decoded, in the order the template wrote their markers.
    images: tuple[Any, ...] = ()


@dataclass(frozen=True)
class RenderBound:
    """How long a chat template may take to render: ``seconds``, cut by ``watchdog``."""

    watchdog: Watchdog
    seconds: float


# Claude Code (>= 2.1.36) puts this line first in its system prompt, with a hash (cch=) and a
# version suffix that change on every request: billing data for Anthropic's own servers, which
# means nothing to the model and, kept, would make every turn's prompt differ from its first
# line on (no prefix cache hit). Gateways that turn its requests into OpenAI's shape carry it
# into a system message, so the rule is here, under every route.
BILLING_HEADER = "x-anthropic-billing-header:"


def without_billing_header(messages: list[dict]) -> list[dict]:
    """The conversation without Claude Code's billing line in its system (or developer)
    messages; a message left empty by it is dropped, as if the block had not been sent."""
    out = []
    for message in messages:
        content = message.get("content")
        if (message.get("role") in ("system", "developer") and isinstance(content, str)
                and BILLING_HEADER in content):
            content = "\n".join(line for line in content.split("\n")
                                if not line.lstrip(" \t").startswith(BILLING_HEADER))
            if not content:
                continue
            message = {**message, "content": content}
        out.append(message)
    return out


def check_template_kwargs(kwargs: dict | None) -> None:
    """Refuse a ``chat_template_kwargs`` key that is not a variable of the template but a
    parameter of ``apply_chat_template`` (``TEMPLATE_PARAMETERS``)."""
    for key in kwargs or ():
        if key in TEMPLATE_PARAMETERS:
            raise AdmissionError(
                "invalid",
                f"chat_template_kwargs may set the chat template's variables (such as "
                f"enable_thinking), not {key!r}: the model's own template renders every "
                f"request",
                param=f"chat_template_kwargs.{key}",
            )


def render_chat(entry: PromptModel, render: RenderBound, messages: list[dict],
                tools: list[dict] | None, extra: dict | None,
                generation_prompt: bool, max_pixels: int) -> RenderedChat:
    """The chat as the template renders it, not tokenized yet (so that its floor of tokens is
    checked first), within ``render``'s time, and its images decoded (each at most
    ``max_pixels``). A template without a tool format gets the tools written into the
    conversation instead (``actors.tool_prompt``), read back in troupe's fallback format."""
    messages = without_billing_header(messages)
    messages, images = _take_images(entry, messages, max_pixels)
    tool_format = entry.tool_format
    if tool_format is None and (tools or uses_tools(messages)):
        messages, tools, tool_format = (with_tools_in_prompt(messages, tools), None,
                                        FALLBACK_TOOL_FORMAT)
    elif uses_tools(messages):
        messages = with_parsed_arguments(messages)
    if not messages:
        raise AdmissionError("invalid", "messages must not be empty", param="messages")
    if not entry.tokenizer.has_chat_template:
        raise AdmissionError("invalid", f"model {entry.card.id!r} has no chat template; "
                             "use /v1/completions", param="messages")
    try:
        text = render.watchdog.call(
            render.seconds, entry.tokenizer.apply_chat_template,
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False,
            **(extra or {}),
        )
    except Overrun:
        raise AdmissionError(
            "invalid",
            f"the chat template did not finish rendering these messages within "
            f"{render.seconds:g} s (the server's --template-timeout)",
            param="messages", code="template_timeout",
        ) from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
        # Templates reject what they cannot render (roles out of order, bad tool specs).
        raise AdmissionError("invalid", f"the chat template rejected the messages: {exc}",
                             param="messages") from exc
    return RenderedChat(text=text, tool_format=tool_format, images=images)


def _take_images(entry: PromptModel, messages: list[dict], max_pixels: int
                 ) -> tuple[list[dict], tuple[Any, ...]]:
    """The messages with each image part (``actors.images``' shape) left as the bare
    ``{"type": "image"}`` a chat template writes its marker for, and the images decoded, in
    order. Refused: images sent to a model that reads none, and images that do not decode or
    are too large (each naming its part)."""
    parts = image_parts(messages)
    if not parts:
        return messages, ()
    first = parts[0]["image"].get("param")
    if entry.no_images is not None:
        raise AdmissionError("invalid", f"model {entry.card.id!r} does not read images: "
                             f"{entry.no_images}", param=first, code="images_not_supported")
    try:
        images = [decode_part(part, max_pixels=max_pixels) for part in parts]
    except ImageError as exc:
        raise AdmissionError("invalid", exc.message, param=exc.param) from None

    def bare(message: dict) -> dict:
        content = message.get("content")
        if not isinstance(content, list):
            return message
        return {**message, "content": [
            {"type": "image"} if isinstance(p, dict) and p.get("type") == "image" else p
            for p in content]}

    return [bare(m) for m in messages], tuple(images)


def encode_with_images(entry: PromptModel, prompt: RenderedChat
                       ) -> tuple[list[int], list[ImageInput]]:
    """A rendered chat's tokens with its images placed by the model's processor."""
    try:
        return with_images(entry.processor, entry.image_token, prompt.text, list(prompt.images))
    except ValueError as exc:
        # A template that dropped an image's marker (or wrote one of its own).
        raise AdmissionError("invalid", f"the chat template did not place the images: {exc}",
                             param="messages") from None


def check_rendered(entry: PromptModel, text: str) -> None:
    """Refuse, from its length alone, a rendered chat that no tokenizing could fit in the
    context (see ``RENDER_CHARS_PER_TOKEN``): a template that wrote far more than it was
    given is not tokenized. Checked after ``check_floor``, whose refusal (the prompt's
    least number of tokens) says more where the tokenizer gives a floor."""
    context = entry.card.context_length
    most = context * max(RENDER_CHARS_PER_TOKEN, entry.bound.chars if entry.bound else 0)
    if len(text) > most:
        raise AdmissionError(
            "invalid",
            f"the chat template rendered these messages as {len(text)} characters, more than "
            f"this model's context of {context} tokens can hold ({most} at the most): "
            f"shorten them",
            param="messages", code="context_length_exceeded",
        )


# A chat ready for the scheduler: its tokens, how its answer is read, its grammar, its images.
Prepared = tuple[list[int], OutputSpec | None, Constraint | None, list[ImageInput]]


def prepare_chat_if_short(entry: PromptModel, render: RenderBound, messages: list[dict],
                          extra: dict | None, large: int, max_pixels: int,
                          tools: list[dict] | None, choice: ToolChoice,
                          fmt: OutputFormat | None, thinking_budget: int | None,
                          ) -> Prepared | RenderedChat:
    """The chat rendered for generation, refused if its floor of tokens cannot fit; prepared
    at once if it has at most ``large`` characters and no images (whose processing takes
    longer), else returned to wait its turn."""
    prompt = render_chat(entry, render, messages, tools, extra, True, max_pixels)
    check_floor(entry, prompt.text, "messages")
    check_rendered(entry, prompt.text)
    if len(prompt.text) > large or prompt.images:
        return prompt
    return prepare_chat(entry, prompt, tools, choice, fmt, thinking_budget)


def prepare_text(entry: PromptModel, prompt: str,
                 fmt: OutputFormat | None) -> tuple[list[int], Constraint | None]:
    """A completion prompt's tokens and its grammar, refused first if its floor of tokens
    cannot fit."""
    check_floor(entry, prompt, "prompt")
    return encode(entry, prompt, True), format_constraint(entry, fmt)


# -- fill in the middle: a completion between a prefix and a suffix ----------------------------


@dataclass(frozen=True)
class FimTokens:
    """A code model's fill-in-the-middle tokens, and their order: ``psm`` writes prefix,
    suffix, then the middle token the answer follows; ``spm`` (Codestral's) the suffix first,
    the answer following the prefix."""

    prefix: int
    suffix: int
    middle: int | None
    order: str


# The vocabularies' names for them: Qwen2.5-Coder, Qwen3-Coder and CodeGemma; StarCoder and
# StarCoder2; DeepSeek-Coder; Codestral.
FIM_STYLES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "psm"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "psm"),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "psm"),
    ("[PREFIX]", "[SUFFIX]", None, "spm"),
)


def fim_tokens_of(tokenizer: Any) -> FimTokens | None:
    """The first style of ``FIM_STYLES`` whose every token is one token of the vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        return None
    for prefix, suffix, middle, order in FIM_STYLES:
        names = (prefix, suffix) + ((middle,) if middle else ())
        if all(name in vocab for name in names):
            return FimTokens(prefix=vocab[prefix], suffix=vocab[suffix],
                             middle=vocab[middle] if middle else None, order=order)
    return None


def prepare_fim(entry: PromptModel, prefix: str, suffix: str,
                fmt: OutputFormat | None) -> tuple[list[int], Constraint | None]:
    """A fill-in-the-middle prompt's tokens (the prefix and the suffix each encoded alone,
    between the model's tokens, as llama.cpp's infill builds it) and its grammar."""
    fim = entry.fim
    if fim is None:
        raise AdmissionError("invalid", "this model has no fill-in-the-middle tokens, so it "
                             "cannot complete between a prompt and a suffix", param="suffix")
    check_floor(entry, prefix + suffix, "prompt")
    head = encode(entry, "", True)  # the tokenizer's own leading tokens (a BOS), if any
    before, after = encode(entry, prefix, False), encode(entry, suffix, False)
    if fim.order == "spm":
        tokens = [*head, fim.suffix, *after, fim.prefix, *before]
    else:
        tokens = [*head, fim.prefix, *before, fim.suffix, *after]
    if fim.middle is not None:
        tokens.append(fim.middle)
    return tokens, format_constraint(entry, fmt)


def encode(entry: PromptModel, text: str, special: bool) -> list[int]:
    """The text's tokens; a rendered chat carries its special tokens already (as
    ``apply_chat_template`` encodes it), a raw completion prompt gets the tokenizer's own."""
    return list(entry.tokenizer.encode(text, add_special_tokens=special))


def prepare_chat(entry: PromptModel, prompt: RenderedChat, tools: list[dict] | None,
                 choice: ToolChoice, fmt: OutputFormat | None, thinking_budget: int | None,
                 ) -> Prepared:
    """A rendered chat's tokens, how its answer is read, and its grammar (``tools``: the
    request's, also when the fallback wrote them into the prompt)."""
    images: list[ImageInput] = []
    if prompt.images:
        tokens, images = encode_with_images(entry, prompt)
        # The answer is read from the text after the images (their ids are no vocabulary's).
        text_ids = [entry.image_token if t < 0 else t for t in tokens]
    else:
        tokens = text_ids = encode(entry, prompt.text, False)
    tool_format = prompt.tool_format
    output = _output_spec(entry, text_ids, tools, tool_format, thinking_budget)
    # The reasoning before a constrained answer stays free text.
    think = {"think": output.think, "in_reasoning": output.in_reasoning} \
        if output is not None else {}
    if tools and choice.mode in ("required", "function"):
        constraint = _compile(
            entry, "tool_choice", lambda g: g.for_tools(tools, choice, tool_format, **think))
    else:
        constraint = format_constraint(entry, fmt, **think)
    return tokens, output, constraint, images


def _output_spec(entry: PromptModel, tokens: list[int], tools: list[dict] | None,
                 tool_format: str | None, thinking_budget: int | None) -> OutputSpec | None:
    """How the engine reads this answer; None when it is plain text (no parser runs).
    Harmony (gpt-oss) marks reasoning and the final text with the same markup as its
    calls, so its answers are always parsed."""
    if entry.tool_format == "harmony":
        tool_format = "harmony"
    elif not tools:
        tool_format = None
    if tool_format is None and entry.think is None:
        return None
    in_reasoning = False
    if entry.think is not None:
        tail = entry.tokenizer.decode(tokens[-16:])
        in_reasoning = prompt_opens_reasoning(tail, entry.think)
    return OutputSpec(tool_format=tool_format, tools=tools,
                      think=entry.think, in_reasoning=in_reasoning,
                      thinking_budget=thinking_budget)


def format_constraint(entry: PromptModel, fmt: OutputFormat | None,
                      **think: Any) -> Constraint | None:
    """The grammar a ``response_format`` asks for (None: plain text), compiled; ``think``: the
    reasoning before the answer, which stays free text."""
    if fmt is None or fmt.type == "text":
        return None
    return _compile(entry, "response_format", lambda g: g.for_format(fmt, **think))


def _compile(entry: PromptModel, param: str, build: Callable[[Grammars], Constraint]
             ) -> Constraint:
    """Compile a grammar in admission's pool, so that the scheduler never waits for one; a
    grammar that cannot be enforced is the client's 400, naming ``param`` (or the narrower
    field the error names: a tool's parameters)."""
    assert entry.grammars is not None
    try:
        return build(entry.grammars)
    except GrammarError as exc:
        raise AdmissionError("invalid", f"cannot enforce this {param}: {exc}",
                             param=exc.param or param) from exc


# -- embedding and rerank inputs ---------------------------------------------------------------


def embed_tokens(entry: PromptModel, texts: list[str], input_type: str | None,
                 limit: int | None) -> list[list[int]]:
    """Embedding inputs as token ids; queries get the model's query prompt before them. An
    encoder's input is cut here to ``limit`` (truncation asked for), its closing token kept."""
    prefix = read_embed_spec(entry.card.path).query_prefix if input_type == "query" else ""
    if is_encoder(entry.card.path):
        return [text_tokens(entry.tokenizer, prefix + text, limit) for text in texts]
    return [entry.tokenizer.encode(prefix + text) for text in texts]


def rerank_inputs(entry: PromptModel, query: str, documents: list[str],
                  instruction: str | None, limit: int | None) -> list[list[int]]:
    """Rerank inputs as token ids: a cross-encoder's (query, document) pairs (it takes no
    instruction), a decoder reranker's prompt format."""
    if is_encoder(entry.card.path):
        return [pair_tokens(entry.tokenizer, query, doc, limit) for doc in documents]
    return [rerank_tokens(entry.tokenizer, query, doc, instruction=instruction, limit=limit)
            for doc in documents]
