# One venv for everything; torch is pinned to the CPU build present on these
# machines (an unpinned torch pulls a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PINS := torch==2.13.0 ray[serve]==2.60.0 transformers==5.24.0 peft==0.21.2 \
        safetensors==0.8.0 huggingface_hub==2.4.0 tokenizers==0.23.3 pytest==9.2.0 \
        openai==3.57.0 pytest-timeout==2.4.0 pytest-xdist==3.8.0 \
        xgrammar==0.2.9 jsonschema==4.26.0
# Only `make bench` needs these (plots; numpy also comes with transformers).
BENCH_PINS := matplotlib==3.11.2 numpy==2.4.6

.PHONY: venv test test-fast serve bench clients clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PINS)
	$(PY) -m pip install --quiet --no-deps -e .
	touch $@

# Python's bytecode cache (__pycache__, git-ignored) even where the environment turns it off: the suite starts
# ~150 Python processes (replicas, engines, TP ranks, CLIs), each of which would compile the project's modules
# from source again (~0.15 s of a core each; the tests' collection 12 s -> 10 s of a core per worker).
unexport PYTHONDONTWRITEBYTECODE

# Two xdist workers for the 2 cores CI has, each module whole in one of them (tests/parallel.py).
test: venv
	$(PY) -m pytest -q -n 2 tests

# The edit loop: the tests that need no Ray cluster and are not slow (tests/tiers.py); `make test` runs them all.
test-fast: venv
	$(PY) -m pytest -q -m "not ray and not slow" tests

serve: venv
	$(PY) -m deployments.cli serve --demo

bench: venv
	$(PY) -m pip install --quiet $(BENCH_PINS)
	$(PY) -m benchmarks.run_all $(BENCH_ARGS)

# guidellm, lm-eval, LangChain and the Agents SDK against the demo server, from a venv of their own
# (.cache/clients-venv); not part of `make test` (docs/clients.md).
clients: venv
	$(PY) -m benchmarks.clients.run $(CLIENTS_ARGS)

clean:
	rm -rf $(VENV) .cache
