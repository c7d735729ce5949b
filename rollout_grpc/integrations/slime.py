"""slime drop-in: `--custom-generate-function-path rollout_grpc.integrations.slime.generate`.

slime calls `await generate(args, sample, sampling_params)` once per sample (and per continuation of
an ABORTED sample) and expects the same `Sample` back, updated the way its own SGLang `generate`
updates it. This module does exactly that through the rollout service:

* **slime's Sample stays the source of truth.** Only what generation needs goes on the wire
  (tokens, response, response_length, loss_mask, rollout_log_probs, status, session_id, index,
  group_index); the answer is written back into the same object. Everything else — `metadata` (ints
  stay ints: nothing goes through `google.protobuf.Struct`), `reward` (float or dict), `label`,
  `multimodal_inputs`, `train_metadata`, `spec_info`, unknown attributes — is never touched.
* **Continuation needs nothing stashed.** An ABORTED slime sample carries prompt + partial tokens,
  its mask, logprobs and response, which is all the service needs to continue it; image samples are
  re-rendered from `prompt` + `multimodal_inputs` (deterministic, same ids and features).
* **slime's field types**: `weight_versions` gets one string per engine call (the version that
  produced the call's last token, like SGLang's `meta_info["weight_version"]`; calls that produced
  no token add none, as vime does); `rollout_routed_experts` is an int32 array
  `[len(tokens) - 1, num_layers, topk]`; `status` is set on the sample's own `Sample.Status` enum.
* **Sampling params** use SGLang's names (`sampling_seed`, `max_new_tokens`, `no_stop_trim`, ...) and
  are translated by `translate_sampling_params`; a key with no equivalent raises ValueError naming
  that key (see docs/slime.md for the table).
* **Target**: `args.rollout_grpc_target`, else the `ROLLOUT_GRPC_TARGET` environment variable. One
  client per target, one channel per event loop (the client opens it lazily in the running loop).
* **Credentials** (docs/security.md), each an `args.rollout_grpc_<name>` attribute, else the
  `ROLLOUT_GRPC_CLIENT_<NAME>` environment variable: `token` (the bearer token itself) or
  `token_file`; `tls` (1: TLS with the system roots), `tls_ca` (PEM file of the replica's CA),
  `tls_cert` + `tls_key` (mTLS), `tls_name` (the name in the replica's certificate).

Only the client's dependencies are needed (grpcio, protobuf, numpy); slime is not imported.
"""

from __future__ import annotations

import asyncio
import copy
import enum
import io
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client import params
from rollout_grpc.client.aio import AsyncRolloutClient
from rollout_grpc.client.samples import routed_experts_array

TARGET_ENV = "ROLLOUT_GRPC_TARGET"
TARGET_ARG = "rollout_grpc_target"
IMAGE_PLACEHOLDER = "<image>"

# ---- sampling parameters -------------------------------------------------------------------------

#: slime/SGLang name -> rollout.v1 SamplingParams field (same meaning; see docs/slime.md).
PARAM_NAMES: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_new_tokens",
    "min_new_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "sampling_seed": "seed",
    "seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
}
#: Keys slime or SGLang may send that have no equivalent, with the reason given to the user.
UNSUPPORTED: dict[str, str] = {
    "custom_params.return_top_p_token_ids": (
        "top-p replay needs slime's patched SGLang; vLLM returns no nucleus ids "
        "(run with --rollout-top-p 1.0, or drop it from custom_params)"
    ),
    "return_top_p_token_ids": "top-p replay needs slime's patched SGLang; vLLM returns no nucleus ids",
    "n": "one sample per call: give a group of samples instead (generate_group)",
    "custom_logit_processor": "the service runs no user code on the engines",
    "json_schema": "structured output is not part of a rollout",
    "regex": "structured output is not part of a rollout",
    "ebnf": "structured output is not part of a rollout",
}


def translate_sampling_params(sampling_params: Mapping[str, Any]) -> pb.SamplingParams:
    """rollout.v1 SamplingParams from slime's dict (SGLang names). `None` values mean "default".

    Raises ValueError naming the slime key for a key without equivalent or a value of the wrong
    type (the clients' own dict parsing, `rollout_grpc.client.params`, with slime's names).
    """
    custom = sampling_params.get("custom_params")
    if custom is not None:
        _check_custom_params(custom)
    rest = {key: value for key, value in sampling_params.items() if key != "custom_params"}
    return params.sampling_params(
        rest, names=PARAM_NAMES, unsupported=UNSUPPORTED, kind="slime sampling param"
    )


def _check_custom_params(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise ValueError(f"slime sampling param 'custom_params' must be a dict, got {type(value).__name__}")
    for sub, sub_value in value.items():
        name = f"custom_params.{sub}"
        if sub == "return_top_p_token_ids" and not sub_value:
            continue  # asking for nothing is fine
        reason = UNSUPPORTED.get(name, "no rollout-grpc equivalent")
        raise ValueError(f"slime sampling param {name!r} is not supported: {reason}")


# ---- slime Sample <-> wire -----------------------------------------------------------------------


def status_name(sample: Any) -> str:
    """ "PENDING", "ABORTED", ... from slime's `Sample.Status` enum (or its string value)."""
    status = sample.status
    if isinstance(status, enum.Enum):
        return str(status.name)
    return str(status).upper()


def _set_status(sample: Any, name: str) -> None:
    current = sample.status
    if isinstance(current, enum.Enum):
        sample.status = type(current)[name]
    else:
        sample.status = name.lower()


def _image_bytes(image: Any) -> bytes:
    """PNG bytes from bytes or a PIL-like image (anything with `.save(fp, format=...)`)."""
    if isinstance(image, bytes | bytearray):
        return bytes(image)
    if hasattr(image, "save"):
        if hasattr(image, "convert"):
            image = image.convert("RGB")  # what slime's encode_image_for_rollout_engine does
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise TypeError(f"multimodal_inputs['images'] holds a {type(image).__name__}: need bytes or a PIL image")


def _images(sample: Any) -> list[Any]:
    inputs = getattr(sample, "multimodal_inputs", None) or {}
    return list(inputs.get("images") or [])


def chat_for_render(sample: Any) -> list[dict[str, Any]]:
    """Chat messages for Render from slime's prompt and images (images fill placeholders in order).

    slime's prompt is either a message list (multimodal keys without a chat template: image parts are
    `{"type": "image"}`) or a string with `<image>` placeholders.
    """
    images = [_image_bytes(image) for image in _images(sample)]
    remaining = iter(images)
    if isinstance(sample.prompt, str):
        messages = [{"role": "user", "content": _parts_of_text(sample.prompt, remaining)}]
    else:
        messages = [_message_for_render(message, remaining) for message in sample.prompt]
    if next(remaining, None) is not None:
        raise ValueError("multimodal_inputs has more images than the prompt has image placeholders")
    return messages


def _parts_of_text(prompt: str, images: Iterator[bytes]) -> list[Any]:
    """Content parts of a string prompt: its text, with the next image at each `<image>`."""
    parts: list[Any] = []
    for i, text in enumerate(re.split(re.escape(IMAGE_PLACEHOLDER), prompt)):
        if i:
            parts.append(next(images))
        if text:
            parts.append(text)
    return parts


def _message_for_render(message: Mapping[str, Any], images: Iterator[bytes]) -> dict[str, Any]:
    """One chat message with its `{"type": "image"}` parts replaced by the next image, in order."""
    content = message.get("content", "")
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    parts: list[Any] = []
    for part in content:
        if isinstance(part, Mapping) and part.get("type") == "image":
            parts.append(next(images))
        elif isinstance(part, Mapping) and part.get("type") == "text":
            parts.append(str(part["text"]))
        else:
            parts.append(part)
    return {"role": message["role"], "content": parts}


def to_wire(sample: Any, prompt_ids: Sequence[int] | None = None) -> pb.Sample:
    """The wire sample of a slime Sample: exactly the fields generation reads.

    `prompt_ids` replaces empty `tokens` (e.g. ids rendered for an image sample).
    """
    wire = pb.Sample(
        index=sample.index or 0,
        group_index=sample.group_index or 0,
        session_id=sample.session_id or "",
        tokens=[int(t) for t in (sample.tokens or prompt_ids or [])],
        response=sample.response or "",
        response_length=int(sample.response_length or 0),
        status=pb.SampleStatus.Value(f"SAMPLE_STATUS_{status_name(sample)}"),
    )
    if not wire.tokens and isinstance(sample.prompt, str) and sample.prompt:
        wire.prompt = sample.prompt
    if sample.loss_mask is not None:
        wire.loss_mask.extend(int(v) for v in sample.loss_mask)
    if sample.rollout_log_probs is not None:
        wire.rollout_log_probs.extend(float(v) for v in sample.rollout_log_probs)
    return wire


def apply_result(sample: Any, result: pb.Sample, sent: pb.Sample) -> Any:
    """Write one engine call's result into the slime Sample (in place) and return it.

    `sent` is the wire sample of this call: the new response tokens are those past its
    `response_length`, which decides the call's weight-version entry.
    """
    sample.tokens = list(result.tokens)
    sample.response = result.response
    new_tokens = result.response_length - sent.response_length
    sample.response_length = result.response_length
    sample.loss_mask = list(result.loss_mask)
    sample.rollout_log_probs = list(result.rollout_log_probs)
    _set_status(sample, pb.SampleStatus.Name(result.status).removeprefix("SAMPLE_STATUS_"))
    if new_tokens > 0:
        last = result.response_length - 1
        version = next((s.version for s in result.weight_versions if s.start <= last < s.end), None)
        if version is not None:
            sample.weight_versions.append(version)
    if result.HasField("routed_experts"):
        sample.rollout_routed_experts = _routed_experts(sample, result)
    if result.HasField("usage") and hasattr(sample, "prefix_cache_info"):
        info = sample.prefix_cache_info
        info.cached_tokens += result.usage.cached_tokens
        info.total_prompt_tokens += result.usage.prompt_tokens
    if result.failure_reason:
        # An extra attribute, not a metadata key: slime's to_dict/from_dict keep it, metadata stays as is.
        sample.rollout_grpc_failure_reason = result.failure_reason
    return sample


def _routed_experts(sample: Any, result: pb.Sample) -> np.ndarray:
    """int32 [len(tokens) - 1, layers, topk], earlier rows kept when the engine started later."""
    array = routed_experts_array(result)
    assert array is not None
    start = result.routed_experts.start
    if start:
        previous = sample.rollout_routed_experts
        if previous is None or len(previous) < start:
            raise ValueError(f"the engine returned routed experts from position {start} without earlier rows")
        array = np.concatenate([np.asarray(previous, dtype=np.int32)[:start], array.astype(np.int32)])
    expected = len(sample.tokens) - 1
    if array.shape[0] != expected:
        raise ValueError(f"routed experts have {array.shape[0]} rows for {len(sample.tokens)} tokens")
    return np.ascontiguousarray(array, dtype=np.int32)


# ---- the hook ------------------------------------------------------------------------------------

_CLIENTS: dict[tuple[str, tuple[tuple[str, str], ...]], AsyncRolloutClient] = {}


def target_of(args: Any) -> str:
    """The service address: `args.rollout_grpc_target`, else $ROLLOUT_GRPC_TARGET."""
    target = getattr(args, TARGET_ARG, None) or os.environ.get(TARGET_ENV)
    if not target:
        raise ValueError(
            f"no rollout service address: set args.{TARGET_ARG} or the {TARGET_ENV} environment variable"
        )
    return str(target)


#: The credential settings: `args.rollout_grpc_<name>` or `$ROLLOUT_GRPC_CLIENT_<NAME>`.
CREDENTIAL_ENV_PREFIX = "ROLLOUT_GRPC_CLIENT_"
_CREDENTIALS = ("token", "token_file", "tls", "tls_ca", "tls_cert", "tls_key", "tls_name")


def _setting(args: Any, name: str) -> str | None:
    value = getattr(args, f"rollout_grpc_{name}", None)
    if value is None or value == "":
        value = os.environ.get(CREDENTIAL_ENV_PREFIX + name.upper())
    return None if value is None or value == "" else str(value)


def credentials_of(args: Any) -> dict[str, Any]:
    """The client's token and TLS keyword arguments from `args` and the environment (see above)."""
    found = {name: _setting(args, name) for name in _CREDENTIALS}
    token = found["token"]
    if token is None and found["token_file"] is not None:
        with open(found["token_file"], encoding="utf-8") as fh:
            token = fh.read().strip()
    if (found["tls_cert"] is None) != (found["tls_key"] is None):
        raise ValueError("the slime hook's mTLS needs both rollout_grpc_tls_cert and rollout_grpc_tls_key")
    return {
        "token": token,
        "tls": (found["tls"] or "").lower() in ("1", "true", "yes", "on"),
        "root_certificates": found["tls_ca"],
        "certificate_chain": found["tls_cert"],
        "private_key": found["tls_key"],
        "server_name": found["tls_name"],
    }


def client_for(args: Any) -> AsyncRolloutClient:
    """The client of the target and credentials (created once per process; its channel opens per
    event loop)."""
    target = target_of(args)
    credentials = credentials_of(args)
    key = (target, tuple(sorted((k, str(v)) for k, v in credentials.items())))
    client = _CLIENTS.get(key)
    if client is None:
        client = _CLIENTS[key] = AsyncRolloutClient(target, **credentials)
    return client


def _options(args: Any) -> pb.GenerateOptions:
    return pb.GenerateOptions(
        final_only=True,
        return_routed_experts=bool(getattr(args, "use_rollout_routing_replay", False)),
        mask_offpolicy=bool(getattr(args, "mask_offpolicy_in_partial_rollout", False))
        and bool(getattr(args, "partial_rollout", False)),
    )


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """slime's custom generate hook: one engine call for `sample`, updated in place and returned.

    PENDING samples start, ABORTED ones continue with `max_new_tokens - response_length` left;
    `sampling_params` is not modified (slime's dict is shared across a group).
    """
    del evaluation  # same behaviour for evaluation, like slime's own generate
    name = status_name(sample)
    if name not in ("PENDING", "ABORTED"):
        raise ValueError(f"generate needs a PENDING or ABORTED sample, got {name}")
    params = translate_sampling_params(sampling_params)
    client = client_for(args)
    wire = to_wire(sample)
    if _images(sample):
        rendered = await client.render(chat_for_render(sample), session_id=wire.session_id)
        if not wire.tokens:
            wire.tokens.extend(rendered.token_ids)
            wire.ClearField("prompt")  # the rendered ids are the prompt now
        wire.multimodal_features.CopyFrom(rendered.features)
    result = await client.generate(wire, params, _options(args))
    return apply_result(sample, result, wire)


async def generate_group(
    args: Any, group: Sequence[Any], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """A prompt group concurrently (slime's `generate_and_rm_group` without the reward), in order."""
    return list(
        await asyncio.gather(
            *(generate(args, s, copy.deepcopy(sampling_params), evaluation=evaluation) for s in group)
        )
    )


async def abort_all(args: Any) -> int:
    """Abort every generation in flight (slime's `abort`): they end as ABORTED samples with their
    partial response, which `generate` continues later. Returns how many this replica ended."""
    response = await client_for(args).abort(all=True)
    return int(response.aborted)


async def pause(args: Any, mode: str = "abort") -> None:
    """Pause the engines before a weight update ("abort", "wait" or "keep")."""
    await client_for(args).pause(mode)


async def resume(args: Any, weight_version: str | None = None) -> None:
    """Resume the engines, labelling the new weights so samples record which version made them."""
    await client_for(args).resume(weight_version)


async def update_weights(args: Any, checkpoint: str, weight_version: str, pause_mode: str = "keep") -> None:
    """Move every engine behind the service to the checkpoint directory `checkpoint` (shared storage
    under the replica's `--weights-path-prefix`), labelled `weight_version`: one serialised
    pause -> load -> label -> resume (`UpdateWeights`; docs/engines.md "Weight updates"). Raises the
    client's errors naming the engines that did not take it. Call it where slime's trainer saved
    the HF checkpoint of the step, instead of syncing its own engines."""
    await client_for(args).update_weights(checkpoint, weight_version, pause_mode=pause_mode)
