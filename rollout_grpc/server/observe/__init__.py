"""Observation: Prometheus metrics, OpenTelemetry tracing, engine HTTP call logs."""
