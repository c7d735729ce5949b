"""The session store's ownership rules (domain/trajectory.TrajectoryStore): only a generated turn
records a session, the cap is per owner, and an id stays its owner's after eviction or collection."""

from __future__ import annotations

import pytest

from rollout_grpc.server.domain.errors import PermissionDenied
from rollout_grpc.server.domain.model import Finish, Status
from rollout_grpc.server.domain.trajectory import Session, TrajectoryStore, Turn


def generated(store: TrajectoryStore, session_id: str, owner: str) -> Session:
    """One request of `owner` on `session_id` whose turn generated."""
    with store.opened(session_id, owner) as session:
        turn = Turn("r", [1], [2], [-0.1], [], Finish.LENGTH, Status.TRUNCATED, "x")
        store.record(session, turn, ["user", "assistant"])
    return session


def failed(store: TrajectoryStore, session_id: str, owner: str) -> None:
    """One request of `owner` on `session_id` that failed before generating."""
    with pytest.raises(ValueError), store.opened(session_id, owner):
        raise ValueError("an invalid request")


def test_a_failed_request_leaves_nothing() -> None:
    store = TrajectoryStore(max_sessions=1)
    generated(store, "bob", "bob")
    for i in range(5):
        failed(store, f"a-{i}", "alice")
    assert len(store) == 1 and store.get("a-0") is None
    assert store.get("bob") is not None
    generated(store, "a-0", "bob")  # alice's failed request did not claim the id


def test_an_id_is_held_while_its_first_request_runs() -> None:
    store = TrajectoryStore()
    with store.opened("s", "alice") as first:
        with pytest.raises(PermissionDenied):
            generated(store, "s", "bob")
        with store.opened("s", "alice") as second:  # the owner's second request waits on its lock
            assert second is first
        assert store.get("s") is first
    assert store.get("s") is None


def test_the_cap_is_per_owner() -> None:
    store = TrajectoryStore(max_sessions=2)
    generated(store, "bob", "bob")
    for i in range(3):
        generated(store, f"a-{i}", "alice")
    assert store.get("bob") is not None
    assert store.get("a-0") is None and store.get("a-1") is not None and store.get("a-2") is not None
    assert len(store) == 3


def test_evicted_and_collected_ids_stay_their_owners() -> None:
    store = TrajectoryStore(max_sessions=1)
    generated(store, "old", "bob")
    generated(store, "new", "bob")  # evicts "old"
    assert store.get("old") is None
    with pytest.raises(PermissionDenied):
        generated(store, "old", "alice")
    failed(store, "old", "bob")  # the owner's failed request does not give the id up
    with pytest.raises(PermissionDenied):
        generated(store, "old", "alice")
    generated(store, "old", "bob")
    assert store.pop("old") is not None
    with pytest.raises(PermissionDenied):
        generated(store, "old", "alice")


def test_retired_ids_are_bounded_per_owner() -> None:
    store = TrajectoryStore(max_sessions=2)
    for i in range(6):
        generated(store, f"b-{i}", "bob")
    # bob's live b-4, b-5 and retired b-2, b-3 are his; b-0 and b-1 were forgotten by his own churn.
    for held in ("b-2", "b-3", "b-4", "b-5"):
        with pytest.raises(PermissionDenied):
            generated(store, held, "alice")
    generated(store, "b-0", "alice")
    # alice's churn never pushes bob's retired ids out.
    for i in range(6):
        generated(store, f"a-{i}", "alice")
    with pytest.raises(PermissionDenied):
        generated(store, "b-2", "alice")
