# flexlab: `make test` and `make app` set up everything they need on a fresh machine.
#
# torch is pinned to 2.13.0: on machines without a GPU, pip takes the CPU wheel that is already on
# disk (see README); on GPU machines the same pin gives the CUDA build. triton is pinned to the
# version torch 2.13's GPU build uses.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.flexlab-installed
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.7.1
PYTEST_ARGS ?=

.PHONY: setup test test-gpu app bench-tiny clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)" "$(TRITON_PIN)"
	$(PIP) install -q -e ".[bench,app,dev]" "$(TORCH_PIN)" "$(TRITON_PIN)"
	touch $(STAMP)

# One worker per core; a test module's tests stay in one worker (they share its fixtures and caches).
test: $(STAMP)
	$(PY) -m pytest -n auto --dist loadfile $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

app: $(STAMP)
	$(PY) -m streamlit run app/streamlit_app.py

bench-tiny: $(STAMP)
	$(PY) -m bench run --config tiny --force

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
