"""vLLM's error bodies, byte for byte (reference §3.7).

Two families exist in vLLM: FastAPI/pydantic request validation (``type:"Bad Request"``, a
``param`` such as ``body.token_ids`` and a message that lists the pydantic errors) and
``VLLMValidationError``/``ValueError`` raised while processing (``type:"BadRequestError"``, the
``param`` the error names, and ``(parameter=…, value=…)`` appended to the message). Clients
match on these, so the simulator reproduces both.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

JSON_CT = "application/json"


class ApiError(Exception):
    """An error answered with vLLM's ``{"error":{message,type,param,code}}`` envelope."""

    def __init__(
        self, status: int, message: str, err_type: str, param: str | None = None, *, in_stream: bool = False
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        #: Raised by vLLM's engine while processing the input: with ``stream: true`` it is an
        #: error event inside an HTTP 200 SSE stream, not an HTTP status.
        self.in_stream = in_stream

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)


def json_response(obj: Any, status: int = 200) -> web.Response:
    """Compact JSON in insertion order, as Starlette's JSONResponse writes it."""
    return web.Response(body=orjson.dumps(obj), status=status, content_type=JSON_CT)


def bad_request(
    message: str,
    param: str | None = None,
    value: Any = None,
    *,
    has_value: bool = False,
    in_stream: bool = False,
) -> ApiError:
    """``VLLMValidationError``: message plus ``(parameter=…, value=…)`` when a parameter is named."""
    if param is not None:
        suffix = f"parameter={param}, value={_py_str(value)}" if has_value else f"parameter={param}"
        message = f"{message} ({suffix})"
    return ApiError(400, message, "BadRequestError", param, in_stream=in_stream)


def _py_str(value: Any) -> str:
    """``str()`` of a value as Python would print it (floats keep their ``.0``)."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if value is None:
        return "None"
    return str(value)


def py_repr(value: Any) -> str:
    """Python ``repr`` of JSON values (``None``, ``True``, single-quoted strings)."""
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(py_repr(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{py_repr(k)}: {py_repr(v)}" for k, v in value.items()) + "}"
    return repr(value)


def pydantic_input(value: Any) -> str:
    """How vLLM's error formatter abbreviates a pydantic error's ``input``."""
    if isinstance(value, dict):
        return f"'<dict of {len(value)} items>'"
    if isinstance(value, list):
        return f"'<list of {len(value)} items>'"
    return py_repr(value)


def validation_error(errors: list[dict[str, Any]]) -> ApiError:
    """FastAPI ``RequestValidationError`` as vLLM renders it.

    Each error dict has ``type``, ``loc`` (a dotted string), ``msg``, ``input`` and optionally
    ``ctx`` (already formatted as Python source text). ``param`` is the first error's ``loc``.
    """
    lines = []
    for e in errors:
        parts = [
            f"'type': {py_repr(e['type'])}",
            f"'loc': {py_repr(e['loc'])}",
            f"'msg': {py_repr(e['msg'])}",
            f"'input': {pydantic_input(e['input']) if not e.get('raw_input') else e['input']}",
        ]
        if "ctx" in e:
            parts.append(f"'ctx': {e['ctx']}")
        lines.append("{" + ", ".join(parts) + "}")
    n = len(errors)
    head = f"{n} validation error{'s' if n != 1 else ''}:"
    message = head + "".join("\n  " + line for line in lines)
    return ApiError(400, message, "Bad Request", errors[0]["loc"] if errors else None)


def missing_field(loc: str, body: Any) -> dict[str, Any]:
    return {"type": "missing", "loc": loc, "msg": "Field required", "input": body}


def type_error(loc: str, expected: str, value: Any) -> dict[str, Any]:
    """A pydantic type error for a scalar or container field."""
    kinds = {
        "int": ("int_type", "Input should be a valid integer"),
        "float": ("float_type", "Input should be a valid number"),
        "bool": ("bool_type", "Input should be a valid boolean"),
        "str": ("string_type", "Input should be a valid string"),
        "list": ("list_type", "Input should be a valid list"),
        "dict": ("dict_type", "Input should be a valid dictionary"),
    }
    t, msg = kinds[expected]
    return {"type": t, "loc": loc, "msg": msg, "input": value}


def internal_error(*, in_stream: bool = False) -> ApiError:
    return ApiError(500, "Internal server error", "InternalServerError", None, in_stream=in_stream)


def not_found_model(name: str, served: str) -> ApiError:
    return ApiError(
        404, f"The model `{name}` does not exist. Valid aliases: {served}.", "NotFoundError", "model"
    )


SCALE_OUT_DISABLED = ApiError(
    403,
    "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
    "PermissionDeniedError",
    None,
)


def not_found_route() -> web.Response:
    """FastAPI's 404 for an unregistered route (what dev-mode routes answer without dev mode)."""
    return json_response({"detail": "Not Found"}, status=404)
