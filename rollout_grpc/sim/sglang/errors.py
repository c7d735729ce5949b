"""SGLang's two error envelopes (``docs/sglang-http-api.md`` §7).

* ``ValueError`` raised while normalising or validating a request (empty input, bad sampling value,
  duplicate rid, prompt too long) is answered ``{"error": {"message": …}}`` with status 400, or, once
  a stream has been asked for, as one ``data: {"error": {"message", "type", "code", "retryable"}}``
  event followed by ``data: [DONE]`` with status 200.
* FastAPI's ``RequestValidationError`` (a body that is not JSON, a field of the wrong type) goes
  through SGLang's handler into the flat OpenAI-style ``ErrorResponse``
  ``{"object":"error","message":…,"type":"Bad Request","param":null,"code":400}``.

* The JSON contract gate of SGLang 0.5.23 (``entrypoints/http_server.py`` 937-939) refuses a body
  the schema rejects (an unknown ``sampling_params`` key, a wrong type) with status 400 and a
  **bare string**: ``{"error": "unknown field `k`, expected one of …"}``, streaming or not.

Adapters must accept all three, so the simulator produces both and never the vLLM envelope.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..errors import json_response


class SGLangError(Exception):
    """A request error in SGLang's native envelope (a ``ValueError`` on the server side)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message}}

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)

    def event(self) -> bytes:
        """The in-stream form: one SSE event (the caller writes ``[DONE]`` after it), which carries
        more than the non-streaming body (0.5.23 ``entrypoints/http_server.py`` 965-974)."""
        error = {
            "message": self.message,
            "type": "invalid_request_error",
            "code": self.status,
            "retryable": False,
        }
        return b"data: " + orjson.dumps({"error": error}) + b"\n\n"


class SGLangValidationError(Exception):
    """FastAPI request validation as SGLang's exception handler renders it (always before a stream
    opens, so never an SSE event). ``field`` is the offending body field, named in the message
    (empty when the body as a whole is wrong)."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        loc = f"body.{field}" if field else "body"
        self.message = f"1 validation error: {loc}: {problem}"
        super().__init__(self.message)

    def response(self) -> web.Response:
        return json_response(
            {"object": "error", "message": self.message, "type": "Bad Request", "param": None, "code": 400},
            status=400,
        )


class SGLangContractError(Exception):
    """The contract gate's refusal: 400 ``{"error": "<text>"}``, before any stream opens."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def response(self) -> web.Response:
        return json_response({"error": self.message}, status=400)
