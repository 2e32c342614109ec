# Build (and push) the three lmforge runtime images and the predictor image (serve, which the serve step's
# InferenceService runs); image names and tags match components/images.py:
#   <REGISTRY>/lmforge-<runtime>:<TAG>, TAG = <package version>-<source hash> (`lmforge images --tag`).
# Use `make images REGISTRY=... [PUSH=1]`, which sets TAG (and builds with podman where no Docker daemon answers);
# by hand:
#   TAG=$(lmforge images --tag) docker buildx bake --print       # show the resolved plan, builds nothing
#   REGISTRY=registry.example.com/ml TAG=$(lmforge images --tag) docker buildx bake --push
# Compile the pipeline with the same registry (`lmforge compile --registry ...`) so its steps pull these images.

variable "REGISTRY" {
  default = "ghcr.io/lmforge"
}

# Keep in step with [project] version in pyproject.toml (tests/test_images.py checks it).
variable "VERSION" {
  default = "0.1.0"
}

# Set by `make images` from `lmforge images --tag`; the default is no tag the compiled pipeline uses.
variable "TAG" {
  default = "dev"
}

group "default" {
  targets = ["cpu", "train", "tensorrt", "serve"]
}

# Build arguments left to the Dockerfiles' defaults unless set (null): the public base, pinned by digest
# (BASE_IMAGE; the wheel stage's WHEEL_IMAGE follows it) and torch's CPU index (TORCH_INDEX_URL).
variable "BASE_IMAGE" {
  default = null
}

variable "TORCH_INDEX_URL" {
  default = null
}

target "_common" {
  context   = "."
  args      = { VERSION = VERSION, BASE_IMAGE = BASE_IMAGE, WHEEL_IMAGE = BASE_IMAGE, TORCH_INDEX_URL = TORCH_INDEX_URL }
  platforms = ["linux/amd64"]
  labels    = { "org.opencontainers.image.version" = VERSION }
}

target "cpu" {
  inherits   = ["_common"]
  dockerfile = "images/cpu/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-cpu:${TAG}"]
}

target "train" {
  inherits   = ["_common"]
  dockerfile = "images/train/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-train:${TAG}"]
}

target "tensorrt" {
  inherits   = ["_common"]
  dockerfile = "images/tensorrt/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-tensorrt:${TAG}"]
}

target "serve" {
  inherits   = ["_common"]
  dockerfile = "images/serve/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-serve:${TAG}"]
}
