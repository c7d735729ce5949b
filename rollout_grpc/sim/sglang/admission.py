"""What SGLang 0.5.23's scheduler does with a request the tokenizer passed (``handle_generate_request``,
``managers/scheduler.py`` 2943-3320; docs/sglang-http-api.md §2.1, §2.2, §3.1, §3.5): the output
budget it allows, and the requests it refuses.

* The budget: ``max_new_tokens`` (null = ``1 << 30``) capped at ``max_req_len - prompt - 1``, where
  ``max_req_len`` is the context length minus one (``init_req_max_new_tokens``, SCH 2693-2716;
  ``managers/tp_worker.py`` 568-572): a call that runs to the context ends two tokens before it, and
  ``finish_reason.length`` reports the capped value. (The simulator's KV pool never binds first.)
* The refusals, in the scheduler's order: a prompt of ``>= max_req_input_len`` tokens (the context
  minus 6, ``validate_input_length``, ``managers/utils.py`` 259-289; SCH 3245-3254),
  ``logprob_start_len`` past the prompt (SCH 3275-3281), ``routed_experts_start_len`` outside
  ``[0, prompt]`` (SCH 3300-3320). These are not HTTP errors of the tokenizer: the scheduler ends the
  request with ``FINISH_ABORT(message, 400, "BadRequestError")`` (``set_finish_with_abort``,
  ``managers/schedule_batch.py`` 2221-2238) after one forward pass over a one-token stub prompt, and
  the tokenizer turns that into a 400 ``{"error": {"message"}}`` for a non-streaming call and into
  the stream's last chunk for a streaming one (TM 1916-1922).
"""

from __future__ import annotations

from .request import SGLangRequest

#: ``init_req_max_new_tokens``'s stand-in for a null ``max_new_tokens`` (SCH 2695-2699).
UNLIMITED = 1 << 30
#: ``FINISH_ABORT``'s status and type for a request the scheduler refuses (``set_finish_with_abort``).
REFUSED_STATUS = 400
REFUSED_TYPE = "BadRequestError"
#: ``set_finish_with_abort`` replaces the prompt with one token (``array("q", [0])``) "to skip the
#: long prefill": the refused request's ``prompt_tokens`` is 1 and it samples one token.
STUB_PROMPT = [0]


def max_req_len(context: int) -> int:
    """The scheduler's longest request (``managers/tp_worker.py`` 568-571): the context minus one."""
    return context - 1


def max_req_input_len(context: int) -> int:
    """The longest prompt the scheduler admits, exclusive (``managers/tp_worker.py`` 572): what
    ``/server_info`` reports as ``max_req_input_len`` (SCH 1946)."""
    return max_req_len(context) - 5


def budget(max_new_tokens: int | None, prompt: int, context: int) -> int:
    """The output budget the scheduler allows (``init_req_max_new_tokens``, SCH 2693-2716)."""
    asked = UNLIMITED if max_new_tokens is None else max_new_tokens
    return max(0, min(asked, max_req_len(context) - prompt - 1))


def refusal(g: SGLangRequest, prompt: int, context: int) -> str | None:
    """The message the scheduler refuses this request with, or None when it admits it."""
    limit = max_req_input_len(context)
    if prompt >= limit:
        return (
            f"Input length ({prompt} tokens) exceeds the maximum allowed length ({limit} tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
    if g.return_logprob and g.logprob_start_len > prompt:
        return (
            f"req.logprob_start_len={g.logprob_start_len} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt}. Please use a smaller logprob_start_len."
        )
    if g.return_routed_experts:
        start = g.routed_experts_start_len
        if start > prompt:
            return (
                f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt}. Please use a smaller routed_experts_start_len."
            )
        if start < 0:
            return (
                f"recv_req.routed_experts_start_len={start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len."
            )
    return None


def refused_finish(message: str) -> dict[str, object]:
    """``FINISH_ABORT(message, 400, "BadRequestError").to_json()``."""
    return {"type": "abort", "message": message, "status_code": REFUSED_STATUS, "err_type": REFUSED_TYPE}
