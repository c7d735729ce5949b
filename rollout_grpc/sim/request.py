"""Parsing of the ``/inference/v1/generate`` body (vLLM's ``GenerateRequest``, reference §3.1).

Field errors are reported the way FastAPI/pydantic reports them (``type:"Bad Request"``,
``param:"body.<field>"``); processing errors (vocabulary, length) the way ``OpenAIServing``
does (``type:"BadRequestError"``). Unknown keys are ignored, as pydantic does by default.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from .errors import ApiError, bad_request, missing_field, type_error, validation_error
from .multimodal import check_features_shape
from .params import ToySampling, parse_sampling_params

ENGINE_ID_PREFIX = "generate-tokens-"


@dataclass(slots=True)
class GenerateRequest:
    """A validated generate call."""

    raw: dict[str, Any]
    request_id: str
    token_ids: list[int]
    params: ToySampling
    model: str | None
    output_mode: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    features: dict[str, Any] | None
    content_parts: list[dict[str, Any]] | None
    cache_salt: str | None
    media: list[bytes] | None = None  # content_parts fetched by the handler


async def read_json_body(request: web.Request) -> Any:
    """Body as JSON with FastAPI's errors for a wrong content type or malformed JSON."""
    ct = request.headers.get("Content-Type", "")
    if ct.split(";")[0].strip().lower() != "application/json":
        raise ApiError(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
        )
    data = await request.read()
    return parse_json_bytes(data)


def parse_json_bytes(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        loc = f"body.{e.pos}"
        raise validation_error(
            [
                {
                    "type": "json_invalid",
                    "loc": loc,
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": "{'error': " + repr(e.msg) + "}",
                }
            ]
        ) from None


def _token_ids_errors(body: dict[str, Any]) -> list[dict[str, Any]]:
    if "token_ids" not in body:
        return [missing_field("body.token_ids", body)]
    ids = body["token_ids"]
    if not isinstance(ids, list):
        return [type_error("body.token_ids", "list", ids)]
    errs: list[dict[str, Any]] = []
    for i, t in enumerate(ids):
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or (isinstance(t, float) and not t.is_integer())
        ):
            errs.append(type_error(f"body.token_ids.{i}", "int", t))
    if errs:
        return errs
    if not ids:
        return [
            {
                "type": "too_short",
                "loc": "body.token_ids",
                "msg": "List should have at least 1 item after validation, not 0",
                "input": ids,
                "ctx": "{'field_type': 'List', 'min_length': 1, 'actual_length': 0}",
            }
        ]
    if any(t < 0 for t in ids):
        return [
            {
                "type": "value_error",
                "loc": "body.token_ids",
                "msg": "Value error, token_ids must not contain negative values",
                "input": ids,
                "ctx": "{'error': ValueError('token_ids must not contain negative values')}",
            }
        ]
    return []


def _opt(body: dict[str, Any], key: str, kind: str, errs: list[dict[str, Any]]) -> Any:
    v = body.get(key)
    if v is None:
        return None
    ok = {
        "str": isinstance(v, str),
        "bool": isinstance(v, bool),
        "dict": isinstance(v, dict),
        "list": isinstance(v, list),
        "int": isinstance(v, int) and not isinstance(v, bool),
    }[kind]
    if not ok:
        errs.append(type_error(f"body.{key}", kind, v))
        return None
    return v


def _body_error(msg: str, body: Any) -> ApiError:
    """A ``ValueError`` from a model-level validator: pydantic reports it at ``loc: body``."""
    return validation_error(
        [
            {
                "type": "value_error",
                "loc": "body",
                "msg": "Value error, " + msg,
                "input": body,
                "ctx": "{'error': ValueError(" + repr(msg) + ")}",
            }
        ]
    )


_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


def _validate_cache_salt(cache_salt: Any) -> None:
    """``validate_cache_salt``: a ``VLLMValidationError``, so BadRequestError with a param."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not cache_salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if len(cache_salt) > 128 or any(c in cache_salt for c in _SALT_FORBIDDEN):
        raise bad_request(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
            "'\\\\', or NUL.",
            "cache_salt",
        )


def _require_ec_for_metadata_only(features: dict[str, Any], body: Any) -> None:
    metadata = features.get("mm_metadata") or {}
    kwargs_data = features.get("kwargs_data") or {}
    for modality, items in metadata.items():
        kw = kwargs_data.get(modality, [None] * len(items))
        if any(m is not None and k is None for m, k in zip(items, kw, strict=False)):
            raise _body_error("metadata-only multimodal items require ec_transfer_params", body)


def parse_generate(body: Any, header_request_id: str | None) -> GenerateRequest:
    """Validate a generate body; raises ``ApiError`` with vLLM's envelope."""
    if not isinstance(body, dict):
        raise validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": "body",
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    _validate_cache_salt(body.get("cache_salt"))  # a "before" validator: runs first
    errs: list[dict[str, Any]] = []
    rid = body.get("request_id")
    if "request_id" in body and not isinstance(rid, str):
        errs.append(type_error("body.request_id", "str", rid))
    errs.extend(_token_ids_errors(body))
    if "sampling_params" not in body:
        errs.append(missing_field("body.sampling_params", body))
    model = _opt(body, "model", "str", errs)
    stream = _opt(body, "stream", "bool", errs)
    stream_options = _opt(body, "stream_options", "dict", errs)
    return_token_ids = _opt(body, "return_token_ids", "bool", errs)
    features = _opt(body, "features", "dict", errs)
    content_parts = _opt(body, "content_parts", "list", errs)
    cache_salt = _opt(body, "cache_salt", "str", errs)
    _opt(body, "priority", "int", errs)
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in ("tokens", "text"):
        errs.append(
            {
                "type": "literal_error",
                "loc": "body.output_mode",
                "msg": "Input should be 'tokens' or 'text'",
                "input": output_mode,
                "ctx": "{'expected': \"'tokens' or 'text'\"}",
            }
        )
    if errs:
        raise validation_error(errs)
    if features is not None:
        check_features_shape(features)
    params = parse_sampling_params(body["sampling_params"])
    # GenerateRequest's "after" model validators, in vLLM's order.
    if content_parts and features:
        raise _body_error("content_parts and features are mutually exclusive", body)
    if features is not None and not body.get("ec_transfer_params"):
        _require_ec_for_metadata_only(features, body)
    if output_mode != "tokens" and not params.detokenize:
        raise _body_error(f"output_mode={output_mode!r} requires sampling_params.detokenize to be true", body)
    if features is not None:
        n = len(body["token_ids"])
        for ranges in features["mm_placeholders"].values():
            if any(p["offset"] + p["length"] > n for p in ranges):
                raise _body_error("mm_placeholders must remain within the token_ids sequence", body)
    base_id = (
        header_request_id if header_request_id else (rid if isinstance(rid, str) else secrets.token_hex(8))
    )
    so = stream_options or {}
    include_usage = bool(so.get("include_usage"))
    continuous = include_usage and bool(so.get("continuous_usage_stats"))
    return GenerateRequest(
        raw=body,
        request_id=ENGINE_ID_PREFIX + base_id,
        token_ids=[int(t) for t in body["token_ids"]],
        params=params,
        model=model,
        output_mode=output_mode,
        stream=bool(stream),
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=bool(return_token_ids),
        features=features,
        content_parts=content_parts,
        cache_salt=cache_salt,
    )
