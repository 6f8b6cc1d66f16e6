"""Grammar-constrained decoding (actors/engine/grammar.py): masks from llguidance, driven as
mlx-lm does.

Most tests drive a Constraint's processor by hand with random logits through a greedy loop on
the default model's real tokenizer: whatever the "model" prefers, the text must follow the
grammar. The engine-level test runs the tiny random model in the batch generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import pytest
from engine_helpers import engine_config
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import json_tools, mistral, qwen3_coder
from reference import PROMPTS, reference_tokens

from troupe.actors.engine.grammar import (
    Constraint,
    GrammarError,
    Grammars,
    thinking_budget_processor,
)
from troupe.actors.engine.runner import Runner
from troupe.actors.messages import OutputFormat, ToolChoice

PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
                "hourly": {"type": "boolean"},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "at": {"$ref": "#/$defs/moment"},
            },
            "required": ["zone", "at"],
            "additionalProperties": False,
            "$defs": {
                "moment": {
                    "type": "object",
                    "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}},
                    "required": ["h"],
                    "additionalProperties": False,
                }
            },
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FORMATS = ["json_tools", "qwen3_coder", "mistral", "llama3_json"]
PROMPT = [1, 2, 3]


def drive(tok, processors, *, seed: int, max_steps: int = 400) -> tuple[list[int], bool]:
    """Greedy decoding over random logits through ``processors``, fed the way mlx-lm's
    GenerationBatch feeds them (the prompt, then each token generated). Returns the tokens
    before EOS and whether EOS came."""
    mx.random.seed(seed)
    width = len(tok._tokenizer)
    context, out = list(PROMPT), []
    for _ in range(max_steps):
        logits = mx.random.normal((1, width))
        ctx = mx.array(context, dtype=mx.int32)
        for p in processors:
            logits = p(ctx, logits)
        token = int(mx.argmax(logits, axis=-1).item())
        if token in tok.eos_token_ids:
            return out, True
        out.append(token)
        context.append(token)
    return out, False


def generate(tok, constraint: Constraint, seed: int) -> str:
    out, ended = drive(tok, [constraint.processor()], seed=seed)
    assert ended, "the grammar never let EOS through"
    return tok.decode(out)


def accepts(tok, constraint: Constraint, text: str) -> bool:
    """Whether the grammar takes ``text`` (tokenized as the model would) and then EOS."""
    proc = constraint.processor()
    context = list(PROMPT)
    width = len(tok._tokenizer)
    proc(mx.array(context), mx.zeros((1, width)))
    for token in tok._tokenizer.encode(text, add_special_tokens=False):
        context.append(token)
        logits = proc(mx.array(context), mx.zeros((1, width)))
        if proc.failed:
            return False
    eos = next(iter(tok.eos_token_ids))
    return logits[0, eos].item() == 0


def calls_in(fmt: str, text: str) -> list[dict]:
    """The tool calls of ``text``, read by mlx-lm's parser for ``fmt`` (llama3_json has none in
    mlx-lm: its calls are JSON objects joined by "; ", as vLLM reads them). Parallel calls may
    end in whitespace."""
    text = text.rstrip()
    if fmt in ("json_tools", "qwen3_coder"):
        parser = json_tools if fmt == "json_tools" else qwen3_coder
        parts = text.split(parser.tool_call_start)
        assert parts[0] == "", f"text before the first call: {parts[0]!r}"
        calls = []
        for part in parts[1:]:
            body, end, rest = part.partition(parser.tool_call_end)
            assert end and rest in ("", "\n"), part
            calls.append(parser.parse_tool_call(body, TOOLS))
        return calls
    if fmt == "mistral":
        assert text.startswith(mistral.tool_call_start)
        parsed = mistral.parse_tool_call(text[len(mistral.tool_call_start):], TOOLS)
        return parsed if isinstance(parsed, list) else [parsed]
    calls, pos, decoder = [], 0, json.JSONDecoder()
    while pos < len(text):
        call, pos = decoder.raw_decode(text, pos)
        calls.append({"name": call["name"], "arguments": call["parameters"]})
        if pos < len(text):
            assert text[pos : pos + 2] == "; "
            pos += 2
    return calls


def check_calls(calls: list[dict]) -> None:
    for call in calls:
        jsonschema.validate(call["arguments"], SCHEMAS[call["name"]])


# --- response formats ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates_against_nested_schema(tokenizer, grammars, seed):
    text = generate(tokenizer, grammars.for_format(OutputFormat(type="json_schema",
                                                                schema=PET)), seed)
    jsonschema.validate(json.loads(text), PET)


def test_json_object_output_is_one_json_object(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="json_object"))
    assert accepts(tokenizer, constraint, '{"a": [1, 2]}')
    assert not accepts(tokenizer, constraint, "[1, 2]")
    assert not accepts(tokenizer, constraint, '{"a": 1} and more')


def test_regex_and_lark_outputs_match_their_patterns(tokenizer, grammars):
    regex = grammars.for_format(OutputFormat(type="regex", pattern=r"(yes|no), [0-9]{2}"))
    text = generate(tokenizer, regex, seed=0)
    assert text.startswith(("yes, ", "no, ")) and text[-2:].isdigit() and len(text) in (6, 7)
    lark = grammars.for_format(OutputFormat(type="lark", pattern='start: "x" /[ab]{3}/ "y"'))
    text = generate(tokenizer, lark, seed=1)
    assert len(text) == 5 and text[0] == "x" and set(text[1:4]) <= {"a", "b"} and text[4] == "y"


def test_text_format_is_unconstrained(grammars):
    assert grammars.for_format(OutputFormat(type="text")) is None


def test_after_a_complete_value_only_eos_is_allowed(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="regex", pattern="ok"))
    proc = constraint.processor()
    width = len(tokenizer._tokenizer)
    proc(mx.array(PROMPT), mx.zeros((1, width)))
    ok = tokenizer._tokenizer.encode("ok", add_special_tokens=False)
    eos = sorted(tokenizer.eos_token_ids)
    for tail in ([], eos[:1]):  # and after an EOS was taken (ignore_eos): never an empty mask
        logits = proc(mx.array(PROMPT + ok + tail), mx.zeros((1, width)))
        allowed = mx.logical_not(mx.isinf(logits[0])).tolist()
        assert [i for i, a in enumerate(allowed) if a] == eos
    assert not proc.failed


def test_masked_logits_keep_dtype_and_disallow_ids_past_the_vocabulary(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="regex", pattern="[a-z]+"))
    proc = constraint.processor()
    width = len(tokenizer._tokenizer) + 64  # a model whose logits are wider than its tokenizer
    logits = proc(mx.array(PROMPT), mx.ones((1, width), dtype=mx.bfloat16))
    assert logits.dtype == mx.bfloat16 and logits.shape == (1, width)
    assert mx.all(mx.isinf(logits[0, -64:])).item()
    assert 0 < mx.sum(~mx.isinf(logits)).item() < width - 64


def test_a_forced_token_the_grammar_refuses_leaves_only_eos(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="regex", pattern="[0-9]+"))
    proc = constraint.processor()
    width = len(tokenizer._tokenizer)
    proc(mx.array(PROMPT), mx.zeros((1, width)))
    digit = tokenizer._tokenizer.encode("7", add_special_tokens=False)
    letter = tokenizer._tokenizer.encode("x", add_special_tokens=False)
    logits = proc(mx.array(PROMPT + digit + letter), mx.zeros((1, width)))
    assert proc.failed and "refused token" in proc.error
    assert proc.error_at == len(digit)  # the refused token's place in the answer
    finite = [i for i, f in enumerate(mx.logical_not(mx.isinf(logits[0])).tolist()) if f]
    assert finite == sorted(tokenizer.eos_token_ids)


# A grammar that lets an answer begin "ab", then allows nothing: its rule x derives no finite
# text (each x needs another x before anything).
DEAD_END = 'start: "ab" x\nx: x "c"'


def test_a_dead_end_fails_the_grammar_at_the_token_it_cannot_give(tokenizer, grammars):
    """Random logits walk the only way the grammar allows, into the dead end: only EOS is
    left, and the processor says the grammar cannot give the token after "ab"."""
    proc = grammars.for_format(OutputFormat(type="lark", pattern=DEAD_END)).processor()
    out, ended = drive(tokenizer, [proc], seed=0)
    assert ended and tokenizer.decode(out) == "ab"
    assert proc.failed and "dead end" in proc.error
    assert proc.error_at == len(out)


def test_processors_of_one_constraint_keep_separate_state(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="regex", pattern="(ab|cd)"))
    first, second = constraint.processor(), constraint.processor()
    width = len(tokenizer._tokenizer)
    for p in (first, second):
        p(mx.array(PROMPT), mx.zeros((1, width)))
    a = tokenizer._tokenizer.encode("a", add_special_tokens=False)
    c = tokenizer._tokenizer.encode("c", add_special_tokens=False)
    first(mx.array(PROMPT + a), mx.zeros((1, width)))
    second(mx.array(PROMPT + c), mx.zeros((1, width)))
    assert not first.failed and not second.failed


def test_unsupported_schema_keyword_raises_grammar_error_naming_it(grammars):
    schema = {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}
    with pytest.raises(GrammarError, match="dependentSchemas"):
        grammars.for_format(OutputFormat(type="json_schema", schema=schema))


def test_bad_regex_raises_grammar_error_saying_why(grammars):
    with pytest.raises(GrammarError, match="unclosed group"):
        grammars.for_format(OutputFormat(type="regex", pattern="a(b"))
    with pytest.raises(GrammarError, match="unclosed character class"):
        schema = {"type": "string", "pattern": "[a-"}
        grammars.for_format(OutputFormat(type="json_schema", schema=schema))


def test_the_tokenizer_is_built_on_first_use_and_kept(tokenizer):
    g = Grammars(tokenizer)
    assert not g.tokenizer_ready
    g.for_format(OutputFormat(type="json_object"))
    assert g.tokenizer_ready
    first = g.llg_tokenizer()
    g.for_format(OutputFormat(type="json_object"))
    assert g.llg_tokenizer() is first and len(g._compiled) == 1  # compiled once as well


# --- tool calls ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_tool_call_parses_with_the_formats_parser_and_validates(
    tokenizer, grammars, fmt
):
    constraint = grammars.for_tools(TOOLS, ToolChoice(mode="required", parallel=False), fmt)
    names = set()
    for seed in range(4):
        calls = calls_in(fmt, generate(tokenizer, constraint, seed))
        assert len(calls) == 1
        check_calls(calls)
        names.add(calls[0]["name"])
    assert names <= set(SCHEMAS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_function_choice_calls_the_named_tool(tokenizer, grammars, fmt):
    constraint = grammars.for_tools(TOOLS, ToolChoice(mode="function", name="get_time"), fmt)
    for seed in range(3):
        calls = calls_in(fmt, generate(tokenizer, constraint, seed))
        assert calls and {c["name"] for c in calls} == {"get_time"}
        check_calls(calls)


FIRST_CALL = {
    "json_tools": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", "at": {"h": 1}}}'
    "\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
    '<parameter=at>\n{"h": 1}\n</parameter>\n</function>\n</tool_call>',
    "mistral": '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC", "at": {"h": 1}}',
    "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC", "at": {"h": 1}}}',
}
SECOND_CALL = {
    "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"unit": "celsius"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>"
    "\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}',
}
BETWEEN_CALLS = {"json_tools": "\n", "qwen3_coder": "\n", "mistral": "", "llama3_json": "; "}


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_allows_several_calls_and_not_parallel_exactly_one(tokenizer, grammars, fmt):
    two = FIRST_CALL[fmt] + BETWEEN_CALLS[fmt] + SECOND_CALL[fmt]
    calls = calls_in(fmt, two)
    assert [c["name"] for c in calls] == ["get_time", "get_weather"]
    check_calls(calls)
    parallel = grammars.for_tools(TOOLS, ToolChoice(mode="required"), fmt)
    single = grammars.for_tools(TOOLS, ToolChoice(mode="required", parallel=False), fmt)
    assert accepts(tokenizer, parallel, two)
    assert accepts(tokenizer, single, FIRST_CALL[fmt])
    assert not accepts(tokenizer, single, two)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parallel_calls_may_end_after_any_call_and_the_whitespace_after_it(
    tokenizer, grammars, fmt
):
    parallel = grammars.for_tools(TOOLS, ToolChoice(mode="required"), fmt)
    single = grammars.for_tools(TOOLS, ToolChoice(mode="required", parallel=False), fmt)
    two = FIRST_CALL[fmt] + BETWEEN_CALLS[fmt] + SECOND_CALL[fmt]
    for calls in (FIRST_CALL[fmt], two):
        for after in ("\n", "\n\n", " \n"):
            assert accepts(tokenizer, parallel, calls + after), (calls, after)
    # Bounded, so that a model cannot loop on blank lines; one call ends at once.
    assert not accepts(tokenizer, parallel, FIRST_CALL[fmt] + "\n" * 3)
    assert not accepts(tokenizer, single, FIRST_CALL[fmt] + "\n")


def call_text(fmt: str, name: str, args: dict) -> str:
    """One call of ``name`` with ``args`` as ``fmt`` writes it (JSON as CALL_JSON spells it)."""
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                         "</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    body = json.dumps(args)
    return {"json_tools": f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>',
            "mistral": f"[TOOL_CALLS]{name}[ARGS]{body}",
            "llama3_json": f'{{"name": "{name}", "parameters": {body}}}'}[fmt]


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "go", "parameters": parameters}}


PLACE = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_undeclared_argument_keys_are_refused_when_the_schema_says_nothing_of_them(
    tokenizer, grammars, fmt
):
    params = {"type": "object", "properties": {
        "at": PLACE,
        "near": {"type": "array", "items": PLACE},
        "via": {"anyOf": [PLACE, {"type": "object", "properties": {"lat": {"type": "number"}}}]},
        "to": {"$ref": "#/$defs/place"},
    }, "required": ["at"], "$defs": {"place": PLACE}}
    before = json.loads(json.dumps(params))
    constraint = grammars.for_tools([tool(params)], ToolChoice(mode="required"), fmt)
    assert params == before  # the caller's schema is never changed
    rome = {"city": "Rome"}
    assert accepts(tokenizer, constraint, call_text(fmt, "go", {
        "at": rome, "near": [rome], "via": {"lat": 1.5}, "to": rome}))
    extra = {"city": "Rome", "unit": "m"}
    for args in ({"at": extra}, {"at": rome, "near": [extra]}, {"at": rome, "via": extra},
                 {"at": rome, "to": extra}):
        assert not accepts(tokenizer, constraint, call_text(fmt, "go", args)), args
    if fmt != "qwen3_coder":  # its markup takes no undeclared parameter in any case
        assert not accepts(tokenizer, constraint, call_text(fmt, "go", {"at": rome, "x": 1}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_undeclared_argument_keys_are_taken_where_the_schema_allows_them(
    tokenizer, grammars, fmt
):
    where = {"type": "object", "properties": {
        "any": {**PLACE, "additionalProperties": True},
        "strs": {**PLACE, "additionalProperties": {"type": "string"}},
    }, "required": ["any", "strs"], "additionalProperties": False}
    constraint = grammars.for_tools([tool(where)], ToolChoice(mode="required"), fmt)
    good = {"any": {"city": "Rome", "unit": 1}, "strs": {"city": "Rome", "unit": "m"}}
    assert accepts(tokenizer, constraint, call_text(fmt, "go", good))
    bad = {"any": {"city": "Rome"}, "strs": {"city": "Rome", "unit": 1}}
    assert not accepts(tokenizer, constraint, call_text(fmt, "go", bad))


def test_objects_under_all_of_stay_open_to_the_keys_the_other_branches_declare(
    tokenizer, grammars
):
    part = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    params = {"allOf": [{"$ref": "#/$defs/a"}, part],
              "$defs": {"a": {"type": "object", "properties": {"a": {"type": "integer"}},
                              "required": ["a"]}}}
    constraint = grammars.for_tools([tool(params)], ToolChoice(mode="required"), "json_tools")
    assert accepts(tokenizer, constraint, call_text("json_tools", "go", {"a": 1, "b": 2}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_tool_call_with_invalid_arguments_is_refused(tokenizer, grammars, fmt):
    constraint = grammars.for_tools(TOOLS, ToolChoice(mode="function", name="get_weather"), fmt)
    bad = {
        "json_tools": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"unit": "kelvin"}}\n</tool_call>',
        "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=unit>\nkelvin\n</parameter>\n</function>\n</tool_call>",
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "kelvin"}',
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "kelvin"}}',
    }[fmt]
    assert not accepts(tokenizer, constraint, bad)
    assert accepts(tokenizer, constraint, bad.replace("kelvin", "celsius"))


def test_unknown_tool_format_and_unknown_function_raise_grammar_error(grammars):
    with pytest.raises(GrammarError, match="'pythonic' cannot be constrained"):
        grammars.for_tools(TOOLS, ToolChoice(mode="required"), "pythonic")
    with pytest.raises(GrammarError, match="'nope'"):
        grammars.for_tools(TOOLS, ToolChoice(mode="function", name="nope"), "json_tools")
    with pytest.raises(ValueError):
        grammars.for_tools(TOOLS, ToolChoice(mode="auto"), "json_tools")


# The issue's schemas whose every value would nest without end (see test_finite_schema).
ENDLESS = {
    "self": {"$ref": "#"},
    "mutual": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
               "$ref": "#/$defs/a"},
    "nested": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                               "required": ["c"]}},
               "$ref": "#/$defs/n"},
}


@pytest.mark.parametrize("name", ENDLESS)
def test_a_schema_no_finite_value_satisfies_is_refused_saying_why(grammars, name):
    fmt = OutputFormat(type="json_schema", schema=ENDLESS[name])
    with pytest.raises(GrammarError, match="no finite JSON value satisfies this schema: "
                                           r".*a cycle with no way out") as err:
        grammars.for_format(fmt)
    assert err.value.param is None  # the constraint's own field: response_format


@pytest.mark.parametrize("name", ENDLESS)
def test_an_enforced_call_of_a_tool_without_finite_arguments_is_refused_naming_it(
    grammars, name
):
    go = tool(ENDLESS[name])
    with pytest.raises(GrammarError, match="the parameters of tool 'go': no finite JSON "
                                           "value satisfies this schema") as err:
        grammars.for_tools([WEATHER, go], ToolChoice(mode="required"), "json_tools")
    assert err.value.param == "tools[1].function.parameters"
    # A call of another tool named by tool_choice can end: it is enforced as usual.
    grammars.for_tools([WEATHER, go], ToolChoice(mode="function", name="get_weather"),
                       "json_tools")


def test_qwen3_coder_text_parameter_cannot_hold_a_closing_tag_or_null(tokenizer, grammars):
    tool = {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
    constraint = grammars.for_tools([tool], ToolChoice(mode="required"), "qwen3_coder")
    call = "<tool_call>\n<function=note>\n<parameter=text>\n{}\n</parameter>\n</function>\n" \
        "</tool_call>"
    assert accepts(tokenizer, constraint, call.format("two\nlines <b>bold</b>"))
    assert not accepts(tokenizer, constraint, call.format("a </parameter> b"))
    assert not accepts(tokenizer, constraint, call.format("NULL"))


def with_markers(tmp: Path, plain: tuple[str, ...], special: tuple[str, ...]) -> TokenizerWrapper:
    """The tiny test tokenizer with ``plain`` and ``special`` added as single tokens."""
    from tiny_model import write_tokenizer
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    write_tokenizer(tmp)
    hf = AutoTokenizer.from_pretrained(str(tmp))
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in special],
                  special_tokens=True)
    return TokenizerWrapper(hf)


@pytest.fixture(scope="module")
def marker_tokenizer(tmp_path_factory) -> TokenizerWrapper:
    """A tokenizer whose tool-call markers are single added tokens: Qwen's <tool_call> (not
    "special" in its tokenizer.json) and Mistral's [TOOL_CALLS] and [ARGS] (special)."""
    return with_markers(tmp_path_factory.mktemp("markers"),
                        ("<tool_call>", "</tool_call>", "<think>", "</think>"),
                        ("[TOOL_CALLS]", "[ARGS]"))


@pytest.mark.parametrize("fmt", ["json_tools", "qwen3_coder", "mistral"])
def test_markers_that_are_single_tokens_are_emitted_as_those_tokens(marker_tokenizer, fmt):
    tok = marker_tokenizer
    vocab = tok._tokenizer.get_added_vocab()
    constraint = Grammars(tok).for_tools(TOOLS, ToolChoice(mode="required", parallel=False), fmt)
    out, ended = drive(tok, [constraint.processor()], seed=0, max_steps=600)
    assert ended
    markers = ["[TOOL_CALLS]", "[ARGS]"] if fmt == "mistral" else ["<tool_call>", "</tool_call>"]
    for m in markers:
        assert out.count(vocab[m]) == 1, m
    assert out[0] == vocab[markers[0]]
    text = tok._tokenizer.decode(out, skip_special_tokens=False)
    check_calls(calls_in(fmt, text))


def test_mistral_tokenizer_without_args_token_gets_the_json_list_form(tmp_path):
    tok = with_markers(tmp_path, (), ("[TOOL_CALLS]",))
    grammars = Grammars(tok)
    calls_token = tok._tokenizer.get_added_vocab()["[TOOL_CALLS]"]
    for parallel in (False, True):
        constraint = grammars.for_tools(TOOLS, ToolChoice(mode="required", parallel=parallel),
                                        "mistral")
        out, ended = drive(tok, [constraint.processor()], seed=2, max_steps=600)
        assert ended and out[0] == calls_token and out.count(calls_token) == 1
        text = tok._tokenizer.decode(out[1:])
        assert text.startswith("[{")
        calls = calls_in("mistral", "[TOOL_CALLS]" + text)
        assert parallel or len(calls) == 1
        check_calls(calls)


# --- reasoning -------------------------------------------------------------------------------


def test_reasoning_stays_free_and_the_answer_follows_its_closing_tag(tokenizer, grammars):
    constraint = grammars.for_format(OutputFormat(type="json_object"),
                                     think=("<think>", "</think>"), in_reasoning=True)
    assert accepts(tokenizer, constraint, 'Maybe {"x"? No.</think>\n\n{"a": 1}')
    assert not accepts(tokenizer, constraint, '{"a": 1}')
    optional = grammars.for_format(OutputFormat(type="json_object"),
                                   think=("<think>", "</think>"))
    assert accepts(tokenizer, optional, '<think>hm</think>{"a": 1}')
    assert accepts(tokenizer, optional, '{"a": 1}')


def test_a_budget_forced_closing_tag_hands_over_to_the_grammar(tokenizer, grammars):
    """Random logits never close the reasoning; the budget does, then the tool call comes."""
    end = tokenizer._tokenizer.encode("</think>", add_special_tokens=False)
    constraint = grammars.for_tools(TOOLS, ToolChoice(mode="function", name="get_weather"),
                                    "json_tools", think=("<think>", "</think>"),
                                    in_reasoning=True)
    budget = thinking_budget_processor(20, end, start_tokens=None, starts_inside=True)
    out, ended = drive(tokenizer, [budget, constraint.processor()], seed=3)
    assert ended
    assert out[20 : 20 + len(end)] == end
    answer = tokenizer.decode(out[20 + len(end) :]).lstrip()
    check_calls(calls_in("json_tools", answer))


def test_reasoning_closed_by_a_special_token_is_free_text_then_the_token(marker_tokenizer):
    tok = marker_tokenizer
    close = tok._tokenizer.get_added_vocab()["</think>"]
    constraint = Grammars(tok).for_format(OutputFormat(type="regex", pattern="ab"),
                                          think=("<think>", "</think>"), in_reasoning=True)
    budget = thinking_budget_processor(30, [close], start_tokens=None, starts_inside=True)
    out, ended = drive(tok, [budget, constraint.processor()], seed=0, max_steps=100)
    assert ended and out[30] == close
    assert tok._tokenizer.decode(out[31:]).strip() == "ab"


# --- the thinking budget --------------------------------------------------------------------


def test_thinking_budget_forces_the_end_tokens_after_budget_tokens(tokenizer):
    end = [11, 22, 33]
    proc = thinking_budget_processor(7, end, start_tokens=None, starts_inside=True)
    out, _ = drive(tokenizer, [proc], seed=0, max_steps=30)
    assert out[7:10] == end
    assert end not in [out[i : i + 3] for i in range(7)]  # not there before by chance
    assert out[10:] != [end[-1]] * len(out[10:])  # then it lets go


def test_thinking_budget_counts_from_the_start_tokens(tokenizer):
    start, end = [5, 6], [9]
    proc = thinking_budget_processor(4, end, start_tokens=start, starts_inside=False)
    width = len(tokenizer._tokenizer)
    context = list(PROMPT)
    proc(mx.array(context), mx.zeros((1, width)))
    for token in [70, 71, 5, 6, 80, 81, 82]:  # not inside yet, the start tag, 3 reasoning
        context.append(token)
        assert proc(mx.array(context), mx.zeros((1, width))).min().item() == 0
    context.append(83)  # the 4th reasoning token: the end tag is next
    forced = proc(mx.array(context), mx.zeros((1, width)))
    assert mx.argmax(forced).item() == 9 and mx.isinf(forced).sum().item() == width - 1


def test_thinking_budget_leaves_reasoning_the_model_closed_itself(tokenizer):
    proc = thinking_budget_processor(3, [9, 10], start_tokens=None, starts_inside=True)
    width = len(tokenizer._tokenizer)
    context = list(PROMPT)
    proc(mx.array(context), mx.zeros((1, width)))
    for token in [50, 9, 10, 51, 52, 53, 54]:
        context.append(token)
        assert not mx.isinf(proc(mx.array(context), mx.zeros((1, width)))).any().item()


def test_thinking_budget_finishes_an_end_tag_the_model_began(tokenizer):
    proc = thinking_budget_processor(2, [9, 10], start_tokens=None, starts_inside=True)
    width = len(tokenizer._tokenizer)
    context = list(PROMPT)
    proc(mx.array(context), mx.zeros((1, width)))
    for token in [50, 9]:  # the budget is spent on a token that begins the end tag
        context.append(token)
        logits = proc(mx.array(context), mx.zeros((1, width)))
    assert mx.argmax(logits).item() == 10 and mx.isinf(logits).sum().item() == width - 1


# --- in the batch ------------------------------------------------------------------------


def test_a_constrained_row_in_a_batch_follows_its_grammar_and_leaves_the_others_alone(loaded):
    """Three prompts decode together in the engine's batch (its runner); the middle one carries a
    JSON Schema. Its answer validates; the other two are mlx-lm's greedy answers alone."""
    model, tok = loaded
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "pick": {"enum": ["fox", "dog"]},
            "word": {"type": "string", "maxLength": 5},
        },
        "required": ["ok", "n", "pick", "word"],
        "additionalProperties": False,
    }
    constraint = Grammars(tok, vocab_size=model.args.vocab_size).for_format(
        OutputFormat(type="json_schema", schema=schema))
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    runner = Runner(model, engine_config(max_batch_size=8, prefill_batch_size=8,
                                         prefill_step_size=64))
    uids = [runner.insert([p], max_tokens=n, cache=None, done=[], sampler=greedy_sampler,
                          processors=procs, stop_ids=frozenset(tok.eos_token_ids))
            for p, n, procs in zip(prompts, [24, 200, 24], [[], [constraint.processor()], []],
                                   strict=True)]
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    finish: dict[int, str] = {}
    while len(finish) < len(uids):
        for r in runner.execute(runner.whole_chunks()).responses:
            if r.finish_reason != "stop":
                tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finish[r.uid] = r.finish_reason
    runner.close()
    assert finish[uids[1]] == "stop"
    jsonschema.validate(json.loads(tok.decode(tokens[uids[1]])), schema)
    for i in (0, 2):
        assert tokens[uids[i]] == reference_tokens(model, tok, prompts[i], 24), i
