"""Whether a JSON Schema has a finite value (actors/engine/finite_schema.py): the check that
refuses, before any token, a schema whose grammar could never end.

Each satisfiable schema comes with a finite value that ``jsonschema`` validates against it,
so the expectation itself is checked; each unsatisfiable one with the explanation's steps.
"""

from __future__ import annotations

import jsonschema
import pytest

from troupe.actors.engine.finite_schema import _Finite, unsatisfiable

# The issue's reproductions.
SELF = {"$ref": "#"}
MUTUAL = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
          "$ref": "#/$defs/a"}
NESTED = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                          "required": ["c"]}},
          "$ref": "#/$defs/n"}
CYCLE = ": a cycle with no way out"

SATISFIABLE = [
    pytest.param({"type": "object", "properties": {"c": {"$ref": "#"}}}, {},
                 id="optional-recursion"),
    pytest.param({"anyOf": [{"type": "null"},
                            {"type": "object", "properties": {"c": {"$ref": "#"}},
                             "required": ["c"]}]},
                 {"c": {"c": None}}, id="recursion-under-anyOf-with-a-leaf-branch"),
    pytest.param({"oneOf": [{"type": "object", "properties": {"c": {"$ref": "#"}},
                             "required": ["c"]},
                            {"type": "integer"}]},
                 {"c": 3}, id="recursion-under-oneOf-with-a-leaf-branch"),
    pytest.param({"type": "array", "items": {"$ref": "#"}}, [[], [[]]],
                 id="array-of-itself-minItems-0"),
    pytest.param({"$defs": {"node": {"type": "object",
                                     "properties": {"kids": {"type": "array",
                                                             "items": {"$ref": "#/$defs/node"}}},
                                     "required": ["kids"]}},
                  "$ref": "#/$defs/node"},
                 {"kids": [{"kids": []}]}, id="tree-whose-children-may-be-none"),
    pytest.param({"type": ["object", "null"], "properties": {"c": {"$ref": "#"}},
                  "required": ["c"]},
                 {"c": None}, id="nullable-recursion"),
    pytest.param({"properties": {"c": {"$ref": "#"}}, "required": ["c"]}, "any string",
                 id="no-type-so-a-scalar-ends-it"),
    pytest.param({"definitions": {"n": {"type": "object",
                                        "properties": {"next": {"$ref": "#/definitions/n"}}}},
                  "$ref": "#/definitions/n"},
                 {"next": {}}, id="draft-7-definitions-linked-list"),
    pytest.param({"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                                  "required": ["b"]},
                            "b": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}},
                  "$ref": "#/$defs/a"},
                 {"b": {"b": "x"}}, id="mutual-recursion-with-a-way-out"),
    pytest.param({"$defs": {"a/b": {"type": "string"}, "t~": {"$ref": "#/$defs/a~1b"}},
                  "$ref": "#/$defs/t~0"}, "x", id="json-pointer-escapes"),
    pytest.param({"type": "object", "properties": {"c": {"enum": []}}}, {},
                 id="an-optional-property-that-allows-nothing"),
    pytest.param({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}],
                  "minItems": 1},
                 ["x"], id="prefixItems-past-minItems-are-optional"),
    pytest.param({"allOf": [{"type": "object"}, {"$ref": "#/$defs/x"}],
                  "$defs": {"x": {"properties": {"y": {"$ref": "#/$defs/x"}}}}},
                 {"y": {}}, id="allOf-of-satisfiable-branches"),
]


@pytest.mark.parametrize(("schema", "value"), SATISFIABLE)
def test_a_schema_with_a_finite_value_passes(schema, value):
    jsonschema.validate(value, schema)  # the expectation holds: a finite value satisfies it
    assert unsatisfiable(schema) is None


UNSATISFIABLE = [
    pytest.param(SELF, "$ref '#'" + CYCLE, id="ref-to-itself"),
    pytest.param(MUTUAL, "$ref '#/$defs/a' → $ref '#/$defs/b' → $ref '#/$defs/a'" + CYCLE,
                 id="two-defs-referring-to-each-other"),
    pytest.param(NESTED, "$ref '#/$defs/n' → required property 'c' → $ref '#/$defs/n'" + CYCLE,
                 id="required-recursive-property"),
    pytest.param({"type": "array", "items": {"$ref": "#"}, "minItems": 1},
                 "items (minItems 1) → $ref '#'" + CYCLE, id="array-of-itself-minItems-1"),
    pytest.param({"type": "array", "prefixItems": [{"type": "string"}, {"$ref": "#"}],
                  "minItems": 2},
                 "prefixItems[1] (minItems 2) → $ref '#'" + CYCLE,
                 id="a-required-prefix-item-of-itself"),
    pytest.param({"type": "array", "items": [{"$ref": "#"}], "minItems": 1},
                 "items[0] (minItems 1) → $ref '#'" + CYCLE, id="draft-7-tuple-items"),
    pytest.param({"type": "array", "contains": {"$ref": "#"}},
                 "contains → $ref '#'" + CYCLE, id="contains-itself"),
    pytest.param({"anyOf": [{"$ref": "#"}, {"type": "array", "items": {"$ref": "#"},
                                            "minItems": 1}]},
                 "anyOf[0] (and every other branch) → $ref '#'" + CYCLE,
                 id="recursion-under-anyOf-without-a-leaf"),
    pytest.param({"anyOf": [{"enum": []}, {"$ref": "#"}]},
                 "anyOf[0] (and every other branch) → enum []",
                 id="no-branch-of-anyOf-allows-a-value"),
    pytest.param({"allOf": [{"type": "object"}, {"$ref": "#/$defs/x"}],
                  "$defs": {"x": {"$ref": "#/$defs/x"}}},
                 "allOf[1] → $ref '#/$defs/x' → $ref '#/$defs/x'" + CYCLE,
                 id="allOf-with-a-cyclic-branch"),
    pytest.param({"definitions": {"n": {"type": ["object", "array"],
                                        "properties": {"up": {"$ref": "#/definitions/n"}},
                                        "required": ["up"],
                                        "items": {"$ref": "#/definitions/n"}, "minItems": 1}},
                  "$ref": "#/definitions/n"},
                 "$ref '#/definitions/n' → required property 'up' → $ref '#/definitions/n'"
                 + CYCLE, id="every-allowed-type-recurses"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string"}},
                  "required": ["a", "b"], "additionalProperties": {"$ref": "#"}},
                 "required property 'b' (additionalProperties) → $ref '#'" + CYCLE,
                 id="a-required-key-only-additionalProperties-describe"),
    pytest.param({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}},
                  "required": ["x"]},
                 "required property 'x' → $ref '#/properties/x'" + CYCLE,
                 id="a-property-referring-to-itself"),
]


@pytest.mark.parametrize(("schema", "why"), UNSATISFIABLE)
def test_a_schema_without_a_finite_value_is_refused_with_the_steps_to_why(schema, why):
    assert unsatisfiable(schema) == why


def test_references_it_cannot_follow_are_taken_as_satisfiable():
    for schema in ({"$ref": "https://example.com/node.json"},
                   {"$ref": "#node"},
                   {"$ref": "#/$defs/missing"},
                   # A nested $id changes what "#" means below it.
                   {"$defs": {"n": {"$id": "https://example.com/n", "$ref": "#"}},
                    "$ref": "#/$defs/n"}):
        assert unsatisfiable(schema) is None, schema


def test_a_long_chain_of_definitions_is_followed_without_recursion():
    """Two thousand definitions, each requiring the next: the last one's way out decides."""
    n = 2000
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}},
                      "required": ["x"]} for i in range(n)}
    ends = {**defs, f"d{n}": {"type": "string"}}
    assert unsatisfiable({"$defs": ends, "$ref": "#/$defs/d0"}) is None
    loops = {**defs, f"d{n}": {"$ref": "#/$defs/d0"}}
    why = unsatisfiable({"$defs": loops, "$ref": "#/$defs/d0"})
    assert why is not None and why.endswith("$ref '#/$defs/d0'" + CYCLE)
    assert why.count("required property 'x'") == n


def test_a_wide_object_is_checked_in_linear_steps(monkeypatch):
    """Each of two thousand required properties is found to end one by one; the object is
    looked at again after them, not after each (two thousand scans of its properties: a
    schema that held the admission thread for seconds). Counted in looks at subschemas."""
    looks = 0
    ok = _Finite.ok

    def counted(self, schema):
        nonlocal looks
        looks += 1
        return ok(self, schema)

    monkeypatch.setattr(_Finite, "ok", counted)
    n = 2000
    props = {f"p{i}": {"type": "string"} for i in range(n)}
    for required in (list(props), list(reversed(props))):
        looks = 0
        assert unsatisfiable({"type": "object", "properties": props,
                              "required": required}) is None
        assert looks <= 4 * n, looks
