# lmforge developer entry points. `make demo` runs the whole DAG locally; `make test` runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint compile images

install:
	# torch first: 2.13.0 resolves to the CPU build; an unpinned resolve pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,demo,deepspeed,train]'

demo: install
	$(PYTHON) -m lmforge run

test: install
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

compile:
	$(PYTHON) -m lmforge compile

REGISTRY ?= ghcr.io/lmforge

images:
	# Build (and with PUSH=1 push) the cpu/train/tensorrt images to REGISTRY under the tag the compiled pipeline
	# pulls (lmforge images --tag); needs a Docker daemon. Then: lmforge compile --registry $(REGISTRY) --root DIR
	REGISTRY=$(REGISTRY) TAG=$$($(PYTHON) -m lmforge images --tag) docker buildx bake $(if $(PUSH),--push,)
