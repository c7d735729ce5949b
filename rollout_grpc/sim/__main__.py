"""``rollout-grpc sim`` (or ``python -m rollout_grpc.sim``): run one simulated engine in the foreground.

Writes the bound port to ``--port-file`` (atomically, via a rename) once the socket listens, so a
parent process can start it with ``--port 0`` and read the port without racing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Sequence

from rollout_grpc.argtypes import CommandParser, number, port

from .app import AppExtension
from .config import SGLangOptions, SimConfig
from .engine import SimEngine
from .vocab import MIN_VOCAB_SIZE

POSITIVE_INT = number(int, low=1)
NON_NEGATIVE = number(float)


def build_parser(prog: str = "python -m rollout_grpc.sim") -> CommandParser:
    p = CommandParser(
        prog=prog,
        description="A simulated vLLM 0.32 or SGLang engine (HTTP) for tests: toy tokens, real API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind the HTTP port to")
    p.add_argument("--port", type=port, default=0, help="HTTP port (0 = any free port; see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here")
    p.add_argument("--model", default="sim-llama", help="served model name")
    p.add_argument(
        "--model-root", default=None, help="`root` reported by /v1/models (default: sim-models/<model>)"
    )
    p.add_argument(
        "--vocab-size",
        type=number(int, low=MIN_VOCAB_SIZE),
        default=2048,
        help="vocabulary size (token ids 0 .. N-1)",
    )
    p.add_argument(
        "--max-model-len",
        type=POSITIVE_INT,
        default=4096,
        help="prompt + output tokens per request, as vLLM's flag",
    )
    p.add_argument(
        "--token-delay-ms", type=NON_NEGATIVE, default=0.0, help="delay between later tokens (0 = flat out)"
    )
    p.add_argument(
        "--ttft-ms", type=NON_NEGATIVE, default=0.0, help="delay before the first token of a request"
    )
    p.add_argument("--seed", type=number(int), default=0, help="sampling stream for unseeded requests")
    p.add_argument("--model-seed", type=number(int), default=0, help="the toy model's weights")
    p.add_argument(
        "--eos-probability",
        type=number(float, high=1),
        default=0.01,
        help="per-step chance that EOS becomes the likely next token (0 = never stop early)",
    )
    p.add_argument(
        "--max-logprobs",
        type=number(int),
        default=20,
        help="most top logprobs a request may ask for, as vLLM's flag",
    )
    p.add_argument(
        "--max-num-seqs",
        type=POSITIVE_INT,
        default=256,
        help="upper bound of a request's `n`, as vLLM's flag",
    )
    p.add_argument("--no-dev-mode", action="store_true", help="as without VLLM_SERVER_DEV_MODE=1")
    p.add_argument("--no-scale-out", action="store_true", help="as without --enable-scale-out")
    p.add_argument(
        "--tokens-only",
        action="store_true",
        help="as vLLM --tokens-only: no tokenizer endpoints, no text mode or stop strings",
    )
    p.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
        help="reported in /server_info as vLLM's --logprobs-mode",
    )
    p.add_argument(
        "--moe", action="store_true", help="return routed experts (--enable-return-routed-experts)"
    )
    p.add_argument(
        "--moe-layers", type=POSITIVE_INT, default=2, help="MoE layers of the toy model (with --moe)"
    )
    p.add_argument("--moe-experts", type=number(int), default=0, help="0 = dense (8 when --moe)")
    p.add_argument(
        "--moe-topk", type=POSITIVE_INT, default=2, help="experts per token and layer (with --moe)"
    )
    p.add_argument("--multimodal", action="store_true", help="a Qwen2-VL-like model")
    p.add_argument("--dead", action="store_true", help="start with /health answering 503")
    sg = p.add_argument_group("SGLang personality (--kind sglang)")
    sg.add_argument(
        "--kind",
        default="vllm",
        choices=("vllm", "sglang"),
        help="HTTP API to serve: vLLM 0.32's, or SGLang's native /generate API (docs/sglang-http-api.md)",
    )
    sg.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="SGLang's flag: stream chunks carry only new text/ids/logprobs instead of everything so far",
    )
    sg.add_argument(
        "--weight-version", default="default", help="SGLang's --weight-version: the version before any update"
    )
    sg.add_argument(
        "--stream-interval",
        type=POSITIVE_INT,
        default=1,
        help="SGLang's --stream-interval: tokens between stream chunks unless the request sets one",
    )
    sg.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="SGLang's flag: sampling_seed is used (without it SGLang ignores the seed)",
    )
    sg.add_argument(
        "--processor-keeps-input-ids",
        action="store_true",
        help="model a multimodal processor that keeps input_ids (default: decoded and tokenized again)",
    )
    return p


def config_from_args(a: argparse.Namespace) -> SimConfig:
    cfg = SimConfig(
        model=a.model,
        model_root=a.model_root,
        vocab_size=a.vocab_size,
        max_model_len=a.max_model_len,
        token_delay_s=a.token_delay_ms / 1000.0,
        ttft_s=a.ttft_ms / 1000.0,
        seed=a.seed,
        model_seed=a.model_seed,
        eos_probability=a.eos_probability,
        max_logprobs=a.max_logprobs,
        max_num_seqs=a.max_num_seqs,
        dev_mode=not a.no_dev_mode,
        scale_out=not a.no_scale_out,
        tokens_only=a.tokens_only,
        moe_layers=a.moe_layers,
        moe_experts=a.moe_experts,
        moe_topk=a.moe_topk,
        return_routed_experts=a.moe,
        multimodal=a.multimodal,
        logprobs_mode=a.logprobs_mode,
    )
    cfg.faults.dead = a.dead
    cfg.kind = a.kind
    cfg.sglang = SGLangOptions(
        incremental_streaming_output=a.incremental_streaming_output,
        weight_version=a.weight_version,
        stream_interval=a.stream_interval,
        enable_deterministic_inference=a.enable_deterministic_inference,
        processor_keeps_input_ids=a.processor_keeps_input_ids,
    )
    return cfg


def _write_port_file(path: str, port: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


async def _serve(
    cfg: SimConfig, host: str, port: int, port_file: str | None, extensions: Sequence[AppExtension] = ()
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with SimEngine(cfg, host=host, port=port, extensions=extensions) as eng:
        if port_file:
            _write_port_file(port_file, eng.port)
        kind = "" if cfg.kind == "vllm" else f" ({cfg.kind})"
        print(f"rollout_grpc.sim serving {cfg.model}{kind} on {eng.url}", file=sys.stderr, flush=True)
        await stop.wait()


def main(
    argv: list[str] | None = None,
    prog: str = "python -m rollout_grpc.sim",
    extensions: Sequence[AppExtension] = (),
) -> None:
    """Parse the flags and serve until SIGINT/SIGTERM; ``extensions`` as in ``create_app``."""
    a = build_parser(prog).parse_args(argv)
    asyncio.run(_serve(config_from_args(a), a.host, a.port, a.port_file, extensions))


if __name__ == "__main__":
    main()
