"""Freeform tools' grammars (actors/engine/custom_tools.py): a Lark grammar rewritten into the
grammar of its sentences' JSON-escaped text, and enforced freeform calls in every tool-call
format (actors/engine/grammar.py).

The rewritten grammar is judged against the original one by llguidance on the default model's
tokenizer: a text is a sentence of the original exactly when its escaped form is one of the
rewrite, over a corpus of sentences and non-sentences and over texts sampled from either
grammar.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from agent_shapes import APPLY_PATCH_GRAMMAR
from llguidance import LLMatcher
from mlx_lm.tool_parsers import json_tools, mistral, qwen3_coder

from troupe.actors.engine.custom_tools import FreeformError, check_format, json_string_grammar
from troupe.actors.engine.grammar import Constraint, Grammars
from troupe.actors.messages import OutputFormat, ToolChoice

PROMPT = [1, 2, 3]
FORMATS = ["json_tools", "qwen3_coder", "mistral", "llama3_json"]

APPLY_PATCH = {
    "type": "function",
    "function": {
        "name": "apply_patch",
        "description": "Edit files.",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                       "required": ["input"], "additionalProperties": False},
    },
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}

PATCHES = [
    "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch",
    "*** Begin Patch\n*** Delete File: a.txt\n*** End Patch\n",
    '*** Begin Patch\n*** Add File: dir/"quoted" \\ name.txt\n+line with \ttab and \\back\n+\n'
    "+é 東京 \x01ctrl \x7fdel / slash\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: src/app.py\n*** Move to: src/main.py\n@@ def greet():\n"
    ' context\n-print("Hi")\n+print("Hello, world!")\n@@\n-x\n*** End of File\n'
    "*** Delete File: old.txt\n*** End Patch\n",
]
NOT_PATCHES = [
    "*** Begin Patch\n*** Delete File: a.txt\n",  # no end
    "*** Begin Patch\n*** End Patch\n",  # no hunk
    "*** Begin Patch\n*** Add File: a.txt\n*** End Patch\n",  # no line
    "*** Begin Patch\n*** Update File: a\nxline\n*** End Patch\n",  # not a change line
    "*** Begin Patch\n*** Delete File: \n*** End Patch\n",  # no file name
    "*** Begin Patch\r\n*** Delete File: a\n*** End Patch\n",  # CR is not LF
]

# Grammars using what the rewrite handles: case-insensitive strings, ranges, classes with
# \s and \d, negated classes, dotall, %ignore, common imports, intersection of plain
# terminals, repetition.
SMALL = [
    ('start: "say" WS? "\\"" WORD "\\""\nWORD: /[a-z\\\\]{1,4}/\n%import common.WS',
     ['say "ab"', 'say\t"a\\\\"', 'say \n "zz"'], ['say "ABC"', 'say ""', "say 'a'"]),
    ('start: "go"i " " DIR ("," DIR) ~ 0..2\nDIR: "n".."s" | /\\d/',
     ["GO n", "gO 3,p,s", "go r"], ["go a", "go n,n,n,n", "go  n"]),
    ("start: ITEM+\nITEM: /[^a-z\\s]/ | /(?s:.)\\n/\n%ignore \" \"",
     ["AB \"\\", "x\nQ", "{ }"], ["ab", "x", "A\t"]),
    ("start: T\nT: /[a-z]+/ & /[a-z0-9]{2,3}/\n",
     ["ab", "abc"], ["a", "abcd", "AB"]),
    ('start: WORD ("\\n" WORD)*\nWORD: /[a-z"]{2,3}/\n%ignore " "',
     ["ab \n xy", 'a" \n "b'], ["a", "ab\nabcd"]),
    ("start: NUMBER (\",\" NUMBER)*\n%import common (NUMBER)",
     ["1,2.5,.3e4"], ["1,,2", "a"]),
]


def escaped(text: str) -> str:
    """What a JSON string holding ``text`` has between its quotes."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def takes(grammars: Grammars, grammar: str, text: str) -> bool:
    """Whether the Lark ``grammar`` takes ``text`` whole."""
    ll = grammars.llg_tokenizer()
    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(ll.tokenize_str(text)) and matcher.is_accepting()


def accepts(tok, constraint: Constraint, text: str) -> bool:
    """Whether a constraint takes ``text`` (tokenized as the model would) and then EOS."""
    proc = constraint.processor()
    context = list(PROMPT)
    width = len(tok._tokenizer)
    logits = proc(mx.array(context), mx.zeros((1, width)))
    for token in tok._tokenizer.encode(text, add_special_tokens=False):
        context.append(token)
        logits = proc(mx.array(context), mx.zeros((1, width)))
        if proc.failed:
            return False
    eos = next(iter(tok.eos_token_ids))
    return logits[0, eos].item() == 0


def _bias(tok, patches: bool) -> tuple[mx.array, int | None]:
    """Random logits' bias towards ending soon: EOS; and for patches, a line's end (a
    newline, or a backslash then "n": the escaped newline) over its text, and a hunk's or
    the patch's end ("***") over more lines. Also the id of "n", to follow a backslash."""
    width = len(tok._tokenizer)
    bias = [0.0] * width
    n_id = None
    for token_id in range(len(tok._tokenizer)) if patches else ():
        text = tok._tokenizer.decode([token_id])
        if text in ("\n", "\\"):
            bias[token_id] = 6.0
        elif "***" in text:
            bias[token_id] = 4.0
        elif text == "n":
            n_id = token_id
    for eos in tok.eos_token_ids:
        bias[eos] = 50.0
    return mx.array(bias), n_id


def sample(tok, constraint: Constraint, bias: tuple[mx.array, int | None], seed: int,
           steps: int = 600) -> str:
    """Greedy decoding over biased random logits through the constraint, until EOS (after
    a lone backslash, "n" first: the escaped newline)."""
    proc = constraint.processor()
    mx.random.seed(seed)
    base, n_id = bias
    context, out = list(PROMPT), []
    for _ in range(steps):
        logits = mx.random.normal((1, base.shape[0])) + base
        text = tok.decode(out)
        if n_id is not None and (len(text) - len(text.rstrip("\\"))) % 2:
            logits[0, n_id] = 100.0
        logits = proc(mx.array(context), logits)
        token = int(mx.argmax(logits, axis=-1).item())
        if token in tok.eos_token_ids:
            return tok.decode(out)
        out.append(token)
        context.append(token)
    raise AssertionError(f"no EOS within {steps} steps: {tok.decode(out)[:300]!r}")


# --- the rewrite -----------------------------------------------------------------------------


@pytest.mark.parametrize("text", PATCHES + NOT_PATCHES)
def test_escaped_apply_patch_takes_exactly_the_escaped_patches(grammars, text):
    rewritten = json_string_grammar(APPLY_PATCH_GRAMMAR)
    is_patch = takes(grammars, APPLY_PATCH_GRAMMAR, text)
    assert is_patch == (text in PATCHES)
    assert takes(grammars, rewritten, escaped(text)) == is_patch


@pytest.mark.parametrize(("grammar", "sentences", "others"), SMALL)
def test_escaped_grammar_takes_exactly_the_escaped_sentences(grammars, grammar, sentences,
                                                             others):
    rewritten = json_string_grammar(grammar)
    for text in sentences:
        assert takes(grammars, grammar, text), text
        assert takes(grammars, rewritten, escaped(text)), text
    for text in others:
        assert not takes(grammars, grammar, text), text
        assert not takes(grammars, rewritten, escaped(text)), text


def test_only_the_canonical_escape_is_taken(grammars):
    """One spelling per character, as json.dumps writes it: the prompt a call goes back as
    is the text the model wrote."""
    rewritten = json_string_grammar(APPLY_PATCH_GRAMMAR)
    base = "*** Begin Patch\\n*** Delete File: {}\\n*** End Patch"
    assert takes(grammars, rewritten, base.format("a/b\\\"c\\u0001"))
    for spelling in ("\\u0061", "a\\/b", '"', "\\u0009", "\\U0001", "\\x", "a\nb"):
        assert not takes(grammars, rewritten, base.format(spelling)), spelling


@pytest.mark.parametrize("seed", range(4))
def test_sentences_sampled_from_either_grammar_are_sentences_of_the_other(
        tokenizer, grammars, seed):
    for grammar, _, _ in [(APPLY_PATCH_GRAMMAR, [], []), *SMALL]:
        bias = _bias(tokenizer, patches=grammar == APPLY_PATCH_GRAMMAR)
        rewritten = json_string_grammar(grammar)
        raw = sample(tokenizer, grammars.compile(LLMatcher.grammar_from_lark(grammar)), bias,
                     seed)
        assert takes(grammars, rewritten, escaped(raw)), raw
        text = sample(tokenizer, grammars.compile(LLMatcher.grammar_from_lark(rewritten)),
                      bias, seed)
        assert takes(grammars, grammar, json.loads(f'"{text}"')), text


@pytest.mark.parametrize(
    ("grammar", "reason"),
    [
        ('start: %json {"type": "object"}', "%json"),
        ("start: <|im_end|>", "special tokens"),
        ("start: <[12]>", "special tokens"),
        ("start: @sub", "nested grammars"),
        ("start: A\nA: /a/ & ~/b/", "negated terminals"),
        ('start: A\nA: /[a\n]/ & /./', "'&'"),
        ("start: A\nA: /x/\n%ignore /#[^\\n]*/", "%ignore"),
        ("start: /(?=a)a/", "look-arounds"),
        ('start: /^"$/', "anchors"),
        ("start: /(a)\\1/", "back-references"),
        ("start: /[[:alpha:]]/", "cannot be read"),
        ("start: /a/l", "'l'"),
        ("start: X\n%import common.NOPE", "not a common terminal"),
        ("start: X\n%import other.X", "only '%import common"),
        ('start: "ab".."c"', "two characters in order"),
        ('%llguidance {}\nstart: "a"', "%llguidance"),
    ],
)
def test_what_the_rewrite_cannot_handle_is_refused_saying_why(grammar, reason):
    with pytest.raises(FreeformError, match=re.escape(reason)):
        json_string_grammar(grammar)
    assert reason in (check_format(OutputFormat(type="lark", pattern=grammar)) or "")


def test_check_format_takes_codexs_grammar_and_refuses_what_cannot_compile():
    assert check_format(OutputFormat(type="lark", pattern=APPLY_PATCH_GRAMMAR)) is None
    assert check_format(OutputFormat(type="regex", pattern="[a-z]+\\d")) is None
    assert "unclosed" in (check_format(OutputFormat(type="regex", pattern="[a-z")) or "")
    assert check_format(OutputFormat(type="lark", pattern="start: ( ")) is not None


# --- enforced freeform calls -----------------------------------------------------------------


def _choice(fmt: OutputFormat) -> ToolChoice:
    return ToolChoice(mode="function", name="apply_patch", parallel=False,
                      input_formats={"apply_patch": fmt})


def call_text(fmt: str, text: str) -> str:
    """A call of apply_patch with ``text`` as its input, as ``fmt`` writes one."""
    arguments = json.dumps({"input": text}, ensure_ascii=False)
    if fmt == "json_tools":
        return f'<tool_call>\n{{"name": "apply_patch", "arguments": {arguments}}}\n</tool_call>'
    if fmt == "llama3_json":
        return f'{{"name": "apply_patch", "parameters": {arguments}}}'
    if fmt == "mistral":
        return f"[TOOL_CALLS]apply_patch[ARGS]{arguments}"
    return ("<tool_call>\n<function=apply_patch>\n<parameter=input>\n"
            f"{text}\n</parameter>\n</function>\n</tool_call>")


def input_of(fmt: str, text: str) -> str:
    """The input of the one call in ``text``, read by the format's parser."""
    tools = [APPLY_PATCH, WEATHER]
    if fmt in ("json_tools", "qwen3_coder"):
        parser = json_tools if fmt == "json_tools" else qwen3_coder
        body = text.removeprefix(parser.tool_call_start).removesuffix(parser.tool_call_end)
        call = parser.parse_tool_call(body, tools)
    elif fmt == "mistral":
        call = mistral.parse_tool_call(text.removeprefix(mistral.tool_call_start), tools)
    else:
        call = json.loads(text)
        call["arguments"] = call.pop("parameters")
    assert call["name"] == "apply_patch"
    arguments = call["arguments"]
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    assert set(arguments) == {"input"}
    return arguments["input"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_enforced_lark_call_takes_patches_and_nothing_else(tokenizer, grammars, fmt):
    constraint = grammars.for_tools([APPLY_PATCH, WEATHER],
                                    _choice(OutputFormat(type="lark", pattern=APPLY_PATCH_GRAMMAR)),
                                    fmt)
    for text in PATCHES:
        assert accepts(tokenizer, constraint, call_text(fmt, text)), text
    for text in NOT_PATCHES:
        assert not accepts(tokenizer, constraint, call_text(fmt, text)), text


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(2))
def test_an_enforced_lark_call_from_random_logits_is_a_valid_patch(tokenizer, grammars, fmt,
                                                                   seed):
    constraint = grammars.for_tools([APPLY_PATCH, WEATHER],
                                    _choice(OutputFormat(type="lark", pattern=APPLY_PATCH_GRAMMAR)),
                                    fmt)
    text = input_of(fmt, sample(tokenizer, constraint, _bias(tokenizer, patches=True), seed))
    assert text.startswith("*** Begin Patch\n")
    assert takes(grammars, APPLY_PATCH_GRAMMAR, text), text


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_enforced_regex_call_matches_the_whole_regex(tokenizer, grammars, fmt):
    pattern = r'(ls|cat) [a-z"\\]{1,5}'
    constraint = grammars.for_tools([APPLY_PATCH, WEATHER],
                                    _choice(OutputFormat(type="regex", pattern=pattern)), fmt)
    for seed in range(3):
        text = input_of(fmt, sample(tokenizer, constraint, _bias(tokenizer, patches=False),
                                    seed))
        assert re.fullmatch(pattern, text), text
    assert not accepts(tokenizer, constraint, call_text(fmt, "rm -rf"))
    assert not accepts(tokenizer, constraint, call_text(fmt, "xls a"))


def test_a_text_format_or_no_format_leaves_the_input_free(tokenizer, grammars):
    for formats in (None, {}):
        choice = ToolChoice(mode="function", name="apply_patch", input_formats=formats)
        constraint = grammars.for_tools([APPLY_PATCH, WEATHER], choice, "json_tools")
        assert accepts(tokenizer, constraint, call_text("json_tools", 'any "text"\n'))
