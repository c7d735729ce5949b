"""The replica the client tests talk to, and what it recorded of their calls (its /metrics)."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

import pytest

TARGET_ENV = "ROLLOUT_GRPC_TARGET"
METRICS_ENV = "ROLLOUT_GRPC_METRICS"


@dataclass(frozen=True)
class Replica:
    """A live replica: its gRPC address and, when known, its Prometheus /metrics address."""

    target: str
    metrics: str | None

    def handled(self, method: str) -> dict[str, float]:
        """The replica's `grpc_server_handled_total` of `method`, by gRPC code name.

        Parsed by hand: the client-only virtualenvs of the matrix have no prometheus_client.
        """
        if self.metrics is None:
            pytest.skip(f"{TARGET_ENV} is set without {METRICS_ENV}: the replica's metrics are unknown")
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
        with direct.open(f"http://{self.metrics}/metrics", timeout=10) as response:
            text = response.read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("rollout_grpc_grpc_server_handled_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rindex("}")]))
            if labels.get("grpc_method") == method:
                # Summed over the `worker` label of a `serve --workers N` replica's merged scrape.
                code = labels["grpc_code"]
                counts[code] = counts.get(code, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts
