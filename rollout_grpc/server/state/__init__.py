"""The fleet's shared state behind one small typed interface (api.py).

The step (rollout/step) reads and writes its partial-rollout buffers through `BufferStore` and
never imports a store client; the wiring (app.py, workers/) picks the implementation: the
in-process `MemoryStore` for one process, `SocketStore` reaching the supervisor's `MemoryStore`
for `serve --workers N`, `RedisStore` for replicas (`--state-store redis://...`).
"""
