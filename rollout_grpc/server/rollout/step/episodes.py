"""One sample of a step as a multi-turn episode driven by an environment server.

observation (the prompt) -> model turn -> environment reply (next observation, done, reward) ->
model turn -> ... until `done`, `max_turns`, the sample's token budget, or a failure. The sample
is recorded token-exactly as the agentic front door records a session (domain/trajectory.py):
ONE `Sample` per episode whose response interleaves the model's turns (loss mask 1, their
logprobs and weight-version spans, exactly what the engine produced) with the environment's
tokens (loss mask 0, logprob 0.0, no weight-version span). Every model turn is an ordinary
continuation of the sample through `Rollout.generate` (Generate's path: admission, failover from
the tokens produced, abort without loss), on the episode's session key, so every turn goes to
the engine that holds its prefix.

Why the state lives on the `StepSample` (`EpisodeState`): a step that stops (target reached,
Abort, a caller that left) aborts the running turn; the sample keeps every token and its episode
state, so a buffered group continues its episodes exactly where they stopped (the environment's
request for a finished turn is sent again: environments answer a repeated `(episode_id, turn)`
the same, as retries already require). Nothing here raises for one episode's failure: it ends the
episode with the reason on the sample, keeping every turn.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rollout_grpc.server.domain import sample_ops
from rollout_grpc.server.domain.errors import InvalidArgument, RolloutError
from rollout_grpc.server.domain.model import Finish, GenerateOptions, Sample, SamplingParams, Status
from rollout_grpc.server.engines.api import EngineError
from rollout_grpc.server.envs.api import (
    MAX_CONCURRENCY,
    MAX_RETRIES,
    EnvFailed,
    Environment,
    EnvReply,
    EnvRequest,
    EpisodeConfig,
)
from rollout_grpc.server.envs.api import MAX_TURNS as MAX_TURNS_BOUND
from rollout_grpc.server.rewards import allowlist
from rollout_grpc.server.rewards.api import RewardKind
from rollout_grpc.server.rollout.generation import Rollout
from rollout_grpc.server.rollout.step.episode_state import (
    BUDGET,
    DONE,
    ENVIRONMENT,
    GENERATION,
    MAX_TURNS,
    EpisodeState,
)
from rollout_grpc.server.rollout.step.spec import StepSample, StepSpec

T = TypeVar("T")


@dataclass(slots=True)
class EpisodeContext:
    """What one episode needs from its step."""

    rollout: Rollout
    env: Environment
    config: EpisodeConfig
    params: SamplingParams
    options: GenerateOptions
    request_id: str
    episode_id: str
    prompt: str
    label: str
    group_index: int
    sample_index: int
    #: Set when the step stops this group: no turn starts, the environment call is dropped.
    stopped: asyncio.Event


async def _unless_stopped(work: Awaitable[T], stopped: asyncio.Event) -> tuple[bool, T | None]:
    """(True, result) or (False, None) when the step stopped first (the work is cancelled: only
    environment and tokenisation calls are, never a generation)."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopped.wait())
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task.done():
        return True, task.result()
    task.cancel()
    return False, None


class Episode:
    """Runs (or continues) one episode on a sample; `run` returns the sample as it ended."""

    def __init__(self, ctx: EpisodeContext, sample: Sample, state: EpisodeState) -> None:
        self.ctx = ctx
        self.sample = sample
        self.state = state

    async def run(self) -> Sample:
        ctx, state = self.ctx, self.state
        while not state.ended:
            if self.sample.status in sample_ops.GENERATING:
                if ctx.stopped.is_set():
                    self._abort_pending()
                    return self.sample
                await self._model_turn()
                if self.sample.status is Status.ABORTED:
                    return self.sample  # stopped mid-turn: every token kept, the state too
                if self.sample.status is Status.FAILED:
                    state.ended, state.why = GENERATION, self.sample.failure_reason
                    return self.sample
            if ctx.stopped.is_set():
                return self.sample
            if self._budget_left() <= 0:
                self._end(BUDGET, f"the sample's budget of {ctx.params.max_new_tokens} tokens is used up")
                break
            if not await self._environment_step():
                return self.sample
        return self.sample

    # ------------------------------------------------------------------------- the model's turn

    async def _model_turn(self) -> None:
        """One model turn (or the rest of an aborted one) through Generate's path."""
        ctx = self.ctx
        params = copy.deepcopy(ctx.params)
        if ctx.config.turn_max_new_tokens and params.max_new_tokens is not None:
            turn_start = self.state.turn_spans[-1][0] if self._turn_open() else self.sample.response_length
            params.max_new_tokens = min(params.max_new_tokens, turn_start + ctx.config.turn_max_new_tokens)
        start = self.sample.response_length
        try:
            async for event in ctx.rollout.generate(self.sample, params, ctx.options, ctx.request_id):
                if type(event) is Sample:
                    self.sample = event
        except RolloutError as exc:
            sample_ops.finish(self.sample, Finish.ERROR, Status.FAILED, str(exc))
        end = self.sample.response_length
        if self._turn_open():
            self.state.turn_spans[-1] = (self.state.turn_spans[-1][0], end)
        elif end > start or self.sample.status is not Status.ABORTED:
            self.state.turn_spans.append((start, end))

    def _turn_open(self) -> bool:
        """The last model turn was cut by an abort and is being continued (not yet answered)."""
        return len(self.state.turn_spans) > self.state.turns

    def _abort_pending(self) -> None:
        if self.sample.status not in sample_ops.FINISHED:
            sample_ops.finish(self.sample, Finish.ABORT, Status.ABORTED)

    def _budget_left(self) -> int:
        total = self.ctx.params.max_new_tokens
        return 1 << 62 if total is None else total - self.sample.response_length

    # ------------------------------------------------------------------------- the environment

    async def _environment_step(self) -> bool:
        """Send the turn, read the reply, insert the observation. False: the step stopped."""
        ctx, state, sample = self.ctx, self.state, self.sample
        request = EnvRequest(
            episode_id=state.episode_id,
            turn=state.turns,
            prompt=ctx.prompt,
            label=ctx.label,
            action=sample.response[state.action_start :],
            group_index=ctx.group_index,
            sample_index=ctx.sample_index,
        )
        finished, outcome = await _unless_stopped(ctx.env.step(request), ctx.stopped)
        if not finished or outcome is None:
            return False
        if isinstance(outcome, EnvFailed):
            self._end(ENVIRONMENT, f"turn {state.turns}: {outcome.reason}")
            return True
        state.turns += 1
        if outcome.reward is not None:
            state.reward = outcome.reward
        if outcome.info is not None:
            state.info = dict(outcome.info)
        if outcome.done:
            state.ended = DONE
            return True
        if len(state.turn_spans) >= ctx.config.max_turns:
            self._end(MAX_TURNS, f"{ctx.config.max_turns} model turns without done")
            return True
        return await self._observe(outcome)

    async def _observe(self, outcome: EnvReply) -> bool:
        """Insert the reply's observation (tokenised unless given as ids); False: the step stopped."""
        state = self.state
        if outcome.observation_ids is not None:
            tokens = list(outcome.observation_ids)
        else:
            finished, tokens_or_none = await _unless_stopped(
                self._tokenize(outcome.observation), self.ctx.stopped
            )
            if not finished:
                state.turns -= 1  # the reply is asked for again when the episode continues
                return False
            if isinstance(tokens_or_none, str):
                self._end(ENVIRONMENT, f"turn {state.turns - 1}: {tokens_or_none}")
                return True
            tokens = tokens_or_none or []
        if len(tokens) >= self._budget_left():
            self._end(
                BUDGET,
                f"the observation of turn {state.turns - 1} ({len(tokens)} tokens) does not fit in the "
                f"{self._budget_left()} tokens left of the sample's budget; not inserted",
            )
            return True
        self._insert(tokens, outcome.observation)
        return True

    async def _tokenize(self, text: str) -> list[int] | str:
        """The observation's token ids by the episode's engine's tokenizer (no template), or why not."""
        if not text:
            return []
        engine = self.ctx.rollout.pool.pick(self.sample.session_id)
        if engine is None:
            return "no engine is available to tokenise the observation"
        try:
            rendered = await engine.client.render_text(text, self.ctx.options.model)
        except EngineError as exc:
            return f"tokenising the observation failed on {exc.url}: {exc.message}"
        return list(rendered.token_ids)

    def _insert(self, tokens: list[int], text: str) -> None:
        """Environment tokens: loss mask 0, logprob 0.0, no weight-version span; back to PENDING."""
        sample = self.sample
        sample.response_ids.extend(tokens)
        sample.loss_mask.extend([0] * len(tokens))
        sample.rollout_log_probs.extend([0.0] * len(tokens))
        if sample.top_logprobs:
            sample.top_logprobs.extend(([], []) for _ in tokens)
        sample.response_length += len(tokens)
        sample.response += text
        self.state.env_tokens += len(tokens)
        self.state.action_start = len(sample.response)
        sample_ops.finish(sample, Finish.UNSPECIFIED, Status.PENDING)
        sample.stop_reason = None

    def _end(self, how: str, why: str) -> None:
        """End the episode short of `done`: every turn stays; the sample says why."""
        self.state.ended, self.state.why = how, why
        self.sample.failure_reason = f"episode ended ({how}): {why}"


async def play(ctx: EpisodeContext, item: StepSample) -> None:
    """Run (or continue) `item`'s episode; when it ends, its reward (the environment's last) or
    the reason it has none is set on `item`, with the episode's account as the reward detail."""
    state = item.episode
    if state is None:
        state = item.episode = EpisodeState(episode_id=ctx.episode_id, action_start=len(item.sample.response))
    before, env_before = item.sample.response_length, state.env_tokens
    item.sample = await Episode(ctx, item.sample, state).run()
    item.new_tokens += item.sample.response_length - before - (state.env_tokens - env_before)
    item.reward_detail = state.detail()
    if not state.ended:
        return  # stopped: continued by a later step (the buffer keeps the state)
    if state.ended == ENVIRONMENT:
        item.reward, item.reward_failure = None, state.why
    elif state.reward is not None:
        item.reward, item.reward_failure = state.reward, ""
    elif state.ended != GENERATION:
        item.reward = None
        item.reward_failure = f"the episode ended ({state.ended}) without a reward from the environment"


def check(spec: StepSpec, env_urls: Sequence[str]) -> None:
    """Refuse an episode step that cannot run, naming the field (INVALID_ARGUMENT, before anything
    generates). `env_urls`: the URL prefixes this replica allows (`--env-url`; empty: any)."""
    config = spec.episode
    if config is None:
        return
    _check_config(config, env_urls)
    _check_step(spec)


def _check_config(config: EpisodeConfig, env_urls: Sequence[str]) -> None:
    url = config.url
    if not url.lower().startswith(("http://", "https://")):
        raise InvalidArgument("episode.url", f"must be an http(s) URL, got {url!r}"[:300])
    if not allowlist.allowed(url, env_urls):
        raise InvalidArgument(
            "episode.url", f"{url!r} is not an environment URL this replica allows (--env-url)"
        )
    if not 1 <= config.max_turns <= MAX_TURNS_BOUND:
        raise InvalidArgument("episode.max_turns", f"must be 1 to {MAX_TURNS_BOUND}, got {config.max_turns}")
    if config.turn_max_new_tokens < 0:
        raise InvalidArgument(
            "episode.turn_max_new_tokens", f"must be non-negative, got {config.turn_max_new_tokens}"
        )
    if not (math.isfinite(config.timeout_s) and config.timeout_s > 0):
        raise InvalidArgument(
            "episode.timeout_s", f"must be a positive number of seconds, got {config.timeout_s}"
        )
    if not 0 <= config.max_retries <= MAX_RETRIES:
        raise InvalidArgument("episode.max_retries", f"must be 0 to {MAX_RETRIES}, got {config.max_retries}")
    if not 1 <= config.max_concurrency <= MAX_CONCURRENCY:
        raise InvalidArgument(
            "episode.max_concurrency", f"must be 1 to {MAX_CONCURRENCY}, got {config.max_concurrency}"
        )


def _check_step(spec: StepSpec) -> None:
    """What the rest of the step must be for episodes to run on it."""
    if spec.params.max_new_tokens is None:
        raise InvalidArgument(
            "sampling_params.max_new_tokens",
            "is required with an episode: it bounds the whole episode's response (turns and observations)",
        )
    if spec.reward.kind is not RewardKind.NONE:
        raise InvalidArgument(
            "reward.kind", "an episode is scored by its environment's reward; leave reward unset"
        )
    if spec.options.mask_offpolicy:
        raise InvalidArgument(
            "options.mask_offpolicy", "would mask every earlier turn of an episode at each new turn"
        )
    for i, group in enumerate(spec.groups):
        if group.partial:
            raise InvalidArgument(
                f"groups[{i}].partial",
                "an episode cannot be continued from returned samples (its environment state is not on "
                "them); use leftovers BUFFER and continue_buffered",
            )
