"""The JSON contract: every --json document the suite produces is checked against its schema.

docs/schema/COMMAND.schema.json (draft 2020-12) describes each command's document; its
validator is compiled once per session. tests/conftest.py wraps ``attnctl.cli.output.print_json``
(every --json document goes through it) so that each document printed in-process is
checked; a test that runs attnctl in a subprocess checks what it parses with :func:`loads`.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import best_match

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = ROOT / "docs" / "schema"
COMMANDS = ("run", "shapes", "memory", "check")
# what the checks cost the session: documents checked and seconds spent
spent = {"documents": 0, "seconds": 0.0}


def schema(command: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / f"{command}.schema.json").read_text(encoding="utf-8"))


# ---------------------------------------------------------------- a fast path
#
# jsonschema checks each value on its own, some microseconds apiece: the attention of one
# long run is millions of weights, and memory's entries hold hundreds of byte counts. Each
# subschema built from the few keywords docs/schema uses is compiled here into one Python
# predicate; a value it accepts is not walked again. A value it does not accept goes to
# jsonschema's own "items" or "properties", whose errors are the ones reported. A predicate
# may refuse more than jsonschema (then jsonschema decides), never less: tests/test_schema.py
# holds it to jsonschema's verdict.

Predicate = Callable[[Any], bool]
_TYPES: dict[str, Predicate] = {
    "null": lambda x: x is None,
    "boolean": lambda x: type(x) is bool,
    "string": lambda x: type(x) is str,
    "integer": lambda x: type(x) is int or (type(x) is float and x.is_integer()),
    "number": lambda x: type(x) is int or type(x) is float,
    "array": lambda x: type(x) is list,
    "object": lambda x: type(x) is dict,
}
_IGNORED = {"description", "title", "$schema", "$id"}
_items = Draft202012Validator.VALIDATORS["items"]
_properties = Draft202012Validator.VALIDATORS["properties"]


def _is_number(x: Any) -> bool:
    return type(x) is int or type(x) is float


def _same(x: Any, value: Any) -> bool:  # stricter than jsonschema's equality: 1 is not 1.0
    return type(x) is type(value) and x == value


def _plain(kind: str, low: float, high: float) -> Predicate | None:
    """One JSON type's predicate, bounds included (the hot path: no inner calls)."""
    if kind == "number":
        return lambda x: (type(x) is float or type(x) is int) and low <= x <= high
    if kind == "integer":
        return lambda x: (
            (type(x) is int or (type(x) is float and x.is_integer())) and (low <= x <= high)
        )
    if kind == "string":
        return lambda x: type(x) is str
    if kind == "boolean":
        return lambda x: type(x) is bool
    return None


class _Compiler:
    """Predicates for one schema's subschemas, by id; None where a keyword is not known."""

    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.done: dict[int, tuple[Any, Predicate | None]] = {}  # the subschema kept beside

    def __call__(self, schema: Any) -> Predicate | None:
        if id(schema) not in self.done:
            self.done[id(schema)] = (schema, None)  # a cycle compiles to "not known"
            self.done[id(schema)] = (schema, self._compile(schema))
        return self.done[id(schema)][1]

    def _compile(self, schema: Any) -> Predicate | None:
        if schema is False:
            return lambda x: False
        if not isinstance(schema, dict):
            return None
        keys = set(schema) - _IGNORED
        common = self._common(schema, keys)  # the forms docs/schema uses, in one closure
        if common is not None:
            return common
        tests: list[Predicate] = []
        for keyword in ("type", "minimum", "maximum", "const", "enum", "pattern", "$ref",
                        "anyOf", "items", "prefixItems", "minItems", "properties", "required",
                        "additionalProperties", "propertyNames", "minProperties"):  # fmt: skip
            if keyword not in keys:
                continue
            keys.discard(keyword)
            test = self._keyword(keyword, schema[keyword], schema)
            if test is None:
                return None
            tests.append(test)
        if keys:  # a keyword this does not know: jsonschema alone
            return None
        if len(tests) == 1:
            return tests[0]
        return lambda x: all(test(x) for test in tests)

    def _common(self, schema: dict[str, Any], keys: set[str]) -> Predicate | None:
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if kinds and keys <= {"type", "minimum", "maximum"}:
            low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
            rest = [k for k in kinds if k != "null"]
            plain = _plain(rest[0], low, high) if len(rest) == 1 else None
            if plain is None or "null" not in kinds:
                return plain
            return lambda x: x is None or plain(x)
        if keys == {"enum"} and all(type(v) is str for v in schema["enum"]):
            options = frozenset(schema["enum"])
            return lambda x: type(x) is str and x in options
        if kinds == ["array"] and "items" in keys and keys <= {"type", "items", "minItems"}:
            rest, shortest = self(schema["items"]), schema.get("minItems", 0)
            if rest is None:
                return None
            return lambda x: type(x) is list and len(x) >= shortest and all(map(rest, x))
        if kinds == ["object"] and keys <= {"type", "properties", "required",
                                            "additionalProperties"}:  # fmt: skip
            inner = self._object(schema)
            return None if inner is None else (lambda x: type(x) is dict and inner(x))
        return None

    def _keyword(self, keyword: str, value: Any, schema: dict[str, Any]) -> Predicate | None:
        if keyword == "type":
            kinds = [value] if isinstance(value, str) else value
            if any(k not in _TYPES for k in kinds):
                return None
            if len(kinds) == 1:
                return _TYPES[kinds[0]]
            tests = [_TYPES[k] for k in kinds]
            return lambda x: any(test(x) for test in tests)
        if keyword == "minimum":
            return lambda x: not _is_number(x) or x >= value
        if keyword == "maximum":
            return lambda x: not _is_number(x) or x <= value
        if keyword == "const":
            return lambda x: _same(x, value)
        if keyword == "enum":
            return lambda x: any(_same(x, option) for option in value)
        if keyword == "pattern":
            compiled = re.compile(value)
            return lambda x: type(x) is not str or compiled.search(x) is not None
        if keyword == "$ref":
            if not value.startswith("#/$defs/") or value.count("/") != 2:
                return None
            return self(self.root["$defs"][value.removeprefix("#/$defs/")])
        if keyword == "anyOf":
            options = [self(option) for option in value]
            if None in options:
                return None
            return lambda x: any(option(x) for option in options)
        if keyword in ("items", "prefixItems"):
            return self._items(schema)
        if keyword == "minItems":
            return lambda x: type(x) is not list or len(x) >= value
        if keyword in ("properties", "required", "additionalProperties"):
            return self._object(schema)
        if keyword == "propertyNames":
            names = self(value)
            if names is None:
                return None
            return lambda x: type(x) is not dict or all(map(names, x))
        if keyword == "minProperties":
            return lambda x: type(x) is not dict or len(x) >= value
        return None

    def _items(self, schema: dict[str, Any]) -> Predicate | None:
        prefix = [self(item) for item in schema.get("prefixItems", [])]
        rest = self(schema["items"]) if "items" in schema else (lambda x: True)
        if None in prefix or rest is None:
            return None
        if not prefix:  # the weights: one map over the row
            return lambda x: type(x) is not list or all(map(rest, x))
        count = len(prefix)

        def check(x: Any) -> bool:
            if type(x) is not list:
                return True
            heads = all(test(item) for test, item in zip(prefix, x, strict=False))
            return heads and all(map(rest, x[count:]))

        return check

    def _object(self, schema: dict[str, Any]) -> Predicate | None:
        properties = {name: self(sub) for name, sub in schema.get("properties", {}).items()}
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        others = None if extra is True else self(extra)
        if None in properties.values() or (extra is not True and others is None):
            return None

        def check(x: Any) -> bool:
            if type(x) is not dict:
                return True
            if any(name not in x for name in required):
                return False
            for name, item in x.items():
                test = properties.get(name, others)
                if test is not None and not test(item):
                    return False
            return True

        return check


# id(subschema) -> (the subschema, kept so that its id stays its own; its predicate)
_checks: dict[int, tuple[Any, Predicate | None]] = {}


def _compile_every_subschema(root: dict[str, Any]) -> None:
    compiler, pending = _Compiler(root), [root]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            _checks[id(node)] = (node, compiler(node))
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)


def _check_of(schema: Any) -> Predicate | None:
    return _checks.get(id(schema), (None, None))[1]


def _fast_items(validator, items, instance, schema):
    check = None if "prefixItems" in schema else _check_of(items)
    if check is not None and type(instance) is list and all(map(check, instance)):
        return
    yield from _items(validator, items, instance, schema)


def _fast_properties(validator, properties, instance, schema):
    if type(instance) is not dict:
        return
    for name, subschema in properties.items():
        if name not in instance:
            continue
        check = _check_of(subschema)
        if check is not None and check(instance[name]):
            continue
        yield from validator.descend(instance[name], subschema, path=name, schema_path=name)


_Validator = validators.extend(
    Draft202012Validator, {"items": _fast_items, "properties": _fast_properties}
)


@functools.cache
def validator(command: str) -> Draft202012Validator:
    """``command``'s schema, compiled once (with the fast path for arrays of numbers)."""
    if command not in COMMANDS:
        raise AssertionError(f"no schema for a command named {command!r}")
    root = schema(command)
    _compile_every_subschema(root)
    return _Validator(root)


def problems(document: Any, command: str | None = None) -> list[str]:
    """What is wrong with ``document`` as ``command``'s (its own ``command`` key when None)."""
    if not isinstance(document, dict) or not document:
        return ["a document is a non-empty JSON object"]
    found = []
    if next(iter(document)) != "schema_version":
        found.append(f"schema_version is not the first key (first: {next(iter(document))!r})")
    command = command or str(document.get("command"))
    errors = list(validator(command).iter_errors(document))
    if errors:
        worst = best_match(errors)
        where = "/".join(str(part) for part in worst.absolute_path) or "(the document)"
        found.append(f"{command}: at {where}: {worst.message[:500]} ({len(errors)} errors)")
    return found


def check(document: Any, command: str | None = None) -> None:
    """Raise AssertionError unless ``document`` (as JSON gives it back) follows its schema."""
    started = time.perf_counter()
    try:
        found = problems(document, command)
    finally:
        spent["documents"] += 1
        spent["seconds"] += time.perf_counter() - started
    if found:
        raise AssertionError("a --json document breaks its schema: " + "; ".join(found))


def check_printed(document: dict[str, Any], command: str) -> None:
    """What ``--json`` prints of ``document``: as JSON gives it back (keys in the same
    order), it follows ``command``'s schema. The time it takes counts in :data:`spent`."""
    started = time.perf_counter()
    try:
        as_read = json.loads(json.dumps(document, ensure_ascii=False))
        found = problems(as_read, command)
        if list(as_read) != list(document):
            found.append("the document's keys change order through JSON")
    finally:
        spent["documents"] += 1
        spent["seconds"] += time.perf_counter() - started
    if found:
        raise AssertionError("a --json document breaks its schema: " + "; ".join(found))


def loads(text: str | bytes, command: str | None = None) -> dict[str, Any]:
    """A document from attnctl's stdout (a subprocess), checked against its schema."""
    document = json.loads(text)
    check(document, command)
    return document


def only_length(document: dict[str, Any]) -> dict[str, Any]:
    """The one entry of ``memory``'s document of one length (``results`` holds one per
    length; each is that length's whole document)."""
    assert document["command"] == "memory" and document["kind"] == "layer", document.get("kind")
    (entry,) = document["results"]
    assert document["seq_lens"] == [entry["seq_len"]]
    return entry
