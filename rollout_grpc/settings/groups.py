"""The sections of `serve --help`: which flag is shown under which title, and so which section
of the config (`server/config.py`) it fills.

A section's title is its sub-config's `SECTION` (`NetworkConfig.SECTION` is "network"): every flag
listed under it fills a field of that sub-config, or is a flag of the command itself
(`table.COMMAND_FLAGS`); tests/ops/test_config_sections.py holds the three together.
"""

from __future__ import annotations

from typing import Final

from rollout_grpc.server.config import (
    AdmissionConfig,
    BoundsConfig,
    EnginesConfig,
    NetworkConfig,
    ObserveConfig,
    OpenAIConfig,
    SecurityConfig,
    StateStoreConfig,
    StepConfig,
    StreamingConfig,
    WeightsConfig,
    WorkersConfig,
)

#: The sections of `serve --help` (title, flags): 77 flags in one list were hard to read. Every flag
#: of FLAGS and `--config` sit in exactly one (tests/ops/test_cli.py); a flag missing here is listed
#: under `UNGROUPED`, which that test refuses. The order within a section is that of FLAGS. Each
#: title but "configuration" (the command's own `--config`, `--port-file`) is a sub-config's.
FLAG_GROUPS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("configuration", ("--config", "--port-file")),
    (
        EnginesConfig.SECTION,
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
        NetworkConfig.SECTION,
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
        SecurityConfig.SECTION,
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
        AdmissionConfig.SECTION,
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
        BoundsConfig.SECTION,
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
        StreamingConfig.SECTION,
        ("--deadline-margin", "--deadline-abort-lead", "--stream-batch-tokens", "--stream-batch-interval-ms"),
    ),
    (
        StepConfig.SECTION,
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
            "--step-drain-lease-ttl-s",
        ),
    ),
    (
        StateStoreConfig.SECTION,
        ("--state-store", "--state-store-password-file", "--state-store-ca-file"),
    ),
    (
        WeightsConfig.SECTION,
        ("--weights-path-prefix", "--weights-load-timeout", "--weights-lease-ttl"),
    ),
    (
        OpenAIConfig.SECTION,
        (
            "--openai-port",
            "--openai-tool-parser",
            "--openai-body-timeout",
            "--openai-max-sessions-per-caller",
            "--openai-session-mb-per-caller",
            "--openai-session-ttl-s",
            "--openai-drift-policy",
        ),
    ),
    (
        WorkersConfig.SECTION,
        ("--workers", "--worker-restarts", "--worker-restart-window", "--grace", "--abort-grace"),
    ),
    (
        ObserveConfig.SECTION,
        ("--metrics-port", "--metrics-engine-urls", "--otlp-endpoint", "--log-level", "--log-format"),
    ),
)
#: The `serve --help` section of a flag missing from FLAG_GROUPS (listed, never hidden).
UNGROUPED: Final = "other (not in settings.FLAG_GROUPS)"
