"""The rollout domain: plain-Python types, errors, sampling knobs, sample operations and pure policies (no
transport, no engine kind).
"""
