"""Engine call ids (rollout/call_ids.py) and the in-flight registry's (owner, request id) keys:
no two replicas, owners, request ids or attempts share an engine id, none is a prefix of another,
and a caller's id tells nothing about another caller's."""

from __future__ import annotations

import itertools

import pytest

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.rollout.call_ids import SEPARATOR, CallIds
from rollout_grpc.server.rollout.inflight import InFlightRegistry

#: Request ids built to collide under a naive scheme: `~` and `%` inside, prefixes of each other.
TRICKY = ["a", "a~1", "a~1~", "a%7E1", "a%257E1", "ab", "%", "~", "a/g1/s1"]


def test_ids_differ_by_replica_owner_request_and_attempt_and_none_prefixes_another() -> None:
    replicas = [CallIds.new(), CallIds.new()]
    ids = [
        r.call_id(owner, rid, attempt)
        for r, owner, rid, attempt in itertools.product(replicas, ["alice", "bob"], TRICKY, range(3))
    ]
    assert len(set(ids)) == len(ids)
    for x, y in itertools.permutations(ids, 2):
        assert not y.startswith(x), (x, y)
    assert all(i.endswith(SEPARATOR) and i.count(SEPARATOR) == 3 for i in ids)


def test_the_owner_reaches_the_engine_only_as_a_keyed_hash() -> None:
    one, two = CallIds.new(), CallIds.new()
    call_id = one.call_id("trainer-alice@example", "r", 0)
    scope = f"{one.instance}.{one.owner_tag('trainer-alice@example')}"
    assert "alice" not in call_id and call_id == f"{scope}~r~0~"
    assert one.owner_tag("alice") != two.owner_tag("alice")  # the key is per replica
    assert one.owner_tag("alice") == one.owner_tag("alice") and len(one.owner_tag("alice")) == 12


def test_two_owners_may_hold_the_same_request_id_and_neither_sees_the_other() -> None:
    registry = InFlightRegistry()
    alices = registry.register("shared-8", "", 0, owner="alice")
    bobs = registry.register("shared-8", "", 0, owner="bob")
    assert registry.select(["shared-8"], "alice") == ([alices], [])
    assert registry.select(["shared-8", "x"], "bob") == ([bobs], ["x"])
    assert registry.select(["shared-8"], "carol") == ([], ["shared-8"])
    found, unknown = registry.select(["shared-8"])  # an admin: every owner's
    assert found == [alices, bobs] and unknown == []

    with pytest.raises(InvalidArgument) as err:
        registry.register("shared-8", "", 0, owner="alice")
    assert err.value.field == "request_id"
    assert "you already have a generation with request_id 'shared-8' in flight" in str(err.value)

    registry.unregister(alices)
    assert not registry.holds(alices) and registry.holds(bobs)
    assert registry.select(["shared-8"]) == ([bobs], [])
    assert registry.owned_by("alice") == 0 and registry.owned_by("bob") == 1
