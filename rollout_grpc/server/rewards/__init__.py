"""Reward models: engines of another kind, behind one small typed interface (`api.py`).

`api.py` is all the rollout step sees; `remote.py` (HTTP, slime's remote_rm shape) and `rules.py`
(math answer equivalence, exact match) implement it; only `registry.py` names the kinds.
"""
