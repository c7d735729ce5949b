"""Structural comparison of JSON bodies and SSE streams, for conformance tests.

The recorded vLLM bodies (``tests/sim/golden``) come from random-weight models, so token ids
and logprob values are not comparable; keys, key order, nesting, value types and ``null``
placement are. ``shape_of`` reduces a JSON value to exactly that, and ``shape_diff`` lists the
differences with JSON paths. The same helpers serve the live-vLLM conformance runs.

Shape notation (itself JSON-serialisable, so failures print readably):

* scalars: ``"null"``, ``"bool"``, ``"int"``, ``"float"``, ``"str"``;
* objects: ``{"{}": [[key, shape], ...]}`` in key order; objects whose keys are all decimal
  strings (token-id maps such as ``prompt_logprobs`` entries) become ``{"{id}": shape}``;
* arrays: ``{"[]": [distinct element shapes in first-seen order]}`` (``[]`` for an empty array).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

Shape = Any
DONE = "[DONE]"


def shape_of(value: Any, *, trimmed: Iterable[str] = ()) -> Shape:
    """The structural shape of a JSON value (see module docstring)."""
    return _shape(value, "$", frozenset(trimmed))


#: Scalar JSON types and their shape names (bool before int: ``True`` is an ``int`` too).
_SCALARS: tuple[tuple[type, str], ...] = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"))


def _shape(v: Any, path: str, trimmed: frozenset[str]) -> Shape:
    if path in trimmed:
        return "<trimmed>"
    if v is None:
        return "null"
    for kind, name in _SCALARS:
        if isinstance(v, kind):
            return name
    if isinstance(v, list):
        return _list_shape(v, path, trimmed)
    if isinstance(v, dict):
        return _dict_shape(v, path, trimmed)
    raise TypeError(f"not a JSON value at {path}: {type(v).__name__}")


def _distinct(shapes: Iterable[Shape]) -> list[Shape]:
    out: list[Shape] = []
    for s in shapes:
        if s not in out:
            out.append(s)
    return out


def _list_shape(v: list[Any], path: str, trimmed: frozenset[str]) -> Shape:
    return {
        "[]": _distinct(
            "<trimmed>" if f"{path}[{i}]" in trimmed else _shape(x, f"{path}[]", trimmed)
            for i, x in enumerate(v)
        )
    }


def _dict_shape(v: dict[Any, Any], path: str, trimmed: frozenset[str]) -> Shape:
    if v and all(isinstance(k, str) and k.isdigit() for k in v):
        return {"{id}": _distinct(_shape(x, f"{path}.{{id}}", trimmed) for x in v.values())}
    return {"{}": [[k, _shape(x, f"{path}.{k}", trimmed)] for k, x in v.items()]}


def shape_diff(expected: Shape, actual: Shape, path: str = "$") -> list[str]:
    """Human-readable differences between two shapes (empty when they match)."""
    if expected == actual or "<trimmed>" in (expected, actual):
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        if "{}" in expected and "{}" in actual:
            return _object_diff(expected["{}"], actual["{}"], path)
        if "[]" in expected and "[]" in actual:
            return _array_diff(expected["[]"], actual["[]"], path)
        if "{id}" in expected and "{id}" in actual:
            return shape_diff({"[]": expected["{id}"]}, {"[]": actual["{id}"]}, f"{path}.{{id}}")
    return [f"{path}: {_brief(actual)} != expected {_brief(expected)}"]


def _object_diff(expected: list[list[Any]], actual: list[list[Any]], path: str) -> list[str]:
    ek = [k for k, _ in expected]
    ak = [k for k, _ in actual]
    out: list[str] = []
    if ek != ak:
        missing = [k for k in ek if k not in ak]
        extra = [k for k in ak if k not in ek]
        if missing or extra:
            out.append(f"{path}: missing keys {missing}, extra keys {extra}")
        else:
            out.append(f"{path}: key order {ak} != expected {ek}")
    amap = dict(actual)
    for k, es in expected:
        if k in amap:
            out.extend(shape_diff(es, amap[k], f"{path}.{k}"))
    return out


def _array_diff(expected: list[Shape], actual: list[Shape], path: str) -> list[str]:
    if not expected or not actual:
        return []  # an empty array matches any element shape
    if len(expected) == 1 and len(actual) == 1:
        return shape_diff(expected[0], actual[0], f"{path}[]")
    unmatched = [a for a in actual if all(shape_diff(e, a, path) for e in expected)]
    return [f"{path}[]: element shapes {unmatched} not among expected {expected}"] if unmatched else []


def _brief(s: Shape) -> str:
    text = orjson.dumps(s).decode()
    return text if len(text) <= 160 else text[:157] + "..."


def assert_same_shape(expected_body: Any, actual_body: Any, *, trimmed: Iterable[str] = ()) -> None:
    """Raise ``AssertionError`` listing every structural difference."""
    t = tuple(trimmed)
    diffs = shape_diff(shape_of(expected_body, trimmed=t), shape_of(actual_body, trimmed=t))
    if diffs:
        raise AssertionError("shape mismatch:\n  " + "\n  ".join(diffs))


def parse_sse(raw: str | bytes) -> list[Any]:
    """Split an SSE body into events (parsed JSON, or ``"[DONE]"``), checking vLLM's framing.

    Every event must be exactly ``data: <compact JSON>\\n\\n`` and the stream must end with
    ``data: [DONE]\\n\\n``; anything else raises ``ValueError``.
    """
    text = raw.decode() if isinstance(raw, bytes) else raw
    if not text.endswith("\n\n"):
        raise ValueError("SSE body does not end with a blank line")
    events: list[Any] = []
    for block in text[:-2].split("\n\n"):
        if not block.startswith("data: ") or "\n" in block:
            raise ValueError(f"bad SSE event framing: {block[:80]!r}")
        payload = block[len("data: ") :]
        if payload == DONE:
            events.append(DONE)
            continue
        obj = orjson.loads(payload)
        # Error events are written with json.dumps (spaces after separators); chunks are compact.
        if not (isinstance(obj, dict) and "error" in obj) and orjson.dumps(obj).decode() != payload:
            raise ValueError(f"event is not compact JSON: {payload[:80]!r}")
        events.append(obj)
    if not events or events[-1] != DONE:
        raise ValueError("SSE stream does not end with data: [DONE]")
    if events.count(DONE) != 1:
        raise ValueError("more than one [DONE]")
    return events


def chunks_by_choice(events: list[Any]) -> dict[int, list[dict[str, Any]]]:
    """Group data chunks by ``choices[0].index`` (vLLM's interleaving across choices is unspecified)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            out.setdefault(e["choices"][0]["index"], []).append(e)
    return out


def stream_shape_diff(expected: list[Any], actual: list[Any]) -> list[str]:
    """Compare two parsed streams chunk by chunk, per choice index, plus the trailing chunks."""
    diffs: list[str] = []
    eb, ab = chunks_by_choice(expected), chunks_by_choice(actual)
    if sorted(eb) != sorted(ab):
        return [f"choice indexes {sorted(ab)} != expected {sorted(eb)}"]
    for i in eb:
        if len(eb[i]) != len(ab[i]):
            diffs.append(f"choice {i}: {len(ab[i])} chunks != expected {len(eb[i])}")
        for n, (e, a) in enumerate(zip(eb[i], ab[i], strict=False)):
            diffs.extend(shape_diff(shape_of(e), shape_of(a), f"choice{i}.chunk{n}"))
    etail = [e for e in expected if not (isinstance(e, dict) and e.get("choices"))]
    atail = [a for a in actual if not (isinstance(a, dict) and a.get("choices"))]
    if len(etail) != len(atail):
        diffs.append(f"{len(atail)} non-choice events != expected {len(etail)}")
    for n, (e, a) in enumerate(zip(etail, atail, strict=False)):
        diffs.extend(shape_diff(shape_of(e), shape_of(a), f"tail{n}"))
    return diffs
