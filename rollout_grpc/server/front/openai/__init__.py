"""The OpenAI-compatible HTTP front door for agent harnesses: protocol, tool parsers, sessions."""
