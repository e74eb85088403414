"""Grammars as requests carry them (GenSpec.grammar), in llguidance's terms: what the leader
checks before queueing and what rank 0 compiles (worker/grammar.py). No torch here.

A grammar is `{"json_schema": {...}}` (optionally with `"strict": true`) or `{"lark": "..."}`.

Strict and not strict (`response_format.json_schema.strict`, a tool's `function.strict`): both
are compiled into a grammar, so the output always validates against the schema as JSON Schema
reads it: `additionalProperties` (false or a schema), `patternProperties`, `required`, `enum`,
`const`, `type`, the bounds (`minimum`/`maximum`/`exclusive*`/`multipleOf`,
`minLength`/`maxLength`, `minItems`/`maxItems`, `minProperties`/`maxProperties`), `pattern`
(no look-around or back-references) and `format` are all enforced by the mask. What strict adds,
so that the output is exactly the schema (OpenAI's strict):

- an object that declares its keys (`properties`/`patternProperties`) and states no
  `additionalProperties` gets `additionalProperties: false`: no key the schema does not name
  (JSON Schema alone would let the model invent any). Not inside a multi-branch `allOf` or
  beside `allOf`/`$ref`, where closing one branch would forbid its siblings' keys; state
  `additionalProperties` there yourself;
- a keyword the grammar cannot enforce is refused (a 400 naming the field and the keyword's
  place in the schema) rather than ignored: an unknown word (`nullable`, a misspelt `maxLenght`)
  as well as one llguidance does not implement (`not`, `uniqueItems`, `if`, `propertyNames`...);
- llguidance's approximations are off whatever the schema's own `x-guidance` says (`lenient`,
  which drops unimplemented keywords, and `coerce_one_of`, which reads `oneOf` as `anyOf`), and
  any compile warning is refused as an error.

Not strict, the schema is JSON Schema as written: keys it leaves open are open, and a word JSON
Schema does not know is an annotation; its `x-guidance` options apply.
"""

from __future__ import annotations

import json
from typing import Any

# JSON as json.dumps writes it, and no free whitespace: a small model given free whitespace can
# spend its whole budget on newlines. A schema's own "x-guidance" options override these.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# strict: no approximation, whatever the schema's "x-guidance" asks
STRICT_OPTIONS = {"lenient": False, "coerce_one_of": False}

# The keywords llguidance turns into grammar (its JSON compiler's implemented set) ...
ENFORCED = frozenset({
    "anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type",
    "items", "additionalItems", "prefixItems", "minItems", "maxItems",
    "properties", "additionalProperties", "patternProperties", "required", "minProperties", "maxProperties",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
})
# ... and the ones that assert nothing about the value (annotations, identifiers, containers).
# `discriminator` (OpenAPI, pydantic's tagged unions) only names the property whose `const` in
# each `oneOf` branch already tells them apart. Any `x-...` key is an extension (`x-guidance`).
ANNOTATIONS = frozenset({
    "$schema", "$id", "id", "$anchor", "$comment", "$defs", "definitions", "title", "description",
    "default", "examples", "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding",
    "discriminator",
})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> subschema
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # [subschema]
_SCHEMAS = ("additionalProperties", "items", "additionalItems")  # a subschema (items: or a list)


def strict_schema(schema: Any) -> Any:
    """`schema` as strict compiles it: a copy, objects that declare their keys closed
    (`additionalProperties: false` where none is stated). Raises ValueError naming the place of a
    keyword the grammar cannot enforce."""
    return _strict(schema, "", closable=True)


def _strict(schema: Any, at: str, closable: bool) -> Any:
    if isinstance(schema, bool):
        return schema
    if not isinstance(schema, dict):
        raise ValueError(f"{at or 'the schema'}: a schema must be an object or a boolean, not {type(schema).__name__}")
    unknown = [key for key in schema if key not in ENFORCED and key not in ANNOTATIONS and not key.startswith("x-")]
    if unknown:
        where = ", ".join(f"'{_join(at, key)}'" for key in unknown)
        raise ValueError(f"strict: {where} is not a keyword the grammar can enforce; remove it or leave strict off")
    out = dict(schema)
    for name in _SCHEMA_MAPS:
        if isinstance(schema.get(name), dict):
            out[name] = {key: _strict(sub, _join(at, name, key), closable=True) for key, sub in schema[name].items()}
    for name in _SCHEMA_LISTS:
        if isinstance(schema.get(name), list):
            # an allOf's branches hold together: closing one would forbid the keys of the others
            open_ = name == "allOf" and len(schema[name]) > 1
            out[name] = [_strict(sub, _join(at, name, str(i)), closable=not open_)
                         for i, sub in enumerate(schema[name])]
    for name in _SCHEMAS:
        sub = schema.get(name)
        if isinstance(sub, list) and name == "items":
            out[name] = [_strict(s, _join(at, name, str(i)), closable=True) for i, s in enumerate(sub)]
        elif sub is not None:
            out[name] = _strict(sub, _join(at, name), closable=True)
    declares = "properties" in schema or "patternProperties" in schema
    beside = "allOf" in schema or "$ref" in schema  # keys it does not list may be its siblings'
    if closable and declares and not beside and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _join(at: str, *names: str) -> str:
    return ".".join([at, *names] if at else names)


def grammar_text(grammar: dict[str, Any]) -> str:
    """llguidance's grammar string for a GenSpec grammar (raises ValueError for an unknown form,
    or for a strict schema with a keyword it cannot enforce)."""
    import llguidance

    if "json_schema" in grammar:
        schema = grammar["json_schema"]
        if grammar.get("strict") is True:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(strict_schema(schema)), defaults=JSON_STYLE, overrides=STRICT_OPTIONS)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
    if "lark" in grammar:
        return llguidance.LLMatcher.grammar_from_lark(grammar["lark"])
    raise ValueError(f"unknown grammar form {sorted(grammar)}; expected json_schema or lark")


def check_grammar(grammar: dict[str, Any]) -> str | None:
    """Why `grammar` cannot be compiled (None when it can); no tokenizer needed (the leader's
    check). A strict grammar's compile warnings (an approximation) are reasons too."""
    import llguidance

    loop = _ref_loop(grammar["json_schema"]) if "json_schema" in grammar else None
    if loop is not None:
        return f"$ref {json.dumps(loop)[:80]} refers back to itself before any value is read (it would recurse forever)"
    try:
        text = grammar_text(grammar)
    except ValueError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if is_error or (messages and grammar.get("strict") is True):
        return "; ".join(messages)
    return None


def _ref_loop(schema: Any) -> str | None:
    """A local `$ref` that reaches itself again through `$ref`s and `anyOf`/`oneOf`/`allOf` alone,
    consuming no input on the way (a schema that recurses before any value: the grammar would
    loop or match nothing), or None."""
    on_path: set[int] = set()
    done: set[int] = set()

    def resolve(ref: str) -> Any:
        if not ref.startswith("#"):
            return None  # remote: llguidance refuses those itself
        node = schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def visit(node: Any) -> str | None:
        if not isinstance(node, dict) or id(node) in done:
            return None
        on_path.add(id(node))
        ref = node.get("$ref")
        targets = [resolve(ref)] if isinstance(ref, str) else []
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(node.get(key), list):
                targets += node[key]
        for target in targets:
            if isinstance(target, dict) and id(target) in on_path:
                return ref if isinstance(ref, str) else "#"
            found = visit(target)
            if found is not None:
                return found
        on_path.discard(id(node))
        done.add(id(node))
        return None

    try:
        return visit(schema)
    except RecursionError:
        return "#"
