"""Benchmarks of rollout-grpc (not tests: nothing here asserts on timings).

* `python -m bench.r3`  — routed-experts (R3) encodings: bytes on the wire and CPU to encode/decode.
* `python -m bench.run` — `make bench`: direct HTTP to simulated engines vs through the service,
  side by side in one run, plus abort-all latency; writes `docs/benchmarks.{json,md,png}`.
"""
