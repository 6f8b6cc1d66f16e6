"""Freeform tools (the Responses API's ``custom`` tools): the grammar of a call's ``input``.

A freeform tool reaches the chat template as a function that takes one string, ``input``
(``INPUT``). When its call is enforced (``ToolChoice.input_formats``), that string follows
the tool's grammar, written the way the model's tool-call format writes a string:

- qwen3_coder writes a string parameter as raw text: a Lark grammar is nested as it is
  (``LarkInput``), a regex becomes the parameter's ``pattern``;
- the JSON formats write it as a JSON string: a regex becomes a JSON Schema ``pattern``
  (llguidance matches it on the decoded string), and a Lark grammar is rewritten into the
  grammar of its sentences' JSON-escaped text (``json_string_grammar``), then nested.

The rewrite escapes each character as ``json.dumps`` writes it (``\\"``, ``\\\\``,
``\\n``..., ``\\u00XX`` for the other control characters, everything else as itself): one
spelling per character, none a prefix of another, so the prompt a call goes back as is the
text the model wrote. What it cannot rewrite (``%json``, special tokens, nested grammars,
negated terminals, regex anchors or look-arounds on special characters) is a
``FreeformError`` saying why: the call is refused rather than left unenforced.
"""

from __future__ import annotations

import json
import re
import re._constants as sre  # the parsed form's opcodes (stdlib, stable since 3.11)
import re._parser as sre_parse  # Python's own regex parser: the AST of a terminal
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from llguidance import LLMatcher

from troupe.actors.messages import OutputFormat

# The one parameter a freeform tool takes.
INPUT = "input"

# Characters a JSON string cannot hold as themselves.
_SPECIALS = ['"', "\\", *map(chr, range(0x20))]
# Any character a JSON string holds as itself (a regex class, in llguidance's syntax).
_PLAIN = r'[^"\\\x00-\x1F]'

# Lark's common terminals llguidance imports (lark/grammars/common.lark), as Python regexes.
_COMMON = {
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[a-fA-F0-9]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "_EXP": r"[eE][+-]?[0-9]+",
    "FLOAT": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+",
    "SIGNED_FLOAT": r"[+-]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[0-9]+[eE][+-]?[0-9]+)",
    "NUMBER": r"[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?"
    r"|[0-9]+[eE][+-]?[0-9]+)",
    "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"',
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[A-Za-z]",
    "WORD": r"[A-Za-z]+",
    "CNAME": r"[_A-Za-z][_A-Za-z0-9]*",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "CR": r"\r",
    "LF": r"\n",
    "NEWLINE": r"(?:\r?\n)+",
    "SH_COMMENT": r"#[^\n]*",
    "CPP_COMMENT": r"//[^\n]*",
    "C_COMMENT": r"/\*[^*]*\*+(?:[^/*][^*]*\*+)*/",
    "SQL_COMMENT": r"--[^\n]*",
}


class FreeformError(ValueError):
    """A freeform tool's grammar that cannot be enforced: str(err) says why, for a 400."""


# --- what grammar.py builds a call from -------------------------------------------------


def input_schema(pattern: str | None = None) -> dict[str, Any]:
    """The parameters of a freeform tool: one required string ``input`` (matching the
    regex ``pattern`` whole, when given)."""
    field: dict[str, Any] = {"type": "string"}
    if pattern is not None:
        field["pattern"] = f"^(?:{pattern})$"
    return {"type": "object", "properties": {INPUT: field}, "required": [INPUT],
            "additionalProperties": False}


@dataclass(frozen=True)
class LarkInput:
    """A freeform tool's ``input`` that follows a Lark grammar, in a constrained call: the
    Lark items of its value in each format, and the nested grammar they refer to as
    ``@name``."""

    definition: str
    name: str

    def json_item(self) -> str:
        """The arguments object, written as the JSON formats write it (tojson's spacing)."""
        return f'"{{\\"{INPUT}\\": \\"" @{self.name} "\\"}}"'

    def qwen3_item(self) -> str:
        """The parameter, written as qwen3_coder writes a string: raw text between lines."""
        return f'"<parameter={INPUT}>\\n" @{self.name} "\\n</parameter>\\n"'

    def nested(self, raw: bool) -> dict[str, str]:
        """The grammar ``@name`` refers to: the definition itself where the format writes
        the input as raw text (``raw``), else the grammar of its JSON-escaped text."""
        lark = self.definition if raw else json_string_grammar(self.definition)
        return {"lark_grammar": lark, "name": self.name}


def with_inputs(funcs: list[tuple[str, Any]], formats: dict[str, OutputFormat] | None
                ) -> list[tuple[str, Any]]:
    """``funcs`` ((name, parameters) of the tools a call may name) with each freeform tool's
    parameters replaced by what its call must follow: a schema whose ``input`` matches a
    regex, or a ``LarkInput``. Tools of ``text`` format keep their plain string ``input``."""
    out: list[tuple[str, Any]] = []
    for i, (name, params) in enumerate(funcs):
        fmt = (formats or {}).get(name)
        if fmt is not None and fmt.type == "regex" and fmt.pattern is not None:
            params = input_schema(fmt.pattern)
        elif fmt is not None and fmt.type == "lark" and fmt.pattern is not None:
            params = LarkInput(fmt.pattern, f"input{i}")
        out.append((name, params))
    return out


def nested_grammars(funcs: list[tuple[str, Any]], raw: bool) -> list[dict[str, str]]:
    """The grammars the calls' ``LarkInput`` items refer to."""
    return [params.nested(raw) for _, params in funcs if isinstance(params, LarkInput)]


def check_format(fmt: OutputFormat) -> str | None:
    """Why a freeform tool's ``lark`` or ``regex`` format cannot be enforced, or None when it
    can: in every tool-call format (as raw text, and as a JSON string)."""
    if fmt.type == "regex":
        grammar = LLMatcher.grammar_from_regex(fmt.pattern or "")
        return _invalid(grammar) or _invalid(
            LLMatcher.grammar_from_json_schema(input_schema(fmt.pattern)))
    if fmt.type == "lark":
        definition = fmt.pattern or ""
        try:
            escaped = json_string_grammar(definition)
        except FreeformError as exc:
            return str(exc)
        return _invalid(LLMatcher.grammar_from_lark(definition)) or _invalid(
            LLMatcher.grammar_from_lark(escaped))
    return None


def _invalid(grammar: str) -> str | None:
    """llguidance's reason ``grammar`` does not compile, or None."""
    return LLMatcher.validate_grammar(grammar).strip() or None


# --- the Lark rewrite ---------------------------------------------------------------------
#
# llguidance reads a grammar's terminals greedily, one byte ahead: a terminal ends where the
# next byte cannot go on with it. Escaped, two terminals can meet where the next byte is a
# backslash that both could take ("file\n": the name could go on with \", the line ends with
# \n), and one byte cannot tell. So a terminal whose text can hold special characters is
# rewritten into a rule whose lexemes are single characters as JSON writes them (one
# codeword each: no lexeme then ever reaches past a character). A terminal that cannot hold
# any keeps its text, which escaping leaves as it is. The result reads the grammar as a
# context-free grammar: where llguidance's greedy reading of a terminal takes less (two
# terminals that split a text two ways), the rewrite takes the escaped text of either way.

# llguidance's Lark lexemes (parser/src/lark/lexer.rs): the longest match wins.
_LEXEMES = [
    ("SKIP", r"(?:#|//)[^\n]*|[ \t]+"),
    ("NEWLINE", r"(?:\r?\n)+[ \t]*"),
    ("KEYWORD", r"%[a-z]+"),
    ("NEST", r"@\{|@\}"),
    ("GRAMMAR_REF", r"@[a-zA-Z0-9_\-]+"),
    ("SPECIAL", r"<[^<>\s]+>"),
    ("STRING", r'"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1F\x7F])*"i?'),
    ("REGEX", r"/(?:\\.|[^/\\])+/[imslux]*"),
    ("RULE", r"!?[_?]?[a-z][_a-z0-9\-]*"),
    ("TOKEN", r"_?[A-Z][_A-Z0-9\-]*"),
    # A fraction needs its digits here, so that "0..2" is a range.
    ("NUMBER", r"[+-]?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"),
    ("PUNCT", r"->|\.\.|[:,.(){}\[\]~|=&+*?]"),
]
_LEXEME_RES = [(kind, re.compile(rx)) for kind, rx in _LEXEMES]
_UNSUPPORTED = {
    "%json": "%json (a JSON Schema inside the grammar)",
    "%regex": "%regex",
    "%llguidance": "%llguidance options",
    "%declare": "%declare",
    "%override": "%override",
}


@dataclass(frozen=True)
class _Lexeme:
    kind: str
    text: str
    line: int


@dataclass
class _Statement:
    kind: str  # "rule", "terminal" or "ignore"
    head: list[_Lexeme]  # the name (a rule's with its alias markers), up to the colon
    body: list[_Lexeme]


def _lex(definition: str) -> list[_Lexeme]:
    out, pos, line = [], 0, 1
    while pos < len(definition):
        best: tuple[int, str] | None = None
        for kind, rx in _LEXEME_RES:
            match = rx.match(definition, pos)
            if match and (best is None or match.end() > best[0]):
                best = (match.end(), kind)
        if best is None:
            raise FreeformError(f"line {line}: cannot read {definition[pos:pos + 20]!r}")
        end, kind = best
        text = definition[pos:end]
        if kind != "SKIP":
            out.append(_Lexeme(kind, text, line))
        line += text.count("\n")
        pos = end
    return out


def _check(lexemes: list[_Lexeme]) -> None:
    """Refuse what cannot be in a JSON string, or cannot be rewritten."""
    for i, lx in enumerate(lexemes):
        where = f"line {lx.line}"
        if lx.kind == "KEYWORD" and lx.text not in ("%import", "%ignore"):
            what = _UNSUPPORTED.get(lx.text, lx.text)
            raise FreeformError(f"{where}: {what} is not supported in a freeform tool's grammar")
        if lx.kind in ("NEST", "GRAMMAR_REF"):
            raise FreeformError(f"{where}: nested grammars ({lx.text}) are not supported")
        if lx.kind == "SPECIAL":
            raise FreeformError(f"{where}: special tokens ({lx.text}) cannot be in a string")
        if lx.text == "~" and (i + 1 == len(lexemes) or lexemes[i + 1].kind != "NUMBER"):
            raise FreeformError(f"{where}: negated terminals (~) are not supported")


def _statements(lexemes: list[_Lexeme]) -> list[_Statement]:
    """The grammar's statements; a line starting with ``|`` goes on with the one above."""
    lines: list[list[_Lexeme]] = [[]]
    for i, lx in enumerate(lexemes):
        if lx.kind == "NEWLINE":
            if i + 1 < len(lexemes) and lexemes[i + 1].text != "|":
                lines.append([])
        else:
            lines[-1].append(lx)
    out: list[_Statement] = []
    for line in filter(None, lines):
        first, where = line[0], f"line {line[0].line}"
        if first.text == "%import":
            out += _imports(line[1:], where)
        elif first.text == "%ignore":
            out.append(_Statement("ignore", [first], line[1:]))
        elif first.kind in ("RULE", "TOKEN"):
            colon = next((j for j, lx in enumerate(line) if lx.text == ":"), None)
            if colon is None:
                raise FreeformError(f"{where}: a definition needs ':'")
            head = line[:colon]
            # A rule's name alone; a terminal's may carry its priority (NAME.2).
            if first.kind == "RULE" and len(head) != 1 or first.kind == "TOKEN" and (
                    len(head) not in (1, 3) or len(head) == 3 and head[1].text != "."):
                raise FreeformError(f"{where}: templates and attributes on {first.text!r} "
                                    "are not supported")
            kind = "rule" if first.kind == "RULE" else "terminal"
            out.append(_Statement(kind, head, line[colon + 1:]))
        else:
            raise FreeformError(f"{where}: cannot read a statement starting {first.text!r}")
    return out


def _imports(lexemes: list[_Lexeme], where: str) -> list[_Statement]:
    """``%import common.X [-> Y]`` or ``%import common (X, Y)``: the terminals' definitions."""
    texts = [lx.text for lx in lexemes]
    names: list[tuple[str, str]] = []
    if texts[:2] == ["common", "."] and len(texts) in (3, 5) and texts[3:4] in ([], ["->"]):
        names.append((texts[2], texts[-1]))
    elif texts[:2] == ["common", "("] and texts[-1:] == [")"]:
        names += [(name, name) for name in texts[2:-1] if name != ","]
    else:
        raise FreeformError(f"{where}: only '%import common.NAME' and "
                            f"'%import common (NAMES)' are supported")
    line = lexemes[0].line
    out = []
    for name, alias in names:
        if name not in _COMMON:
            raise FreeformError(f"{where}: common.{name} is not a common terminal")
        regex = "/" + _COMMON[name].replace("/", "\\/") + "/"
        out.append(_Statement("terminal", [_Lexeme("TOKEN", alias, line)],
                              [_Lexeme("REGEX", regex, line)]))
    return out


@lru_cache(maxsize=64)
def json_string_grammar(definition: str) -> str:
    """The Lark grammar (llguidance's dialect) of the JSON-escaped text of ``definition``'s
    sentences: what a JSON string holding one of them has between its quotes. Raises
    FreeformError for what cannot be rewritten."""
    lexemes = _lex(definition)
    _check(lexemes)
    statements = _statements(lexemes)
    terminals = {st.head[0].text: st.body for st in statements if st.kind == "terminal"}
    rules = {st.head[0].text.lstrip("!?") for st in statements if st.kind == "rule"}
    special = _special_terminals(terminals)
    names = _rule_names(terminals, rules)
    rewrite = _Rewrite(terminals, special, names)
    out = []
    for st in statements:
        head = " ".join(lx.text for lx in st.head)
        if st.kind == "rule":
            out.append(f"{head}: {rewrite.in_rule(st.body)}")
        elif st.kind == "ignore":
            out.append(f"%ignore {rewrite.ignored(st.body)}")
        elif st.head[0].text not in special:
            out.append(f"{head}: {' '.join(lx.text for lx in st.body)}")
    # The rules of the terminals rewritten character by character, as far as they are used.
    done: set[str] = set()
    while rewrite.wanted - done:
        name = min(rewrite.wanted - done)
        done.add(name)
        out.append(f"{names[name]}: {rewrite.by_char(terminals[name])}")
    return "\n".join(out) + "\n"


def _rule_names(terminals: dict[str, list[_Lexeme]], rules: set[str]) -> dict[str, str]:
    """A rule name for each terminal, clashing with none of the grammar's."""
    names = {}
    for name in terminals:
        rule = "tok_" + name.lower()
        while rule in rules:
            rule += "_"
        names[name] = rule
    return names


def _special_terminals(terminals: dict[str, list[_Lexeme]]) -> set[str]:
    """The terminals whose text can hold a character JSON escapes."""
    special: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, body in terminals.items():
            if name not in special and any(
                    lx.kind == "TOKEN" and lx.text in special or _holds_special(lx, body, i)
                    for i, lx in enumerate(body)):
                special.add(name)
                changed = True
    return special


def _holds_special(lx: _Lexeme, body: list[_Lexeme], i: int) -> bool:
    """Whether a string, range or regex lexeme's text can hold a special character."""
    where = f"line {lx.line}"
    if lx.kind == "STRING":
        if i + 2 < len(body) and body[i + 1].text == ".." and body[i + 2].kind == "STRING":
            return _range_items(lx.text, body[i + 2].text, where)[1]
        return any(c in _SPECIALS for c in _string_text(lx.text))
    if lx.kind == "REGEX":
        pattern, flags = _regex_parts(lx.text, where)
        return _special(_parse(pattern, flags, where), where, pattern)
    return False


class _Rewrite:
    """Rewrites a statement's lexemes: in a rule (what can hold special characters becomes
    single-character lexemes), in a terminal's rule (everything does), in an %ignore."""

    def __init__(self, terminals: dict[str, list[_Lexeme]], special: set[str],
                 names: dict[str, str]) -> None:
        self.terminals = terminals
        self.special = special
        self.names = names
        self.wanted: set[str] = set()  # the terminals whose character rules are used

    def in_rule(self, body: list[_Lexeme]) -> str:
        return self._walk(body, by_char=False)

    def by_char(self, body: list[_Lexeme]) -> str:
        return self._walk(body, by_char=True)

    def _walk(self, body: list[_Lexeme], by_char: bool) -> str:
        out: list[str] = []
        i = 0
        while i < len(body):
            lx = body[i]
            where = f"line {lx.line}"
            if (lx.kind == "STRING" and i + 2 < len(body) and body[i + 1].text == ".."
                    and body[i + 2].kind == "STRING"):
                items, special = _range_items(lx.text, body[i + 2].text, where)
                out.append(f"/{_set(items, 0)}/" if special or by_char else
                           f"{lx.text} .. {body[i + 2].text}")
                i += 3
                continue
            if lx.kind == "STRING":
                keep = not by_char and not _holds_special(lx, body, i)
                out.append(lx.text if keep else _string_chars(lx.text))
            elif lx.kind == "REGEX":
                keep = not by_char and not _holds_special(lx, body, i)
                out.append(lx.text if keep else _regex_chars(lx.text, where))
            elif lx.kind == "TOKEN" and lx.text in self.terminals and (
                    by_char or lx.text in self.special):
                self.wanted.add(lx.text)
                out.append(self.names[lx.text])
            elif lx.text == "&" and by_char:
                raise FreeformError(f"{where}: '&' in a terminal that can hold special "
                                    "characters is not supported")
            else:
                out.append(lx.text)
            i += 1
        return " ".join(out)

    def ignored(self, body: list[_Lexeme]) -> str:
        """An %ignore'd terminal: as it is when it cannot hold special characters; one
        character at a time when it is a class of them repeated; refused otherwise."""
        where = f"line {body[0].line}" if body else "%ignore"
        if len(body) == 1 and body[0].kind == "TOKEN" and body[0].text in self.terminals:
            name = body[0].text
            if name not in self.special:
                return name
            body = self.terminals[name]
        if not any(lx.kind == "TOKEN" or _holds_special(lx, body, i)
                   for i, lx in enumerate(body)):
            return " ".join(lx.text for lx in body)
        if len(body) == 1 and body[0].kind == "REGEX":
            pattern, flags = _regex_parts(body[0].text, where)
            parsed = _parse(pattern, flags, where)
            items = list(parsed)
            if len(items) == 1 and items[0][0] in _REPEATS and items[0][1][0] <= 1 \
                    and items[0][1][1] == sre.MAXREPEAT:
                items = list(items[0][1][2])
            if len(items) == 1 and items[0][0] in _ONE_CHAR:
                return f"/{_chars(items, parsed.state.flags, where, pattern)}/"
        if len(body) == 1 and body[0].kind == "STRING" and len(_string_text(body[0].text)) == 1:
            return _string_chars(body[0].text)
        raise FreeformError(f"{where}: an %ignore'd text that can hold characters JSON escapes "
                            "must be one character, or a class of them repeated")


def _lit(text: str) -> str:
    """``text`` as a Lark string literal (JSON's syntax; llguidance wants DEL escaped)."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _escape(char: str) -> str:
    """How a JSON string (``json.dumps``) writes ``char``."""
    return json.dumps(char, ensure_ascii=False)[1:-1]


def _string_text(token: str) -> str:
    return json.loads(token[:-1] if token.endswith("i") else token)


def _string_chars(token: str) -> str:
    """A string literal as one lexeme a character (a case-insensitive one's letters as
    classes)."""
    flags = re.IGNORECASE if token.endswith("i") else 0
    text = _string_text(token)
    return f"({' '.join(_char_item(c, flags) for c in text)})" if text else '""'


def _char_item(char: str, flags: int) -> str:
    """One character as a lexeme: its escape, or itself (either case with IGNORECASE)."""
    if char in _SPECIALS:
        return _lit(_escape(char))
    if flags & re.IGNORECASE and char.lower() != char.upper():
        return f"/(?i:{_text(char)})/"
    return _lit(char)


def _range_items(start: str, end: str, where: str) -> tuple[list[tuple[Any, Any]], bool]:
    """A range ``"a".."z"`` as a class item, and whether it holds a special character."""
    a, b = json.loads(start), json.loads(end)
    if len(a) != 1 or len(b) != 1 or a > b:
        raise FreeformError(f"{where}: a range needs two characters in order")
    return [(sre.RANGE, (ord(a), ord(b)))], any(a <= c <= b for c in _SPECIALS)


def _regex_parts(token: str, where: str) -> tuple[str, int]:
    body, _, flag_text = token[1:].rpartition("/")
    flags = 0
    for flag in flag_text:
        if flag == "l":
            raise FreeformError(f"{where}: the regex flag 'l' is not supported")
        flags |= {"i": re.IGNORECASE, "s": re.DOTALL, "m": re.MULTILINE,
                  "x": re.VERBOSE}.get(flag, 0)
    return body, flags


def _parse(pattern: str, flags: int, where: str) -> Any:
    """Python's parse of a terminal's regex (the two syntaxes agree where it succeeds)."""
    try:
        with warnings.catch_warnings():
            # Python reads "[[:alpha:]]" or "&&" in a class as plain characters, where
            # llguidance reads a class or an operation: refuse what the two read apart.
            warnings.simplefilter("error", FutureWarning)
            return sre_parse.parse(pattern, flags)
    except (re.error, FutureWarning) as exc:
        raise FreeformError(f"{where}: the regex /{pattern}/ cannot be read: {exc}") from exc


def _regex_chars(token: str, where: str) -> str:
    pattern, flags = _regex_parts(token, where)
    parsed = _parse(pattern, flags, where)
    return f"({_chars(parsed, parsed.state.flags, where, pattern)})"


_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)
_ONE_CHAR = (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN)
_REFUSED = {sre.AT: "anchors", sre.ASSERT: "look-arounds", sre.ASSERT_NOT: "look-arounds",
            sre.GROUPREF: "back-references", sre.GROUPREF_EXISTS: "back-references",
            sre.ATOMIC_GROUP: "atomic groups"}


def _chars(items: Any, flags: int, where: str, pattern: str) -> str:
    """A parsed regex as Lark rule items of one lexeme a character."""
    out = []
    for op, av in items:
        if op in _ONE_CHAR:
            out.append(f"/{_one_char(op, av, flags)}/")
        elif op is sre.BRANCH:
            out.append("(" + " | ".join(_chars(b, flags, where, pattern) for b in av[1]) + ")")
        elif op is sre.SUBPATTERN:
            _, add, remove, sub = av
            out.append(f"({_chars(sub, (flags | add) & ~remove, where, pattern)})")
        elif op in _REPEATS:
            low, high, sub = av
            item = f"({_chars(sub, flags, where, pattern)})"
            if high == sre.MAXREPEAT:
                out.append({0: f"{item}*", 1: f"{item}+"}.get(low, f"{item} ~ {low} {item}*"))
            else:
                out.append(f"{item}?" if (low, high) == (0, 1) else f"{item} ~ {low}..{high}")
        else:
            what = _REFUSED.get(op, str(op).lower())
            raise FreeformError(f"{where}: the regex /{pattern}/ uses {what}, which a "
                                "freeform tool's grammar cannot have")
    return " ".join(out) or '""'


def _special(items: Any, where: str, pattern: str) -> bool:
    """Whether a parsed regex can match a special character."""
    for op, av in items:
        if op is sre.LITERAL:
            if chr(av) in _SPECIALS:
                return True
        elif op is sre.IN:
            negate = bool(av) and av[0][0] is sre.NEGATE
            tests = [_member(o, a) for o, a in (av[1:] if negate else av)]
            if any(any(t(c) for t in tests) != negate for c in _SPECIALS):
                return True
        elif op in (sre.ANY, sre.NOT_LITERAL):
            return True
        elif op is sre.BRANCH:
            if any(_special(b, where, pattern) for b in av[1]):
                return True
        elif op is sre.SUBPATTERN:
            if _special(av[3], where, pattern):
                return True
        elif op in _REPEATS:
            if _special(av[2], where, pattern):
                return True
        elif op in _REFUSED and op is not sre.AT:
            return True  # rewritten by character, which refuses it
    return False


def _one_char(op: Any, av: Any, flags: int) -> str:
    """One character of a match (a literal, a class, any) as one codeword's regex."""
    if op is sre.LITERAL:
        char = chr(av)
        if char in _SPECIALS:
            return _text(_escape(char))
        text = _text(char)
        return f"(?i:{text})" if flags & re.IGNORECASE and char.lower() != char.upper() else text
    if op is sre.NOT_LITERAL:
        return _set([(sre.NEGATE, None), (sre.LITERAL, av)], flags)
    if op is sre.ANY:
        dot = [] if flags & re.DOTALL else [(sre.LITERAL, ord("\n"))]
        return _set([(sre.NEGATE, None), *dot], flags)
    return _set(av, flags)


def _text(text: str) -> str:
    """A regex matching ``text`` exactly: punctuation as ``\\x{..}`` (never ends a /regex/)."""
    return "".join(c if c.isalnum() or c == "_" or ord(c) > 0x7F else f"\\x{{{ord(c):02X}}}"
                   for c in text)


# A class's items in llguidance's syntax, and whether a special character is among them
# (Unicode White_Space, as llguidance's \s, holds the controls 0x09-0x0D).
_CATEGORIES = {
    sre.CATEGORY_DIGIT: ("\\d", lambda c: False),
    sre.CATEGORY_NOT_DIGIT: ("\\D", lambda c: True),
    sre.CATEGORY_SPACE: ("\\s", lambda c: "\t" <= c <= "\r"),
    sre.CATEGORY_NOT_SPACE: ("\\S", lambda c: not "\t" <= c <= "\r"),
    sre.CATEGORY_WORD: ("\\w", lambda c: False),
    sre.CATEGORY_NOT_WORD: ("\\W", lambda c: True),
}


def _member(op: Any, av: Any) -> Any:
    """A class item's test of whether it holds a (special) character."""
    if op is sre.LITERAL:
        return lambda c: ord(c) == av
    if op is sre.RANGE:
        return lambda c: av[0] <= ord(c) <= av[1]
    if op is sre.CATEGORY and av in _CATEGORIES:
        return _CATEGORIES[av][1]
    raise FreeformError(f"a regex class holds {op}, which is not supported")


def _class_item(op: Any, av: Any) -> str:
    if op is sre.LITERAL:
        return f"\\x{{{av:X}}}"
    if op is sre.RANGE:
        return f"\\x{{{av[0]:X}}}-\\x{{{av[1]:X}}}"
    if op is sre.CATEGORY and av in _CATEGORIES:
        return _CATEGORIES[av][0]
    raise FreeformError(f"a regex class holds {op}, which is not supported")


def _set(items: list[tuple[Any, Any]], flags: int) -> str:
    """One character of a class, as one codeword's regex: a plain character it holds as
    itself, or the escape of a special one it holds."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    members = items[1:] if negate else items
    body = "".join(_class_item(op, av) for op, av in members)
    tests = [_member(op, av) for op, av in members]
    plain = (f'[^{body}"\\\\\\x00-\\x1F]' if negate
             else f'[[{body}]&&{_PLAIN}]' if body else "")
    if plain and flags & re.IGNORECASE:
        plain = f"(?i:{plain})"
    held = [c for c in _SPECIALS if any(t(c) for t in tests) != negate]
    alternatives = [plain] if plain else []
    alternatives += [_text(_escape(c)) for c in held]
    if not alternatives:
        return "[^\\x00-\\x{10FFFF}]"  # an empty class: matches nothing
    return alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
