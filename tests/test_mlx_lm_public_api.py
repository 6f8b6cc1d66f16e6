"""Troupe reaches mlx-lm through its public API only: a test walks the AST of every module
under actors/, api/ and runtime/ and lists each use of a private mlx-lm name outside
``actors/mlx_lm_private.py`` (the one module that may hold them, each with its reason).

What counts as a use: importing an underscore name from an ``mlx_lm`` module; an underscore
attribute of a name bound from an ``mlx_lm`` import (``BatchKVCache._idx``); an underscore
attribute that mlx-lm's classes define (every ``self._x`` they assign and every ``_x`` method,
read from the installed mlx-lm's source) and the module's own classes do not, read or
written on any object, or named as a string to ``getattr``/``setattr``/``hasattr``/
``delattr``; and a method overriding one of those in a subclass of an mlx-lm class.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import mlx_lm

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "api", "runtime")
ALLOWED = ROOT / "actors" / "mlx_lm_private.py"
NAMED_BY_STRING = frozenset({"getattr", "setattr", "hasattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_privates(tree: ast.AST, skip_bases: frozenset[str] = frozenset()) -> set[str]:
    """The private names the classes of ``tree`` define: ``self._x`` assigned, ``def _x``.
    Classes with a base in ``skip_bases`` (subclasses of mlx-lm's) are left out."""
    names: set[str] = set()
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        if any(_base_name(b) in skip_bases for b in cls.bases):
            continue
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                    and isinstance(node.value, ast.Name) and node.value.id == "self"
                    and _private(node.attr)):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _private(node.name):
                names.add(node.name)
    return names


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


@functools.cache
def mlx_lm_privates() -> frozenset[str]:
    """Every private attribute or method name of the installed mlx-lm's classes."""
    names: set[str] = set()
    for path in Path(mlx_lm.__file__).parent.rglob("*.py"):
        names |= _class_privates(ast.parse(path.read_text(), str(path)))
    return frozenset(names)


def _troupe_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if p != ALLOWED)


def _mlx_lm_bindings(tree: ast.AST) -> set[str]:
    """Names a module binds from ``mlx_lm`` imports (modules, classes, functions)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mlx_lm":
                    bound.add(alias.asname or "mlx_lm")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            bound.update(alias.asname or alias.name for alias in node.names)
    return bound


def private_uses(source: str, name: str) -> list[str]:
    """Each use of a private mlx-lm name in the module ``source`` (named ``name``), as
    ``name:line attribute``."""
    tree = ast.parse(source, name)
    bound = _mlx_lm_bindings(tree)
    # A name the module's own classes also define (not its subclasses of mlx-lm's) is theirs.
    theirs = mlx_lm_privates() - _class_privates(tree, frozenset(bound))
    uses: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            uses += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            of_mlx_lm = isinstance(node.value, ast.Name) and node.value.id in bound
            if of_mlx_lm or node.attr in theirs:
                uses.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in NAMED_BY_STRING and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in theirs):
            uses.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ClassDef) and any(_base_name(b) in bound for b in node.bases):
            uses += [(f.lineno, f.name) for f in node.body
                     if isinstance(f, ast.FunctionDef) and f.name in mlx_lm_privates()]
    return [f"{name}:{line} {attr}" for line, attr in sorted(uses)]


def all_private_uses() -> list[str]:
    return [use for path in _troupe_modules()
            for use in private_uses(path.read_text(), str(path.relative_to(ROOT)))]


SAMPLE = """
from mlx_lm.generate import GenerationBatch, _right_pad_prompts
from mlx_lm.models.cache import BatchKVCache

class Batch(GenerationBatch):
    def _step(self):
        return self._next_tokens

def roll(cache, gen):
    n = BatchKVCache._idx
    pad = getattr(cache, "_right_padding", None)
    return gen._prompt_batch, n, pad
"""


def test_the_walk_finds_each_kind_of_private_use() -> None:
    assert private_uses(SAMPLE, "sample.py") == [
        "sample.py:2 _right_pad_prompts", "sample.py:6 _step", "sample.py:7 _next_tokens",
        "sample.py:10 _idx", "sample.py:11 _right_padding", "sample.py:12 _prompt_batch"]


def test_a_modules_own_private_names_are_not_mlx_lms() -> None:
    own = """
class Clock:
    def __init__(self):
        self._step = 0
        self._counters = {}

    def tick(self, other):
        self._step += 1
        return other._counters
"""
    assert "_step" in mlx_lm_privates() and "_counters" in mlx_lm_privates()
    assert private_uses(own, "own.py") == []


def test_no_module_uses_a_private_mlx_lm_name_outside_mlx_lm_private() -> None:
    uses = all_private_uses()
    assert not uses, ("private mlx-lm names used outside actors/mlx_lm_private.py "
                      "(move them there with their reason, or use the public API):\n"
                      + "\n".join(uses))
