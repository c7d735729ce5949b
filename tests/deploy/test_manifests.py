"""The Kubernetes example stays consistent with the code it deploys.

No cluster is needed: these read deploy/k8s/*.yaml as text (the venv has no YAML parser, and the
files are ours, with one `key: value` per line) and compare them with the CLI's flags and the
server's shutdown timings, so a renamed flag or a longer grace shows up here instead of in a
cluster (a kubelet SIGKILL cuts streams without their final samples).
"""

from __future__ import annotations

import re
import subprocess

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.server import bounds
from rollout_grpc.server.app import ServerConfig
from tests.deploy.fleet import REPO, replica_command

K8S = REPO / "deploy" / "k8s"
DEPLOYMENT = (K8S / "deployment.yaml").read_text()


def container_args() -> dict[str, str]:
    """`--flag=value` items of the rollout-grpc container's args (flags only: value "")."""
    block = DEPLOYMENT.split("args:", 1)[1].split("ports:", 1)[0]
    items = re.findall(r"^\s+- (--[a-z0-9-]+)(?:=(\S+))?\s*$", block, flags=re.MULTILINE)
    return dict(items)


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
    holds with hung engines: grace, the abort fan-out's deadline, the drain, closing."""
    grace = float(container_args()["--grace"])
    prestop = number("seconds")
    needed = prestop + ServerConfig(engines=[], grace_s=grace).shutdown_bound_s()
    assert needed == prestop + bounds.shutdown_bound_s(grace)
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
