"""`python -m tests.support.sim_server`: `rollout-grpc sim` plus the `/_sim/*` test routes.

For tests that run a simulated engine in its own process and still switch its faults or read its
counters (over HTTP, `tests/support/sim_admin.py`). Same flags as `rollout-grpc sim`; run it from
the repository root (`tests` is not installed).
"""

from __future__ import annotations

from rollout_grpc.sim.__main__ import main
from tests.support import sim_admin

if __name__ == "__main__":
    main(prog="python -m tests.support.sim_server", extensions=[sim_admin.mount])
