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


def _shape(v: Any, path: str, trimmed: frozenset[str]) -> Shape:
    if path in trimmed:
        return "<trimmed>"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    if isinstance(v, list):
        shapes: list[Shape] = []
        for i, x in enumerate(v):
            s = _shape(x, f"{path}[]", trimmed) if f"{path}[{i}]" not in trimmed else "<trimmed>"
            if s not in shapes:
                shapes.append(s)
        return {"[]": shapes}
    if isinstance(v, dict):
        if v and all(isinstance(k, str) and k.isdigit() for k in v):
            vals: list[Shape] = []
            for x in v.values():
                s = _shape(x, f"{path}.{{id}}", trimmed)
                if s not in vals:
                    vals.append(s)
            return {"{id}": vals}
        return {"{}": [[k, _shape(x, f"{path}.{k}", trimmed)] for k, x in v.items()]}
    raise TypeError(f"not a JSON value at {path}: {type(v).__name__}")


def shape_diff(expected: Shape, actual: Shape, path: str = "$") -> list[str]:
    """Human-readable differences between two shapes (empty when they match)."""
    if expected == actual:
        return []
    if "<trimmed>" in (expected, actual):
        return []
    if isinstance(expected, dict) and isinstance(actual, dict):
        if "{}" in expected and "{}" in actual:
            ek = [k for k, _ in expected["{}"]]
            ak = [k for k, _ in actual["{}"]]
            out: list[str] = []
            if ek != ak:
                missing = [k for k in ek if k not in ak]
                extra = [k for k in ak if k not in ek]
                if missing or extra:
                    out.append(f"{path}: missing keys {missing}, extra keys {extra}")
                else:
                    out.append(f"{path}: key order {ak} != expected {ek}")
            amap = dict(actual["{}"])
            for k, es in expected["{}"]:
                if k in amap:
                    out.extend(shape_diff(es, amap[k], f"{path}.{k}"))
            return out
        if "[]" in expected and "[]" in actual:
            el, al = expected["[]"], actual["[]"]
            if not el or not al:
                return []  # an empty array matches any element shape
            if len(el) == 1 and len(al) == 1:
                return shape_diff(el[0], al[0], f"{path}[]")
            unmatched = [a for a in al if all(shape_diff(e, a, path) for e in el)]
            return [f"{path}[]: element shapes {unmatched} not among expected {el}"] if unmatched else []
        if "{id}" in expected and "{id}" in actual:
            return shape_diff({"[]": expected["{id}"]}, {"[]": actual["{id}"]}, f"{path}.{{id}}")
    return [f"{path}: {_brief(actual)} != expected {_brief(expected)}"]


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
