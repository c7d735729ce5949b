"""The gRPC front door: servicers, proto <-> domain conversion, status mapping, the per-call wrapper,
replica peers.
"""
