"""Environment servers for multi-turn episodes inside a RolloutStep (docs/episodes.md).

`api.py` is the typed boundary the step uses (no transport); `remote.py` speaks HTTP to an
environment server. Only the wiring (`app.py`) imports `remote.py`.
"""
