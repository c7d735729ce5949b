"""One replica, every core: `rollout-grpc serve --workers N` (docs/workers.md).

The `serve` process becomes a supervisor (`supervisor.py`) that reserves the gRPC port
(`reservation.py`), starts N worker processes (`worker.py`, each a `RolloutServer` bound to the
port with SO_REUSEPORT) and talks to them over one socket pair each (`handshake.py`). The workers
reach each other ("siblings") over private unix sockets (`siblings.py`, `sibling_service.py`) so
that control RPCs act on the whole replica (`control.py`) and count one in-flight limit together
(`admission.py`); the supervisor serves the merged metrics (`metrics.py`) and watches that nobody
else listens on the port.
"""
