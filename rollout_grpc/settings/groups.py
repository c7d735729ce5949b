"""The sections of `serve --help`: which flag is shown under which title."""

from __future__ import annotations

from typing import Final

#: The sections of `serve --help` (title, flags): 77 flags in one list were hard to read. Every flag
#: of FLAGS and `--config` sit in exactly one (tests/ops/test_cli.py); a flag missing here is listed
#: under `UNGROUPED`, which that test refuses. The order within a section is that of FLAGS.
FLAG_GROUPS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("configuration", ("--config", "--port-file")),
    (
        "engines",
        (
            "--engine",
            "--engines-file",
            "--sim",
            "--sim-token-delay-ms",
            "--raw-logprobs",
            "--sglang-experts-topk",
            "--health-interval",
            "--breaker-cooldown",
            "--engine-connect-timeout",
            "--engine-read-timeout",
            "--engine-idle-timeout",
            "--max-engine-attempts",
            "--no-engine-stream-interval",
        ),
    ),
    (
        "network",
        (
            "--host",
            "--port",
            "--health-port",
            "--peer",
            "--max-receive-message-mb",
            "--max-send-message-mb",
            "--max-connection-age",
            "--max-connection-age-grace",
            "--keepalive-time",
            "--max-unrequested-time",
            "--max-pending-calls",
        ),
    ),
    (
        "TLS and authentication (docs/security.md)",
        (
            "--tls-cert",
            "--tls-key",
            "--tls-client-ca",
            "--health-plaintext",
            "--auth-tokens-file",
            "--mtls-role",
            "--insecure-trusted-network",
            "--peer-token-file",
            "--peer-ca",
            "--peer-tls-name",
            "--no-reflection",
            "--reflection-open",
            "--auth-failure-rate",
            "--auth-failure-burst",
            "--refusal-audit-rate",
            "--refusal-audit-burst",
        ),
    ),
    (
        "admission and control",
        (
            "--server-concurrency",
            "--rollout-num-gpus",
            "--rollout-num-gpus-per-engine",
            "--max-queue",
            "--retry-after",
            "--max-in-flight-per-caller",
            "--control-rate",
            "--control-burst",
            "--control-deadline",
        ),
    ),
    (
        "request bounds",
        (
            "--max-images",
            "--max-image-pixels",
            "--max-image-bytes",
            "--max-abort-ids",
            "--max-metadata-bytes",
            "--max-stop-strings",
            "--max-stop-string-chars",
            "--max-chat-template-kwargs-bytes",
            "--max-prompt-chars",
            "--max-control-request-bytes",
        ),
    ),
    (
        "streaming and deadlines",
        ("--deadline-margin", "--deadline-abort-lead", "--stream-batch-tokens", "--stream-batch-interval-ms"),
    ),
    (
        "RolloutStep and rewards (docs/rollout-step.md)",
        (
            "--reward-url",
            "--step-plugin",
            "--env-url",
            "--rule-reward-processes",
            "--rule-reward-timeout-s",
            "--rule-reward-memory-mb",
            "--step-buffer-mb-per-caller",
            "--step-buffer-mb",
            "--step-buffer-ttl-s",
        ),
    ),
    (
        "fleet state (docs/architecture.md)",
        ("--state-store", "--state-store-password-file", "--state-store-ca-file"),
    ),
    (
        "weight updates (docs/engines.md)",
        ("--weights-path-prefix", "--weights-load-timeout", "--weights-lease-ttl"),
    ),
    (
        "OpenAI front door (docs/agentic.md)",
        ("--openai-port", "--openai-tool-parser", "--openai-body-timeout", "--openai-drift-policy"),
    ),
    (
        "workers and shutdown (docs/workers.md)",
        ("--workers", "--worker-restarts", "--worker-restart-window", "--grace", "--abort-grace"),
    ),
    (
        "observability (docs/operations.md)",
        ("--metrics-port", "--metrics-engine-urls", "--otlp-endpoint", "--log-level", "--log-format"),
    ),
)
#: The `serve --help` section of a flag missing from FLAG_GROUPS (listed, never hidden).
UNGROUPED: Final = "other (not in settings.FLAG_GROUPS)"
