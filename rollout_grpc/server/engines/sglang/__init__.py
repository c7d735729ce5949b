"""The SGLang engine kind: `/generate` with `input_ids`, SGLang's control routes (docs/engines.md)."""
