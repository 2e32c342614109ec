# Build (and push) the three lmforge runtime images and the predictor image (serve, which the serve step's
# InferenceService runs); image names and tags match components/images.py, each image under two tags:
#   <REGISTRY>/lmforge-<runtime>:<TAG>      the content tag, <package version>-<source hash> (`lmforge images --tag`)
#   <REGISTRY>/lmforge-<runtime>:<VERSION>  the release tag, which the committed pipeline pulls
# Use `make images REGISTRY=... [PUSH=1 [RELEASE=1]]`, which sets TAG, builds (with podman where no Docker daemon
# answers) and pushes the content tag (the release tag too with RELEASE=1); by hand:
#   TAG=$(lmforge images --tag) docker buildx bake --print       # show the resolved plan, builds nothing
#   REGISTRY=registry.example.com/ml TAG=$(lmforge images --tag) docker buildx bake --push   # pushes both tags
# Compile the pipeline with the same registry and the content tag (`lmforge compile --registry ... --image-tag
# content`) so its steps pull these images.

variable "REGISTRY" {
  default = "ghcr.io/lmforge"
}

# Keep in step with [project] version in pyproject.toml (tests/test_images.py checks it).
variable "VERSION" {
  default = "0.1.0"
}

# Set by `make images` to the content tag (`lmforge images --tag`), also baked into each image (build argument
# CONTENT_TAG); the default is no tag a compiled pipeline names.
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
  args = {
    VERSION         = VERSION
    CONTENT_TAG     = TAG
    BASE_IMAGE      = BASE_IMAGE
    WHEEL_IMAGE     = BASE_IMAGE
    TORCH_INDEX_URL = TORCH_INDEX_URL
  }
  platforms = ["linux/amd64"]
  labels    = { "org.opencontainers.image.version" = VERSION }
}

target "cpu" {
  inherits   = ["_common"]
  dockerfile = "images/cpu/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-cpu:${TAG}", "${REGISTRY}/lmforge-cpu:${VERSION}"]
}

target "train" {
  inherits   = ["_common"]
  dockerfile = "images/train/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-train:${TAG}", "${REGISTRY}/lmforge-train:${VERSION}"]
}

target "tensorrt" {
  inherits   = ["_common"]
  dockerfile = "images/tensorrt/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-tensorrt:${TAG}", "${REGISTRY}/lmforge-tensorrt:${VERSION}"]
}

target "serve" {
  inherits   = ["_common"]
  dockerfile = "images/serve/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-serve:${TAG}", "${REGISTRY}/lmforge-serve:${VERSION}"]
}
