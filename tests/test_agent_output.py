"""The streaming output parser: text, reasoning and tool calls out of each model family's
markup, whatever the split of the deltas."""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from troupe.actors.engine.agent_output import (
    FALLBACK_TOOL_FORMAT,
    OutputParser,
    Parsed,
    prompt_opens_reasoning,
    think_tags_of,
    tool_format_of,
)
from troupe.actors.messages import OutputSpec, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
            },
        },
    },
]
THINK = ("<think>", "</think>")
PARIS = {"city": "Paris"}
EUROPE = {"timezone": "Europe/Paris"}

# What each family's models write (as decoded text, special tokens included).
HERMES = (
    "Let me check the weather.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
HERMES_PARALLEL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>'
)
QWEN3_CODER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "</function>\n</tool_call>"
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TAGGED = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}'
)
LLAMA3_TEXT = 'A call looks like {"name": "get_weather", "parameters": {}}.'
MISTRAL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
MISTRAL_PARALLEL = (
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
    '{"timezone": "Europe/Paris"}'
)
MISTRAL_JSON = (
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]'
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)
# <|call|> is an end-of-sequence token: the engine cuts it, so the output just ends.
HARMONY_CALL_AT_EOS = (
    "<|channel|>analysis<|message|>Weather.<|end|>"
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
    '<|message|>{"city": "Paris"}'
)
HARMONY_FINAL = (
    "<|channel|>analysis<|message|>A greeting; answer briefly.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
)
QWEN3_THINK_CALL = (
    "<think>\nThe user asks for the weather, so I call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
QWEN3_OPEN_THINK = "The user greets me.\n\nI answer.\n</think>\n\nHello! How can I help?"
ANGLES = "3 < 4, <tool_ is no tag and [TOOL] no call."

HERMES_MARKERS = ("<tool_call>", "</tool_call>")
THINK_MARKERS = THINK
MISTRAL_MARKERS = ("[TOOL_CALLS]", "[ARGS]")
HARMONY_MARKERS = (
    "<|channel|>",
    "<|message|>",
    "<|start|>",
    "<|end|>",
    "<|call|>",
    "<|constrain|>",
)


def spec(fmt: str | None = None, *, think: bool = False, open_: bool = False) -> OutputSpec:
    return OutputSpec(
        tool_format=fmt,
        tools=TOOLS if fmt else None,
        think=THINK if think else None,
        in_reasoning=open_,
    )


@dataclass
class Case:
    """One model output and what must come out of it."""

    id: str
    spec: OutputSpec
    output: str
    text: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    markers: tuple[str, ...] = HERMES_MARKERS


CASES = [
    Case(
        "hermes",
        spec("json_tools"),
        HERMES,
        "Let me check the weather.\n",
        "",
        [("get_weather", PARIS)],
    ),
    Case(
        "hermes_parallel",
        spec("json_tools"),
        HERMES_PARALLEL,
        calls=[("get_weather", PARIS), ("get_time", EUROPE)],
    ),
    Case("qwen3_coder", spec("qwen3_coder"), QWEN3_CODER, calls=[("get_weather", PARIS)]),
    Case("llama3", spec("llama3_json"), LLAMA3, calls=[("get_weather", PARIS)], markers=()),
    Case(
        "llama3_tagged",
        spec("llama3_json"),
        LLAMA3_TAGGED,
        calls=[("get_weather", PARIS), ("get_time", EUROPE)],
        markers=("<|python_tag|>",),
    ),
    Case("llama3_text", spec("llama3_json"), LLAMA3_TEXT, text=LLAMA3_TEXT, markers=()),
    Case(
        "mistral", spec("mistral"), MISTRAL, calls=[("get_weather", PARIS)], markers=MISTRAL_MARKERS
    ),
    Case(
        "mistral_parallel",
        spec("mistral"),
        MISTRAL_PARALLEL,
        calls=[("get_weather", PARIS), ("get_time", EUROPE)],
        markers=MISTRAL_MARKERS,
    ),
    Case(
        "mistral_json",
        spec("mistral"),
        MISTRAL_JSON,
        calls=[("get_weather", PARIS)],
        markers=MISTRAL_MARKERS,
    ),
    Case(
        "harmony_call",
        spec("harmony"),
        HARMONY_CALL,
        reasoning="The user wants the weather in Paris.",
        calls=[("get_weather", PARIS)],
        markers=HARMONY_MARKERS,
    ),
    Case(
        "harmony_call_at_eos",
        spec("harmony"),
        HARMONY_CALL_AT_EOS,
        reasoning="Weather.",
        calls=[("get_weather", PARIS)],
        markers=HARMONY_MARKERS,
    ),
    Case(
        "harmony_final",
        spec("harmony"),
        HARMONY_FINAL,
        text="Hello! How can I help?",
        reasoning="A greeting; answer briefly.",
        markers=HARMONY_MARKERS,
    ),
    Case(
        "qwen3_think_then_call",
        spec("json_tools", think=True),
        QWEN3_THINK_CALL,
        reasoning="The user asks for the weather, so I call the tool.",
        calls=[("get_weather", PARIS)],
        markers=HERMES_MARKERS + THINK_MARKERS,
    ),
    Case(
        "qwen3_starts_in_reasoning",
        spec(think=True, open_=True),
        QWEN3_OPEN_THINK,
        text="Hello! How can I help?",
        reasoning="The user greets me.\n\nI answer.",
        markers=THINK_MARKERS,
    ),
    Case("angle_brackets_are_text", spec("json_tools", think=True), ANGLES, text=ANGLES),
    Case(
        "brackets_are_text_for_mistral",
        spec("mistral"),
        ANGLES,
        text=ANGLES,
        markers=MISTRAL_MARKERS,
    ),
]


@dataclass
class Run:
    texts: list[str]
    reasonings: list[str]
    calls: list[ToolCall]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasonings)


def run(output_spec: OutputSpec, pieces: list[str], *, cut: bool = False, **kwargs) -> Run:
    parser = OutputParser(output_spec, **kwargs)
    results: list[Parsed] = [parser.feed(p) for p in pieces] + [parser.finish(cut=cut)]
    assert parser.calls_made == sum(len(r.tool_calls) for r in results)
    return Run(
        [r.text for r in results],
        [r.reasoning for r in results],
        [c for r in results for c in r.tool_calls],
    )


def splits(output: str) -> list[list[str]]:
    """Every split of ``output`` in two pieces, and one character at a time."""
    return [[output[:i], output[i:]] for i in range(len(output) + 1)] + [list(output)]


def assert_calls(calls: list[ToolCall], expected: list[tuple[str, dict]]) -> None:
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
        (i, name, args) for i, (name, args) in enumerate(expected)
    ]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_every_split_of_each_family_output_gives_the_same_text_reasoning_and_whole_calls(
    case: Case,
) -> None:
    for pieces in splits(case.output):
        got = run(case.spec, pieces)
        where = f"split {[len(p) for p in pieces][:3]}"
        assert got.text == case.text, where
        assert got.reasoning == case.reasoning, where
        assert_calls(got.calls, case.calls)
        for piece in got.texts + [got.text] + got.reasonings + [got.reasoning]:
            for marker in case.markers:
                assert marker not in piece, (where, marker, piece)


def test_call_ids_carry_the_prefix_and_24_hex_digits_and_differ() -> None:
    got = run(spec("json_tools"), [HERMES_PARALLEL], id_prefix="toolu_")
    assert all(re.fullmatch(r"toolu_[0-9a-f]{24}", c.id) for c in got.calls)
    assert len({c.id for c in got.calls}) == 2


def test_the_models_own_call_id_is_kept() -> None:
    got = run(spec("mistral"), [MISTRAL_JSON])
    assert [c.id for c in got.calls] == ["a1B2c3D4e"]


def test_arguments_are_json_text_with_non_ascii_kept() -> None:
    output = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    (call,) = run(spec("json_tools"), [output]).calls
    assert call.arguments == '{"city": "Zürich"}'


def test_a_call_comes_out_on_the_feed_that_closes_it() -> None:
    parser = OutputParser(spec("json_tools"))
    assert (
        parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
        == Parsed()
    )
    got = parser.feed("</tool_call>")
    assert [c.name for c in got.tool_calls] == ["get_weather"]
    assert parser.calls_made == 1


def test_a_held_prefix_that_turns_out_no_marker_is_released_on_the_next_feed() -> None:
    parser = OutputParser(spec("json_tools"))
    assert parser.feed("Hi <tool").text == "Hi "
    assert parser.feed("box").text == "<toolbox"


def test_in_reasoning_follows_the_think_tags() -> None:
    parser = OutputParser(spec(think=True))
    parser.feed("<think>hm")
    assert parser.in_reasoning
    got = parser.feed("m</think>\n\nAnswer")
    assert not parser.in_reasoning
    assert (got.reasoning, got.text) == ("m", "Answer")


def test_output_starting_in_reasoning_is_reasoning_until_the_closing_tag() -> None:
    parser = OutputParser(spec(think=True, open_=True))
    assert parser.in_reasoning
    assert parser.feed("thinking").reasoning == "thinking"


def test_reasoning_cut_by_finish_stays_reasoning() -> None:
    got = run(spec("json_tools", think=True), ["<think>\nStill thinking about <tool_call>"])
    assert (got.reasoning, got.text, got.calls) == ("Still thinking about <tool_call>", "", [])


def test_without_format_or_think_tags_text_passes_through_unchanged() -> None:
    parser = OutputParser(OutputSpec())
    for piece in ["<tool_call>", "<think>x</think>", "[TOOL_CALLS]"]:
        assert parser.feed(piece) == Parsed(text=piece)
    assert parser.finish() == Parsed()


def test_a_stray_closing_think_tag_is_never_shown() -> None:
    assert run(spec(think=True), ["Hi</think>\n\nthere"]).text == "Hithere"


MALFORMED = [
    (
        "invalid_json",
        "json_tools",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        "JSONDecodeError",
    ),
    (
        "unknown_tool",
        "json_tools",
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        "launch_rockets",
    ),
    (
        "arguments_not_object",
        "json_tools",
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
        "not an object",
    ),
    (
        "mistral_unreadable_at_the_models_end",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
        "ValueError",
    ),
    (
        "llama3_unreadable_at_the_models_end",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"ci',
        "JSONDecodeError",
    ),
    (
        "qwen3_coder_no_function",
        "qwen3_coder",
        "<tool_call>\nget_weather Paris\n</tool_call>",
        "ValueError",
    ),
    (
        "harmony_unknown_tool",
        "harmony",
        '<|channel|>commentary to=functions.rm <|constrain|>json<|message|>{"path": "/"}<|call|>',
        "rm",
    ),
]


@pytest.mark.parametrize(
    "fmt,output,why", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_or_unknown_calls_come_back_as_text_with_a_warning(
    fmt: str, output: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    for pieces in splits(output):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actors.engine.agent_output"):
            got = run(spec(fmt), pieces)
        assert (got.text, got.calls) == (output, [])
        assert [r.name for r in caplog.records] == ["actors.engine.agent_output"]
        assert why in caplog.records[0].getMessage()


# A complete call, then one the end of the output cuts (max_tokens), in each format.
CUT = [
    ("json_tools", HERMES + '\n<tool_call>\n{"name": "get_time", "argu',
     "Let me check the weather.\n"),
    ("qwen3_coder", QWEN3_CODER + "\n<tool_call>\n<function=get_time>\n<parameter=time", ""),
    ("mistral", MISTRAL + '[TOOL_CALLS]get_time[ARGS]{"timezone": "Eur', ""),
    ("llama3_json", LLAMA3 + '; {"name": "get_time", "parameters": {"timezone": "a;', ""),
    ("harmony", HARMONY_CALL_AT_EOS[: HARMONY_CALL_AT_EOS.index("<|message|>{")], ""),
    ("harmony", HARMONY_CALL_AT_EOS[:-4], ""),
]


@pytest.mark.parametrize("fmt,output,text", CUT, ids=[
    "json_tools", "qwen3_coder", "mistral", "llama3_json", "harmony_header",
    "harmony_arguments"])
def test_a_call_cut_by_the_end_of_the_output_is_dropped_and_the_complete_ones_kept(
    fmt: str, output: str, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    complete = [] if fmt == "harmony" else [("get_weather", PARIS)]
    for pieces in splits(output):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="actors.engine.agent_output"):
            got = run(spec(fmt), pieces, cut=True)
        assert (got.text, got.reasoning.startswith("Weather") or fmt != "harmony") == (text, True)
        assert_calls(got.calls, complete)
        assert [r.name for r in caplog.records] == ["actors.engine.agent_output"]
        assert "dropped" in caplog.records[0].getMessage()


def test_an_unclosed_call_is_dropped_even_when_the_model_ended_the_output() -> None:
    got = run(spec("json_tools"), ['Hi <tool_call>\n{"name": "get_weather", "argu'])
    assert (got.text, got.calls) == ("Hi ", [])


def test_what_may_begin_a_marker_is_dropped_at_a_cut_and_kept_at_the_models_end() -> None:
    for fmt, tail in [("json_tools", "<tool_"), ("mistral", "[TOOL"), ("llama3_json", "<|py")]:
        output = HERMES + "\n" + tail if fmt == "json_tools" else "Hi " + tail
        head = "Let me check the weather.\n" if fmt == "json_tools" else "Hi "
        for pieces in splits(output):
            assert run(spec(fmt), pieces, cut=True).text == head, fmt
            assert run(spec(fmt), pieces).text == head + tail, fmt


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_repeated_call_ends_the_answer_and_is_dropped_with_all_after_it() -> None:
    two = {"type": "function", "function": {"name": "pair", "parameters": {"type": "object"}}}
    output = "\n".join([
        hermes("pair", '{"a": 1, "b": [true]}'),
        hermes("pair", '{"a": 1, "b": [1]}'),  # not a repeat: true is not 1 in JSON
        hermes("get_weather", '{"city": "Paris"}'),
        hermes("pair", '{"b": [true], "a": 1}'),  # the first call, its keys in another order
        "More text",
        hermes("get_time", "{}"),
    ])
    for pieces in splits(output):
        parser = OutputParser(OutputSpec(tool_format="json_tools", tools=[*TOOLS, two]))
        results = [parser.feed(p) for p in pieces] + [parser.finish()]
        assert parser.ended
        assert [(c.name, json.loads(c.arguments)) for r in results for c in r.tool_calls] == [
            ("pair", {"a": 1, "b": [True]}), ("pair", {"a": 1, "b": [1]}),
            ("get_weather", PARIS)]
        assert "".join(r.text for r in results) == ""
        assert parser.feed("<tool_call>") == Parsed()


def test_a_repeated_call_in_a_format_read_at_the_end_ends_the_answer_too() -> None:
    output = MISTRAL_PARALLEL + MISTRAL + '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"}'
    parser = OutputParser(spec("mistral"))
    got = [parser.feed(output), parser.finish()]
    assert parser.ended
    assert_calls([c for r in got for c in r.tool_calls],
                 [("get_weather", PARIS), ("get_time", EUROPE)])


def test_different_calls_never_end_the_answer() -> None:
    parser = OutputParser(spec("json_tools"))
    parser.feed(HERMES_PARALLEL + "\n" + hermes("get_weather", '{"city": "Rome"}'))
    assert parser.calls_made == 3 and not parser.ended


def test_a_good_call_after_a_malformed_one_gets_index_zero() -> None:
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    good = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    got = run(spec("json_tools"), [bad + good])
    assert got.text == bad
    assert [(c.index, c.name) for c in got.calls] == [(0, "get_time")]


def test_an_unknown_format_name_leaves_text_untouched() -> None:
    got = run(OutputSpec(tool_format="no_such_format", tools=TOOLS), [HERMES])
    assert got.text == HERMES


FUZZ_PIECES = [
    *HERMES_MARKERS,
    *THINK_MARKERS,
    *MISTRAL_MARKERS,
    *HARMONY_MARKERS,
    "<|python_tag|>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<|tool_calls_section_begin|>",
    "<invoke name=",
    "call:",
    "to=functions.get_weather",
    "analysis",
    "final",
    '"name"',
    '"get_weather"',
    "{",
    "}",
    ":",
    ";",
    "\n",
    " ",
    "x",
    "<",
]


def test_random_markup_in_any_format_never_raises() -> None:
    import mlx_lm.tool_parsers as parsers

    formats = [p.stem for p in Path(parsers.__file__).parent.glob("*.py") if p.stem != "__init__"]
    rng = random.Random(0)
    logging.getLogger("actors.engine.agent_output").disabled = True
    try:
        for fmt in [*formats, "llama3_json", "harmony"]:
            for _ in range(30):
                output = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 20)))
                cuts = sorted(rng.sample(range(len(output) + 1), min(4, len(output) + 1)))
                pieces = [
                    output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)
                ]
                think = rng.random() < 0.5
                run(spec(fmt, think=think, open_=think and rng.random() < 0.5), pieces)
    finally:
        logging.getLogger("actors.engine.agent_output").disabled = False


def test_every_mlx_lm_tool_parser_module_loads_by_name() -> None:
    import mlx_lm.tool_parsers as parsers

    names = sorted(
        p.stem for p in Path(parsers.__file__).parent.glob("*.py") if p.stem != "__init__"
    )
    assert FALLBACK_TOOL_FORMAT in names
    for name in names:
        text = "plain answer"
        assert run(OutputSpec(tool_format=name, tools=TOOLS), [text]).text == text, name


# --- tokenizers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_model import write_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(out)
    return out


def load_with(base: Path, out: Path, template: str, extra_tokens: list[str] = ()):
    """A real mlx-lm TokenizerWrapper with ``template`` as its chat template."""
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    shutil.copytree(base, out)
    tok = AutoTokenizer.from_pretrained(str(out))
    if extra_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(extra_tokens)})
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return load_tokenizer(out)


HERMES_TEMPLATE = (
    "{% for m in messages %}{% for tool_call in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}"}\n</tool_call>{% endfor %}{% endfor %}'
)
LLAMA31_TEMPLATE = (
    "{% for m in messages %}{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function.name }}"
    "{% endif %}{{ m.content }}<|eot_id|>{% endfor %}"
)
HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
    "<|end|>{% endfor %}<|start|>assistant"
)
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(
    "template,fmt",
    [
        (HERMES_TEMPLATE, "json_tools"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (HARMONY_TEMPLATE, "harmony"),
        (CHATML, None),
    ],
    ids=["json_tools", "llama3_json", "harmony", "none"],
)
def test_tool_format_of_reads_the_chat_template(
    base_tokenizer: Path, tmp_path: Path, template: str, fmt: str | None
) -> None:
    assert tool_format_of(load_with(base_tokenizer, tmp_path / "tok", template)) == fmt


def test_think_tags_of_finds_think_tokens_in_the_vocabulary(
    base_tokenizer: Path, tmp_path: Path
) -> None:
    thinking = load_with(base_tokenizer, tmp_path / "think", CHATML, ["<think>", "</think>"])
    plain = load_with(base_tokenizer, tmp_path / "plain", CHATML)
    assert (think_tags_of(thinking), think_tags_of(plain)) == (THINK, None)


def test_prompt_opens_reasoning_when_its_last_think_tag_is_unclosed() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK)
    assert not prompt_opens_reasoning("<|im_start|>assistant\n", THINK)
    assert not prompt_opens_reasoning("<think>\n", None)
