"""The transport-neutral door both front doors call: one call record, admission, identity, metrics and the
log line.
"""
