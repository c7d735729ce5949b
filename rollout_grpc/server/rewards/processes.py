"""Rule rewards run in child processes that have a time and a memory limit and can be killed.

Why processes: a rule reward parses and compares strings a caller chose. math-verify turns the
label `9^{9^{9^{9}}}` into a big-integer power that runs for minutes inside one C call holding
Python's lock, so a thread does not help: every RPC of the replica (health included) stopped.
A child process cannot hold the replica's lock; when it overruns its time limit it is killed and a
fresh one takes its place, and its sample gets a `RewardFailed` naming the limit. The memory limit
(`RLIMIT_AS`, set in the child once its imports are done) turns a runaway allocation into a
`MemoryError` in the child instead of memory taken from the replica.

One `RuleProcesses` per replica process (so one per worker with `serve --workers N`): its children
start lazily on the first rule reward, at most `processes` of them; calls beyond that wait for a
free one (the wait does not count toward the time limit). The parent waits on the pipe's file
descriptor in the event loop, never in a thread. `close()` kills them on stop; a child whose parent
died reads EOF from its pipe and exits, so none outlives a killed worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import resource
import signal
from collections.abc import Callable
from dataclasses import dataclass

from rollout_grpc.server.rewards.api import RewardFailed, RewardOutcome, RewardResult

#: A rule: a pure, importable module-level function (it is sent to the child by reference).
Rule = Callable[[str, str], float]

#: Seconds a new child may take to import its libraries and say it is ready (not the call's limit).
START_TIMEOUT_S = 120.0
#: Characters of an exception's text kept in a failure reason.
MAX_ERROR_CHARS = 300


@dataclass(frozen=True, slots=True)
class ProcessLimits:
    """The bounds of rule rewards in one replica process (`serve --rule-reward-*`)."""

    #: Child processes (rule rewards computed at once); more calls wait for a free child.
    processes: int = 2
    #: Seconds one rule reward may compute before its child is killed.
    timeout_s: float = 10.0
    #: Address space of one child (RLIMIT_AS), in MiB; the imports take ~150 MiB of it.
    memory_mb: int = 1024


def _child_main(conn: multiprocessing.connection.Connection, memory_bytes: int, warm: Rule | None) -> None:
    """The child: import, warm up, cap memory, then answer `(rule, label, response)` messages until
    the pipe closes. Ctrl-C in a terminal is the parent's to handle (it kills the children)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if warm is not None:
        with contextlib.suppress(Exception):
            warm("1", "1")  # imports the rule's libraries before the memory cap and the first call
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    conn.send(("ready", None))
    while True:
        try:
            rule, label, response = conn.recv()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        try:
            conn.send(("ok", float(rule(label, response))))
        except MemoryError:
            conn.send(("memory", None))
            return  # a process that ran out of memory is not trusted with the next call
        except Exception as exc:
            conn.send(("error", repr(exc)[:MAX_ERROR_CHARS]))


class _Child:
    """One child process and the parent's end of its pipe."""

    def __init__(self, limits: ProcessLimits, warm: Rule | None) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs gRPC threads
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main,
            args=(theirs, limits.memory_mb << 20, warm),
            name="rollout-grpc-rule-reward",
            daemon=True,
        )
        self.process.start()
        theirs.close()
        self.ready = False

    async def receive(self, timeout_s: float) -> tuple[str, object] | None:
        """The child's next message, or None when `timeout_s` passed first. EOFError when it died."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()

        def wake() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await asyncio.wait_for(readable, timeout_s)
        except TimeoutError:
            return None
        finally:
            loop.remove_reader(fd)
        kind, value = self.conn.recv()
        return str(kind), value

    def kill(self) -> None:
        """Kill the child at once (SIGKILL) and release the pipe; reaped by `reap`."""
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()
        with contextlib.suppress(OSError):
            self.conn.close()

    def reap(self) -> None:
        """Collect the killed child's exit status (it is gone within milliseconds of SIGKILL)."""
        with contextlib.suppress(OSError, ValueError, AssertionError):
            self.process.join(5.0)


class RuleProcesses:
    """A pool of rule-reward child processes with per-call time and memory limits."""

    def __init__(self, limits: ProcessLimits | None = None, warm: Rule | None = None) -> None:
        self.limits = limits or ProcessLimits()
        self._warm = warm
        self._idle: list[_Child] = []
        self._all: set[_Child] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        #: Children killed for overrunning (time or memory), for tests and the log.
        self.killed = 0

    @property
    def started(self) -> int:
        """How many children are alive now (0 until the first rule reward)."""
        return sum(1 for c in self._all if c.process.is_alive())

    async def run(self, rule: Rule, label: str, response: str) -> RewardOutcome:
        """`rule(label, response)` in a child: its value, or RewardFailed naming the limit it hit."""
        if self._closed:
            return RewardFailed("the replica is stopping; rule rewards are no longer computed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(max(1, self.limits.processes))
        async with self._slots:
            child = self._idle.pop() if self._idle else None
            if child is None or not child.process.is_alive():
                if child is not None:
                    self._drop(child)
                child = _Child(self.limits, self._warm)
                self._all.add(child)
            keep = False
            try:
                failure = await self._ready(child)
                if failure is not None:
                    return failure
                outcome, keep = await self._call(child, rule, label, response)
                return outcome
            finally:
                if keep and not self._closed:
                    self._idle.append(child)
                else:  # overran, died, was cancelled mid-call or the pool closed: never reused
                    self._drop(child)

    async def _ready(self, child: _Child) -> RewardFailed | None:
        if child.ready:
            return None
        try:
            message = await child.receive(START_TIMEOUT_S)
        except (EOFError, OSError):
            message = ("died", None)
        if message is None or message[0] != "ready":
            code = child.process.exitcode
            return RewardFailed(f"the rule reward process did not start (exit code {code})")
        child.ready = True
        return None

    async def _call(self, child: _Child, rule: Rule, label: str, response: str) -> tuple[RewardOutcome, bool]:
        """One call on a ready child: (outcome, whether the child may serve the next call)."""
        limits = self.limits
        try:
            child.conn.send((rule, label, response))
            message = await child.receive(limits.timeout_s)
        except (EOFError, OSError):
            code = child.process.exitcode
            return RewardFailed(f"the rule reward process died (exit code {code})"), False
        if message is None:
            self.killed += 1
            return RewardFailed(
                f"the rule reward took longer than its time limit of {limits.timeout_s:g} s "
                "(--rule-reward-timeout-s); its process was killed"
            ), False
        kind, value = message
        if kind == "ok" and isinstance(value, float):
            return RewardResult(value), True
        if kind == "memory":
            self.killed += 1
            return RewardFailed(
                f"the rule reward ran out of its memory limit of {limits.memory_mb} MiB "
                "(--rule-reward-memory-mb)"
            ), False
        return RewardFailed(f"could not check the answer: {value}"[:MAX_ERROR_CHARS]), True

    def _drop(self, child: _Child) -> None:
        self._all.discard(child)
        child.kill()
        asyncio.get_running_loop().run_in_executor(None, child.reap)

    async def close(self) -> None:
        """Kill every child (replica stop); later calls fail with a reason."""
        self._closed = True
        children, self._idle = list(self._all), []
        self._all.clear()
        for child in children:
            child.kill()
        for child in children:
            await asyncio.to_thread(child.reap)
