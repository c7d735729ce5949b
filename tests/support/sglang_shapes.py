"""Response shapes of SGLang 0.5.23, written down as data from the released wheel's source.

Every shape names the file and line of ``sglang==0.5.23`` (``pip download --no-deps
sglang==0.5.23``, paths under ``sglang/srt/``) it was read from. Nothing here imports SGLang: the
conformance test (``tests/sim/test_sglang_conformance_0523.py``) holds the simulator's bodies to
these shapes, so a simulator that drifts from the source fails there.

A shape lists its keys in the order the source inserts them (``ordered``), which keys must be
present, the JSON type of each, and whether other keys are allowed (``closed``). Types are the
Python types ``orjson`` decodes into; ``None`` in a type tuple means JSON ``null``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TM = "managers/tokenizer_manager.py"
SB = "managers/schedule_batch.py"
HS = "entrypoints/http_server.py"
WV = "utils/weight_versions.py"
PROTO = "entrypoints/openai/protocol.py"

NULL = type(None)
Types = tuple[type, ...]
NUM: Types = (int, float)


@dataclass(frozen=True)
class Shape:
    """One JSON object as the 0.5.23 source builds it."""

    name: str
    source: str
    #: ``(key, types)`` in the order the source inserts them.
    keys: tuple[tuple[str, Types], ...]
    required: frozenset[str]
    #: No key outside ``keys`` may appear.
    closed: bool = True
    #: Keys whose value is fixed by the source.
    values: dict[str, Any] = field(default_factory=dict)
    #: The keys appear in ``keys``' order (false where the source's order is not written down).
    ordered: bool = True

    def problems(self, obj: Any) -> list[str]:
        """Every way ``obj`` differs from this shape (empty when it conforms)."""
        where = f"{self.name} ({self.source})"
        if not isinstance(obj, dict):
            return [f"{where}: not an object: {obj!r}"]
        out: list[str] = []
        known = dict(self.keys)
        for key in sorted(self.required - obj.keys()):
            out.append(f"{where}: missing key {key!r}")
        if self.closed:
            for key in obj.keys() - known.keys():
                out.append(f"{where}: unexpected key {key!r}")
        for key, value in obj.items():
            types = known.get(key)
            if types is not None and not _is(value, types):
                out.append(f"{where}: {key!r} is {type(value).__name__} ({value!r:.60}), want {types}")
        for key, want in self.values.items():
            if key in obj and obj[key] != want:
                out.append(f"{where}: {key!r} = {obj[key]!r}, want {want!r}")
        order = [k for k, _ in self.keys]
        seen = [k for k in obj if k in known]
        if self.ordered and seen != sorted(seen, key=order.index):
            out.append(f"{where}: key order {seen}, want the order of {order}")
        return out


def _is(value: Any, types: Types) -> bool:
    # bool is an int in Python but not in JSON.
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _shape(
    name: str, source: str, keys: list[tuple[str, Types]], optional: tuple[str, ...] = (), **kw: Any
) -> Shape:
    return Shape(name, source, tuple(keys), frozenset(k for k, _ in keys) - set(optional), **kw)


# --------------------------------------------------------------------------- /generate outputs
#: ``_handle_batch_output``'s out_dict (TM 2624-2674): ``text`` only with a tokenizer (the
#: ``BatchTokenIDOutput`` branch, TM 2675-2713, has none), ``prompt_token_ids`` when asked (TM
#: 2673-2674, 2712-2713).
OUTPUT = _shape(
    "generate output",
    f"{TM}:2624-2674,2675-2713",
    [("text", (str, NULL)), ("output_ids", (list,)), ("meta_info", (dict,)), ("prompt_token_ids", (list,))],
    optional=("text", "prompt_token_ids"),
)

#: ``meta_info`` of a running or finished request, keys in insertion order: the five of TM
#: 2507-2513; logprobs via ``convert_logprob_style`` (TM 2521, 3009) and ``add_logprob_to_meta_info``
#: (TM 2840, 2868-2870; top logprobs TM 2938, 2973); TM 2555-2557; the spans
#: (``add_weight_versions_to_meta_info``, TM 2564; WV 90, 99-107, which overwrites ``weight_version``
#: in place so its position stays the fourth); image tokens TM 2591-2592; routed experts TM
#: 2602-2609 (base64 text); ``dp_rank`` TM 2616-2617 (null without a data-parallel controller: the
#: scheduler's rank is None, ``managers/scheduler_components/output_streamer.py`` 723, and the list of
#: them is still truthy); ``e2e_latency`` on the finished output TM 2753;
#: ``response_sent_to_client_ts`` on the first output sent only (``_stream_one_response``, TM 1946,
#: 2025-2029, 2055-2059).
META_INFO = _shape(
    "meta_info",
    f"{TM}:2507-2617,2753,2868-2870,2938,2973,2027,2057; {WV}:99-107",
    [
        ("id", (str,)),
        ("finish_reason", (dict, NULL)),
        ("prompt_tokens", (int,)),
        ("weight_version", (str,)),
        ("num_retractions", (int,)),
        ("input_token_logprobs", (list,)),
        ("output_token_logprobs", (list,)),
        ("output_token_logprobs_length", (int,)),
        ("input_top_logprobs", (list,)),
        ("output_top_logprobs", (list,)),
        ("reasoning_tokens", (int,)),
        ("completion_tokens", (int,)),
        ("cached_tokens", (int,)),
        ("weight_versions", (list,)),
        ("image_tokens", (int,)),
        ("routed_experts", (str,)),
        ("dp_rank", (int, NULL)),
        ("e2e_latency", NUM),
        ("response_sent_to_client_ts", NUM),
    ],
    optional=(
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "input_top_logprobs",
        "output_top_logprobs",
        "weight_versions",
        "image_tokens",
        "routed_experts",
        "dp_rank",
        "e2e_latency",
        "response_sent_to_client_ts",
    ),
)

#: The keys ``_slice_streaming_output_meta_info`` cuts to the chunk's delta under
#: ``--incremental-streaming-output`` (TM 258-264, 364-374); every other key stays cumulative.
INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs")

#: ``meta_info`` the tokenizer builds itself for a request aborted in the waiting queue
#: (``_handle_abort_req``, TM 3577, 3603-3628): no ``prompt_tokens``, ``num_retractions``,
#: ``cached_tokens`` or ``reasoning_tokens``; spans as for any output (TM 3609-3614, WV 99-107);
#: logprobs whole (``add_logprob_to_meta_info``, TM 3617-3625, with ``finished=True``);
#: ``response_sent_to_client_ts`` when it is the first output sent (TM 2025-2029).
QUEUED_ABORT_META = _shape(
    "queued-abort meta_info",
    f"{TM}:3603-3628,2868-2870,2938,2973,2027; {WV}:99-107",
    [
        ("id", (str,)),
        ("finish_reason", (dict,)),
        ("weight_version", (str,)),
        ("e2e_latency", NUM),
        ("weight_versions", (list,)),
        ("input_token_logprobs", (list,)),
        ("output_token_logprobs", (list,)),
        ("output_token_logprobs_length", (int,)),
        ("input_top_logprobs", (list,)),
        ("output_top_logprobs", (list,)),
        ("completion_tokens", (int,)),
        ("response_sent_to_client_ts", NUM),
    ],
    optional=(
        "response_sent_to_client_ts",
        "weight_versions",
        "input_token_logprobs",
        "output_token_logprobs",
        "output_token_logprobs_length",
        "input_top_logprobs",
        "output_top_logprobs",
    ),
)
#: Its output object always has ``text`` (TM 3631-3637).
QUEUED_ABORT_OUTPUT = _shape(
    "queued-abort output",
    f"{TM}:3631-3637",
    [("text", (str,)), ("output_ids", (list,)), ("meta_info", (dict,)), ("prompt_token_ids", (list,))],
    optional=("prompt_token_ids",),
)
#: ``finish_reason`` of that output (TM 3596-3600): the scheduler passes no reason of its own for a
#: request popped by ``/abort_request`` or an abort pause (SCH 5700-5702, 6398-6403; TM 2254).
QUEUED_ABORT_FINISH = _shape(
    "queued-abort finish_reason",
    f"{TM}:3596-3600",
    [("type", (str,)), ("message", (str,))],
    values={"type": "abort", "message": "Abort in waiting queue"},
)

#: One weight-version span (WV 99-106).
WEIGHT_SPAN = _shape(
    "weight_versions[i]", f"{WV}:99-106", [("version", (str,)), ("start", (int,)), ("end", (int,))]
)

#: ``[logprob, token_id, text|null]`` (``detokenize_logprob_tokens``, TM 3098-3116): a tuple, JSON
#: array of three.
LOGPROB_TRIPLE_SOURCE = f"{TM}:3098-3116"


def logprob_triple_problems(triple: Any) -> list[str]:
    where = f"logprob triple ({LOGPROB_TRIPLE_SOURCE})"
    if not isinstance(triple, list) or len(triple) != 3:
        return [f"{where}: not a list of three: {triple!r}"]
    lp, tid, text = triple
    out = []
    if not _is(lp, (*NUM, NULL)):
        out.append(f"{where}: logprob {lp!r}")
    if not _is(tid, (int,)):
        out.append(f"{where}: token id {tid!r}")
    if not _is(text, (str, NULL)):
        out.append(f"{where}: text {text!r}")
    return out


# --------------------------------------------------------------------------- finish reasons
FINISH_STOP = _shape(
    "finish_reason stop",
    f"{SB}:284-317",
    [("type", (str,)), ("matched", (int, str, list))],
    values={"type": "stop"},
)
FINISH_LENGTH = _shape(
    "finish_reason length", f"{SB}:320-329", [("type", (str,)), ("length", (int,))], values={"type": "length"}
)
#: ``FINISH_ABORT()``: message defaults to "Aborted" (SB 332-345).
FINISH_ABORT = _shape(
    "finish_reason abort",
    f"{SB}:332-345",
    [("type", (str,)), ("message", (str,)), ("status_code", (int, NULL)), ("err_type", (str, NULL))],
    values={"type": "abort", "message": "Aborted", "status_code": None, "err_type": None},
)
FINISH_BY_TYPE = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


# --------------------------------------------------------------------------- control routes
PAUSE_OK = _shape(
    "/pause_generation",
    f"{HS}:1831-1841",
    [("message", (str,)), ("status", (str,))],
    values={"message": "Generation paused successfully.", "status": "ok"},
)
CONTINUE_OK = _shape(
    "/continue_generation",
    f"{HS}:1844-1854",
    [("message", (str,)), ("status", (str,))],
    values={"message": "Generation continued successfully.", "status": "ok"},
)
#: ``/abort_request``: ``Response(status_code=200)``, an empty body (HS 1721-1729).
ABORT_SOURCE = f"{HS}:1721-1729"
#: ``/flush_cache``: plain text, 200 or 400 (HS 1025-1040).
FLUSH_SOURCE = f"{HS}:1025-1040"
FLUSH_OK_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
UPDATE_WEIGHT_VERSION_OK = _shape(
    "/update_weight_version",
    f"{HS}:1527-1548",
    [("success", (bool,)), ("message", (str,)), ("new_version", (str,))],
    values={"success": True},
)
UPDATE_FROM_DISK = _shape(
    "/update_weights_from_disk",
    f"{HS}:1300-1326",
    [("success", (bool,)), ("message", (str,)), ("num_paused_requests", (int,))],
)
#: ``/init_weights_update_group`` and ``/update_weights_from_distributed`` (HS 1404-1417, 1488-1505).
SUCCESS_MESSAGE = _shape(
    "weights success/message", f"{HS}:1404-1417,1488-1505", [("success", (bool,)), ("message", (str,))]
)
#: ``/release_memory_occupation``, ``/resume_memory_occupation``: the handler returns ``None``, so
#: FastAPI answers 200 with the JSON null (HS 1575-1597).
MEMORY_SOURCE = f"{HS}:1575-1597"


# --------------------------------------------------------------------------- discovery
#: ``/server_info``: ``build_server_info`` (``utils/common.py`` 3584-3593: the resolved server
#: arguments, ``launch_command``, the scheduler info, ``kv_events``) then HS 863-892
#: (``startup_time``, ``internal_states``, ``version``, ``frontend``). Open: the server arguments are
#: many; listed are those the adapter reads, with their field files.
SERVER_INFO = _shape(
    "/server_info",
    f"{HS}:863-892; utils/common.py:3584-3593; arg_groups/fields/serving.py:58,172,262,274; "
    "arg_groups/fields/exec_.py:158,1153; arg_groups/fields/model.py:51,110",
    [
        ("model_path", (str,)),
        ("context_length", (int, NULL)),
        ("skip_tokenizer_init", (bool,)),
        ("weight_version", (str,)),
        ("stream_interval", (int,)),
        ("incremental_streaming_output", (bool,)),
        ("enable_return_routed_experts", (bool,)),
        ("enable_deterministic_inference", (bool,)),
        ("launch_command", (str, NULL)),
        ("kv_events", (dict, NULL)),
        ("startup_time", NUM),
        ("internal_states", (list,)),
        ("version", (str,)),
        ("frontend", (str,)),
    ],
    closed=False,
    ordered=False,
    values={"frontend": "python"},
)
#: ``/model_info`` (HS 812-850); ``embedding`` only for embedding models (HS 843-849).
MODEL_INFO = _shape(
    "/model_info",
    f"{HS}:812-850",
    [
        ("model_path", (str,)),
        ("served_model_name", (str,)),
        ("tokenizer_path", (str, NULL)),
        ("is_generation", (bool,)),
        ("preferred_sampling_params", (str, dict, NULL)),
        ("weight_version", (str,)),
        ("load_format", (str, NULL)),
        ("reasoning_parser", (str, NULL)),
        ("tool_call_parser", (str, NULL)),
        ("disaggregation_mode", (str, NULL)),
        ("has_image_understanding", (bool,)),
        ("has_audio_understanding", (bool,)),
        ("model_type", (str, NULL)),
        ("architectures", (list, NULL)),
    ],
)


# --------------------------------------------------------------------------- errors
#: ``_create_error_response``: a ``ValueError`` before a non-streaming answer (HS 2246-2250).
ERROR_NATIVE = _shape("native error", f"{HS}:2246-2250", [("error", (dict,))])
ERROR_NATIVE_INNER = _shape("native error.error", f"{HS}:2248", [("message", (str,))])
#: The in-stream error event once a stream was asked for (HS 965-974), then ``data: [DONE]`` (HS 975).
ERROR_STREAM = _shape("in-stream error", f"{HS}:965-975", [("error", (dict,))])
ERROR_STREAM_INNER = _shape(
    "in-stream error.error",
    f"{HS}:965-972",
    [("message", (str,)), ("type", (str,)), ("code", (int,)), ("retryable", (bool,))],
    values={"type": "invalid_request_error", "retryable": False},
)
#: ``RequestValidationError`` on native routes: ``ErrorResponse`` (``entrypoints/openai/protocol.py``
#: 106-111) with status 400 (HS 635-694).
ERROR_VALIDATION = _shape(
    "validation error",
    f"{HS}:635-694; {PROTO}:106-111",
    [("object", (str,)), ("message", (str,)), ("type", (str,)), ("param", (str, NULL)), ("code", (int,))],
    values={"object": "error", "type": "Bad Request", "code": 400},
)
#: ``HTTPException`` on native routes (HS 578-631, the envelope 625-631): ``type`` is the status as a
#: string.
ERROR_HTTP = _shape(
    "HTTPException",
    f"{HS}:625-631; {PROTO}:106-111",
    [("object", (str,)), ("message", (str,)), ("type", (str,)), ("param", (str, NULL)), ("code", (int,))],
    values={"object": "error"},
)
#: The ``/generate`` contract gate: 400 ``{"error": "<text>"}`` (HS 937-939).
ERROR_CONTRACT = _shape("contract-gate error", f"{HS}:937-939", [("error", (str,))])
