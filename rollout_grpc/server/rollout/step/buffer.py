"""Per-caller buffers of partial groups (slime's partial rollout, server side).

A step that reaches its target with `leftovers=BUFFER`, or whose caller went away mid-step, puts
its aborted groups here under the caller's buffer owner (`buffer_owner`); the caller's next step
with `continue_buffered` takes them first. The groups live in the state store the wiring chose
(server/state: this process, the supervisor of `--workers N`, or Redis shared by every replica);
this module encodes them for it and never imports a store client.

No race by construction: a step holds a drain lease in the store from before it starts anything
until it has put every group it will put (also when its caller left mid-step), and a
`continue_buffered` step of the same owner waits for every lease of that owner first, on any
worker or replica. A lease of a replica killed with SIGKILL expires (`lease_ttl_s`); the groups
its step held only in its process (in flight, or taken from the buffer and not started), which the
lease names in the store as they change (`DrainLease.hold`), then move to the owner's lost list,
so the owner's next step reports them (`lost_group_indexes`) instead of their vanishing silently.
A step that returns its leftovers (`leftovers=RETURN`) and does not continue buffered groups has
nothing to keep in the store: it takes no lease unless its caller leaves mid-step (runner.py).

The buffer is bounded in bytes, per caller and for the whole replica process, not only in groups:
a buffered group of 64 long samples is ~0.7-0.9 MB, so the old 10,000-group cap let one caller
hold 6.5-8.2 GB. A group's size is estimated from what it holds (`group_bytes`: token lists,
logprobs, masks, text, routed experts, media), an over-estimate of the Python objects. A group that
does not fit is handed back to the caller (`put` returns it); it is never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import uuid

import structlog

from rollout_grpc.server.domain.errors import InvalidArgument
from rollout_grpc.server.domain.identity import ANONYMOUS, Caller
from rollout_grpc.server.domain.model import Sample
from rollout_grpc.server.rollout.pickled import RestrictedPickle
from rollout_grpc.server.rollout.step.spec import PromptGroup, StepSample
from rollout_grpc.server.state.api import BufferStore, StoredGroup, StoreUnavailable
from rollout_grpc.server.state.memory import MemoryStore

log = structlog.get_logger(__name__)

#: Bytes per element of a list of ints: an 8-byte slot and a 28-byte int object (small ids are
#: shared objects in CPython; counting them anyway keeps the estimate an upper bound).
_INT_BYTES = 36
#: Bytes per element of a list of floats: an 8-byte slot and a 24-byte float object.
_FLOAT_BYTES = 32
#: The fixed part of a sample and its step record (dataclasses, empty lists, the wire message's
#: header kept as `origin`).
_SAMPLE_OVERHEAD = 1024
#: Longest a buffer name may be (it is part of the store's keys).
MAX_BUFFER_NAME = 128


def sample_bytes(sample: Sample) -> int:
    """An upper estimate of the memory `sample` holds (token ids are also counted once more for
    the transport message a partial sample keeps as its origin)."""
    size = _SAMPLE_OVERHEAD + (_INT_BYTES + 8) * sample.token_count
    size += _FLOAT_BYTES * len(sample.rollout_log_probs) + 8 * len(sample.loss_mask)
    size += sys.getsizeof(sample.response) + sys.getsizeof(sample.prompt or "")
    for ids, logprobs in sample.top_logprobs:
        size += 120 + _INT_BYTES * len(ids) + _FLOAT_BYTES * len(logprobs)
    if sample.routed_experts is not None:
        size += int(sample.routed_experts.array.nbytes)
    if sample.features is not None:
        for items in sample.features.modalities.values():
            for item in items:
                size += 200 + len(item.kwargs_data or b"") + len(item.mm_metadata or b"")
    return size


def group_bytes(group: PromptGroup) -> int:
    """An upper estimate of the memory a buffered group holds (its prompt and its samples)."""
    items: list[StepSample] = group.partial
    return sample_bytes(group.prompt) + sum(sample_bytes(i.sample) for i in items)


def buffer_owner(caller: Caller, buffer_name: str) -> str | None:
    """Whose buffer a step reads and writes: the authenticated identity (and, when named, its
    sub-buffer), or for an anonymous caller the buffer it names; None for an anonymous caller that
    names none (it has no buffer: two anonymous trainers must never share one)."""
    if len(buffer_name) > MAX_BUFFER_NAME:
        raise InvalidArgument("buffer_name", f"at most {MAX_BUFFER_NAME} characters")
    if not buffer_name.isprintable():
        raise InvalidArgument("buffer_name", "printable characters only")
    if caller.identity == ANONYMOUS.identity:
        return f"anonymous#{buffer_name}" if buffer_name else None
    return f"{caller.identity}#{buffer_name}" if buffer_name else caller.identity


#: What a buffered group's pickle may name: the step's and the domain's dataclasses and enums, the
#: transport's messages kept as `origin`, numpy arrays (R3), sets and byte arrays.
_GROUPS = RestrictedPickle(
    PromptGroup,
    "a buffered group",
    ("rollout_grpc.server.domain.", "rollout_grpc.server.rollout.step.", "rollout_grpc._proto."),
    frozenset({("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray")}),
)
encode_group = _GROUPS.encode
decode_group = _GROUPS.decode


class DrainLease:
    """A step's lease on its owner's buffer, renewed in the background until `end`."""

    def __init__(self, store: BufferStore, owner: str) -> None:
        self.store = store
        self.owner = owner
        self.id = uuid.uuid4().hex
        self._renewer: asyncio.Task[None] | None = None
        #: The group indexes last named in the store (`hold`).
        self._held: frozenset[int] = frozenset()
        #: A renewal found the lease gone (this process did not reach the store for longer than
        #: `lease_ttl_s`): the store reports the groups it held lost, so the step buffers nothing
        #: more and hands its leftovers back instead (drain.py).
        self.expired = False

    async def begin(self) -> None:
        await self.store.begin_drain(self.owner, self.id)
        self._renewer = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.store.caps.lease_ttl_s / 3)
            try:
                live = await self.store.renew_drain(self.owner, self.id)
            except Exception:  # the lease expires; the next step then waits no longer for it
                log.warning("step_lease_renew_failed", owner=self.owner, store=self.store.name)
                continue
            if not live:
                self.expired = True
                log.error(
                    "step_lease_expired",
                    owner=self.owner,
                    store=self.store.name,
                    held_groups=sorted(self._held),
                    why="the store was not reached for longer than --step-drain-lease-ttl-s",
                )
                return

    async def hold(self, indexes: set[int]) -> None:
        """Name the groups the step holds only in this process now (written when they changed):
        if this process dies, its lease expires and they are reported lost, not silently gone."""
        held = frozenset(indexes)
        if held == self._held:
            return
        try:
            await self.store.hold_groups(self.owner, self.id, sorted(held))
        except StoreUnavailable:  # the step goes on; its leftovers come back if the store stays away
            log.warning("step_lease_hold_failed", owner=self.owner, store=self.store.name)
            return
        self._held = held

    def took(self, indexes: set[int]) -> None:
        """The store named `indexes` held by this lease as the step took them (`take_held`)."""
        self._held = self._held | frozenset(indexes)

    async def end(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        try:
            await self.store.end_drain(self.owner, self.id)
        except StoreUnavailable:  # it expires after lease_ttl_s; the owner's next step waits that long
            log.warning("step_lease_end_failed", owner=self.owner, store=self.store.name)


class StepBuffers:
    """Owner -> its buffered groups, oldest first, bounded in groups and in bytes, in a store."""

    def __init__(self, store: BufferStore | None = None) -> None:
        self.store: BufferStore = store or MemoryStore()

    async def put(self, owner: str, groups: list[PromptGroup]) -> list[PromptGroup]:
        """Buffer `groups` for `owner`, in order, while they fit under the caps; returns those
        that did not fit (the caller hands them back instead: a group is never dropped)."""
        if not groups:
            return []
        stored = [StoredGroup(g.group_index, group_bytes(g), encode_group(g)) for g in groups]
        refused = await self.store.put(owner, stored)
        return [groups[i] for i in refused]

    async def full_reason(self, owner: str) -> str:
        """Which cap a rejected group hit, for the reason handed back with it."""
        held = await self.store.holding(owner)
        caps = self.store.caps
        return (
            f"the step buffer is full (this caller holds {held.count} groups, "
            f"{held.bytes} bytes; caps {caps.max_groups_per_owner} groups and "
            f"{caps.max_bytes_per_owner} bytes per caller, {caps.max_bytes_total} bytes in all: "
            "--step-buffer-mb-per-caller, --step-buffer-mb)"
        )

    async def note_lost(self, owner: str, indexes: list[int]) -> None:
        """Remember groups of `owner`'s abandoned step that did not fit: its next step reports
        them (`take_lost`)."""
        await self.store.note_lost(owner, indexes)

    async def take_lost(self, owner: str) -> list[int]:
        """The indexes noted lost for `owner`, expired groups' too (forgotten once taken), each
        once: a step whose lease expired notes its abandoned groups itself, and the store may have
        noted some of them already from the lease (drain.py)."""
        return list(dict.fromkeys(await self.store.take_lost(owner)))

    async def take(self, owner: str, lease: DrainLease | None = None) -> list[PromptGroup]:
        """Every buffered group of `owner` (the buffer empties). With the step's `lease`, the store
        names them held by it in the same operation (`take_held`): a kill right after the take
        reports them lost instead of losing them silently."""
        if lease is None:
            return [decode_group(blob) for blob in await self.store.take(owner)]
        groups = [decode_group(blob) for blob in await self.store.take_held(owner, lease.id)]
        lease.took({group.group_index for group in groups})
        return groups

    async def indexes(self, owner: str) -> frozenset[int]:
        """The group indexes `owner` has buffered."""
        return (await self.store.holding(owner)).indexes

    async def count(self, owner: str) -> int:
        """How many groups `owner` has buffered."""
        return (await self.store.holding(owner)).count

    async def bytes_of(self, owner: str) -> int:
        """The estimated bytes `owner`'s buffered groups hold."""
        return (await self.store.holding(owner)).bytes

    async def lease(self, owner: str) -> DrainLease:
        """A lease held from now until the step has put everything it will put."""
        lease = DrainLease(self.store, owner)
        await lease.begin()
        return lease

    async def wait_drains(self, owner: str, timeout_s: float) -> bool:
        """Wait until no step of `owner` may still add to its buffer (False: timed out)."""
        return await self.store.wait_drains(owner, timeout_s)
