"""Grammar-constrained decoding: JSON Schema, regex, Lark and tool-call grammars as token masks.

Compiling is llguidance's (``LLMatcher``). ``Grammars`` (one per model) compiles a request's
constraint on the admission thread and never touches an ``mx.array``; the ``Constraint`` it
returns crosses to the MLX thread in ``AddRequest.constraint``, where ``Constraint.processor()``
makes the mlx-lm logits processor that masks every token the grammar does not allow.

Masks are applied with plain MLX ops, not ``llguidance.mlx``'s Metal kernel: one path, which
runs on the CPU backend (Linux) as on Metal.

``thinking_budget_processor`` (Anthropic's ``thinking.budget_tokens``) lives here too: the other
processor that forces tokens.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from troupe.actors.engine.custom_tools import LarkInput, nested_grammars, with_inputs
from troupe.actors.engine.finite_schema import unsatisfiable
from troupe.actors.messages import OutputFormat, ToolChoice
from troupe.actors.mlx_lm_private import hf_tokenizer

log = logging.getLogger("actors.engine.grammar")

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# JSON written as the answer (response_format): whitespace between tokens is free, as models
# pretty-print, but bounded, so a model cannot loop on blank lines until max_tokens.
ANSWER_JSON: dict[str, Any] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}
# JSON inside tool-call markup: exactly as chat templates render it (tojson: ", " and ": ").
CALL_JSON: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Between a closed reasoning block and the constrained answer (Qwen3 writes "</think>\n\n").
GAP = r"/[\x20\x0A\x0D\x09]{0,8}/"
# After the last of parallel calls: the newline models write after a call, before the end.
# Short: a small model goes on writing newlines until the grammar allows only the end.
TRAIL = r"/[\x20\x0A\x0D\x09]{0,2}/"
# Free reasoning text.
ANY_TEXT = r"/(.|\n)*/"
# What a qwen3_coder parameter's text must not be: mlx-lm's parser would cut it at a closing
# tag, and read "null" in any case as None.
NOT_IN_TEXT = r"~/(.|\n)*<\/parameter>(.|\n)*/ & ~/[nN][uU][lL][lL]/"

# The tool-call markups for_tools can constrain (names as OutputSpec.tool_format spells them).
TOOL_FORMATS = ("json_tools", "qwen3_coder", "mistral", "llama3_json")

# Compiled grammars kept per model: agents send the same tools (so the same grammar) every
# turn, and compiling a big one costs milliseconds where a copy costs a microsecond.
CACHE_SIZE = 64
# llguidance's errors can carry a dump of the parser state; a 400 needs the first lines.
MAX_ERROR = 600


class GrammarError(ValueError):
    """A grammar that cannot be enforced (llguidance cannot compile it: an unsupported keyword,
    a bad regex...; or no finite answer follows it): str(err) says why, for a 400. ``param``:
    the request field at fault, when narrower than the constraint's own."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# --- compiling (admission thread) -----------------------------------------------------------


class Grammars:
    """One model's grammar compiler, used on the admission thread (never touches mx.array).

    ``tokenizer``: the model's mlx-lm ``TokenizerWrapper``. ``vocab_size``: the model's logits
    width if known (it may exceed the tokenizer's; the extra ids are never allowed). The
    llguidance tokenizer is built on first use (about 0.5 s for a 49k vocabulary), then kept.
    Thread-safe, though meant for one thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None) -> None:
        self._wrapper = tokenizer
        self._hf = hf_tokenizer(tokenizer)
        self.vocab_size = vocab_size
        self.eos_ids: list[int] = sorted(int(t) for t in tokenizer.eos_token_ids)
        self._ll: LLTokenizer | None = None
        self._ll_error: str | None = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    @property
    def tokenizer_ready(self) -> bool:
        """Whether the llguidance tokenizer was built (lazily, on first use)."""
        return self._ll is not None

    def llg_tokenizer(self) -> LLTokenizer:
        """The llguidance view of the model's tokenizer, built once. Raises GrammarError when
        the tokenizer cannot be used (llguidance needs a fast Hugging Face tokenizer)."""
        with self._lock:
            if self._ll is None and self._ll_error is None:
                try:
                    n_vocab = len(self._hf)
                    if self.vocab_size is not None:
                        n_vocab = max(n_vocab, self.vocab_size)
                    self._ll = llguidance.hf.from_tokenizer(
                        self._hf, n_vocab=n_vocab, eos_token=self.eos_ids or None
                    )
                except Exception as e:  # kept: each request should not pay to fail again
                    self._ll_error = f"this model's tokenizer cannot constrain output: {e}"
            if self._ll is None:
                raise GrammarError(self._ll_error)
            return self._ll

    def for_format(
        self,
        fmt: OutputFormat,
        *,
        think: tuple[str, str] | None = None,
        in_reasoning: bool = False,
    ) -> Constraint | None:
        """The constraint of a ``response_format``: None for ``text``; ``json_object``: any
        JSON object; ``json_schema``: JSON valid against ``fmt.schema``; ``regex`` / ``lark``:
        ``fmt.pattern``. Raises GrammarError when it cannot be compiled.

        ``think`` (the model's reasoning tags) and ``in_reasoning`` (the prompt ends inside an
        open tag), as in ``OutputSpec``: the reasoning stays free and the constraint starts
        after its closing tag. Without ``think`` the constraint starts at the first token.

        A schema no finite JSON value satisfies (``unsatisfiable``) raises GrammarError: its
        grammar could never end. A regex or Lark grammar gets no such check; one that cannot
        end fails its request when decoding reaches the dead end (``GrammarProcessor``)."""
        if fmt.type == "text":
            return None
        if fmt.type in ("json_object", "json_schema"):
            schema = {"type": "object"} if fmt.type == "json_object" else fmt.schema
            if not isinstance(schema, dict):
                raise GrammarError("response_format json_schema needs a schema object")
            body = LLMatcher.grammar_from_json_schema(schema, overrides=ANSWER_JSON)
        elif fmt.type in ("regex", "lark"):
            if not fmt.pattern:
                raise GrammarError(f"response_format {fmt.type} needs a pattern")
            if fmt.type == "regex":
                body = LLMatcher.grammar_from_regex(fmt.pattern)
            else:
                body = json.dumps({"grammars": [{"lark_grammar": fmt.pattern}]})
        else:
            raise GrammarError(f"unknown response_format type {fmt.type!r}")
        reasoning = self._reasoning(think, in_reasoning)
        if reasoning is None:
            constraint = self.compile(body)
        else:
            # The answer's grammar is nested whole (a Lark grammar keeps its own start rule).
            answer = {**json.loads(body)["grammars"][0], "name": "answer"}
            prefix, rules = reasoning
            top = "\n".join([f"start: {prefix} @answer", *rules])
            constraint = self.compile(json.dumps({"grammars": [{"lark_grammar": top}, answer]}))
        # After compiling: llguidance's own refusals say more of what they find.
        _check_finite(fmt.schema if fmt.type == "json_schema" else None)
        return constraint

    def for_tools(
        self,
        tools: list[dict],
        choice: ToolChoice,
        tool_format: str | None,
        *,
        think: tuple[str, str] | None = None,
        in_reasoning: bool = False,
    ) -> Constraint:
        """The constraint of ``tool_choice`` ``required`` (calls of any of ``tools``) or
        ``function`` (calls of the tool ``choice.name``): the answer is tool calls in the
        model's own markup (``tool_format``, one of TOOL_FORMATS; None means troupe's
        fallback, ``json_tools``), each call's arguments valid against its tool's
        ``parameters`` (a freeform tool's ``input`` following its grammar in
        ``choice.input_formats``; an object schema that declares ``properties`` and says
        nothing of other keys takes no other key: ``_closed``); exactly one call unless
        ``choice.parallel``, and then the answer may end after any complete call. ``think`` /
        ``in_reasoning``: as in ``for_format``. Raises GrammarError (a 400) when the calls
        cannot be constrained (among them the calls of a tool whose parameters no finite JSON
        value satisfies: the error's ``param`` names the tool), ValueError for a mode that
        constrains nothing."""
        if choice.mode not in ("required", "function"):
            raise ValueError(f"tool_choice {choice.mode!r} does not constrain the answer")
        fmt = tool_format or "json_tools"
        if fmt not in TOOL_FORMATS:
            raise GrammarError(
                f"tool_choice {choice.mode!r} cannot be enforced for this model: its tool-call "
                f"format {fmt!r} cannot be constrained (only {', '.join(TOOL_FORMATS)})"
            )
        # (index in ``tools``, (name, parameters)) of the tools a call may name
        declared = [(i, f) for i, f in enumerate(map(_function, tools)) if f is not None]
        if choice.mode == "function":
            declared = [(i, f) for i, f in declared if f[0] == choice.name]
            if not declared:
                raise GrammarError(f"tool_choice names {choice.name!r}, which is not a tool")
        if not declared:
            raise GrammarError("tool_choice requires a tool call, but no function tool is given")
        funcs = with_inputs([(name, _closed(params)) for _, (name, params) in declared],
                            choice.input_formats)
        rules = getattr(self, f"_{fmt}")(funcs, choice.parallel)  # they define "calls"
        start = "start: calls"
        reasoning = self._reasoning(think, in_reasoning)
        if reasoning is not None:
            start = f"start: {reasoning[0]} calls"
            rules += reasoning[1]
        top = "\n".join([start, *rules])
        # A freeform tool's Lark input is a grammar of its own, which its call's items name.
        nested = nested_grammars(funcs, raw=fmt == "qwen3_coder")
        if nested:
            constraint = self.compile(json.dumps({"grammars": [{"lark_grammar": top}, *nested]}))
        else:
            constraint = self.compile(LLMatcher.grammar_from_lark(top))
        # A tool no call of which can end is refused, though others could be called: the
        # model may start that call.
        for i, (name, params) in declared:
            _check_finite(params, param=f"tools[{i}].function.parameters",
                          where=f"the parameters of tool {name!r}: ")
        return constraint

    # -- the tool-call markups -------------------------------------------------------------

    def _json_tools(self, funcs: list[tuple[str, dict]], parallel: bool) -> list[str]:
        # <tool_call>\n{"name": "NAME", "arguments": {...}}\n</tool_call>, several joined by
        # "\n" (as Qwen2.5's template writes them)
        open_, close = self._marker("<tool_call>"), self._marker("</tool_call>")
        return [_calls("\n", parallel),
                *_json_calls(funcs, "arguments", f'{open_} "\\n"', f'"\\n" {close}')]

    def _llama3_json(self, funcs: list[tuple[str, dict]], parallel: bool) -> list[str]:
        # {"name": "NAME", "parameters": {...}}, several joined by "; " (as vLLM reads them)
        return [_calls("; ", parallel), *_json_calls(funcs, "parameters", "", "")]

    def _mistral(self, funcs: list[tuple[str, dict]], parallel: bool) -> list[str]:
        open_ = self._marker("[TOOL_CALLS]")
        args = self._marker("[ARGS]")
        if open_.startswith("<[") and not args.startswith("<["):
            # [TOOL_CALLS] but no [ARGS] token (Mistral 7B v0.3, Nemo): the older JSON list,
            # [TOOL_CALLS][{"name": "NAME", "arguments": {...}}, ...]
            return [_calls(", ", parallel, f'{open_} "["', '"]"'),
                    *_json_calls(funcs, "arguments", "", "")]
        # [TOOL_CALLS]NAME[ARGS]{...}, each call with its own [TOOL_CALLS]
        rules = [_calls("", parallel), f"call: {open_} ({_alternatives(funcs)})"]
        rules += [f"tool{i}: {_lit(n)} {args} {_arguments(p)}" for i, (n, p) in enumerate(funcs)]
        return rules

    def _qwen3_coder(self, funcs: list[tuple[str, dict]], parallel: bool) -> list[str]:
        # <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n
        # </tool_call>, where VALUE is raw text for a string and JSON otherwise, as
        # mlx_lm.tool_parsers.qwen3_coder reads it; several joined by "\n"
        open_, close = self._marker("<tool_call>"), self._marker("</tool_call>")
        rules = [
            _calls("\n", parallel),
            f'call: {open_} "\\n" ({_alternatives(funcs)}) "</function>\\n" {close}',
            # Text the parser would neither cut short nor read as null.
            f"TEXT: /(.|\\n)*/ & {NOT_IN_TEXT}",
            r'text[suffix="\n</parameter>\n"]: TEXT',
            r"PARAM_NAME: /[^\s<>]+/",
        ]
        for i, (name, params) in enumerate(funcs):
            rules += _qwen3_tool(i, name, params)
        return rules

    # -- building blocks -------------------------------------------------------------------

    def _marker(self, text: str) -> str:
        """``text`` as a grammar item: a reference to its token where the vocabulary has it as
        one special token (llguidance matches those by id only), else a string literal."""
        added = self._hf.get_added_vocab() if hasattr(self._hf, "get_added_vocab") else {}
        ids = [added[text]] if text in added else self._hf.encode(text, add_special_tokens=False)
        if len(ids) == 1 and self.llg_tokenizer().is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return _lit(text)

    def _reasoning(
        self, think: tuple[str, str] | None, in_reasoning: bool
    ) -> tuple[str, list[str]] | None:
        """The Lark items (and the rules they need) of free reasoning before the constrained
        answer: optional unless the prompt opened it. None without reasoning tags."""
        if think is None:
            return None
        start, end = self._marker(think[0]), self._marker(think[1])
        if end.startswith("<["):
            # A special closing token cannot occur in text: free text, then the token.
            body, rules = f"{ANY_TEXT} {end} {GAP}", []
        else:
            # A spelled closing tag: the reasoning ends at its first occurrence.
            body, rules = f"reasoning {GAP}", [f"reasoning[suffix={end}]: {ANY_TEXT}"]
        return (body if in_reasoning else f"({start} {body})?"), rules

    def compile(self, grammar: str) -> Constraint:
        """A Constraint for ``grammar`` (llguidance's JSON form or Lark), compiled once per
        distinct grammar. Raises GrammarError with llguidance's message."""
        tok = self.llg_tokenizer()
        with self._lock:
            matcher = self._compiled.get(grammar)
            if matcher is not None:
                self._compiled.move_to_end(grammar)
        if matcher is None:
            # Compiling drops the GIL (up to hundreds of ms for huge schemas).
            matcher = LLMatcher(tok, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(_short(matcher.get_error()))
            with self._lock:
                self._compiled[grammar] = matcher
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return Constraint(matcher, tok.vocab_size, self.eos_ids, grammar)


def _lit(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _short(message: str) -> str:
    return message if len(message) <= MAX_ERROR else message[:MAX_ERROR] + "..."


def _check_finite(schema: Any, *, param: str | None = None, where: str = "") -> None:
    """Raise GrammarError when no finite JSON value satisfies ``schema`` (None: no schema):
    its grammar would never let an answer end."""
    why = unsatisfiable(schema) if schema is not None else None
    if why is not None:
        raise GrammarError(_short(f"{where}no finite JSON value satisfies this schema: {why}"),
                           param=param)


def _json(schema: dict) -> str:
    """A JSON Schema as an inline Lark item, written as tool-call JSON is (CALL_JSON)."""
    return "%json " + json.dumps({**schema, "x-guidance": CALL_JSON}, ensure_ascii=False)


def _calls(sep: str, parallel: bool, before: str = "", after: str = "") -> str:
    """The rule ``calls``: one ``call``, or with ``parallel`` one or more joined by ``sep``,
    between the Lark items ``before`` and ``after``. Parallel calls may end after any call,
    with the whitespace models write after one (most write a newline, the start of ``sep``
    in some formats: without it a model that did was forced into another call)."""
    if not parallel:
        return f"calls: {before} call {after}"
    body = f"call ({_lit(sep)} call)*" if sep else "call+"
    return f"calls: {before} {body} {after} {TRAIL}"


def _arguments(params: dict | LarkInput) -> str:
    """A call's arguments object as a Lark item: JSON valid against ``params``, or the
    object holding a freeform tool's input."""
    return params.json_item() if isinstance(params, LarkInput) else _json(params)


def _alternatives(funcs: list[tuple[str, dict]]) -> str:
    return " | ".join(f"tool{i}" for i in range(len(funcs)))


def _function(tool: dict) -> tuple[str, dict] | None:
    """(name, parameters schema) of an OpenAI-shaped function tool; None for other tools.
    A function without parameters takes none: its arguments are ``{}``."""
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    fn = tool.get("function", tool)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        return None
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    return name, params


# Keywords that let an object schema take keys its ``properties`` do not declare.
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# Keywords that add to an object's declared keys from elsewhere: closing the object, or the
# branches, would refuse the keys the other part declares.
COMBINED_KEYS = ("allOf", "anyOf", "oneOf", "$ref")


def _closed(schema: Any) -> Any:
    """A copy of a tool's ``parameters`` schema in which every object schema that declares
    ``properties`` and says nothing of other keys (``OPEN_KEYS``) takes no other key: a tool
    wants the keys it declares, and a model would otherwise invent some. Nested schemas too
    (``properties``, ``items``, ``prefixItems``, ``additionalProperties``, ``$defs`` /
    ``definitions``, ``anyOf`` / ``oneOf`` branches); never under ``allOf`` (nor a definition
    an ``allOf`` refers to), whose branches each declare part of one object, nor an object
    whose ``properties`` a combinator beside them completes."""
    return _close(schema, frozenset(_refs(schema, False)))


def _close(schema: Any, open_defs: frozenset[str], *, here: str = "") -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _close(s, open_defs, here=f"#/{key}/{name}")
                        for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: _close(s, open_defs) for name, s in out["properties"].items()}
    for key in ("items", "prefixItems", "additionalProperties"):
        if isinstance(out.get(key), list):
            out[key] = [_close(s, open_defs) for s in out[key]]
        elif isinstance(out.get(key), dict):
            out[key] = _close(out[key], open_defs)
    if "properties" in out and any(k in out for k in COMBINED_KEYS):
        return out
    for key in ("anyOf", "oneOf"):
        if isinstance(out.get(key), list):
            out[key] = [_close(s, open_defs) for s in out[key]]
    if (isinstance(out.get("properties"), dict) and here not in open_defs
            and not any(k in out for k in OPEN_KEYS)):
        out["additionalProperties"] = False
    return out


def _refs(schema: Any, in_all_of: bool) -> list[str]:
    """The ``$ref``s found under an ``allOf`` of ``schema`` (with ``in_all_of``: all of them)."""
    found: list[str] = []
    if isinstance(schema, dict):
        if in_all_of and isinstance(schema.get("$ref"), str):
            found.append(schema["$ref"])
        for key, value in schema.items():
            found += _refs(value, in_all_of or key == "allOf")
    elif isinstance(schema, list):
        for value in schema:
            found += _refs(value, in_all_of)
    return found


def _json_calls(funcs: list[tuple[str, dict]], key: str, before: str, after: str) -> list[str]:
    """Calls written as ``{"name": "NAME", "KEY": {...}}`` between ``before`` and ``after``.
    One rule per tool, told apart by the name's literal before any JSON starts (llguidance
    cannot choose between two nested JSON grammars that start alike), each with its own
    ``%json`` so that the parameters' ``$ref``s resolve against their own root."""
    rules = [f"call: {before} ({_alternatives(funcs)}) {after}"]
    for i, (name, params) in enumerate(funcs):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{key}": '
        rules.append(f'tool{i}: {_lit(head)} {_arguments(params)} "}}"')
    return rules


def _qwen3_tool(i: int, name: str, params: dict | LarkInput) -> list[str]:
    """Rules of one tool's call in the qwen3_coder markup: its declared parameters in their
    order (the required ones always, the others optional); a schema that declares none takes
    any parameter names, as text."""
    if isinstance(params, LarkInput):
        head = _lit(f"<function={name}>\n")
        return [f"tool{i}: {head} {params.qwen3_item()}"]
    props = params.get("properties")
    required = set(params.get("required") or [])
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    items, rules = [], []
    if isinstance(props, dict) and props:
        for j, (pname, pschema) in enumerate(props.items()):
            rule = f"tool{i}_{j}"
            head = _lit(f"<parameter={pname}>" + "\n")
            value, extra = _qwen3_value(f"T{i}_{j}", pschema, defs, params)
            rules += [f"{rule}: {head} {value}", *extra]
            items.append(rule if pname in required else f"{rule}?")
    elif params.get("additionalProperties", True) is not False:
        rules.append(f'tool{i}_any: "<parameter=" PARAM_NAME ">\\n" text')
        items.append(f"tool{i}_any*")
    head = _lit(f"<function={name}>" + "\n")
    rules.insert(0, f"tool{i}: {head} {' '.join(items)}".rstrip())
    return rules


def _qwen3_value(
    terminal: str, schema: Any, defs: dict, root: dict
) -> tuple[str, list[str]]:
    """One qwen3_coder parameter's value and the line after it, as Lark items and the rules
    they need: raw text for a string (its enum, pattern and length kept), JSON for the rest."""
    end = r'"\n</parameter>\n"'
    resolved = _resolve(schema, root)
    if not isinstance(resolved, dict):
        return f"{_json({})} {end}", []
    choices = resolved.get("enum", [resolved["const"]] if "const" in resolved else None)
    if choices and all(isinstance(c, str) for c in choices):
        alts = " | ".join(_lit(c) for c in choices)
        return terminal.lower(), [f"{terminal.lower()}: ({alts}) {end}"]
    if resolved.get("type") == "string":
        # Raw text (a "format" is not enforced: a JSON string would keep its quotes).
        lo, hi = resolved.get("minLength"), resolved.get("maxLength")
        if "pattern" in resolved:
            regex = "/" + llguidance.regex_to_lark(resolved["pattern"], "dw") + "/"
        elif lo is not None or hi is not None:
            regex = f"/(.|\\n){{{int(lo or 0)},{'' if hi is None else int(hi)}}}/"
        else:
            return "text", []
        rule = terminal.lower()
        return rule, [
            f"{terminal}: {regex} & {NOT_IN_TEXT}",
            f'{rule}[suffix="\\n</parameter>\\n"]: {terminal}',
        ]
    return f"{_json({**schema, **defs} if defs else schema)} {end}", []


def _resolve(schema: Any, root: dict) -> Any:
    """A local ``$ref`` (``#/$defs/X`` or ``#/definitions/X``) followed, to see a type."""
    seen = 0
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 8:
        path = schema["$ref"]
        if not path.startswith("#/"):
            return schema
        node: Any = root
        for part in path[2:].split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return schema
        schema, seen = node, seen + 1
    return schema


# --- masking (MLX thread) -------------------------------------------------------------------


class Constraint:
    """One request's compiled grammar: made in admission, then used only on the MLX thread."""

    def __init__(self, matcher: LLMatcher, n_vocab: int, eos_ids: Sequence[int],
                 grammar: str) -> None:
        self._matcher = matcher  # pristine (shared with the compile cache): only copied
        self.n_vocab = n_vocab
        self.eos_ids = list(eos_ids)
        self.grammar = grammar  # its source: what another rank compiles for the same mask

    def processor(self) -> GrammarProcessor:
        """An mlx-lm logits processor for one sequence (each call makes a fresh one): every
        token the grammar does not allow gets -inf."""
        return GrammarProcessor(self._matcher.deep_copy(), self.n_vocab, self.eos_ids)


class GrammarProcessor:
    """The logits processor of one constrained sequence (see ``Constraint.processor``).

    mlx-lm calls it as ``processor(context, logits)`` each step: ``context`` holds the prompt,
    then every token generated so far; the first call's length is the prompt's. Each later call
    feeds the matcher only the new tail (one token, normally).

    When the grammar cannot go on, it allows only EOS from then on, and says why in ``error``
    and where in ``error_at`` (the index, among the generated tokens, of the first one the
    grammar did not give), for the engine to end the request there with that error: at a dead
    end (the grammar allows no token and is not complete: a rule that derives no finite text),
    or after a token the grammar refused that another processor forced."""

    def __init__(self, matcher: LLMatcher, n_vocab: int, eos_ids: list[int]) -> None:
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.eos_ids = eos_ids
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, n_vocab)
        self.seen: int | None = None
        self.prompt_len = 0
        self.error: str | None = None
        self.error_at: int | None = None
        self.detail = ""  # llguidance's own word on the failure, for the log

    @property
    def failed(self) -> bool:
        """Whether the grammar cannot go on (``error`` says why)."""
        return self.error is not None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        n = context.shape[-1]
        if self.seen is None:
            self.seen = self.prompt_len = n
        elif n > self.seen:
            at, new = self.seen, context[self.seen :].tolist()
            self.seen = n
            # One by one: consume_tokens refuses the EOS of a finished grammar that
            # consume_token takes.
            for i, token in enumerate(new):
                if self.error is None and not self.matcher.consume_token(token):
                    self._fail(at + i, f"refused token {token}, forced by another processor")
                    break
        if self.error is None:
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
            # A complete grammar allows EOS (alone once it takes nothing more, even after an
            # EOS with ignore_eos); one that is not complete and allows nothing is stuck.
            if self.matcher.is_stopped() and not self.matcher.is_accepting():
                self._fail(n, "reached a dead end: it allows no next token, and the text so far "
                              "does not complete it (a rule that derives no finite text does "
                              "this)")
        if self.error is not None:
            return _only(logits, self.eos_ids)
        return _apply(logits, self.bitmask[0])

    def _fail(self, position: int, what: str) -> None:
        """The grammar cannot take the token at ``position`` of the context."""
        self.error_at = position - self.prompt_len
        self.error = (f"the grammar of this request's response_format or enforced tool call "
                      f"{what} (after {self.error_at} generated tokens)")
        self.detail = self.matcher.get_error().split("\n", 1)[0]


def _apply(logits: mx.array, words: np.ndarray) -> mx.array:
    """``logits`` (shape [..., width]) with -inf where the bitmask ``words`` (32 tokens a word,
    llguidance's layout) has no bit; ids past the bitmask are disallowed."""
    # count= cuts the bits to the logits' width, or pads them with zeros (disallowed).
    bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=logits.shape[-1])
    return mx.where(mx.array(bits.view(np.bool_)), logits, -mx.inf)


def _only(logits: mx.array, ids: Sequence[int]) -> mx.array:
    """``logits`` with every id but ``ids`` set to -inf."""
    allowed = np.zeros(logits.shape[-1], dtype=np.bool_)
    allowed[[i for i in ids if 0 <= i < allowed.shape[0]]] = True
    return mx.where(mx.array(allowed), logits, -mx.inf)


# --- the thinking budget --------------------------------------------------------------------


def thinking_budget_processor(
    budget: int,
    end_tokens: list[int],
    *,
    start_tokens: list[int] | None,
    starts_inside: bool,
) -> LogitsProcessor:
    """An mlx-lm logits processor that caps the reasoning at ``budget`` tokens (Anthropic's
    ``thinking.budget_tokens``).

    It counts the generated tokens inside the reasoning (from the first token if
    ``starts_inside``, the prompt having opened it; else from after ``start_tokens`` appear
    in the generated tokens). Once ``budget`` are spent and ``end_tokens`` have not appeared,
    it forces ``end_tokens`` one by one (after any of their first tokens the model already
    wrote), then leaves the sequence alone for good."""
    return ThinkingBudget(budget, end_tokens, start_tokens, starts_inside)


class ThinkingBudget:
    """The state of ``thinking_budget_processor``'s processor."""

    def __init__(self, budget: int, end_tokens: list[int], start_tokens: list[int] | None,
                 starts_inside: bool) -> None:
        if not end_tokens:
            raise ValueError("a thinking budget needs the closing tag's tokens")
        self.budget = max(0, int(budget))
        self.end = list(end_tokens)
        self.start = list(start_tokens or [])
        self.inside = starts_inside
        self.done = not starts_inside and not self.start  # no way in: nothing to do
        self.spent = 0
        self.forced: int | None = None  # how many end tokens are written while forcing
        self.tail: list[int] = []  # the last generated tokens, to match the tags
        self.seen: int | None = None

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        n = context.shape[-1]
        if self.seen is None:
            self.seen = n
        elif n > self.seen and not self.done:
            for token in context[self.seen :].tolist():
                self._take(token)
        self.seen = n
        if self.done or not self.inside or self.spent < self.budget:
            return logits
        if self.forced is None:
            # Forcing starts after the longest head of the end tag the model already wrote.
            self.forced = next(
                (k for k in range(min(len(self.end), len(self.tail)), 0, -1)
                 if self.tail[-k:] == self.end[:k]), 0)
        return _only(logits, [self.end[self.forced]])

    def _take(self, token: int) -> None:
        if self.done:
            return
        keep = max(len(self.start), len(self.end))
        self.tail = (self.tail + [token])[-keep:]
        if not self.inside:
            if self.tail[-len(self.start):] == self.start:
                self.inside, self.tail = True, []
            return
        if self.forced is not None:
            if token == self.end[self.forced]:
                self.forced += 1
                self.done = self.forced == len(self.end)
            else:
                self.forced = None  # overruled (another processor): take up from what is there
            return
        self.spent += 1
        if self.tail[-len(self.end):] == self.end:
            self.done = True  # the model closed its reasoning itself
