"""One sample's generation: the domain logic of slime/vime `generate()` on inference engines.

`Rollout.generate` is an async generator: it yields `TokenBatch`es as tokens arrive and, last, the
final `Sample`. It owns budget, continuation, masks, status, weight versions, routed experts and
failover; it knows nothing about gRPC, and engines only through `engine_api.EngineAdapter`. What
happens after a failed engine call is decided by `failover.decide` (one table of rules). This module
is the entrance (checks, admission, the in-flight entry, the caller's deadline); the work is done by
`attempts.py` (the failover loop), `engine_call.py` (one engine call), `cancellation.py` (ending a
call from outside) and `batching.py` (stream messages), over the state of `run_state.py`.
Guarantees:

* every token yielded in a batch is in the final sample, and vice versa (no loss, no duplicates);
* a failure after tokens were produced never raises: the sample comes back ABORTED (engines lost)
  or FAILED (unusable reply) with everything generated so far;
* when an engine dies or its stream breaks, the sample continues on another healthy engine from
  the tokens already produced, with the reduced budget (partial-rollout continuation);
* leaving early (client cancel, deadline) closes the upstream HTTP request, which makes vLLM
  abort the engine-side generation;
* an abort ends the generation within `RolloutConfig.abort_drain_s` of the request, even if its
  engine never answers again (a caller busy with its own await then, e.g. a gRPC write under flow
  control, is never cancelled: the generation ends at its next read of the engine);
* a stream on an engine that a health probe finds dead (while the stream was silent) fails over
  at once, not after the adapter's idle timeout (`EngineHandle.watch`);
* a caller's deadline (`GenerateOptions.deadline`) is met with the sample: shortly before it the
  engine call is aborted upstream, so the engine's final chunk brings every token it made, and
  by `bounds.deadline_margin_s` before it the generation ends ABORTED with every token received
  (`deadline.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from rollout_grpc.server.domain import params as params_mod
from rollout_grpc.server.domain import routed_experts, sample_ops
from rollout_grpc.server.domain.errors import Unavailable
from rollout_grpc.server.domain.identity import current_caller
from rollout_grpc.server.domain.model import (
    Finish,
    GenerateOptions,
    Sample,
    SamplingParams,
    Status,
    TokenBatch,
)
from rollout_grpc.server.engines.pool import EnginePool
from rollout_grpc.server.rollout.admission import Admission
from rollout_grpc.server.rollout.attempts import AttemptLoop
from rollout_grpc.server.rollout.batching import StreamBatcher
from rollout_grpc.server.rollout.call_ids import CallIds
from rollout_grpc.server.rollout.config import RolloutConfig
from rollout_grpc.server.rollout.deadline import CallerDeadline
from rollout_grpc.server.rollout.engine_call import EngineCaller
from rollout_grpc.server.rollout.inflight import AbortedWhileQueued, InFlightRegistry
from rollout_grpc.server.rollout.owner_abort import OwnerAborts
from rollout_grpc.server.rollout.run_state import GenerateRun

__all__ = ["Rollout", "RolloutConfig"]


class Rollout:
    """Generates samples on the engine pool."""

    def __init__(
        self,
        pool: EnginePool,
        admission: Admission,
        registry: InFlightRegistry,
        config: RolloutConfig | None = None,
        call_ids: CallIds | None = None,
    ) -> None:
        self.pool = pool
        self.admission = admission
        self.registry = registry
        self.config = config or RolloutConfig()
        #: Engine call ids of this replica (a fresh instance token unless given).
        self.call_ids = call_ids or CallIds.new()
        self._abort_all_depth = 0
        self._closed = False
        self._loop = AttemptLoop(pool, self.config, EngineCaller(pool, self.config, self.call_ids))
        #: Abort{mine} windows: a caller's new generations end ABORTED while its abort runs.
        #: Private: control opens and closes them, a running step watches them, through the
        #: methods below (issue 35: no module reaches into another's state).
        self._owner_aborts = OwnerAborts()

    def close(self) -> None:
        """Refuse new generations (shutdown); in-flight ones continue."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once `close()` ran (a running RolloutStep then starts no more groups)."""
        return self._closed

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False on timeout."""
        return await self.registry.wait_idle(timeout)

    # ----------------------------------------------------------------------------- abort-all window

    @property
    def aborting(self) -> bool:
        """True while an abort-all runs on this replica: new generations end ABORTED at once."""
        return self._abort_all_depth > 0

    def begin_abort_all(self) -> None:
        """Open the abort-all window (nested calls are counted)."""
        self._abort_all_depth += 1

    def end_abort_all(self) -> None:
        """Close the abort-all window."""
        self._abort_all_depth = max(0, self._abort_all_depth - 1)

    # ----------------------------------------------------------------------------- owner abort windows

    def begin_owner_abort(self, owner: str) -> None:
        """Open an Abort{mine} window for `owner` (nested windows are counted): its new
        generations end ABORTED at once, and its running steps hear of it (`watch_owner_aborts`)."""
        self._owner_aborts.begin(owner)

    def end_owner_abort(self, owner: str) -> None:
        """Close one Abort{mine} window of `owner`."""
        self._owner_aborts.end(owner)

    def owner_aborting(self, owner: str) -> bool:
        """True while an Abort{mine} of `owner` runs on this replica."""
        return self._owner_aborts.aborting(owner)

    def watch_owner_aborts(self, owner: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when an Abort{mine} of `owner` begins (a running RolloutStep stops at
        once); returns the function that unwatches."""
        return self._owner_aborts.watch(owner, callback)

    # ----------------------------------------------------------------------------- generate

    async def generate(
        self,
        sample: Sample,
        params: SamplingParams,
        options: GenerateOptions,
        request_id: str,
        on_first_token: Callable[[], None] | None = None,
        on_sample: Callable[[Sample], None] | None = None,
    ) -> AsyncIterator[TokenBatch | Sample]:
        """Yield token batches, then the final sample (always last, exactly once).

        `on_first_token` is called once, when the first token of this Generate arrives from an
        engine, whatever the caller asked for: a `final_only` caller gets no batch to time, and its
        time to first token is still the engine's (the latency metrics are read from this).
        `on_sample` is called with the final sample just before it is yielded: an observer of the
        call needs no generator of its own around this one (bench/profile_notes.md, thirteenth pass).
        """
        if self._closed:
            raise Unavailable("the server is shutting down; retry on another replica")
        sample_ops.check_input(sample)
        params_mod.validate(params, skip_text=options.skip_text)
        routed_experts.check_input(sample.routed_experts, sample.token_count, options)
        if sample.status in sample_ops.FINISHED:
            yield _final(sample, on_sample)
            return
        sample_ops.prepare_masks(sample, options.mask_offpolicy)
        budget = sample_ops.remaining_budget(sample, params)
        if budget == 0:
            sample_ops.finish(sample, Finish.LENGTH, Status.TRUNCATED)
            yield _final(sample, on_sample)
            return
        if self.aborting or self.owner_aborting(current_caller().identity):
            sample_ops.finish(sample, Finish.ABORT, Status.ABORTED)
            yield _final(sample, on_sample)
            return
        entry = self.registry.register(request_id, sample.session_id, sample.group_index)
        deadline = CallerDeadline(
            options.deadline, entry, self.config.deadline_margin_s, self.config.deadline_abort_lead_s
        )
        try:
            try:
                async with self.admission.slot(entry):
                    run = GenerateRun(
                        sample,
                        params,
                        options,
                        entry,
                        deadline,
                        StreamBatcher(options),
                        call_offset=sample.response_length,
                        on_first_token=on_first_token,
                    )
                    async for batch in self._loop.run(run):
                        yield batch
            except AbortedWhileQueued:
                sample_ops.finish(sample, Finish.ABORT, Status.ABORTED, deadline.reason)
        finally:
            deadline.cancel()
            self.registry.unregister(entry)
        problem = sample_ops.check_invariants(sample)
        if problem:
            sample_ops.finish(sample, Finish.ERROR, Status.FAILED, problem)
        yield _final(sample, on_sample)


def _final(sample: Sample, on_sample: Callable[[Sample], None] | None) -> Sample:
    """The final sample, shown to the caller's observer first."""
    if on_sample is not None:
        on_sample(sample)
    return sample
