"""Start one tier server by hand and keep it up until Ctrl-C (or SIGTERM); then stop its process group.

    .venv/bin/python -m tools.vllm.launch dense      # or moe, vl; from the repository root

Needs the vLLM venv and models (tools/vllm/install.sh, tools/vllm/build_models.sh). Prints the URL,
the start time and the resident memory of the server's processes.
"""

from __future__ import annotations

import argparse
import signal
import sys
from types import FrameType

from tests.vllm.servers import MODEL_KINDS, VllmServerManager, cache_dir


def main() -> int:
    parser = argparse.ArgumentParser(description="Run one tiny-model vLLM server until interrupted.")
    parser.add_argument("kind", choices=MODEL_KINDS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /health")
    args = parser.parse_args()

    manager = VllmServerManager(log_dir=cache_dir() / "vllm-logs", start_timeout_s=args.timeout)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # SIGTERM ends us like Ctrl-C: through the finally below

    signal.signal(signal.SIGTERM, on_term)
    try:
        url = manager.url(args.kind)
        server = manager.server(args.kind)
        assert server is not None
        rss = server.rss_mib()
        print(f"{args.kind}: {url} (healthy after {server.started_s:.1f} s; log {server.log_path})")
        print(
            f"RSS {sum(rss.values()):.0f} MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(rss.items()))
        )
        sys.stdout.flush()
        while True:
            signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        manager.stop_all()
        print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
