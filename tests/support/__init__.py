"""Helpers shared by test modules. Test modules import from here, never from one another.

* ``service``: a prompt, streaming Generate recorders, lossless checks, ``field_violation``.
* ``sim_http``: HTTP helpers for the simulator's tests, ``golden`` recorded vLLM bodies.
* ``fake_engine``: an in-memory engine adapter, so ``Rollout`` is tested without HTTP.

``tests/harness.py`` (a replica and client on simulated or real engines) and ``tests/deploy/fleet.py``
(processes for the deployment tests) stay where they are; they are helpers, not test modules.
"""
