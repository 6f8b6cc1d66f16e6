"""Whether a JSON Schema has a finite value: the check run on every schema a grammar enforces
(``response_format``, the parameters of an enforced tool call) before it is served.

llguidance refuses, as it compiles, most schemas that no value satisfies (``false``, an empty
``enum``, a required property that can hold nothing), but not those whose every value would
have to contain another without end: ``{"$ref": "#"}``, two definitions that refer only to
each other, an object that requires a property of its own kind. It compiles them into a
grammar that can never end, and the answer stops short or runs until ``max_tokens``.

``unsatisfiable`` finds them as the least fixpoint over the schema's subschemas: a subschema
has a finite value if its ``enum`` is not empty, its ``$ref`` target, each ``allOf`` branch
and one ``anyOf`` / ``oneOf`` branch have one, and one of the types it allows (any, without
``type``) does: a scalar always, an object when each required property does, an array when
each item its ``minItems`` requires (and ``contains``) does. Whatever else a schema says
(bounds, patterns, values, references it cannot follow) is taken as satisfiable: only what is
provably unsatisfiable is refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# A step of an explanation: what it follows, and the schema it leads to (None: the step
# itself allows no value).
Step = tuple[str, Any]


def unsatisfiable(schema: Any) -> str | None:
    """Why no finite JSON value satisfies ``schema``: the steps from its root to a subschema
    that allows no value, or round a cycle of them (e.g. ``$ref '#/$defs/n' → required
    property 'c' → $ref '#/$defs/n': a cycle with no way out``). None when a value may."""
    check = _Finite(schema)
    if check.unsure or check.ok(schema):
        return None
    return check.why(schema)


class _Finite:
    """The subschemas of one schema that have a finite value, found by a worklist: a subschema
    is looked at again each time one it depends on is found to have one."""

    def __init__(self, root: Any) -> None:
        self.root = root
        # A nested "$id" changes what the "#..." references under it mean: too unsure to refuse.
        self.unsure = False
        self.finite: set[int] = set()
        nodes: dict[int, dict] = {}
        parents: dict[int, list[dict]] = {}
        todo = [root]
        while todo:
            node = todo.pop()
            if not isinstance(node, dict) or id(node) in nodes:
                continue
            nodes[id(node)] = node
            if node is not root and isinstance(node.get("$id"), str):
                self.unsure = True
            for child in self._children(node):
                if isinstance(child, dict):
                    parents.setdefault(id(child), []).append(node)
                    todo.append(child)
        # Innermost first (found after their parents), and first in, first out, each subschema
        # queued once at a time: a parent is looked at again once, after the children found
        # meanwhile, not once for each (which is quadratic in an object's required properties).
        work = deque(reversed(nodes.values()))
        queued = set(nodes)
        while work:
            node = work.popleft()
            queued.discard(id(node))
            if id(node) in self.finite or self._fault(node) is not None:
                continue
            self.finite.add(id(node))
            for parent in parents.get(id(node), ()):
                if id(parent) not in queued and id(parent) not in self.finite:
                    queued.add(id(parent))
                    work.append(parent)

    def ok(self, schema: Any) -> bool:
        """Whether ``schema`` has a finite value, as far as found (a non-schema: yes)."""
        if isinstance(schema, bool):
            return schema
        if isinstance(schema, dict):
            return id(schema) in self.finite
        return True

    def why(self, schema: Any) -> str:
        """The steps down from ``schema`` (which has no finite value) to where that shows."""
        steps: list[str] = []
        path: set[int] = set()
        node = schema
        while isinstance(node, dict):
            path.add(id(node))
            fault = self._fault(node)
            if fault is None:  # not reached: every subschema without a value has a fault
                break
            step, node = fault
            if isinstance(node, dict) and id(node) in path:
                steps.append(f"{step}: a cycle with no way out")
                break
            steps.append(step)
        if node is False:
            steps.append("false")
        return " → ".join(steps)

    # -- one subschema --------------------------------------------------------------------

    def _fault(self, node: dict) -> Step | None:
        """The first reason ``node`` has no finite value, by what is known of its
        subschemas: the step and where it leads. None when it has one."""
        if node.get("enum") == []:
            return "enum []", None
        if "$ref" in node:
            target = self._target(node["$ref"])
            if not self.ok(target):
                return f"$ref {node['$ref']!r}", target
        branches = node.get("allOf")
        if isinstance(branches, list):
            for i, branch in enumerate(branches):
                if not self.ok(branch):
                    return f"allOf[{i}]", branch
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(map(self.ok, branches)):
                more = " (and every other branch)" if len(branches) > 1 else ""
                return f"{key}[0]{more}", branches[0]
        types = node.get("type")
        if isinstance(types, str):
            types = [types]
        if not isinstance(types, list):
            return None  # any type: a scalar always ends
        first: Step | None = None
        for kind in types:
            if kind == "object":
                needs = self._required(node)
            elif kind == "array":
                needs = self._items(node)
            else:
                return None  # a scalar always ends
            fault = next(((step, s) for step, s in needs if not self.ok(s)), None)
            if fault is None:
                return None
            first = first or fault
        return first or ("type []", None)

    def _children(self, node: dict) -> Iterator[Any]:
        """Every subschema ``_fault`` may look at."""
        if "$ref" in node:
            yield self._target(node["$ref"])
        for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
            if isinstance(node.get(key), list):
                yield from node[key]
        if isinstance(node.get("properties"), dict):
            yield from node["properties"].values()
        for key in ("additionalProperties", "items", "additionalItems", "contains"):
            value = node.get(key)
            if isinstance(value, list):
                yield from value
            elif value is not None:
                yield value

    @staticmethod
    def _required(node: dict) -> Iterator[Step]:
        """Each property an object of ``node`` must hold, with its schema where known."""
        names = node.get("required")
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        for name in names if isinstance(names, list) else ():
            if not isinstance(name, str):
                continue
            if name in props:
                yield f"required property {name!r}", props[name]
            elif "additionalProperties" in node and "patternProperties" not in node:
                yield f"required property {name!r} (additionalProperties)", \
                    node["additionalProperties"]

    @staticmethod
    def _items(node: dict) -> Iterator[Step]:
        """Each item an array of ``node`` must hold (its ``minItems``, its ``contains``)."""
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) and not isinstance(least, bool) else 0
        if isinstance(node.get("prefixItems"), list):
            prefix, rest, name = node["prefixItems"], node.get("items"), "prefixItems"
        elif isinstance(node.get("items"), list):  # draft 7 and earlier: a tuple
            prefix, rest, name = node["items"], node.get("additionalItems"), "items"
        else:
            prefix, rest, name = [], node.get("items"), "items"
        for i in range(min(least, len(prefix))):
            yield f"{name}[{i}] (minItems {least})", prefix[i]
        if least > len(prefix) and rest is not None:
            yield f"items (minItems {least})", rest
        if "contains" in node and node.get("minContains", 1) != 0:
            yield "contains", node["contains"]

    def _target(self, ref: Any) -> Any:
        """The subschema a local ``$ref`` names (``#``, or a JSON pointer from the root:
        ``#/$defs/x``, ``#/definitions/x``, ``#/properties/a``...); None for one that cannot
        be followed here (another document, an anchor)."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            return None
        node = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node
