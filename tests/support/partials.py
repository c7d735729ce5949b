"""Partial samples as a previous rollout step hands them back: what RolloutStep tests continue."""

from __future__ import annotations

from rollout_grpc.client import pb


def aborted_partials(prompt: list[int], first_index: int, n: int, done: int) -> list[pb.Sample]:
    """`n` ABORTED samples of an earlier step (`start_step_id` "earlier"), each with `done` response
    tokens after `prompt`, indexes from `first_index`."""
    return [
        pb.Sample(
            tokens=[*prompt, *([5] * done)],
            index=first_index + i,
            response_length=done,
            loss_mask=[1] * done,
            rollout_log_probs=[-1.0] * done,
            status=pb.SAMPLE_STATUS_ABORTED,
            finish_reason=pb.FINISH_REASON_ABORT,
            start_step_id="earlier",
        )
        for i in range(n)
    ]
