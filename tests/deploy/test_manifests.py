"""The Kubernetes example stays consistent with the code it deploys.

No cluster is needed: these read deploy/k8s/*.yaml as text (the venv has no YAML parser, and the
files are ours, with one `key: value` per line) and compare them with the CLI's flags and the
server's shutdown timings, so a renamed flag or a longer grace shows up here instead of in a
cluster (a kubelet SIGKILL cuts streams without their final samples).
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis as redis_client

from rollout_grpc import __version__
from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server.app import ServerConfig
from rollout_grpc.server.domain import bounds
from tests.support.processes import (
    REPO,
    Processes,
    free_listen_port,
    replica_command,
    tcp_accepts,
    wait_until,
)
from tests.support.redis_server import redis_binary

K8S = REPO / "deploy" / "k8s"
DEPLOYMENT = (K8S / "deployment.yaml").read_text()


def container_args() -> dict[str, str]:
    """`--flag=value` items of the rollout-grpc container's args (flags only: value "")."""
    block = DEPLOYMENT.split("args:", 1)[1].split("ports:", 1)[0]
    items = re.findall(r"^\s+- (--[a-z0-9-]+)(?:=(\S+))?\s*$", block, flags=re.MULTILINE)
    return dict(items)


def commented_args() -> dict[str, str]:
    """`#   - --flag=value` items of the container's args: the documented alternatives (the `--peer`
    block of a fleet without a state store)."""
    block = DEPLOYMENT.split("args:", 1)[1].split("ports:", 1)[0]
    items = re.findall(r"^\s+#\s+- (--[a-z0-9-]+)(?:=(\S+))?\s*$", block, flags=re.MULTILINE)
    return dict(items)


def mounts() -> dict[str, str]:
    """Volume name -> mount path of the rollout-grpc container."""
    return dict(re.findall(r"- name: (\S+)\n\s+mountPath: (\S+)", DEPLOYMENT))


def number(key: str, text: str = DEPLOYMENT) -> int:
    """The single integer value of `key:` in `text`."""
    values = re.findall(rf"^\s+{key}: (\d+)\s*$", text, flags=re.MULTILINE)
    assert len(values) == 1, (key, values)
    return int(values[0])


def test_every_flag_in_the_deployment_exists() -> None:
    help_text = subprocess.run(
        [*replica_command(), "serve", "--help"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    known = set(re.findall(r"(--[a-z0-9-]+)", help_text))
    args = container_args()
    assert args, "no args found in deployment.yaml"
    assert set(args) <= known, set(args) - known
    alternatives = commented_args()
    assert alternatives, "the commented --peer alternative is gone"
    assert set(alternatives) <= known, set(alternatives) - known


def test_probes_use_the_health_port_and_the_service_name() -> None:
    args = container_args()
    health_port = int(args["--health-port"])
    probe_ports = re.findall(r"grpc:\n\s+port: (\d+)", DEPLOYMENT)
    assert [int(p) for p in probe_ports] == [health_port] * 3  # startup, readiness, liveness
    service = pb.DESCRIPTOR.services_by_name["RolloutService"].full_name
    assert re.findall(r"service: (\S+)", DEPLOYMENT) == [service]  # readiness only; liveness is ""
    assert f"containerPort: {args['--port']}" in DEPLOYMENT


def test_termination_grace_covers_prestop_and_the_shutdown_bound() -> None:
    """The kubelet's SIGKILL must never come before the replica's own bound (bounds.py), which
    holds with hung engines: the workers' first drain phase, grace, the abort fan-out's deadline,
    the drain, closing."""
    args = container_args()
    grace = float(args["--grace"])
    workers = int(args["--workers"])
    prestop = number("seconds")
    needed = prestop + ServerConfig(engines=[], grace_s=grace).shutdown_bound_s(workers=workers)
    assert needed == prestop + bounds.shutdown_bound_s(grace, workers=workers)
    assert number("terminationGracePeriodSeconds") >= needed


def test_engines_configmap_lists_engine_urls() -> None:
    text = (K8S / "configmap.yaml").read_text()
    block = text.split("engines.txt: |\n", 1)[1]
    lines = [line.strip() for line in block.splitlines()]
    urls = [line for line in lines if line and not line.startswith("#")]
    assert urls and all(re.fullmatch(r"http://[a-z0-9.-]+:\d+", url) for url in urls), urls


def test_vllm_example_enables_what_the_service_needs() -> None:
    text = (K8S / "vllm-engines.example.yaml").read_text()
    for flag in ("--enable-scale-out", "--logprobs-mode=processed_logprobs"):
        assert re.search(rf"^\s+- {re.escape(flag)}\s*$", text, flags=re.MULTILINE), flag
    assert re.search(r'name: VLLM_SERVER_DEV_MODE\n\s+value: "1"', text)


def test_replicas_authenticate_with_the_mounted_secret() -> None:
    args, mounted = container_args(), mounts()
    assert args["--auth-tokens-file"].startswith(mounted["auth"] + "/")
    assert commented_args()["--peer-token-file"].startswith(mounted["auth"] + "/")
    assert args["--engines-file"].startswith(mounted["engines"] + "/")
    assert "secretName: rollout-grpc-auth" in DEPLOYMENT
    secret = (K8S / "auth-secret.example.yaml").read_text()
    assert "name: rollout-grpc-auth" in secret
    assert re.search(r"^\s+tokens: \|", secret, flags=re.MULTILINE)
    assert re.search(r"^\s+peer-token: ", secret, flags=re.MULTILINE)


def test_network_policy_admits_clients_and_peers_only() -> None:
    text = (K8S / "networkpolicy.yaml").read_text()
    assert "networkpolicy.yaml" in (K8S / "kustomization.yaml").read_text()
    args = container_args()
    ports = re.findall(r"^\s+- port: (\d+)\s*$", text, flags=re.MULTILINE)
    assert args["--port"] in ports and args["--health-port"] in ports
    # The front door is open to clients only (a rule of its own, without the peers).
    front_door_rule = text.split(f"- port: {args['--port']}\n", 1)[1].split(
        f"- port: {args['--health-port']}", 1
    )[0]
    assert f"- port: {args['--openai-port']}\n" in front_door_rule
    assert (
        'rollout-grpc/client: "true"' in front_door_rule and "app.kubernetes.io/name" not in front_door_rule
    )
    assert re.search(rf"- name: openai\n\s+containerPort: {args['--openai-port']}\n", DEPLOYMENT)
    assert re.search(
        r"- name: openai\n\s+port: \d+\n\s+targetPort: openai", (K8S / "services.yaml").read_text()
    )
    assert 'rollout-grpc/client: "true"' in text
    assert 'policyTypes: ["Ingress", "Egress"]' in text
    # Prometheus (labelled pods, any namespace) may scrape the metrics port, and only it.
    metrics_rule = text.split(f"- port: {args['--health-port']}\n", 1)[1].split("egress:", 1)[0]
    assert f"- port: {args['--metrics-port']}\n" in metrics_rule
    assert 'rollout-grpc/metrics-scraper: "true"' in metrics_rule and "namespaceSelector: {}" in metrics_rule
    engines = (K8S / "vllm-engines.example.yaml").read_text()
    assert "app.kubernetes.io/name: trainer" not in engines  # not every trainer pod
    assert 'rollout-grpc/engine-admin: "true"' in engines


def test_the_documented_deployment_serves_tls_with_its_tokens() -> None:
    """Tokens never cross the pod network in plaintext: the base manifests (what the README applies)
    serve TLS from the mounted kubernetes.io/tls Secret, and a replica would refuse tokens without
    it on --host=0.0.0.0 (tests/deploy/test_exposure.py)."""
    args = container_args()
    assert args["--host"] == "0.0.0.0" and "--auth-tokens-file" in args
    assert "--insecure-trusted-network" not in args
    mounted, peers = mounts(), commented_args()
    for flag in ("--tls-cert", "--tls-key"):
        assert args[flag].startswith(mounted["tls"] + "/"), flag
    assert peers["--peer-ca"].startswith(mounted["tls"] + "/")
    assert "--health-plaintext" in args and peers["--peer-tls-name"] == "rollout-grpc-headless"
    assert re.search(r"- name: tls\n\s+secret:\n\s+secretName: rollout-grpc-tls\n", DEPLOYMENT)
    assert not (K8S / "tls").exists()  # no plaintext base with an optional TLS overlay any more
    services = (K8S / "services.yaml").read_text()
    assert "h2c" not in services and services.count("appProtocol: https") == 3


def test_metrics_port_is_exposed_and_annotated_for_scraping() -> None:
    port = container_args()["--metrics-port"]
    assert re.search(rf"- name: metrics\n\s+containerPort: {port}\n", DEPLOYMENT)
    assert 'prometheus.io/scrape: "true"' in DEPLOYMENT
    assert f'prometheus.io/port: "{port}"' in DEPLOYMENT


async def test_grafana_dashboard_queries_only_metrics_the_server_exports() -> None:
    import json

    import aiohttp

    from rollout_grpc.server.engines.pool import EnginePool
    from rollout_grpc.server.engines.registry import adapter_factory
    from rollout_grpc.server.observe.metrics import PREFIX, Metrics
    from rollout_grpc.server.rollout.admission import Admission

    dashboard = json.loads((REPO / "deploy" / "grafana" / "rollout-grpc.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    used = {n for e in exprs for n in re.findall(rf"\b({PREFIX}[a-z0-9_]+)", e)}
    async with aiohttp.ClientSession() as session:
        metrics = Metrics(EnginePool([], adapter_factory(session)), Admission(1, 0))
        families = list(metrics.registry.collect())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {f.name + s for f in families for s in suffixes.get(f.type, ("",))}
    assert not used - exported, used - exported


def test_the_deployment_runs_the_containerfiles_image() -> None:
    """The image the Deployment names is the Containerfile's (make image), with its user and ports."""
    containerfile = (REPO / "Containerfile").read_text()
    assert re.search(rf"^\s+image: rollout-grpc:{re.escape(__version__)}$", DEPLOYMENT, flags=re.MULTILINE)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", containerfile, flags=re.MULTILINE)
    assert (number("runAsUser"), number("runAsGroup")) == (int(user[0]), int(user[1]))
    assert 'ENTRYPOINT ["rollout-grpc"]' in containerfile
    assert 'command: ["rollout-grpc"]' in DEPLOYMENT
    (exposed,) = re.findall(r"^EXPOSE (.+)$", containerfile, flags=re.MULTILINE)
    ports = {int(p) for p in re.findall(r"containerPort: (\d+)", DEPLOYMENT)}
    assert ports == {int(p) for p in exposed.split()}


REDIS = (K8S / "redis.example.yaml").read_text()


def test_the_deployment_uses_the_redis_examples_store_for_fleet_control() -> None:
    """docs/operations.md "Fleet control" recommends the shared store (no --peer list; with a store
    --peer is unused): the example Deployment names redis.example.yaml's Redis (its StatefulSet's
    first pod behind its headless Service) and reads the password that Redis requires from the
    same Secret, mounted as a file. `--peer` stays only as the commented no-store alternative."""
    args = container_args()
    assert "--peer" not in args and "--peer" in commented_args()
    (service,) = re.findall(r"^kind: Service\nmetadata:\n  name: (\S+)", REDIS, flags=re.MULTILINE)
    (statefulset,) = re.findall(r"^kind: StatefulSet\nmetadata:\n  name: (\S+)", REDIS, flags=re.MULTILINE)
    (port,) = re.findall(r"^\s+- name: redis\n\s+port: (\d+)", REDIS, flags=re.MULTILINE)
    assert re.fullmatch(rf"redis://{statefulset}-0\.{service}:{port}/\d+", args["--state-store"])
    # The Secret the Redis reads its password from is the one mounted for --state-store-password-file.
    (secret,) = re.findall(r"secretName: (\S+), items: \[\{key: password", REDIS)
    (volume,) = re.findall(
        rf"- name: (\S+)\n\s+secret:\n\s+secretName: {secret}\n"
        r"\s+items: \[\{key: password, path: password\}\]",
        DEPLOYMENT,
    )
    assert args["--state-store-password-file"] == mounts()[volume] + "/password"
    # The front door's port then serves any session from any pod.
    assert "--openai-port" in args


def _command_lines(text: str) -> list[str]:
    """Every line of the `command:` and `args:` lists, block scalars included (what a process runs);
    a list ends at the next key of its own or a lower indentation."""
    lines: list[str] = []
    indent: int | None = None  # of the `command:`/`args:` key whose list is being read
    for line in text.splitlines():
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        depth = len(line) - len(stripped)
        if re.match(r"(command|args):", stripped):
            indent = depth
        elif indent is not None and (depth < indent or (depth == indent and not stripped.startswith("- "))):
            indent = None
        if indent is not None:
            lines.append(stripped)
    return lines


#: What puts a password on a command line: redis-server's --requirepass / redis-cli's -a, a URL
#: with credentials (user:password@; a password flag with its value is `_password_flag`).
PASSWORD_ON_A_COMMAND_LINE = re.compile(r"--requirepass|\s-a\s|://[^/\s@]*@")


def _password_flag(line: str) -> bool:
    """A `--*pass*` flag given a value (a `--*-file` flag names a file instead)."""
    flags = re.findall(r"--([a-z-]*pass[a-z-]*)[= ]\S", line)
    return any(not name.endswith("-file") for name in flags)


def _shows_a_password(line: str) -> bool:
    return bool(PASSWORD_ON_A_COMMAND_LINE.search(line)) or _password_flag(line)


def test_no_password_is_on_a_command_line() -> None:
    """A password on a command line is in the pod spec or in `ps` (the process's argv): the
    replicas read it from a file (--state-store-password-file), and the Redis example gives it to
    redis-server as configuration on stdin."""
    found = {
        path.name: [line for line in _command_lines(path.read_text()) if _shows_a_password(line)]
        for path in sorted(K8S.glob("*.yaml"))
    }
    assert not any(found.values()), found
    assert _command_lines(DEPLOYMENT) and _command_lines(REDIS)
    assert any("--state-store-password-file=" in line for line in _command_lines(DEPLOYMENT))
    for bad in (
        "- --requirepass s3cret",
        'exec redis-server --requirepass "$(cat /etc/redis/password)"',
        "- --state-store=redis://:s3cret@rollout-grpc-redis-0.rollout-grpc-redis:6379/0",
        "- --state-store-password=s3cret",
    ):
        assert _shows_a_password(bad), bad


def test_the_redis_examples_command_requires_the_password_from_its_file(tmp_path: Path) -> None:
    """redis.example.yaml's container command, run as the pod runs it (`sh -c`, the Secret's file
    at another path, another port): the server starts, refuses a client without the password and
    accepts the file's password, which no process's command line carries."""
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed")
    (script,) = re.findall(r"args:\n\s+- \|-\n((?:\s{14}.*\n)+)", REDIS)
    script = "\n".join(line[14:] for line in script.splitlines())
    password = "pw-" + random.Random().randbytes(8).hex()
    (tmp_path / "password").write_text(password + "\n")
    port = free_listen_port(random.Random())
    script = script.replace("/etc/redis/password", str(tmp_path / "password"))
    script = script.replace("--port 6379", f"--port {port} --bind 127.0.0.1 --dir {tmp_path}")
    script = script.replace("exec redis-server", f"exec {shutil.which(binary) or binary}")
    with Processes(tmp_path / "procs") as procs:
        proc = procs.start("redis-example", ["sh", "-c", script])
        wait_until("the example's redis-server", lambda: tcp_accepts(port), proc)
        with pytest.raises(redis_client.AuthenticationError):
            redis_client.Redis(port=port).ping()
        with redis_client.Redis(port=port, password=password) as client:
            assert client.ping()
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
