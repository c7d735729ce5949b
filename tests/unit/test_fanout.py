"""The fanout's pieces that need no process: the abort selector the store's bus carries, and
`Fanouts` adding up its members (the processes themselves: tests/faults/test_fleet_aborts.py)."""

from __future__ import annotations

import pytest

from rollout_grpc.server.rollout.fanout import (
    AbortScope,
    Fanouts,
    ForwardedAbort,
    NoFanout,
    scope_from_message,
    scope_message,
)
from rollout_grpc.server.state.api import StoreUnavailable

SCOPES = [
    AbortScope(owner="alice", request_ids=("a", "b")),
    AbortScope(owner=None, session_id="s"),
    AbortScope(owner="bob", group_index=0),
    AbortScope(owner="carol", all_of_owner=True),
    AbortScope(owner=None, everything=True),
]


@pytest.mark.parametrize("scope", SCOPES)
def test_a_scope_survives_the_bus(scope: AbortScope) -> None:
    assert scope_from_message(scope_message(scope)) == scope


@pytest.mark.parametrize(
    ("message", "what"),
    [
        ({"owner": 3, "request_ids": []}, "owner"),
        ({"request_ids": "a"}, "request_ids"),
        ({"request_ids": [1]}, "request_ids"),
        ({"request_ids": [], "session_id": 5}, "session_id"),
        ({"request_ids": [], "group_index": True}, "group_index"),
    ],
)
def test_a_message_no_replica_wrote_is_refused(message: dict[str, object], what: str) -> None:
    with pytest.raises(ValueError, match=what):
        scope_from_message(message)


class _Counted(NoFanout):
    def __init__(self, aborted: int, found: set[str]) -> None:
        self.answer = ForwardedAbort(aborted, found)
        self.asked: list[tuple[AbortScope, bool]] = []

    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        self.asked.append((scope, within_replica))
        return self.answer


class _Down(NoFanout):
    async def abort(self, scope: AbortScope, *, within_replica: bool = False) -> ForwardedAbort:
        raise StoreUnavailable("redis://127.0.0.1:1/0", "ConnectionError: refused")


async def test_fanouts_add_up_their_members_and_pass_the_relay_flag() -> None:
    one, two = _Counted(1, {"a"}), _Counted(2, {"b"})
    scope = AbortScope(owner="alice", request_ids=("a", "b", "c"))
    total = await Fanouts([one, two]).abort(scope, within_replica=True)
    assert (total.aborted, total.found_request_ids) == (3, {"a", "b"})
    assert one.asked == two.asked == [(scope, True)]


async def test_a_failing_member_fails_the_fanout_after_the_others_ran() -> None:
    reached = _Counted(1, set())
    with pytest.raises(StoreUnavailable, match=r"redis://127\.0\.0\.1:1/0"):
        await Fanouts([_Down(), reached]).abort(AbortScope(owner=None, session_id="s"))
    assert len(reached.asked) == 1
