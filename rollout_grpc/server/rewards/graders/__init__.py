"""Rule graders: pure functions `(label, response) -> verdict`, one module per family.

They hold no I/O and no state, so the reward kinds in `rewards/rules.py` can run them wherever they
must (a thread, a process pool with limits) and tests can check them against a table.
"""
