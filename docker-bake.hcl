# Build (and push) the three lmforge runtime images; image names and tags match components/images.py:
#   <REGISTRY>/lmforge-<runtime>:<VERSION>, VERSION = the lmforge package version.
#   docker buildx bake --print                                   # show the resolved plan, builds nothing
#   docker buildx bake                                           # build cpu, train and tensorrt locally
#   REGISTRY=registry.example.com/ml VERSION=0.1.0 docker buildx bake --push
# Compile the pipeline with the same registry (LMFORGE_IMAGE_REGISTRY) so its steps pull these images.

variable "REGISTRY" {
  default = "ghcr.io/lmforge"
}

# Keep in step with [project] version in pyproject.toml (tests/test_images.py checks it).
variable "VERSION" {
  default = "0.1.0"
}

group "default" {
  targets = ["cpu", "train", "tensorrt"]
}

target "_common" {
  context   = "."
  args      = { VERSION = VERSION }
  platforms = ["linux/amd64"]
  labels    = { "org.opencontainers.image.version" = VERSION }
}

target "cpu" {
  inherits   = ["_common"]
  dockerfile = "images/cpu/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-cpu:${VERSION}"]
}

target "train" {
  inherits   = ["_common"]
  dockerfile = "images/train/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-train:${VERSION}"]
}

target "tensorrt" {
  inherits   = ["_common"]
  dockerfile = "images/tensorrt/Dockerfile"
  tags       = ["${REGISTRY}/lmforge-tensorrt:${VERSION}"]
}
