"""Shared test helpers (imported by test modules; never a test module itself)."""
