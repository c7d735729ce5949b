"""Helpers to build requests from plain Python values and to read results as numpy arrays."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import json_format, struct_pb2

from rollout_grpc._proto import rollout_pb2 as pb
from rollout_grpc.client.params import sampling_params

_DTYPES: dict[int, np.dtype[Any]] = {
    pb.D_TYPE_UINT8: np.dtype("uint8"),
    pb.D_TYPE_UINT16: np.dtype("<u2"),
    pb.D_TYPE_INT32: np.dtype("<i4"),
}
_PB_DTYPES: dict[np.dtype[Any], Any] = {
    np.dtype("uint8"): pb.D_TYPE_UINT8,
    np.dtype("<u2"): pb.D_TYPE_UINT16,
    np.dtype("<i4"): pb.D_TYPE_INT32,
}

#: One sample as `generate` takes it (also a 1-D integer numpy array: see SampleLike).
OneSample = pb.Sample | Mapping[str, Any] | Sequence[int | np.integer[Any]]
#: A sample: a Sample, a dict of Sample fields, or prompt token ids (list, tuple, 1-D array).
SampleLike = OneSample | np.ndarray
#: Several samples for one `generate` call (a 2-D integer array is a batch too).
BatchLike = Sequence[SampleLike]
ParamsLike = pb.SamplingParams | Mapping[str, Any] | None
OptionsLike = pb.GenerateOptions | Mapping[str, Any] | None


def token_ids(tokens: Iterable[int | np.integer[Any]] | np.ndarray) -> list[int]:
    """Plain ints from a list, tuple, generator or 1-D integer numpy array (numpy ints included)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        return [int(t) for t in tokens.tolist()]
    try:
        return [operator.index(t) for t in tokens]
    except TypeError:
        raise TypeError("token ids must be integers (int or numpy integer)") from None


def make_sample(
    tokens: Iterable[int | np.integer[Any]] | np.ndarray = (),
    *,
    prompt: str | None = None,
    index: int = 0,
    group_index: int = 0,
    session_id: str = "",
    metadata: Mapping[str, Any] | None = None,
    features: pb.MultimodalFeatures | None = None,
) -> pb.Sample:
    """A PENDING sample from prompt token ids (or a prompt text the engine will render).

    `metadata` travels as a `google.protobuf.Struct`, i.e. JSON: numbers are doubles, so an int
    comes back as a float (`3` -> `3.0`; exact up to 2**53). Carry ints that must stay ints as
    strings, or keep metadata on your side (the slime integration never sends it).
    """
    sample = pb.Sample(
        tokens=token_ids(tokens),
        index=index,
        group_index=group_index,
        session_id=session_id,
        status=pb.SAMPLE_STATUS_PENDING,
    )
    if prompt is not None:
        sample.prompt = prompt
    if metadata:
        sample.metadata.CopyFrom(json_format.ParseDict(dict(metadata), struct_pb2.Struct()))
    if features is not None:
        sample.multimodal_features.CopyFrom(features)
    return sample


def to_sample(value: SampleLike) -> pb.Sample:
    """Accept a Sample, a dict of Sample fields (proto JSON names or field names) or a token list."""
    if isinstance(value, pb.Sample):
        return value
    if isinstance(value, Mapping):
        data = dict(value)
        data.setdefault("status", "SAMPLE_STATUS_PENDING")
        return json_format.ParseDict(data, pb.Sample())
    return make_sample(value)


def to_params(value: ParamsLike) -> pb.SamplingParams:
    """Accept SamplingParams or a dict such as {"temperature": 0, "max_new_tokens": 32}.

    Dict keys are the SamplingParams field names; an unknown key or a value of the wrong type is a
    ValueError naming it (`rollout_grpc.client.params.sampling_params`).
    """
    if value is None:
        return pb.SamplingParams()
    if isinstance(value, pb.SamplingParams):
        return value
    return sampling_params(value)


def to_options(value: OptionsLike) -> pb.GenerateOptions:
    """Accept GenerateOptions or a dict such as {"return_routed_experts": True}."""
    if value is None:
        return pb.GenerateOptions()
    if isinstance(value, pb.GenerateOptions):
        return value
    return json_format.ParseDict(dict(value), pb.GenerateOptions())


def routed_experts_array(sample: pb.Sample) -> np.ndarray | None:
    """The sample's routed experts as a read-only numpy view of the message bytes (no copy)."""
    if not sample.HasField("routed_experts"):
        return None
    routed = sample.routed_experts
    dtype = _DTYPES[routed.dtype]
    return np.frombuffer(routed.data, dtype=dtype).reshape(tuple(routed.shape))


def routed_experts_message(array: np.ndarray, start: int = 0) -> pb.RoutedExperts:
    """A RoutedExperts message from a [tokens, layers, topk] uint8/uint16/int32 array."""
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype not in _PB_DTYPES or array.ndim != 3:
        raise ValueError(f"need a 3-D uint8, uint16 or int32 array, got {array.dtype} {array.shape}")
    data = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return pb.RoutedExperts(data=data, dtype=_PB_DTYPES[dtype], shape=list(array.shape), start=start)


def image_part(data: bytes, mime_type: str = "image/png") -> pb.ContentPart:
    """A chat content part holding image bytes."""
    return pb.ContentPart(image=pb.Image(data=data, mime_type=mime_type))


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> pb.ChatMessages:
    """Chat messages from dicts: {"role": "user", "content": str | [str | bytes | ContentPart | dict]}.

    In a content list, `str` is text, `bytes` is a PNG image, a dict may be
    {"type": "text", "text": ...} or {"type": "image", "data": bytes, "mime_type": ...} or
    {"type": "image_url", "image_url": {"url": "data:..."}}.
    """
    result = pb.ChatMessages()
    for message in messages:
        msg = result.messages.add(role=str(message["role"]))
        content = message.get("content", "")
        parts = [content] if isinstance(content, str) else list(content)
        for part in parts:
            if isinstance(part, pb.ContentPart):
                msg.content.append(part)
            elif isinstance(part, str):
                msg.content.add(text=part)
            elif isinstance(part, bytes | bytearray):
                msg.content.append(image_part(bytes(part)))
            elif isinstance(part, Mapping):
                kind = part.get("type")
                if kind == "text":
                    msg.content.add(text=str(part["text"]))
                elif kind == "image":
                    msg.content.append(
                        image_part(bytes(part["data"]), str(part.get("mime_type", "image/png")))
                    )
                elif kind == "image_url":
                    msg.content.add(image=pb.Image(data_url=str(part["image_url"]["url"])))
                else:
                    raise ValueError(f"unknown content part type {kind!r}")
            else:
                raise TypeError(f"unsupported content part {type(part).__name__}")
    return result


_PAUSE_MODES = {"abort": pb.PAUSE_MODE_ABORT, "wait": pb.PAUSE_MODE_WAIT, "keep": pb.PAUSE_MODE_KEEP}


def abort_request(
    *,
    all: bool = False,
    request_ids: Sequence[str] = (),
    session_id: str | None = None,
    group_index: int | None = None,
    mine: bool = False,
) -> pb.AbortRequest:
    """An AbortRequest with the first target given (none given: the server answers INVALID_ARGUMENT)."""
    request = pb.AbortRequest()
    if all:
        request.all = True
    elif mine:
        request.mine = True
    elif request_ids:
        request.request_ids.ids.extend(request_ids)
    elif session_id is not None:
        request.session_id = session_id
    elif group_index is not None:
        request.group_index = group_index
    return request


def pause_request(mode: str) -> pb.PauseRequest:
    """A PauseRequest for "abort", "wait" or "keep"."""
    if mode not in _PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}")
    return pb.PauseRequest(mode=_PAUSE_MODES[mode])


def resume_request(weight_version: str | None) -> pb.ResumeRequest:
    """A ResumeRequest, relabelling the weights when `weight_version` is given."""
    request = pb.ResumeRequest()
    if weight_version is not None:
        request.weight_version = weight_version
    return request


def update_weights_request(
    checkpoint: str, weight_version: str, *, pause_mode: str = "keep", all_at_once: bool = False
) -> pb.UpdateWeightsRequest:
    """An UpdateWeightsRequest loading the checkpoint directory `checkpoint` as `weight_version`."""
    if pause_mode not in _PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {pause_mode!r}")
    return pb.UpdateWeightsRequest(
        checkpoint=pb.CheckpointSource(path=checkpoint),
        weight_version=weight_version,
        pause_mode=_PAUSE_MODES[pause_mode],
        all_at_once=all_at_once,
    )


def update_weights_distributed_request(
    weight_version: str,
    *,
    master_address: str,
    master_port: int,
    world_size: int,
    tensors: Sequence[tuple[str, str, Sequence[int]]],
    group_name: str = "weight_update_group",
    backend: str = "nccl",
    pause_mode: str = "keep",
) -> pb.UpdateWeightsRequest:
    """An UpdateWeightsRequest receiving `tensors` ((name, torch dtype, shape), in broadcast order)
    from the trainer's broadcast in the planned group."""
    if pause_mode not in _PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {sorted(_PAUSE_MODES)}, got {pause_mode!r}")
    source = pb.DistributedSource(
        backend=backend,
        master_address=master_address,
        master_port=master_port,
        group_name=group_name,
        world_size=world_size,
        tensors=[pb.TensorSpec(name=n, dtype=d, shape=list(shape)) for n, d, shape in tensors],
    )
    return pb.UpdateWeightsRequest(
        distributed=source, weight_version=weight_version, pause_mode=_PAUSE_MODES[pause_mode]
    )


def render_request(
    messages: Sequence[Mapping[str, Any]] | None,
    *,
    text: str | None,
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
    session_id: str,
) -> pb.RenderRequest:
    """A RenderRequest for chat messages or a plain text."""
    request = pb.RenderRequest(add_generation_prompt=add_generation_prompt, session_id=session_id)
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(chat_messages(messages or []))
    if chat_template_kwargs:
        request.chat_template_kwargs.CopyFrom(
            json_format.ParseDict(dict(chat_template_kwargs), struct_pb2.Struct())
        )
    return request
