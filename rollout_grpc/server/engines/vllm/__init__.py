"""Everything that knows vLLM's HTTP wire format: paths, JSON keys, ids, encodings, status codes."""
