#!/usr/bin/env bash
# The one place that starts a replica on simulated engines for the client tests and the client
# matrix (tools/client_matrix.sh, tests/client/conftest.py): `tools/serve_sim.sh PORT_FILE`.
# Runs in the foreground from the dev virtualenv (the server's Python and pins) and writes
# {"grpc": port, ...} to PORT_FILE once serving. A 2 ms per-token delay keeps long generations in
# flight long enough to abort them, while short ones still finish in tens of milliseconds. The
# Prometheus port (also in PORT_FILE) lets client tests read what the server recorded of their calls.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
exec "${ROLLOUT_SERVER_PYTHON:-$ROOT/.venv/bin/python}" -m rollout_grpc._entry serve \
  --port 0 --health-port 0 --metrics-port 0 --port-file "$1" \
  --sim-engines 2 --sim-token-delay-ms 2 \
  --log-level warning
