"""``/v1/chat/completions/render`` and ``/v1/completions/render`` (reference §7.1, §7.2, §10.5).

Both answer ``GenerateRequest`` bodies that can be POSTed to generate unchanged. The
``sampling_params`` object mimics msgspec's ``omit_defaults`` encoding as observed: the four
penalty/temperature floats, ``stop``, ``stop_token_ids`` and ``bad_words`` lists and the resolved
``max_tokens`` always appear; ``top_p``/``min_p`` appear unless greedy; other fields only when
they differ from the default; plus the internal ``output_kind`` and ``skip_clone``.
"""

from __future__ import annotations

import secrets
from typing import Any

from aiohttp import web

from .core import CORE_KEY, EngineCore
from .errors import bad_request, json_response, not_found_model, validation_error
from .multimodal import ImageItem, fetch_media, process_image, require_multimodal, too_many_images
from .params import ToySampling, parse_sampling_params
from .request import read_json_body
from .vocab import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID

_IMAGE_MARK = "<|vision_start|><|image_pad|><|vision_end|>"


def _core(request: web.Request) -> EngineCore:
    core: EngineCore = request.app[CORE_KEY]
    return core


def openai_sampling_params(body: dict[str, Any], *, chat: bool) -> dict[str, Any]:
    """OpenAI request fields -> a ``sampling_params`` dict for ``parse_sampling_params``."""
    sp: dict[str, Any] = {}
    for key in (
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "logit_bias",
        "allowed_token_ids",
        "bad_words",
        "prompt_logprobs",
    ):
        if body.get(key) is not None:
            sp[key] = body[key]
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    if mt is not None:
        sp["max_tokens"] = mt
    if chat:
        if body.get("logprobs"):
            sp["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        sp["logprobs"] = body["logprobs"]
    return sp


def _small_int_default(value: int, default: int) -> bool:
    """msgspec's ``omit_defaults`` compares by identity: a small int equal to its default is omitted
    (CPython caches -5..256), so e.g. a resolved ``max_tokens`` of exactly 16 disappears."""
    return value == default and -5 <= value <= 256


def encode_sampling_params(sp: ToySampling, max_tokens: int) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` as its msgspec encoder writes it (``omit_defaults``), in field order.

    Floats taken from the request are new objects, so they are never "the default" and always
    appear; ints equal to a small default are omitted (see ``_small_int_default``). Private fields
    (``_all_stop_token_ids``) are left out by vLLM's pydantic bridge.
    """
    d: dict[str, Any] = {}
    if sp.n != 1:
        d["n"] = sp.n
    d["presence_penalty"] = float(sp.presence_penalty)
    d["frequency_penalty"] = float(sp.frequency_penalty)
    d["repetition_penalty"] = float(sp.repetition_penalty)
    d["temperature"] = float(sp.temperature)
    if not sp.greedy:
        d["top_p"] = float(sp.top_p)
        if sp.top_k:
            d["top_k"] = sp.top_k
        d["min_p"] = float(sp.min_p)
    if sp.seed is not None:
        d["seed"] = sp.seed
    d["stop"] = list(sp.stop)
    d["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        d["ignore_eos"] = True
    if not _small_int_default(max_tokens, 16):
        d["max_tokens"] = max_tokens
    if sp.min_tokens:
        d["min_tokens"] = sp.min_tokens
    if sp.logprobs is not None:
        d["logprobs"] = sp.logprobs
    if sp.prompt_logprobs is not None:
        d["prompt_logprobs"] = sp.prompt_logprobs
    if not sp.skip_special_tokens:
        d["skip_special_tokens"] = False
    if not sp.spaces_between_special_tokens:
        d["spaces_between_special_tokens"] = False
    if sp.include_stop_str_in_output:
        d["include_stop_str_in_output"] = True
    d["output_kind"] = 2
    d["skip_clone"] = True
    if sp.stop and not sp.include_stop_str_in_output:
        buffer = max(len(s) for s in sp.stop) - 1
        if not _small_int_default(buffer, 0):
            d["output_text_buffer_length"] = buffer
    if sp.logit_bias:
        d["logit_bias"] = {str(k): v for k, v in sp.logit_bias.items()}
    if sp.allowed_token_ids is not None:
        d["allowed_token_ids"] = list(sp.allowed_token_ids)
    d["bad_words"] = list(sp.bad_words)
    d["skip_reading_prefix_cache"] = sp.prompt_logprobs is not None
    return d


def _stream_options(body: dict[str, Any]) -> dict[str, Any] | None:
    so = body.get("stream_options")
    if not isinstance(so, dict):
        return None
    return {
        "include_usage": so.get("include_usage", False),
        "continuous_usage_stats": so.get("continuous_usage_stats", False),
    }


def _generate_request(
    request_id: str,
    token_ids: list[int],
    features: dict[str, Any] | None,
    sampling: dict[str, Any],
    body: dict[str, Any],
) -> dict[str, Any]:
    """A ``GenerateRequest`` in vLLM's field order (§7.1)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "token_offsets": None,
        "features": features,
        "content_parts": None,
        "sampling_params": sampling,
        "model": body.get("model"),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": bool(body.get("stream", False)),
        "stream_options": _stream_options(body) if body.get("stream") else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0) or 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def _check_common(core: EngineCore, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise validation_error(
            [
                {
                    "type": "model_attributes_type",
                    "loc": "body",
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": body,
                }
            ]
        )
    model = body.get("model")
    if model is not None and model != core.config.model:
        raise not_found_model(str(model), core.config.model)
    if core.config.tokens_only:
        raise bad_request("Tokenizer not available when skip_tokenizer_init=True")
    return body


def _resolve_max_tokens(core: EngineCore, sp: ToySampling, prompt_len: int, *, from_text: bool) -> int:
    """The renderer's length check, then ``get_max_tokens`` (observed messages).

    Text is tokenized with truncation to ``max_model_len + 1``, hence "at least" in that case.
    """
    cfg = core.config
    limit = cfg.max_model_len
    if prompt_len > limit:
        count, qualifier = (limit + 1, "at least ") if from_text else (prompt_len, "")
        raise bad_request(
            f"This model's maximum context length is {limit} tokens. However, your prompt contains "
            f"{qualifier}{count} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt.",
            "input_tokens",
            count,
            has_value=True,
        )
    room = limit - prompt_len
    max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
    if max_tokens < 1:  # vLLM's SamplingParams rejects the resolved value
        raise bad_request(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens, has_value=True
        )
    return max_tokens


async def _message_text(core: EngineCore, content: Any, images: list[ImageItem]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("message content must be a string or a list of content parts")
    out = []
    for part in content:
        if not isinstance(part, dict):
            raise bad_request("content parts must be objects")
        kind = part.get("type")
        if kind == "text":
            out.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_image"):
            require_multimodal(core)
            iu = part.get("image_url")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str):
                raise bad_request("image_url.url is required")
            if len(images) >= core.config.limit_images:
                raise too_many_images(core.config.limit_images)
            images.append(process_image(core, await fetch_media(url), cache=False))
            out.append(_IMAGE_MARK)
        else:
            raise bad_request(f"Unknown part type: {kind}")
    return "".join(out)


def _expand_images(ids: list[int], images: list[ImageItem]) -> tuple[list[int], list[dict[str, int]]]:
    """Replace each ``<|vision_start|><|image_pad|><|vision_end|>`` pad with N pads."""
    out: list[int] = []
    ranges: list[dict[str, int]] = []
    k = 0
    for i, t in enumerate(ids):
        if (
            t == IMAGE_PAD_ID
            and k < len(images)
            and i > 0
            and ids[i - 1] == VISION_START_ID
            and i + 1 < len(ids)
            and ids[i + 1] == VISION_END_ID
        ):
            ranges.append({"offset": len(out), "length": images[k].num_tokens})
            out.extend([IMAGE_PAD_ID] * images[k].num_tokens)
            k += 1
        else:
            out.append(t)
    return out, ranges


async def chat_render(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.render_calls += 1
    body = _check_common(core, await read_json_body(request))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise validation_error(
            [
                {"type": "missing", "loc": "body.messages", "msg": "Field required", "input": body}
                if messages is None
                else {
                    "type": "list_type",
                    "loc": "body.messages",
                    "msg": "Input should be a valid list",
                    "input": messages,
                }
            ]
        )
    if body.get("use_beam_search"):
        raise bad_request("Beam search is not supported by the render endpoints")
    sp = parse_sampling_params(openai_sampling_params(body, chat=True))
    images: list[ImageItem] = []
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            raise bad_request("messages must be objects")
        parts.append((str(m.get("role", "user")), await _message_text(core, m.get("content"), images)))
    cont = bool(body.get("continue_final_message", False))
    agp = bool(body.get("add_generation_prompt", True)) and not cont
    text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in parts)
    if cont and parts:
        text = text[: -len("<|im_end|>\n")]
    if agp:
        text += "<|im_start|>assistant\n"
    ids = core.vocab.encode(text)
    features: dict[str, Any] | None = None
    if images:
        ids, ranges = _expand_images(ids, images)
        with_payload = body.get("mm_payload", "tensors") != "none"
        features = {
            "mm_hashes": {"image": [im.mm_hash for im in images]},
            "mm_placeholders": {"image": ranges},
            "kwargs_data": {"image": [im.kwargs_b64() for im in images]} if with_payload else None,
            "mm_metadata": {"image": [im.metadata_b64() for im in images]} if with_payload else None,
        }
    max_tokens = _resolve_max_tokens(core, sp, len(ids), from_text=True)
    rid = body.get("request_id")
    request_id = "chatcmpl-" + (rid if isinstance(rid, str) and rid else secrets.token_hex(8))
    return json_response(
        _generate_request(request_id, ids, features, encode_sampling_params(sp, max_tokens), body)
    )


def _prompt_union_errors(prompt: list[Any]) -> list[dict[str, Any]]:
    """pydantic's errors for a list that is neither list[int], list[list[int]] nor list[str]."""
    errs: list[dict[str, Any]] = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            errs.append(
                {
                    "type": "int_parsing",
                    "loc": f"body.prompt.{i}",
                    "msg": "Input should be a valid integer, unable to parse string as an integer",
                    "input": p,
                }
            )
        elif not isinstance(p, int) or isinstance(p, bool):
            errs.append(
                {
                    "type": "int_type",
                    "loc": f"body.prompt.{i}",
                    "msg": "Input should be a valid integer",
                    "input": p,
                }
            )
    for i, p in enumerate(prompt):
        if not isinstance(p, list):
            errs.append(
                {
                    "type": "list_type",
                    "loc": f"body.prompt.{i}",
                    "msg": "Input should be a valid list",
                    "input": p,
                }
            )
    errs.append(
        {
            "type": "string_type",
            "loc": "body.prompt",
            "msg": "Input should be a valid string",
            "input": prompt,
        }
    )
    for i, p in enumerate(prompt):
        if not isinstance(p, str):
            errs.append(
                {
                    "type": "string_type",
                    "loc": f"body.prompt.{i}",
                    "msg": "Input should be a valid string",
                    "input": p,
                }
            )
    return errs


def _prompts(body: dict[str, Any], core: EngineCore) -> list[tuple[list[int], bool]]:
    """Each prompt's ids and whether they came from text."""
    prompt = body.get("prompt")
    if prompt is None:
        raise validation_error(
            [{"type": "missing", "loc": "body.prompt", "msg": "Field required", "input": body}]
        )
    if isinstance(prompt, str):
        return [(core.vocab.encode(prompt), True)]
    if isinstance(prompt, list):
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt) and prompt:
            return [(list(prompt), False)]
        if prompt and all(isinstance(p, str) for p in prompt):
            return [(core.vocab.encode(p), True) for p in prompt]
        if prompt and all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return [(list(p), False) for p in prompt]
        raise validation_error(_prompt_union_errors(prompt))
    raise validation_error(
        [
            {
                "type": "string_type",
                "loc": "body.prompt",
                "msg": "Input should be a valid string",
                "input": prompt,
            }
        ]
    )


async def completions_render(request: web.Request) -> web.StreamResponse:
    core = _core(request)
    core.stats.render_calls += 1
    body = _check_common(core, await read_json_body(request))
    prompts = _prompts(body, core)
    sp = parse_sampling_params(openai_sampling_params(body, chat=False))
    rid = body.get("request_id")
    base = "cmpl-" + (rid if isinstance(rid, str) and rid else secrets.token_hex(8))
    out = []
    for i, (ids, from_text) in enumerate(prompts):
        bad = [t for t in ids if not 0 <= t < core.config.vocab_size]
        if bad:
            raise bad_request(f"Token id {max(bad)} is out of vocabulary")
        max_tokens = _resolve_max_tokens(core, sp, len(ids), from_text=from_text)
        request_id = base if len(prompts) == 1 else f"{base}-{i}"
        out.append(_generate_request(request_id, ids, None, encode_sampling_params(sp, max_tokens), body))
    return json_response(out)
