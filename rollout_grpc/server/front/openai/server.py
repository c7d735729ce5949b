"""The OpenAI-compatible front door: `/v1/chat/completions` for agent harnesses, recorded per session.

Agent harnesses speak OpenAI chat completions; trainers need the exact tokens. Each request is
rendered with the engine's own chat template (`/v1/chat/completions/render`) and generated
token-in/token-out through `Rollout.generate`, the same path as the Generate RPC, so admission,
Abort/Pause/Resume, failover, session affinity and weight-version spans apply unchanged. Every turn
is recorded in the state store (`RolloutFacade.record_turn`, rollout/sessions.py), so any replica or
worker sharing the store continues the session; `GetTrajectory` returns it as training samples.

Sessions: `POST /sessions/{id}/v1/chat/completions` (a client that can only set a base URL uses
`base_url=http://host:port/sessions/{id}/v1`), or the `X-Session-Id` header on `/v1/...`. A request
with neither is a session of its own, named in the `X-Session-Id` response header. The session id
is the sample's `session_id`: it routes every turn to the same engine (prefix cache) and
`Abort(session_id=...)` aborts its running turn.

Responses follow OpenAI's shape; like vLLM's own endpoint, an aborted turn ends with
`finish_reason: "abort"` and the text produced so far, and `return_token_ids: true` adds
`prompt_token_ids` and `choices[].token_ids`. The `X-Request-Id` response header names the turn's
generation (`Abort(request_ids=[...])` ends it).

Security is the gRPC port's (docs/security.md): the same credentials (`openai_auth.py`: bearer
token or client certificate), TLS from the same files, and the caller bound as `identity` does for
an RPC, so each turn's generation is owned by its caller (Abort, the per-caller admission share),
a session by the caller that opened it, and the request bounds of `limits.RequestLimits` apply.
Every request is one `CallRecord` of the facade (`facade/calls.py`), which the gRPC door shares:
it ends with one `openai_done` log line and in the Prometheus metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import structlog
from aiohttp import web

from rollout_grpc.server.config import FrontDoorConfig
from rollout_grpc.server.domain import trajectory
from rollout_grpc.server.domain.errors import FailedPrecondition, RolloutError
from rollout_grpc.server.domain.identity import current_caller, reset_caller, set_caller
from rollout_grpc.server.domain.model import GenerateOptions, Sample, SamplingParams, TokenBatch
from rollout_grpc.server.domain.trajectory import DriftPolicy, Session, Turn
from rollout_grpc.server.facade.calls import CallRecord, Door, http_code_name
from rollout_grpc.server.facade.door import RolloutFacade
from rollout_grpc.server.front.openai import auth as openai_auth
from rollout_grpc.server.front.openai.protocol import (
    OpenAIError,
    check_session_id,
    error_response,
    finish_reason,
    from_domain,
    render_request,
    sampling_params,
    text_chars,
    usage,
)
from rollout_grpc.server.front.openai.tools import ParsedOutput, ToolCallParser, get_parser, held_back
from rollout_grpc.server.security import redact
from rollout_grpc.server.security.auth import AuthConfig
from rollout_grpc.server.security.limits import RequestLimits
from rollout_grpc.server.security.tls import TlsConfig, server_ssl_context

log = structlog.get_logger(__name__)

#: The front door's body cap (aiohttp's `client_max_size`; 413 over it).
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Answers after which the connection is closed: the rest of the body was never read.
_CLOSE_AFTER = frozenset({408, 413})
SESSION_HEADER = "X-Session-Id"
REQUEST_ID_HEADER = "X-Request-Id"
#: Where the middleware keeps the request's `FrontDoorCall`.
_CALL = web.RequestKey("rollout_front_door_call", CallRecord)
_SESSION_PREFIX = "/sessions/{session_id}"

#: A neutral conversation the KEEP_PREFIX policy renders new messages after (see `_delta`).
_BASE: list[dict[str, Any]] = [{"role": "user", "content": "."}]


class OpenAIFrontDoor:
    """The aiohttp application and the per-turn logic."""

    def __init__(
        self,
        facade: RolloutFacade,
        config: FrontDoorConfig | None = None,
        *,
        auth: AuthConfig | None = None,
        tls: TlsConfig | None = None,
        limits: RequestLimits | None = None,
    ) -> None:
        """`auth`, `tls` and `limits` are the gRPC port's (off, plaintext and the defaults when not
        given); every request is recorded in the facade's `CallBook` (log line and metrics)."""
        if facade.trajectories is None:
            raise ValueError("the front door records sessions: the facade needs a session store")
        self._facade = facade
        self.config = config or FrontDoorConfig()
        self._parser: ToolCallParser = get_parser(self.config.tool_parser)
        self._auth = auth or AuthConfig()
        self._tls = tls
        self._limits = limits or RequestLimits()
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ----------------------------------------------------------------------------- lifecycle

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware])
        for prefix in ("", _SESSION_PREFIX):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_get(prefix + "/v1/models", self._models)
        return app

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> int:
        """Serve on host:port (0 = a free port); returns the bound port. `reuse_port`: the workers
        of `serve --workers N` share the port their supervisor reserved."""
        self._runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        await self._runner.setup()
        context = server_ssl_context(self._tls) if self._tls is not None else None
        await web.TCPSite(
            self._runner, host, port, ssl_context=context, reuse_port=reuse_port or None
        ).start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------------------- middleware

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Authenticate, bind the caller to the request's task, record and report the request."""
        call = self._facade.calls.open(Door.OPENAI, _route(request))
        request[_CALL] = call
        try:
            try:
                caller = openai_auth.authenticate(
                    self._auth, request.headers.get("Authorization"), _peercert(request)
                )
            except OpenAIError as err:
                response: web.StreamResponse = self._error(request, err)
            else:
                call.caller = caller.identity
                token = set_caller(caller)
                try:
                    response = await handler(request)
                finally:
                    reset_caller(token)
            call.http_status = response.status
            if response.status in _CLOSE_AFTER:
                response.force_close()
            return response
        except web.HTTPException as exc:  # the router's 404 and 405, the body cap's 413
            if exc.status < 400:
                call.http_status, call.details = exc.status, exc.reason
                raise
            http_error = self._error(request, _http_error(exc))
            call.http_status = http_error.status
            if http_error.status in _CLOSE_AFTER:
                http_error.force_close()
            return http_error
        except ConnectionError as exc:  # the client left while its body was read: no one to answer
            call.http_status, call.details = 499, f"the client closed the connection ({exc})"
            return web.Response(status=499)
        except BaseException as exc:  # cancelled (client gone before the response) or a bug
            call.http_status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            call.details = repr(exc)
            raise
        finally:
            self._facade.calls.close(call, http_code_name(call.http_status or 200), call.details)

    def _error(self, request: web.Request, err: OpenAIError) -> web.Response:
        """The error response; engine addresses are shown to admins only (as on the gRPC port)."""
        if not current_caller().is_admin:
            err.message = redact.redact_text(err.message, self._facade.engine_urls())
        request[_CALL].details = err.message
        return error_response(err)

    # ----------------------------------------------------------------------------- handlers

    async def _models(self, request: web.Request) -> web.Response:
        try:
            models = await self._facade.models()
        except RolloutError as exc:
            return self._error(request, from_domain(exc))
        data = [
            {
                "id": m.id,
                "object": "model",
                "created": m.created if m.created is not None else int(time.time()),
                "owned_by": "rollout-grpc",
                "max_model_len": m.max_model_len,
            }
            for m in models
        ]
        return web.json_response({"object": "list", "data": data}, dumps=lambda o: orjson.dumps(o).decode())

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            try:
                body = orjson.loads(await self._body(request))
            except orjson.JSONDecodeError as exc:
                raise OpenAIError(400, f"the body is not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise OpenAIError(400, "the body must be a JSON object")
            messages = body.get("messages")
            if (
                not isinstance(messages, list)
                or not messages
                or not all(isinstance(m, dict) for m in messages)
            ):
                raise OpenAIError(400, "messages: must be a non-empty list of message objects", "messages")
            if body.get("tool_choice") not in (None, "auto", "none"):
                raise OpenAIError(
                    400,
                    'tool_choice: only "auto" and "none" are supported (the front door does not force '
                    "calls with guided decoding)",
                    "tool_choice",
                )
            if body.get("n") not in (None, 1):
                raise OpenAIError(400, "n: only n=1 is supported", "n")
            if not isinstance(body.get("stream", False), bool | None):  # "yes" is not a stream
                raise OpenAIError(400, f"stream: must be a boolean, got {body['stream']!r}", "stream")
            session_id = (
                request.match_info.get("session_id")
                or request.headers.get(SESSION_HEADER)
                or "sess-" + secrets.token_hex(8)
            )
            check_session_id(session_id)
            call = request[_CALL]
            call.session_id, call.stream = session_id, bool(body.get("stream"))
            params = sampling_params(body)
            self._check_bounds(body, params)
            # A session is recorded only once a turn generates in it (`Sessions.record`).
            async with self._facade.open_session(session_id, current_caller().identity) as session:
                return await self._turn(request, body, messages, session, params)
        except OpenAIError as err:
            return self._error(request, err)
        except RolloutError as exc:
            return self._error(request, from_domain(exc))

    async def _body(self, request: web.Request) -> bytes:
        """The whole body within `body_timeout_s` (408 after it: a client that trickles bytes holds
        a connection and a handler), under the 64 MiB cap (aiohttp's 413, an OpenAI error)."""
        timeout = self.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except TimeoutError:
            raise OpenAIError(
                408, f"the request body did not arrive within body_timeout_s={timeout:g} s", etype="timeout"
            ) from None

    def _check_bounds(self, body: dict[str, Any], params: SamplingParams) -> None:
        """The gRPC port's per-request caps (InvalidArgument naming the field: a 400), and the prompt
        text cap before anything is rendered (tools count with it: the template renders them)."""
        chars = text_chars(body.get("messages"))
        self._limits.check_prompt("messages", chars)
        if body.get("tools") is not None:
            self._limits.check_prompt("tools", chars + text_chars(body["tools"]))
        self._limits.check_stop(params.stop, "stop")
        for key, limit in (
            ("chat_template_kwargs", "max_chat_template_kwargs_bytes"),
            ("metadata", "max_metadata_bytes"),
        ):
            if body.get(key) is not None:
                self._limits.check_size(key, len(orjson.dumps(body[key])), limit)

    # ----------------------------------------------------------------------------- one turn

    async def _turn(
        self,
        request: web.Request,
        body: dict[str, Any],
        messages: list[dict[str, Any]],
        session: Session,
        params: SamplingParams,
    ) -> web.StreamResponse:
        model = str(body.get("model") or "")
        prompt_ids, new_sample, drift = await self._prompt(session, messages, body, model)
        shown_model = model or self._facade.served_model()
        prev_len = 0 if new_sample else len(session.tokens())
        options = GenerateOptions(
            stream_batch_tokens=self.config.stream_batch_tokens,
            stream_batch_interval_s=self.config.stream_batch_interval_s,
            final_only=not body.get("stream"),
            model=model,
            return_routed_experts=self.config.return_routed_experts,
            routed_experts_start=max(0, prev_len - 1) if self.config.return_routed_experts else 0,
        )
        turn_index = len(session.turns)
        request_id = f"{session.session_id}.t{turn_index}.{secrets.token_hex(4)}"
        sample = Sample(session_id=session.session_id, prompt_ids=tuple(prompt_ids))
        call = request[_CALL]
        call.request_id, call.prompt_tokens = request_id, len(prompt_ids)
        use_tools = bool(body.get("tools")) and body.get("tool_choice") != "none"
        chat_id = "chatcmpl-" + request_id
        created = int(time.time())
        events = self._facade.generate(call, sample, params, options, request_id)
        # The first event comes before the response starts, so refusals are plain HTTP errors.
        first = await anext(events)
        if body.get("stream"):
            response, final = await self._stream(
                request, body, events, first, chat_id, created, shown_model, use_tools, session.session_id
            )
        else:
            final = first if isinstance(first, Sample) else await _last(events)
            response = None
        parsed = self._parser.parse(final.response) if use_tools else ParsedOutput(content=final.response)
        turn = self._turn_of(request_id, prompt_ids, final, parsed, new_sample, drift)
        roles = [str(m.get("role", "")) for m in messages] + ["assistant"]
        if response is not None:
            try:  # the stream went out whole already: a refusal is logged, not answered
                await self._facade.record_turn(session, turn, roles)
            except RolloutError as exc:
                call.details = f"the turn was streamed but not recorded: {exc}"
                log.warning("turn_not_recorded", session=session.session_id, error=str(exc))
            return response
        await self._facade.record_turn(session, turn, roles)
        return self._completion(
            body, chat_id, created, shown_model, turn, parsed, session.session_id, request_id
        )

    async def _prompt(
        self, session: Session, messages: list[dict[str, Any]], body: dict[str, Any], model: str
    ) -> tuple[list[int], bool, bool]:
        """(engine input, starts a new sample, drift detected) for this turn."""
        rendered = await self._render(session.session_id, messages, body, model)
        recorded = session.tokens()
        if not recorded:
            return rendered, True, False
        if trajectory.extends(recorded, rendered):
            return rendered, False, False
        first_new = session.continues([str(m.get("role", "")) for m in messages])
        if self.config.drift_policy == DriftPolicy.SPLIT or first_new is None:
            log.info("trajectory_split", session=session.session_id, continues=first_new is not None)
            return rendered, True, True
        closing, delta = await self._delta(session.session_id, messages[first_new:], body, model)
        return trajectory.splice(recorded, closing, delta), False, True

    async def _delta(
        self, session_id: str, new: list[dict[str, Any]], body: dict[str, Any], model: str
    ) -> tuple[list[int], list[int]]:
        """(closing of an assistant message, rendering of the new messages) by the template.

        Renders a neutral conversation, then the same conversation with an empty assistant reply,
        then with the new messages and the generation prompt; the differences are what the
        template puts after an assistant's content and what it makes of the new messages.
        """
        asked = await self._render(session_id, _BASE, body, model)
        answered = await self._render(
            session_id, [*_BASE, {"role": "assistant", "content": ""}], body, model, False
        )
        full = await self._render(
            session_id, [*_BASE, {"role": "assistant", "content": ""}, *new], body, model
        )
        if not trajectory.extends(asked, answered) or not trajectory.extends(answered, full):
            raise FailedPrecondition(
                "the chat template re-renders history in a way the keep_prefix drift policy cannot "
                "follow; use the split drift policy (ServerConfig.openai.drift_policy)"
            )
        return answered[len(asked) :], full[len(answered) :]

    async def _render(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        body: dict[str, Any],
        model: str,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The session's engine renders `messages` with the request's template fields (the
        facade's one chat-render path; an engine rejection names the field the engine named)."""
        request = render_request(messages, body, model, add_generation_prompt=add_generation_prompt)
        rendered = await self._facade.render_request(request, session_id=session_id)
        return list(rendered.token_ids)

    def _turn_of(
        self,
        request_id: str,
        prompt_ids: list[int],
        final: Sample,
        parsed: ParsedOutput,
        new_sample: bool,
        drift: bool,
    ) -> Turn:
        return Turn(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            response_ids=list(final.response_ids),
            logprobs=list(final.rollout_log_probs),
            weight_versions=list(final.weight_versions),
            finish=final.finish_reason,
            status=final.status,
            text=final.response,
            tool_calls=[c.to_openai() for c in parsed.tool_calls],
            routed_experts=final.routed_experts,
            new_sample=new_sample,
            drift=drift,
            failure=final.failure_reason,
            usage=final.usage,
            engine_attempts=list(final.engine_attempts),
        )

    # ----------------------------------------------------------------------------- responses

    def _completion(
        self,
        body: dict[str, Any],
        chat_id: str,
        created: int,
        model: str,
        turn: Turn,
        parsed: ParsedOutput,
        session_id: str,
        request_id: str,
    ) -> web.Response:
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if turn.tool_calls:
            message["tool_calls"] = turn.tool_calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason(turn.finish, bool(turn.tool_calls)),
            "stop_reason": None,
        }
        result: dict[str, Any] = {
            "id": chat_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": usage(len(turn.prompt_ids), len(turn.response_ids)),
        }
        if body.get("return_token_ids"):
            result["prompt_token_ids"] = turn.prompt_ids
            choice["token_ids"] = turn.response_ids
        return web.Response(
            body=orjson.dumps(result),
            content_type="application/json",
            headers={SESSION_HEADER: session_id, REQUEST_ID_HEADER: request_id},
        )

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        events: AsyncIterator[TokenBatch | Sample],
        first: TokenBatch | Sample,
        chat_id: str,
        created: int,
        model: str,
        use_tools: bool,
        session_id: str,
    ) -> tuple[web.StreamResponse, Sample]:
        """SSE chunks as tokens arrive; text from a tool-call marker on is held back to the end."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        response.headers[SESSION_HEADER] = session_id
        response.headers[REQUEST_ID_HEADER] = chat_id.removeprefix("chatcmpl-")
        await response.prepare(request)
        writer = _ChunkWriter(
            response, chat_id, created, model, self._facade, chat_id.removeprefix("chatcmpl-")
        )
        await writer.send({"role": "assistant", "content": ""}, None)
        marker = self._parser.start_marker if use_tools else ""
        text = ""
        sent = 0
        final: Sample | None = None
        event: TokenBatch | Sample | None = first
        while event is not None:
            if isinstance(event, Sample):
                final = event
                break
            text += event.text
            held = text.find(marker) if marker else -1
            upto = held if held >= 0 else len(text) - held_back(text, marker)
            if upto > sent:
                await writer.send({"content": text[sent:upto]}, None)
                sent = upto
            event = await anext(events, None)
        assert final is not None, "Rollout.generate always ends with the sample"
        parsed = self._parser.parse(final.response) if use_tools else ParsedOutput(content=final.response)
        finish = finish_reason(final.finish_reason, bool(parsed.tool_calls))
        if parsed.tool_calls:
            # The content before the first marker went out already; the calls go out whole.
            calls = [{"index": i, **c.to_openai()} for i, c in enumerate(parsed.tool_calls)]
            await writer.send({"tool_calls": calls}, None)
        elif len(final.response) > sent:
            await writer.send({"content": final.response[sent:]}, None)
        await writer.send({}, finish)
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            prompt = final.token_count - final.response_length
            await writer.raw(
                {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage(prompt, final.response_length),
                }
            )
        await writer.done()
        return response, final


class _ChunkWriter:
    """Writes `chat.completion.chunk` events; a vanished client aborts the turn (kept recorded)."""

    def __init__(
        self,
        response: web.StreamResponse,
        chat_id: str,
        created: int,
        model: str,
        facade: RolloutFacade,
        rid: str,
    ) -> None:
        self._response = response
        self._base = {"id": chat_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._facade = facade
        self._request_id = rid
        self._gone = False

    async def send(self, delta: dict[str, Any], finish: str | None) -> None:
        await self.raw({**self._base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    async def raw(self, obj: dict[str, Any]) -> None:
        if self._gone:
            return
        try:
            await self._response.write(b"data: " + orjson.dumps(obj) + b"\n\n")
        except (ConnectionError, RuntimeError):
            # The harness went away: abort the turn so the rest of it stops on the engine; the
            # generation still ends with its sample, which is recorded.
            self._gone = True
            with contextlib.suppress(RolloutError):
                await self._facade.abort_ids(None, [self._request_id])

    async def done(self) -> None:
        if not self._gone:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self._response.write(b"data: [DONE]\n\n")
                await self._response.write_eof()


def _http_error(exc: web.HTTPException) -> OpenAIError:
    """An HTTP error of aiohttp (no route, wrong method, body over the cap) in OpenAI's shape."""
    if exc.status == 404:
        return OpenAIError(404, "no such route on the OpenAI front door", etype="not_found_error")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return OpenAIError(405, f"method {exc.method} is not allowed on this route (it takes {allowed})")
    if exc.status == 413:
        return OpenAIError(413, f"the request body is over the limit of {MAX_BODY_BYTES >> 20} MiB")
    return OpenAIError(exc.status, exc.reason or exc.text or "HTTP error")


def _route(request: web.Request) -> str:
    """The metric label of a request's route: its pattern without the session prefix."""
    resource = request.match_info.route.resource
    if resource is None:
        return "other"
    return resource.canonical.removeprefix(_SESSION_PREFIX)


def _peercert(request: web.Request) -> dict[str, Any] | None:
    """The verified client certificate of an mTLS connection (None over plaintext or TLS alone)."""
    transport = request.transport
    if transport is None:
        return None
    ssl_object = transport.get_extra_info("ssl_object")
    if not isinstance(ssl_object, ssl.SSLObject):
        return None
    cert = ssl_object.getpeercert()
    return dict(cert) if cert else None


async def _last(events: AsyncIterator[TokenBatch | Sample]) -> Sample:
    """The final sample of a generation (deltas are not asked for when not streaming)."""
    final: Sample | None = None
    async for event in events:
        if isinstance(event, Sample):
            final = event
    assert final is not None, "Rollout.generate always ends with the sample"
    return final
