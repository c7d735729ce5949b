"""The contract from another language: a Node.js client (tests/crosslang/client.js) against live replicas.

Why: trainers are not all Python. The Node client loads proto/rollout.proto at run time with
@grpc/proto-loader (no generated code, nothing from this package), calls real grpc.aio replicas
on simulated vLLM engines and prints what it saw as JSON; these tests assert on that JSON and
compare it with what the Python client gets for the same requests. So a change in the server's
behaviour, in the proto, or in how either side encodes the contract fails here.

The npm packages are installed with `npm ci` from the committed package-lock.json into
tests/crosslang/node_modules (once per lockfile: a stamp file records its hash). The tests skip,
saying so, only when `node` or `npm` is not installed.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2, status_pb2
from PIL import Image

from rollout_grpc.client import AsyncRolloutClient, make_sample, pb, routed_experts_array
from rollout_grpc.server.security import redact
from tests.harness import Harness, harness
from tests.support.checkpoints import toy_checkpoint

pytestmark = [pytest.mark.crosslang, pytest.mark.asyncio(loop_scope="module")]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

#: A ChatML prompt of ordinary ids (valid in the simulator's 2048-token vocabulary).
PROMPT = [1, 92, 510, 206, 62, 79, 286, 317, 835, 1301, 835, 38, 2, 206, 1, 72, 345, 80, 1653, 206]
STREAM_TOKENS, STREAM_BATCH = 30, 8
CONTINUE_TOKENS = 5
RENDER_TOKENS = 6
GREEDY = {"temperature": 0, "ignore_eos": True}
#: Bearer tokens of the replica with authentication on (a trainer and an admin).
NODE_TRAINER, NODE_ADMIN = "node-trainer-token", "node-admin-token"
#: The MoE engines: (name, moe_layers, moe_experts, moe_topk, expected dtype, typed array, new tokens).
MOE = [
    ("uint8", 3, 8, 2, "D_TYPE_UINT8", "Uint8Array", 12),
    ("uint16", 2, 300, 4, "D_TYPE_UINT16", "Uint16Array", 9),
]
#: Long enough that the engine is still generating when the abort arrives (the engine waits this
#: long per token; an aborted generation stops early, so the tests do not wait for it).
ABORT_TOKEN_DELAY_S = 0.005
NODE_TIMEOUT_S = 90  # a safety net against a hung client, not a performance assertion


async def run_node(client_js: Path, plan: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run client.js on `plan` (without blocking the event loop that serves the replicas)."""
    plan_path = tmp / "plan.json"
    plan_path.write_text(json.dumps({"proto_dir": str(ROOT / "proto"), "prompt": PROMPT, **plan}))
    proc = await asyncio.create_subprocess_exec(
        # --no-deprecation: a newer Node's deprecation notices about dependencies are not our concern;
        # anything else on stderr (e.g. a proto-loader warning) fails the run.
        "node",
        "--no-deprecation",
        str(client_js),
        str(plan_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), NODE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = stdout.decode()
    assert proc.returncode == 0, f"node exited with {proc.returncode}:\n{text}\n{stderr.decode()}"
    assert stderr.decode().strip() == "", (
        f"node wrote to stderr (e.g. a proto-loader warning):\n{stderr.decode()}"
    )
    lines = text.strip().splitlines()
    assert len(lines) == 1, f"expected one JSON document, got:\n{text}"
    out: dict[str, Any] = json.loads(lines[0])
    return out


def png_bytes() -> bytes:
    """An 84x56 RGB gradient PNG (3x2 Qwen2-VL patches of 28 px: 6 placeholder tokens)."""
    x = np.linspace(0, 255, 84, dtype=np.uint8)
    y = np.linspace(0, 255, 56, dtype=np.uint8)
    rgb = np.stack(
        [np.tile(x, (56, 1)), np.tile(y[:, None], (1, 84)), np.full((56, 84), 128, np.uint8)], axis=-1
    )
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


class Run:
    """The replicas of one Node run and the JSON it printed."""

    def __init__(self, out: dict[str, Any], replicas: dict[str, Harness], png: bytes) -> None:
        self.out = out
        self.replicas = replicas
        self.png = png


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run(node_client: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Run]:
    """Start one replica per engine kind, run every Node scenario once, keep the replicas up."""
    tmp = tmp_path_factory.mktemp("crosslang")
    png = png_bytes()
    (tmp / "image.png").write_bytes(png)
    async with contextlib.AsyncExitStack() as stack:
        replicas = {
            "dense": await stack.enter_async_context(
                harness("sim", sim_config={"token_delay_s": ABORT_TOKEN_DELAY_S})
            ),
            "multimodal": await stack.enter_async_context(harness("sim", sim_config={"multimodal": True})),
        }
        for name, layers, experts, topk, *_ in MOE:
            replicas[name] = await stack.enter_async_context(
                harness(
                    "sim",
                    sim_config={
                        "return_routed_experts": True,
                        "moe_layers": layers,
                        "moe_experts": experts,
                        "moe_topk": topk,
                    },
                )
            )
        tokens = tmp / "tokens"
        tokens.write_text(f"node-trainer trainer {NODE_TRAINER}\nnode-admin admin {NODE_ADMIN}\n")
        replicas["authed"] = await stack.enter_async_context(harness("sim", auth_tokens_file=str(tokens)))
        checkpoints = tmp / "checkpoints"
        toy_checkpoint(checkpoints / "v1", seed=1)
        replicas["weights"] = await stack.enter_async_context(
            harness("sim", sim_count=2, weights_path_prefixes=[str(checkpoints)])
        )
        dense = replicas["dense"].target
        plan = {
            "server_info": {"target": dense},
            "stream": {"target": dense, "max_new_tokens": STREAM_TOKENS, "stream_batch_tokens": STREAM_BATCH},
            "invalid": {"target": dense},
            "abort_by_id": {"target": dense, "continue_tokens": CONTINUE_TOKENS},
            "abort_all": {"target": dense},
            "rollout_step": {"target": dense, "prompt": PROMPT},
            "render": {"target": replicas["multimodal"].target, "png_path": str(tmp / "image.png")},
            "auth": {
                "target": replicas["authed"].target,
                "trainer_token": NODE_TRAINER,
                "admin_token": NODE_ADMIN,
            },
            "routed_experts": [
                {"name": name, "target": replicas[name].target, "max_new_tokens": n} for name, *_, n in MOE
            ],
            "update_weights": {
                "target": replicas["weights"].target,
                "checkpoint": str(checkpoints / "v1"),
                "outside": "/etc",
                "prompt": PROMPT,
            },
        }
        out = await run_node(node_client, plan, tmp)
        assert "fatal" not in out, out
        yield Run(out, replicas, png)


# ------------------------------------------------------------------------------------------ helpers


def concat(deltas: list[dict[str, Any]], key: str) -> list[Any]:
    return [v for d in deltas for v in d[key]]


def assert_stream_contract(stream: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """OK status, the sample last and once, deltas contiguous and equal to the new tokens."""
    assert stream["code"] == "OK", stream["details"]
    assert stream["messages_after_sample"] == 0
    sample = stream["sample"]
    assert sample is not None, "the stream must end with the final sample"
    n = sample["response_length"]
    assert sample["tokens"][: len(prompt)] == prompt
    assert len(sample["tokens"]) == len(prompt) + n
    assert len(sample["loss_mask"]) == n == len(sample["rollout_log_probs"])
    offset = 0
    for delta in stream["deltas"]:
        assert delta["offset"] == offset, "deltas are in order and contiguous"
        assert len(delta["token_ids"]) == len(delta["logprobs"])
        offset += len(delta["token_ids"])
    assert concat(stream["deltas"], "token_ids") == sample["tokens"][len(prompt) :]
    assert concat(stream["deltas"], "logprobs") == sample["rollout_log_probs"]
    return dict(sample)


def status_details(b64: str) -> status_pb2.Status:
    return status_pb2.Status.FromString(base64.b64decode(b64))


# -------------------------------------------------------------------------------------------- tests


async def test_versions_and_server_info(run: Run) -> None:
    out = run.out
    assert (out["grpc_js"], out["proto_loader"]) == ("1.14.7", "0.8.1")
    info = out["server_info"]
    py_info = await run.replicas["dense"].client.server_info()
    assert info["version"] == py_info.version != ""
    assert (
        [e["url"] for e in info["engines"]]
        == [e.url for e in py_info.engines]
        == [run.replicas["dense"].sims[0].url]
    )
    assert all(e["healthy"] for e in info["engines"])
    assert info["paused"] is False


async def test_stream_deltas_then_final_sample(run: Run) -> None:
    stream = run.out["stream"]
    sample = assert_stream_contract(stream, PROMPT)
    assert stream["header_request_id"] == "node-stream-1"
    # The time flush is off, so a delta is flushed only once `stream_batch_tokens` tokens are pending
    # (the last one excepted), and the stream stays within the documented bound of
    # ceil(new_tokens / stream_batch_tokens) + 1 messages, the final sample included.
    sizes = [len(d["token_ids"]) for d in stream["deltas"]]
    assert 1 <= len(sizes) <= math.ceil(STREAM_TOKENS / STREAM_BATCH)
    assert all(size >= STREAM_BATCH for size in sizes[:-1])
    assert sample["status"] == "SAMPLE_STATUS_TRUNCATED"
    assert sample["finish_reason"] == "FINISH_REASON_LENGTH"
    assert sample["response_length"] == STREAM_TOKENS
    assert sample["loss_mask"] == [1] * STREAM_TOKENS
    assert all(lp <= 0 for lp in sample["rollout_log_probs"])
    assert sample["failure_reason"] == ""
    # Echoed fields, int64 as decimal strings (longs: String), and the Struct metadata.
    assert (sample["index"], sample["group_index"], sample["session_id"]) == ("7", "3", "node-session")
    assert sample["metadata"]["fields"]["source"]["stringValue"] == "node"
    assert sample["metadata"]["fields"]["weight"]["numberValue"] == 0.5
    assert sample["usage"]["prompt_tokens"] == str(len(PROMPT))
    assert sample["usage"]["completion_tokens"] == str(STREAM_TOKENS)
    assert [(w["start"], w["end"]) for w in sample["weight_versions"]] == [(0, STREAM_TOKENS)]
    assert sample["response"].startswith("".join(d["text"] for d in stream["deltas"]))
    assert sample["has_routed_experts"] is False
    # The same request from Python gives the same sample (greedy; presence of temperature=0 and
    # ignore_eos survived Node's encoding).
    py = await run.replicas["dense"].client.generate(
        make_sample(PROMPT), {**GREEDY, "max_new_tokens": STREAM_TOKENS}
    )
    assert sample["tokens"] == list(py.tokens)
    assert sample["rollout_log_probs"] == list(py.rollout_log_probs)
    assert sample["response"] == py.response


async def test_invalid_argument_names_the_field(run: Run) -> None:
    invalid = run.out["invalid"]
    assert invalid["code"] == "INVALID_ARGUMENT"
    assert invalid["deltas"] == 0 and invalid["sample"] is None
    assert invalid["details"].startswith("sample.tokens[1]")
    status = status_details(invalid["status_details_b64"])
    assert status.code == 3
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert [v.field for v in bad.field_violations] == ["sample.tokens[1]"]


async def test_abort_by_request_id_then_continue(run: Run) -> None:
    report = run.out["abort_by_id"]
    assert report["abort"] == {
        "aborted": 1,
        "unknown_request_ids": ["node-not-in-flight"],
        "engine_errors": [],
    }
    stream = report["stream"]
    assert stream["header_request_id"] == "node-abort-1"
    sample = assert_stream_contract(stream, PROMPT)
    assert sample["status"] == "SAMPLE_STATUS_ABORTED"
    assert sample["finish_reason"] == "FINISH_REASON_ABORT"
    assert sample["failure_reason"] == "", "aborted on request: no failure reason"
    k = sample["response_length"]
    assert k >= 1, "the abort was sent after the first delta"
    assert k < 4096 - len(PROMPT), "the generation was cut short"
    # The decoded ABORTED sample, sent back by Node as it was, continues with the remaining budget.
    cont = report["continuation"]
    assert cont["code"] == "OK" and cont["deltas"] == []
    done = cont["sample"]
    budget = cont["budget"]
    assert budget == k + CONTINUE_TOKENS
    assert done["status"] == "SAMPLE_STATUS_TRUNCATED"
    assert done["response_length"] == budget
    assert done["tokens"][: len(sample["tokens"])] == sample["tokens"]
    assert done["rollout_log_probs"][:k] == sample["rollout_log_probs"]
    assert done["loss_mask"] == [1] * budget
    assert [(w["start"], w["end"]) for w in done["weight_versions"]] == [(0, budget)]
    # Greedy abort + continuation equals one uninterrupted greedy generation of the same length.
    py = await run.replicas["dense"].client.generate(
        make_sample(PROMPT), {**GREEDY, "max_new_tokens": budget}
    )
    assert done["tokens"] == list(py.tokens)


async def test_abort_all(run: Run) -> None:
    report = run.out["abort_all"]
    assert report["abort"] == {"aborted": 2, "unknown_request_ids": [], "engine_errors": []}
    for stream, rid in zip(report["streams"], ["node-all-1", "node-all-2"], strict=True):
        assert stream["header_request_id"] == rid
        sample = assert_stream_contract(stream, PROMPT)
        assert sample["status"] == "SAMPLE_STATUS_ABORTED"
        assert sample["finish_reason"] == "FINISH_REASON_ABORT"
        assert sample["response_length"] >= 1
    # The engines were resumed: the next generation runs to its budget.
    after = assert_stream_contract(report["after"], PROMPT)
    assert after["status"] == "SAMPLE_STATUS_TRUNCATED" and after["response_length"] == 4
    info = await run.replicas["dense"].client.server_info()
    assert not info.paused and info.in_flight == 0


async def test_render_chat_with_png_then_generate(run: Run) -> None:
    report = run.out["render"]
    assert report["png_sha256"] == hashlib.sha256(run.png).hexdigest()
    rendered = report["bytes"]
    ids = rendered["token_ids"]
    (modality,) = rendered["features"]
    assert modality["modality"] == "image"
    (item,) = modality["items"]
    assert item["mm_hash"] and item["length"] == 6  # 84x56 px = 3x2 patches of 28 px
    span = ids[item["offset"] : item["offset"] + item["length"]]
    assert span == [item["placeholder_token_id"]] * item["length"]
    assert rendered["engine"] == run.replicas["multimodal"].sims[0].url
    # The same image as a data URL renders identically.
    assert report["data_url"]["token_ids"] == ids
    assert report["data_url"]["features"] == rendered["features"]
    # Python renders the same chat to the same ids and the same media hash.
    py = await run.replicas["multimodal"].client.render(
        [{"role": "user", "content": ["What is in this picture?", run.png]}], session_id="node-render"
    )
    assert list(py.token_ids) == ids
    py_item = py.features.modalities[0].items[0]
    assert (py_item.mm_hash, py_item.placeholder.offset, py_item.placeholder.length) == (
        item["mm_hash"],
        item["offset"],
        item["length"],
    )
    assert py_item.placeholder_token_id == item["placeholder_token_id"]
    py_kwargs = len(py_item.kwargs_data) if py_item.HasField("kwargs_data") else None
    assert py_kwargs == item["kwargs_data_bytes"]
    # Node generated from the rendered ids with the features it had decoded.
    gen = report["generate"]
    assert gen["code"] == "OK", gen["details"]
    sample = gen["sample"]
    assert sample["status"] == "SAMPLE_STATUS_TRUNCATED"
    assert sample["response_length"] == RENDER_TOKENS
    assert sample["tokens"][: len(ids)] == ids


@pytest.mark.parametrize(("name", "layers", "experts", "topk", "dtype", "array_type", "new_tokens"), MOE)
async def test_routed_experts_decoded_in_node_match_python(
    run: Run, name: str, layers: int, experts: int, topk: int, dtype: str, array_type: str, new_tokens: int
) -> None:
    (report,) = [r for r in run.out["routed_experts"] if r["name"] == name]
    summary = report["sample"]
    assert summary["status"] == "SAMPLE_STATUS_TRUNCATED"
    assert summary["response_length"] == new_tokens
    node = report["routed_experts"]
    num_tokens = len(summary["tokens"])
    assert node["dtype"] == dtype and node["array_type"] == array_type
    assert node["start"] == 0
    assert node["shape"] == [num_tokens - 1, layers, topk], "every token but the last"
    # Python decodes the very bytes Node decoded (the raw final message).
    final = pb.GenerateResponse.FromString(base64.b64decode(report["final_message_b64"]))
    assert final.WhichOneof("event") == "sample"
    assert list(final.sample.tokens) == summary["tokens"]
    array = routed_experts_array(final.sample)
    assert array is not None
    assert list(array.shape) == node["shape"]
    assert node["byte_length"] == array.nbytes == len(final.sample.routed_experts.data)
    assert node["sum"] == int(array.sum(dtype=np.int64))
    assert node["sha256"] == hashlib.sha256(array.astype(array.dtype.newbyteorder("<")).tobytes()).hexdigest()
    assert (node["min"], node["max"]) == (int(array.min()), int(array.max()))
    assert node["first_row"] == array[0].tolist() and node["last_row"] == array[-1].tolist()
    assert int(array.max()) < experts
    assert all(len(set(row)) == topk for row in array.reshape(-1, topk).tolist()), (
        "top-k experts are distinct"
    )
    if experts > 256:
        assert int(array.max()) > 255, "uint16 values above one byte exercise the little-endian decode"
    # The same request from Python routes the same tokens through the same experts.
    py = await run.replicas[name].client.generate(
        make_sample(PROMPT), {**GREEDY, "max_new_tokens": new_tokens}, {"return_routed_experts": True}
    )
    py_array = routed_experts_array(py)
    assert py_array is not None
    assert list(py.tokens) == summary["tokens"]
    assert np.array_equal(py_array, array)


# ----------------------------------------------------------------- the `rollout-grpc serve` command


def _serve_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout-grpc"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout_grpc.cli"]


async def test_node_client_against_rollout_grpc_serve(node_client: Path, tmp_path: Path) -> None:
    """The shipped command (embedded simulated engines) serves the Node client too."""
    port_file = tmp_path / "ports.json"
    proc = await asyncio.create_subprocess_exec(
        *_serve_command(),
        "serve",
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--sim-engines",
        "1",
        "--sim-token-delay-ms",
        str(ABORT_TOKEN_DELAY_S * 1000),
        "--log-format",
        "json",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    log_lines: list[str] = []
    drain: asyncio.Task[None] | None = None
    try:
        port = await _wait_serving(proc.stderr, log_lines)
        drain = asyncio.create_task(_drain(proc.stderr, log_lines))
        target = f"127.0.0.1:{port}"
        plan = {
            "server_info": {"target": target},
            "stream": {
                "target": target,
                "max_new_tokens": STREAM_TOKENS,
                "stream_batch_tokens": STREAM_BATCH,
            },
            "abort_all": {"target": target},
        }
        out = await run_node(node_client, plan, tmp_path)
        assert len(out["server_info"]["engines"]) == 1
        sample = assert_stream_contract(out["stream"], PROMPT)
        assert sample["status"] == "SAMPLE_STATUS_TRUNCATED" and sample["response_length"] == STREAM_TOKENS
        assert out["abort_all"]["abort"]["aborted"] == 2
        assert [s["sample"]["status"] for s in out["abort_all"]["streams"]] == ["SAMPLE_STATUS_ABORTED"] * 2
        # The port file (written once serving) names the same port; Python sees the same greedy sample.
        assert json.loads(port_file.read_text())["grpc"] == port
        async with AsyncRolloutClient(target) as client:
            py = await client.generate(make_sample(PROMPT), {**GREEDY, "max_new_tokens": STREAM_TOKENS})
        assert sample["tokens"] == list(py.tokens)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), NODE_TIMEOUT_S)
        if drain is not None:
            await drain  # ends at EOF, now that the process has exited
    assert rc == 0, "rollout-grpc serve did not stop cleanly on SIGTERM:\n" + "".join(log_lines[-20:])


async def _wait_serving(stderr: asyncio.StreamReader, lines: list[str]) -> int:
    """Read the replica's JSON log until its `serving` event; return the gRPC port it names."""
    while True:
        line = await asyncio.wait_for(stderr.readline(), NODE_TIMEOUT_S)
        assert line, "rollout-grpc serve exited before serving:\n" + "".join(lines)
        lines.append(line.decode())
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and event.get("event") == "serving":
                return int(event["port"])


async def _drain(stream: asyncio.StreamReader, lines: list[str]) -> None:
    """Keep reading the server's log so a full pipe never blocks it."""
    while line := await stream.readline():
        lines.append(line.decode())


async def test_auth_roles_from_node(run: Run) -> None:
    report = run.out["auth"]
    assert "local_only" not in report["abort_request_fields"]
    assert report["abort_request_fields"] == ["all", "request_ids", "session_id", "group_index", "mine"]
    assert report["replica_service"] is True
    assert report["anonymous_info"] == "UNAUTHENTICATED"
    urls = [e.url for e in run.replicas["authed"].server.pool.engines]
    assert report["trainer_engine_urls"] == [redact.engine_label(u) for u in urls]
    assert report["trainer_pause"] == "PERMISSION_DENIED"
    assert report["trainer_abort_all"] == "PERMISSION_DENIED"
    assert report["admin_pause"] == "OK" and report["admin_resume"] == "OK"


async def test_rollout_step_from_node(run: Run) -> None:
    step = run.out["rollout_step"]
    assert step["code"] == "OK" and step["after_summary"] == 0
    assert step["summary"] == {"accepted": 2, "target_reached": True}
    assert sorted(g["group_index"] for g in step["groups"]) == [0, 1]
    for group in step["groups"]:
        assert group["outcome"] == "GROUP_OUTCOME_ACCEPTED"
        assert len(group["samples"]) == 2
        for sample in group["samples"]:
            assert sample["response_length"] == 5 and sample["tokens"][: len(PROMPT)] == PROMPT
    assert step["progress"] >= 1


async def test_update_weights_from_node(run: Run) -> None:
    report = run.out["update_weights"]
    sims = run.replicas["weights"].sims
    assert report["weight_version"] == "node-v1" and report["previous_versions"] == ["default"]
    assert sorted(e["engine"] for e in report["engines"]) == sorted(s.url for s in sims)
    assert all(e["updated"] and e["error"] == "" for e in report["engines"])
    assert (
        report["refused"]["code"] == "PERMISSION_DENIED"
        and "--weights-path-prefix" in report["refused"]["details"]
    )
    assert report["sample_versions"] == ["node-v1"]
    assert [(s.stats.weight_loads, s.core.version) for s in sims] == [(1, "node-v1"), (1, "node-v1")]
