"""Helpers shared by test modules. Test modules import from here, never from one another.

* ``service``: a prompt, streaming Generate recorders, lossless checks, ``field_violation``.
* ``sim_http``: HTTP helpers for the simulator's tests, ``golden`` recorded vLLM bodies.
* ``fake_engine``: an in-memory engine adapter, so ``Rollout`` is tested without HTTP.
* ``processes``: the one process supervisor (engines, replicas, nginx as subprocesses), shared with
  ``bench/``.
* ``conformance``: structural comparison of JSON bodies and SSE streams (simulator vs vLLM).
* ``sim_admin``: the simulator's ``/_sim/*`` test routes, mounted through ``SimEngine(extensions=...)``;
  ``sim_server``: ``python -m tests.support.sim_server``, a subprocess engine with those routes.

``tests/harness.py`` (a replica and client on simulated or real engines) stays where it is; it is a
helper, not a test module.
"""
