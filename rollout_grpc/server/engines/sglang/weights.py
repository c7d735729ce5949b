"""SGLang's checkpoint load from disk and memory release (docs/engines.md "Weight updates").

Read in SGLang 0.5.23's released source (`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`,
`tokenizer_manager.update_weights_from_disk`); verified against the simulator, not a running SGLang:

* `POST /update_weights_from_disk {"model_path", "load_format", "abort_all_requests", "weight_version",
  "flush_cache", ...}` -> 200 `{"success": true, "message", "num_paused_requests"}`, or HTTP 400 with
  `"success": false` and SGLang's message. A paused engine (`/pause_generation`) loads at once; an
  unpaused one waits for its model-update lock. The version is set by the domain's own
  `/update_weight_version` call afterwards (one path for every engine kind), so none is sent here.
  A failed load is rolled back: the engine keeps serving its old weights.
* `POST /release_memory_occupation {"tags": [...]}` / `POST /resume_memory_occupation {"tags": [...]}`
  (tags `weights`, `kv_cache`; null: all) -> 200 with a `null` body, or `{"error": {"message"}}`.
  Release asserts that the engine is idle (`scheduler_components/weight_updater.py`): the domain
  pauses it with ABORT first.
* distributed transfer: `/init_weights_update_group {"master_address", "master_port", "rank_offset",
  "world_size", "group_name", "backend"}` (each tensor-parallel rank joins as `rank_offset + tp_rank`)
  and `/update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "flush_cache",
  "abort_all_requests", ...}`, both -> `{"success", "message"}`, 400 on failure
  (`entrypoints/http_server.py:1404,1488`). Ranks per engine: `tp_size` x `pp_size` of
  `/get_server_info`; data parallel replicas would share rank offsets and are refused. Unverified
  here without GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from rollout_grpc.server.engines.api import (
    EngineMalformed,
    EngineRejected,
    MemoryRelease,
    TensorSpec,
    TransferGroup,
    WeightAction,
)
from rollout_grpc.server.engines.http import HttpEngineMixin

WEIGHT_ROUTES: Final[dict[WeightAction, str]] = {
    WeightAction.LOAD_CHECKPOINT: "/update_weights_from_disk",
    WeightAction.RELEASE_MEMORY: "/release_memory_occupation",
    WeightAction.RESUME_MEMORY: "/resume_memory_occupation",
    WeightAction.TRANSFER_RANKS: "/get_server_info",
    WeightAction.INIT_TRANSFER: "/init_weights_update_group",
    WeightAction.RECEIVE_WEIGHTS: "/update_weights_from_distributed",
}


class SglangWeights(HttpEngineMixin):
    """The weight operations of `SglangEngine` (mixed in; uses its `_json` and `url`)."""

    def weight_route(self, action: WeightAction) -> str:
        return WEIGHT_ROUTES[action]

    async def load_checkpoint(self, path: str, timeout: float | None) -> None:
        """`/update_weights_from_disk` without aborting (the caller paused in its own mode)."""
        body = await self._json(
            "POST",
            "/update_weights_from_disk",
            json_body={"model_path": path, "abort_all_requests": False, "flush_cache": True},
            timeout=timeout,
        )
        if not isinstance(body, dict) or body.get("success") is not True:
            raise EngineMalformed(self.url, f"/update_weights_from_disk answered {str(body)[:200]!r}")

    async def release_memory(self, release: MemoryRelease) -> None:
        """`/release_memory_occupation` (no levels in SGLang: the tags say what is freed)."""
        await self._json("POST", "/release_memory_occupation", json_body={"tags": list(release.tags) or None})

    async def resume_memory(self, tags: tuple[str, ...]) -> None:
        """`/resume_memory_occupation` with `tags` (null: everything)."""
        await self._json("POST", "/resume_memory_occupation", json_body={"tags": list(tags) or None})

    async def transfer_ranks(self) -> int:
        """`tp_size` x `pp_size` from `/get_server_info` (`dp_size` > 1 is refused, see above)."""
        body = await self._json("GET", "/get_server_info")
        if not isinstance(body, dict):
            raise EngineMalformed(self.url, "/get_server_info answered no JSON object")
        sizes = [body.get(key, 1) for key in ("tp_size", "pp_size", "dp_size")]
        if not all(type(v) is int and v >= 1 for v in sizes):
            raise EngineMalformed(self.url, f"/get_server_info has no valid tp/pp/dp sizes: {sizes}")
        tp, pp, dp = sizes
        if dp > 1:
            raise EngineRejected(self.url, f"dp_size {dp}: data-parallel replicas would share rank offsets")
        return int(tp * pp)

    async def init_transfer(self, group: TransferGroup, rank_offset: int, timeout: float | None) -> None:
        body = {
            "master_address": group.master_address,
            "master_port": group.master_port,
            "rank_offset": rank_offset,
            "world_size": group.world_size,
            "group_name": group.group_name,
            "backend": group.backend,
        }
        answer = await self._json("POST", "/init_weights_update_group", json_body=body, timeout=timeout)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineMalformed(self.url, f"/init_weights_update_group answered {str(answer)[:200]!r}")

    async def receive_weights(
        self, group: TransferGroup, tensors: Sequence[TensorSpec], timeout: float | None
    ) -> None:
        body = {
            "names": [t.name for t in tensors],
            "dtypes": [t.dtype for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": group.group_name,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        answer = await self._json("POST", "/update_weights_from_distributed", json_body=body, timeout=timeout)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            raise EngineMalformed(
                self.url, f"/update_weights_from_distributed answered {str(answer)[:200]!r}"
            )
