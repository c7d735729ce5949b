"""`serve --workers 2`: two processes on one port behave as one replica (docs/workers.md).

Every test runs the console script in a subprocess (`serve --workers 2 --sim 2`) and places its
streams on a chosen worker (`clients_by_worker`), so that a control RPC received by one worker is
seen to act on the generations of the other.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc._proto import rollout_pb2_grpc as pb_grpc
from rollout_grpc.client import AsyncRolloutClient, NotFoundError, RolloutClient, make_sample
from rollout_grpc.server.workers.reservation import foreign_listeners
from tests.support.processes import POLL_S, Processes, child_env, replica_command, start_engine
from tests.support.workers import (
    Replica,
    Streams,
    clients_by_worker,
    front_door_worker,
    http_by_worker,
    start_replica,
    wait_admitted,
)
from tests.support.workers import client as fresh_client

pytestmark = pytest.mark.timeout(180)

#: Two generations in flight in the whole replica (server concurrency 1, 2 engines; the workers
#: share that one limit), so that further streams queue in admission.
SMALL = ("--server-concurrency", "1", "--max-queue", "16")
SIM = ("--workers", "2", "--sim", "2", "--sim-token-delay-ms", "20")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    with Processes(tmp_path) as group:
        yield group


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Processes]:
    with Processes(tmp_path_factory.mktemp("workers")) as group:
        yield group


@pytest.fixture(scope="module")
def replica(module_procs: Processes) -> Replica:
    """One replica for the control tests (each test leaves nothing in flight behind)."""
    return start_replica(
        module_procs, module_procs.workdir, *SIM, *SMALL, "--openai-port", "0", "--metrics-port", "0"
    )


@pytest.fixture
async def by_worker(replica: Replica) -> AsyncIterator[dict[int, AsyncRolloutClient]]:
    async with clients_by_worker(replica.target, 2) as found:
        yield found


async def scrape(replica: Replica) -> str:
    """The supervisor's merged /metrics."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{replica.ports['metrics']}/metrics") as r,
    ):
        return await r.text()


def _statuses(finals: object) -> list[int]:
    return [f.status if f is not None else -1 for f in finals]  # type: ignore[attr-defined]


async def test_server_info_reports_the_workers(by_worker: dict[int, AsyncRolloutClient]) -> None:
    for index, on in by_worker.items():
        info = await on.server_info()
        assert (info.workers, info.worker) == (2, index)
        assert len(info.engines) == 2 and all(e.healthy for e in info.engines)


async def test_abort_all_on_one_worker_ends_the_other_workers_streams_queued_ones_too(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    streams = Streams(by_worker[1])
    streams.start(4, "abort-all")  # two run on worker 1 (the replica's limit), two wait in its queue
    await wait_admitted(by_worker[0], running=2, queued=2)  # GetServerInfo adds up every worker
    response = await by_worker[0].abort(all=True)
    finals = await streams.finals()
    assert _statuses(finals) == [pb.SAMPLE_STATUS_ABORTED] * 4
    assert response.aborted == 4


async def test_pause_abort_reaches_queued_generations_of_the_other_worker(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    streams = Streams(by_worker[1])
    streams.start(4, "pause-abort")
    await wait_admitted(by_worker[1], running=2, queued=2)
    await by_worker[0].pause("abort")
    try:
        finals = await streams.finals()
    finally:
        await by_worker[0].resume()
    assert _statuses(finals) == [pb.SAMPLE_STATUS_ABORTED] * 4


async def test_resume_with_a_weight_version_labels_tokens_on_every_worker(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    await by_worker[0].pause("keep")
    await by_worker[0].resume("v-workers-7")
    for on in by_worker.values():
        final = await on.generate(
            pb.Sample(tokens=[1, 2, 3], status=pb.SAMPLE_STATUS_PENDING),
            {"max_new_tokens": 8, "ignore_eos": True},
        )
        assert [span.version for span in final.weight_versions] == ["v-workers-7"], final.weight_versions
        info = await on.server_info()
        assert info.weight_version == "v-workers-7"


async def test_abort_by_id_finds_ids_on_any_worker_and_lists_only_unknown_ones(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    here, there = Streams(by_worker[0]), Streams(by_worker[1])
    ids = here.start(1, "by-id-0") + there.start(1, "by-id-1")
    await here.running()
    await there.running()
    response = await by_worker[0].abort(request_ids=[*ids, "nobody-knows-this-id"])
    assert response.aborted == 2
    assert list(response.unknown_request_ids) == ["nobody-knows-this-id"]
    assert _statuses([*(await here.finals()), *(await there.finals())]) == [pb.SAMPLE_STATUS_ABORTED] * 2


@pytest.mark.parametrize("target", ["session", "group", "mine"])
async def test_session_group_and_mine_aborts_reach_the_other_worker(
    by_worker: dict[int, AsyncRolloutClient], target: str
) -> None:
    streams = Streams(by_worker[1])
    # Two run on worker 1, one waits in its admission queue: all must be found.
    streams.start(3, f"scoped-{target}", session_id="sess-workers", group_index=77)
    await wait_admitted(by_worker[1], running=2, queued=1)
    if target == "session":
        response = await by_worker[0].abort(session_id="sess-workers")
    elif target == "group":
        response = await by_worker[0].abort(group_index=77)
    else:
        response = await by_worker[0].abort(mine=True)
    assert response.aborted == 3
    assert _statuses(await streams.finals()) == [pb.SAMPLE_STATUS_ABORTED] * 3


@pytest.mark.parametrize(("holding", "waiting"), [(1, 0), (0, 1)])
async def test_the_in_flight_limit_is_the_replicas_and_a_freed_slot_wakes_another_worker(
    by_worker: dict[int, AsyncRolloutClient], holding: int, waiting: int
) -> None:
    holders, waiter = Streams(by_worker[holding]), Streams(by_worker[waiting])
    ids = holders.start(2, "holder")  # the replica's two slots, both on one worker
    await holders.running()
    waiter.start(1, "waiter")
    await wait_admitted(by_worker[waiting], running=2, queued=1)  # queued although its worker runs none
    assert (await by_worker[waiting].abort(request_ids=ids[:1])).aborted == 1
    await waiter.running()  # started by the slot worker 1 gave back (a wake-up, not a poll)
    await by_worker[0].abort(all=True)
    assert _statuses([*(await holders.finals()), *(await waiter.finals())]) == [pb.SAMPLE_STATUS_ABORTED] * 3


async def test_a_sessions_turns_are_served_by_either_worker_and_read_on_both(
    replica: Replica, by_worker: dict[int, AsyncRolloutClient]
) -> None:
    """Every worker runs the front door, and the session is in the supervisor's store: a turn on
    worker 1 continues the turn worker 0 recorded, and either worker returns both."""
    url = f"http://127.0.0.1:{replica.ports['openai']}/sessions/traj-workers/v1/chat/completions"
    hello = [{"role": "user", "content": "hi"}]
    body: dict[str, object] = {"model": "", "max_tokens": 4, "temperature": 0.0, "return_token_ids": True}
    async with http_by_worker(replica.ports, 2) as http:
        async with http[0][0].post(url, json={**body, "messages": hello}) as reply:
            assert reply.status == 200, await reply.text()
            first = await reply.json()
        conversation = [
            *hello,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and then?"},
        ]
        async with http[1][0].post(url, json={**body, "messages": conversation}) as reply:
            assert reply.status == 200, await reply.text()
        # The keep-alive connections stayed with their workers.
        assert [await front_door_worker(replica.ports, *http[i]) for i in (0, 1)] == [0, 1]
    for on in by_worker.values():
        trajectory = await on.get_trajectory("traj-workers")
        assert [t.sample_index for t in trajectory.turns] == [0, 0], trajectory
        assert list(trajectory.turns[0].response_token_ids) == first["choices"][0]["token_ids"]
    with pytest.raises(NotFoundError):
        await by_worker[1].get_trajectory("no-such-session")


async def test_one_metrics_scrape_shows_every_worker(
    replica: Replica, by_worker: dict[int, AsyncRolloutClient]
) -> None:
    for on in by_worker.values():
        await on.generate(pb.Sample(tokens=[1, 2], status=pb.SAMPLE_STATUS_PENDING), {"max_new_tokens": 2})
    text = await scrape(replica)
    assert "rollout_grpc_workers 2.0" in text
    for index in (0, 1):
        assert f'rollout_grpc_worker_up{{worker="{index}"}} 1.0' in text
    assert "rollout_grpc_foreign_listeners 0.0" in text
    for index in (0, 1):
        assert any(
            line.startswith("rollout_grpc_") and f'worker="{index}"' in line for line in text.splitlines()
        ), index


@pytest.mark.parametrize("which", ["grpc", "openai"])
async def test_a_foreign_reuseport_listener_is_detected(replica: Replica, which: str) -> None:
    port = replica.ports[which]
    before = replica.proc.log_text().count('"foreign_listener"')
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as stranger:
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("::ffff:127.0.0.1", port))
        stranger.listen()
        assert foreign_listeners(port, replica.ports["worker_pids"])
        text = await scrape(replica)
        assert "rollout_grpc_foreign_listeners 1.0" in text
    assert replica.proc.log_text().count('"foreign_listener"') > before
    assert foreign_listeners(port, replica.ports["worker_pids"]) == set()


def test_a_second_replica_on_the_port_fails_with_one_line(replica: Replica) -> None:
    result = subprocess.run(
        [*replica_command(), "serve", *SIM, "--port", str(replica.ports["grpc"])],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")},
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("rollout-grpc serve:")]
    assert lines == [
        f"rollout-grpc serve: cannot listen on 127.0.0.1:{replica.ports['grpc']} (gRPC, --port): address "
        "already in use: another process is listening there (`ss -ltnp` names it)"
    ], result.stderr


def test_only_the_workers_listen_on_the_port(replica: Replica) -> None:
    assert foreign_listeners(replica.ports["grpc"], replica.ports["worker_pids"]) == set()
    # The test process's own listener is foreign to the workers, and found.
    with socket.socket() as mine:
        mine.bind(("127.0.0.1", 0))
        mine.listen()
        port = mine.getsockname()[1]
        assert foreign_listeners(port, replica.ports["worker_pids"])


async def test_sigterm_stops_gracefully_and_streams_end_with_their_samples(
    procs: Processes, tmp_path: Path
) -> None:
    replica = start_replica(procs, tmp_path, *SIM, "--grace", "1")
    async with clients_by_worker(replica.target, 2) as found:
        streams = [Streams(on) for on in found.values()]
        for i, group in enumerate(streams):
            group.start(2, f"sigterm-{i}")
        for group in streams:
            await group.running()
        replica.proc.popen.send_signal(signal.SIGTERM)
        finals = [final for group in streams for final in await group.finals()]
    assert _statuses(finals) == [pb.SAMPLE_STATUS_ABORTED] * 4
    assert all(final is not None and final.response_length > 0 for final in finals)
    assert await asyncio.to_thread(replica.proc.popen.wait, 60) == 0


def port_file_pids(tmp_path: Path) -> list[int]:
    """The worker pids the supervisor's port file names now (rewritten after a replacement)."""
    try:
        return list(json.loads((tmp_path / "replica.ports.json").read_text())["worker_pids"])
    except (FileNotFoundError, json.JSONDecodeError):
        return []


async def test_a_killed_worker_is_replaced_while_the_other_keeps_serving(
    procs: Processes, tmp_path: Path
) -> None:
    """kill -9 of a worker (issue 34 item 11): its streams end UNAVAILABLE (the connection is
    gone with the process); the other worker's stream goes on and it answers new Generates
    meanwhile; the slot the dead worker held in the shared in-flight limit is given back; a new
    worker with the same index serves again. (Before: the supervisor stopped the whole replica.)"""
    replica = start_replica(procs, tmp_path, *SIM, *SMALL)
    survivor_pid, victim_pid = replica.ports["worker_pids"]
    async with clients_by_worker(replica.target, 2) as by_index:
        # The replica's whole in-flight limit (2): one stream on each worker.
        on_survivor, on_victim = Streams(by_index[0]), Streams(by_index[1])
        on_survivor.start(1, "keeps")
        on_victim.start(1, "dies")
        await on_survivor.running()
        await on_victim.running()
        signal_pid(victim_pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as killed:
            await on_victim.finals()
        assert killed.value.code() == grpc.StatusCode.UNAVAILABLE, killed.value
        # The survivor answers at once, and its new stream runs in the slot the dead worker held
        # (without the reclaim it would queue behind the long stream).
        extra = Streams(by_index[0])
        extra.start(1, "after-the-kill")
        await extra.running()
        await until("the supervisor replaced worker 1", lambda: victim_pid not in port_file_pids(tmp_path))
        pids = port_file_pids(tmp_path)
        assert pids[0] == survivor_pid and pids[1] != victim_pid
        assert replica.proc.popen.poll() is None
        await by_index[0].abort(all=True)
        finals = [*await on_survivor.finals(), *await extra.finals()]
        assert _statuses(finals) == [pb.SAMPLE_STATUS_ABORTED] * 2
    # The replacement serves: a connection reaches worker 1 again, and a Generate there completes.
    async with clients_by_worker(replica.target, 2) as again:
        done = await again[1].generate(make_sample([1, 2, 3, 4]), {"max_new_tokens": 4, "ignore_eos": True})
        assert done.response_length == 4
    log = replica.proc.log_text()
    assert '"worker_exited"' in log and '"worker_restarted"' in log and '"worker_slots_reclaimed"' in log


async def test_a_worker_that_keeps_dying_stops_the_replica_with_a_clear_line(
    procs: Processes, tmp_path: Path
) -> None:
    """Past --worker-restarts replacements within the window the replica stops (exit 1)."""
    replica = start_replica(procs, tmp_path, *SIM, "--worker-restarts", "1", "--worker-restart-window", "600")
    survivor, victim = replica.ports["worker_pids"]
    signal_pid(victim, signal.SIGKILL)
    await until("the supervisor replaced worker 1", lambda: victim not in port_file_pids(tmp_path))
    signal_pid(port_file_pids(tmp_path)[1], signal.SIGKILL)
    assert await asyncio.to_thread(replica.proc.popen.wait, 60) == 1
    assert '"worker_restart_limit"' in replica.proc.log_text()
    with pytest.raises(ProcessLookupError):
        signal_pid(survivor, 0)


def signal_pid(pid: int, sig: int) -> None:
    import os

    os.kill(pid, sig)


#: Streams that end on their own within the drain's grace (40 tokens at 100 ms/token: still in
#: flight when the drain starts).
DRAINED = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 1.0}


async def until(what: str, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `condition` (a kernel state, no event to wait for) until it holds."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                if condition():
                    return
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"not after {timeout} s: {what}") from None


def listeners(port: int) -> set[int]:
    """Socket inodes listening on `port` (whoever holds them)."""
    return foreign_listeners(port, [])


async def health(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
        return int(response.status)


async def test_the_health_port_says_not_serving_only_once_no_worker_accepts_calls(
    procs: Processes, tmp_path: Path
) -> None:
    """The drain's order, made visible by stopping worker 1 (SIGSTOP) while the supervisor drains:
    worker 0 closes its listener, but its health port stays SERVING as long as worker 1 has not
    stopped accepting; once it says NOT_SERVING, every new call is refused and the streams in
    flight end with their samples."""
    replica = start_replica(
        procs,
        tmp_path,
        *("--workers", "2", "--sim", "2", "--sim-token-delay-ms", "100"),
        *("--grace", "30", "--control-deadline", "60", "--health-port", "0"),
    )
    port, health_target = replica.ports["grpc"], f"127.0.0.1:{replica.ports['health']}"
    service = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    second = replica.ports["worker_pids"][1]
    async with clients_by_worker(replica.target, 2) as found:
        streams = [Streams(on, DRAINED) for on in found.values()]
        for i, group in enumerate(streams):
            group.start(2, f"drain-{i}")
        for group in streams:
            await group.running()
        assert len(listeners(port)) == 2
        signal_pid(second, signal.SIGSTOP)
        try:
            replica.proc.popen.send_signal(signal.SIGTERM)
            # Worker 0 stopped accepting: only the stopped worker 1 still listens on the port.
            await until("worker 0 closed its listener", lambda: not foreign_listeners(port, [second]))
            assert listeners(port), "worker 1 (stopped) still listens"
            assert await health(health_target, service) == health_pb2.HealthCheckResponse.SERVING
        finally:
            signal_pid(second, signal.SIGCONT)
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        async with grpc.aio.insecure_channel(health_target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=service), timeout=60
            )
            while (await watch.read()).status != not_serving:
                pass  # each read is the next status change
            watch.cancel()
        # Every worker refuses new calls now, on new connections (whichever worker the kernel
        # would pick) and on the connections already open.
        refused: list[grpc.StatusCode] = []
        for on in [*(fresh_client(replica.target) for _ in range(8)), *found.values()]:
            try:
                await on.generate(make_sample([1, 2, 3]), {"max_new_tokens": 2}, timeout=10)
                refused.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                refused.append(exc.code())
            if on not in found.values():
                await on.close()
        assert refused == [grpc.StatusCode.UNAVAILABLE] * 10
        finals = [final for group in streams for final in await group.finals()]
    assert _statuses(finals) == [pb.SAMPLE_STATUS_TRUNCATED] * 4
    assert [final.response_length if final is not None else -1 for final in finals] == [40] * 4
    assert await asyncio.to_thread(replica.proc.popen.wait, 60) == 0


async def test_a_sigterm_to_a_worker_drains_the_whole_replica(procs: Processes, tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group, systemd's SIGTERM the whole cgroup: a worker passes
    the signal to its supervisor, which drains every worker in order and exits 0."""
    replica = start_replica(procs, tmp_path, *SIM, "--grace", "1")
    async with clients_by_worker(replica.target, 2) as found:
        streams = Streams(found[1])
        streams.start(1, "worker-signal")
        await streams.running()
        signal_pid(replica.ports["worker_pids"][1], signal.SIGTERM)
        finals = await streams.finals()
    assert _statuses(finals) == [pb.SAMPLE_STATUS_ABORTED]
    assert await asyncio.to_thread(replica.proc.popen.wait, 60) == 0
    assert '"stop_requested_by_worker"' in replica.proc.log_text()


def gone(pid: int) -> bool:
    """`pid` exited (a zombie nobody reaped counts as exited)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


async def test_workers_stop_when_their_supervisor_is_killed(procs: Processes, tmp_path: Path) -> None:
    replica = start_replica(procs, tmp_path, *SIM)
    replica.proc.popen.send_signal(signal.SIGKILL)
    pids: list[int] = replica.ports["worker_pids"]
    await until("every worker exited", lambda: all(gone(pid) for pid in pids), timeout=60)


async def test_the_health_port_goes_not_serving_when_the_engines_die(
    procs: Processes, tmp_path: Path
) -> None:
    sim = start_engine(procs, "sim", token_delay_ms=0)
    replica = start_replica(
        procs,
        tmp_path,
        "--workers",
        "2",
        "--engine",
        sim.url,
        "--health-port",
        "0",
        "--health-interval",
        "0.2",
    )
    service = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replica.ports['health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        procs.stop(sim.proc)
        while (await watch.read()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            pass  # each read is the next status change
        watch.cancel()


async def test_sighup_reloads_the_engines_file_in_every_worker(procs: Processes, tmp_path: Path) -> None:
    engines = [start_engine(procs, f"engine-{i}", token_delay_ms=0, seed=i) for i in range(2)]
    path = tmp_path / "engines.txt"
    path.write_text(engines[0].url + "\n")
    replica = start_replica(procs, tmp_path, "--workers", "2", "--engines-file", str(path))
    async with clients_by_worker(replica.target, 2) as found:
        for on in found.values():
            assert len((await on.server_info()).engines) == 1
        tmp = tmp_path / "engines.txt.tmp"
        tmp.write_text("".join(e.url + "\n" for e in engines))
        tmp.replace(path)
        replica.proc.popen.send_signal(signal.SIGHUP)
        async with asyncio.timeout(30):
            for on in found.values():
                while True:  # each worker re-reads the file on the SIGHUP its supervisor forwards
                    if len((await on.server_info()).engines) == 2:
                        break
                    await asyncio.sleep(0.05)
    assert replica.proc.popen.poll() is None


async def test_a_client_with_k_connections_spreads_its_calls_over_the_workers(replica: Replica) -> None:
    # 16 connections all on one worker: 2**-15 (the kernel hashes each connection's ports).
    async with AsyncRolloutClient(replica.target, connections=16) as spread:
        answered = {(await spread.server_info()).worker for _ in range(32)}
    assert answered == {0, 1}


def test_the_blocking_client_spreads_its_calls_too(replica: Replica) -> None:
    with RolloutClient(replica.target, connections=16) as spread:
        answered = {spread.server_info().worker for _ in range(32)}
    assert answered == {0, 1}


def test_connections_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="connections"):
        AsyncRolloutClient("127.0.0.1:1", connections=0)
    with pytest.raises(ValueError, match="connections"):
        RolloutClient("127.0.0.1:1", connections=0)


async def test_with_authentication_a_trainer_reaches_only_its_own_streams_on_other_workers(
    procs: Processes, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("trainer-a trainer token-a\ntrainer-b trainer token-b\nops admin token-ops\n")
    replica = start_replica(procs, tmp_path, *SIM, "--auth-tokens-file", str(tokens))
    async with (
        clients_by_worker(replica.target, 2, "token-a") as a,
        clients_by_worker(replica.target, 2, "token-b") as b,
    ):
        streams = Streams(a[1])
        ids = streams.start(2, "owned")
        await streams.running()
        other = await b[0].abort(request_ids=ids)
        assert (other.aborted, sorted(other.unknown_request_ids)) == (0, sorted(ids))
        others_mine = await b[0].abort(mine=True)
        assert others_mine.aborted == 0
        own = await a[0].abort(request_ids=ids)
        assert (own.aborted, list(own.unknown_request_ids)) == (2, [])
        assert _statuses(await streams.finals()) == [pb.SAMPLE_STATUS_ABORTED] * 2


async def test_a_sibling_socket_refuses_calls_without_the_secret(replica: Replica) -> None:
    run_dir = Path(replica.ports["run_dir"])
    assert run_dir.stat().st_mode & 0o777 == 0o700
    async with grpc.aio.insecure_channel(f"unix:{run_dir / 'worker-1.sock'}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        for metadata in ((), (("x-rollout-sibling", "a guess"),)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.AbortSibling(
                    pb.AbortSiblingRequest(abort=pb.AbortLocalRequest(all=True)),
                    metadata=metadata,
                    timeout=10,
                )
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("flag", "what"), [("--port", "gRPC, --port"), ("--openai-port", "the OpenAI front door, --openai-port")]
)
def test_a_port_another_process_listens_on_is_one_clear_error_with_workers(flag: str, what: str) -> None:
    """The supervisor reserves both ports every worker shares: one held by anyone is one line."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as gRPC core's default
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--port": "0", "--openai-port": "0", flag: str(port)}
        result = subprocess.run(
            [
                *replica_command(),
                "serve",
                "--workers",
                "2",
                "--sim",
                "1",
                *(a for kv in ports.items() for a in kv),
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in child_env().items() if not k.startswith("ROLLOUT_GRPC_")},
        )
    assert result.returncode == 1
    assert [line for line in result.stderr.splitlines() if line.startswith("rollout-grpc serve:")] == [
        f"rollout-grpc serve: cannot listen on 127.0.0.1:{port} ({what}): address already in use: "
        "another process is listening there (`ss -ltnp` names it)"
    ], result.stderr
    assert '"worker_serving"' not in result.stderr


#: Streams that end by themselves after ~1 s at the simulated engines' 20 ms per token.
SHORT = {"max_new_tokens": 50, "ignore_eos": True, "temperature": 1.0}


async def test_pause_keep_freezes_the_other_workers_streams_and_resume_continues_them(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    streams = Streams(by_worker[1], SHORT)
    streams.start(1, "keep")
    await streams.running()
    await by_worker[0].pause("keep")
    try:
        assert (await by_worker[1].server_info()).paused
    finally:
        await by_worker[0].resume()
    [final] = await streams.finals()
    assert final is not None and final.status == pb.SAMPLE_STATUS_TRUNCATED and final.response_length == 50


async def test_pause_wait_returns_once_the_other_workers_streams_finished(
    by_worker: dict[int, AsyncRolloutClient],
) -> None:
    streams = Streams(by_worker[1], SHORT)
    streams.start(1, "wait")
    await streams.running()
    try:
        await by_worker[0].pause("wait", timeout=60)
        [final] = await streams.finals()  # done before Pause(WAIT) answered: nothing left to wait for
    finally:
        await by_worker[0].resume()
    assert final is not None and final.status == pb.SAMPLE_STATUS_TRUNCATED


async def test_an_update_on_one_worker_takes_a_failed_engine_out_of_every_workers_rotation(
    procs: Processes, tmp_path: Path
) -> None:
    """UpdateWeights received by one worker: an engine that failed to load receives no generation
    from any worker, and every worker labels the others' tokens with the new version."""
    from tests.support.checkpoints import toy_checkpoint

    good = start_engine(procs, "good", token_delay_ms=0, test_routes=True)
    bad = start_engine(procs, "bad", token_delay_ms=0, test_routes=True)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{bad.url}/_sim/faults", json={"load_fault": "error"}) as r,
    ):
        assert r.status == 200
    ckpt = toy_checkpoint(tmp_path / "ckpt" / "v1", seed=1)
    replica = start_replica(
        procs,
        tmp_path,
        "--workers",
        "2",
        "--engine",
        good.url,
        "--engine",
        bad.url,
        "--weights-path-prefix",
        str(tmp_path / "ckpt"),
    )
    async with clients_by_worker(replica.target, 2) as by_worker:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await by_worker[0].update_weights(str(ckpt), "v1", all_at_once=True)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and bad.url in (info.value.details() or "")
        for on in by_worker.values():
            engines = {e.url: e for e in (await on.server_info()).engines}
            assert engines[good.url].usable and engines[good.url].weight_version == "v1"
            assert not engines[bad.url].usable
            for _ in range(4):
                final = await on.generate(
                    pb.Sample(tokens=[1, 2, 3], status=pb.SAMPLE_STATUS_PENDING), {"max_new_tokens": 4}
                )
                assert [a.engine for a in final.engine_attempts] == [good.url]
                assert [span.version for span in final.weight_versions] == ["v1"]
