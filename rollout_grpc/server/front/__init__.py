"""The front doors: transports that turn their requests into facade calls (gRPC, OpenAI-compatible HTTP).
They never import each other.
"""
