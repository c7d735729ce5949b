"""Fault injection against a real replica: engines that hang, die, stop, refuse or misbehave.

Every stream is checked against the promise of the contract — exactly one final sample or a clean
error before any token; the final sample holds exactly the streamed deltas; no token lost compared
with an uninterrupted greedy reference (temperature 0 is deterministic across simulated engines
that share the model seed, so a failover continues the same sequence) — and its outcome is
recorded in the session's fault table (tests/faults/conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb
from tests.support.processes import Engine, Processes, start_engine

#: Short prompt of ordinary ids (valid in the simulator's vocabulary).
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301]
#: Every token its own delta: the stream shows exactly what was generated.
EVERY_TOKEN = {"stream_batch_tokens": 1, "stream_batch_interval_ms": 0}
#: Bound on every wait (never reached when things work).
WAIT_S = 30.0


def greedy(max_new_tokens: int) -> dict[str, object]:
    """Greedy sampling of exactly `max_new_tokens` (EOS ignored): the same on every engine."""
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


@dataclass
class Outcome:
    """What one caller saw."""

    request_id: str
    streamed: list[int] = field(default_factory=list)
    final: pb.Sample | None = None
    error: grpc.aio.AioRpcError | None = None
    finals: int = 0
    first: asyncio.Event = field(default_factory=asyncio.Event)
    #: A `final_only` caller (it streams nothing): the tokens the engine says it generated for it
    #: stand where the streamed deltas would (the final sample must hold every one of them).
    engine_made: int | None = None

    @property
    def response(self) -> list[int]:
        return list(self.final.tokens[len(PROMPT) :]) if self.final is not None else []


async def consume(
    client: AsyncRolloutClient,
    request_id: str,
    max_new_tokens: int,
    outcome: Outcome | None = None,
    timeout: float = WAIT_S,
) -> Outcome:
    """Run one streaming Generate to its end, recording deltas, final samples and the error."""
    out = outcome or Outcome(request_id)
    try:
        async for message in client.generate_stream(
            make_sample(PROMPT), greedy(max_new_tokens), EVERY_TOKEN, request_id=request_id, timeout=timeout
        ):
            if message.HasField("delta"):
                assert out.final is None, "a delta after the final sample"
                assert message.delta.offset == len(out.streamed), "deltas must be contiguous"
                out.streamed.extend(message.delta.token_ids)
                if message.delta.token_ids:
                    out.first.set()
            else:
                out.final = message.sample
                out.finals += 1
    except grpc.aio.AioRpcError as exc:
        out.error = exc
    return out


def start(
    client: AsyncRolloutClient, request_id: str, max_new_tokens: int
) -> tuple[Outcome, asyncio.Task[Outcome]]:
    """`consume` in the background; the Outcome fills in as messages arrive."""
    out = Outcome(request_id)
    return out, asyncio.create_task(consume(client, request_id, max_new_tokens, out))


async def first_tokens(*outcomes: Outcome) -> None:
    """Wait until every stream has streamed a token (it is then in flight on an engine)."""
    await asyncio.wait_for(asyncio.gather(*(o.first.wait() for o in outcomes)), WAIT_S)


def tokens_lost(out: Outcome, reference: list[int]) -> int:
    """Tokens the caller saw (or should have kept) that the final sample lacks or changed.

    A final sample must hold exactly the streamed deltas, as a prefix of the uninterrupted greedy
    reference. Lost = streamed tokens missing from the final sample + positions where the final
    sample departs from the reference. A clean error before any token loses nothing.
    """
    if out.final is None:
        return len(out.streamed) if out.engine_made is None else out.engine_made
    response = out.response
    seen = len(out.streamed) if out.engine_made is None else out.engine_made
    missing = max(0, seen - len(response))
    differing = sum(1 for a, b in zip(response, reference, strict=False) if a != b)
    extra = max(0, len(response) - len(reference))
    return missing + differing + extra


def _final_mismatch(out: Outcome) -> str | None:
    """The final sample lacks what the caller saw (deltas) or the engine made (`final_only`)."""
    assert out.final is not None
    if out.engine_made is not None:
        missing = out.engine_made - out.final.response_length
        return f"{missing} of the engine's {out.engine_made} tokens missing" if missing > 0 else None
    return "final sample != concatenated deltas" if out.response != out.streamed else None


def _without_sample(out: Outcome) -> str | None:
    """What is wrong with a stream that ended without a final sample, or None (a clean error)."""
    if out.error is None:
        return "no final sample and no error"
    if out.streamed:
        return f"{len(out.streamed)} tokens streamed, then {out.error.code().name} without a sample"
    if out.engine_made:
        return f"{out.engine_made} tokens generated, then {out.error.code().name} without a sample"
    if out.error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return f"unclean error {out.error.code().name}: {out.error.details()}"
    return None


def problem(out: Outcome, reference: list[int]) -> str | None:
    """What breaks the contract for one stream, or None."""
    if out.final is None:
        return _without_sample(out)
    if out.finals != 1:
        return f"{out.finals} final samples"
    if out.error is not None:
        return f"error after the final sample: {out.error.code().name}"
    mismatch = _final_mismatch(out)
    if mismatch:
        return mismatch
    if list(out.final.tokens[: len(PROMPT)]) != PROMPT:
        return "the prompt changed"
    lost = tokens_lost(out, reference)
    return f"{lost} tokens lost against the greedy reference" if lost else None


def check(out: Outcome, reference: list[int]) -> int:
    """Assert the contract for one stream; return its tokens lost (0 when the checks pass)."""
    issue = problem(out, reference)
    assert issue is None, f"{out.request_id}: {issue}"
    return 0


# ------------------------------------------------------------------------------------ hung engines


@contextlib.asynccontextmanager
async def silent_server() -> AsyncIterator[str]:
    """An HTTP 'engine' that accepts connections and never answers (a wedged process)."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


def sim_process(procs: Processes, name: str, *extra: str, token_delay_ms: float = 5.0) -> Engine:
    """A simulated engine in its own process (it can be SIGKILLed or SIGSTOPped), never ending early."""
    return start_engine(procs, name, "--eos-probability", "0", *extra, token_delay_ms=token_delay_ms)


@contextlib.contextmanager
def processes(workdir: Path) -> Iterator[Processes]:
    """A process group whose members are stopped at the end (SIGSTOPped ones too: see `Processes.stop`)."""
    with Processes(workdir) as procs:
        yield procs
