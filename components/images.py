"""The container image of each component (its stage's ``runtime`` in the registry), the service images, the tags.

Two tags name the same build:

- the **release tag**, the package version: what a release publishes and what the committed generated files
  (``components/*/component.yaml``, ``pipelines/compiled/*.yaml``) name, so they change only when their
  content does;
- the **content tag**, ``<package version>-<12 hex of the image sources' sha256>`` over the Dockerfiles,
  ``pyproject.toml`` and the Python code the images install (``src/``, ``components``, ``pipelines``; generated
  files excluded). A changed image is a new content tag, so KFP's cache, whose key holds the image reference,
  never reuses a step run by an older image. ``make images`` builds under both (``lmforge images --tag`` prints
  the content tag) and pushes the content tag; ``lmforge compile --image-tag content`` names it.

In a checkout the content tag is computed from the files; inside an image it is ``$LMFORGE_CONTENT_TAG``, which
the Dockerfiles set from the build argument ``CONTENT_TAG`` (the release tag where the build was given none).

The registry prefix defaults to ``ghcr.io/lmforge`` and is overridden at compile time with
``LMFORGE_IMAGE_REGISTRY`` (``lmforge compile --registry``): the registry you push to. The tag the references
name is ``LMFORGE_IMAGE_TAG`` (``lmforge compile --image-tag``): a tag, or ``content``; default the release tag.
The images set it to ``content``, so a step that names its own image (a training job's) names the one it runs in.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import cache
from pathlib import Path

from lmforge import __version__
from lmforge.errors import ConfigError
from lmforge.stages import get_stage

DEFAULT_REGISTRY = "ghcr.io/lmforge"
REGISTRY_ENV = "LMFORGE_IMAGE_REGISTRY"
TAG_ENV = "LMFORGE_IMAGE_TAG"  # the tag image references name: a tag, or CONTENT
CONTENT_TAG_ENV = "LMFORGE_CONTENT_TAG"  # inside an image: the content tag it was built under
CONTENT = "content"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Images (images/<name>/Dockerfile) that no step runs in: the lmforge predictor, which the InferenceService the
# serve step writes starts (the pipeline passes its reference as the serve step's predictor_image).
SERVICE_IMAGES: tuple[str, ...] = ("serve",)
# A Docker tag: ASCII letters, digits, '_', '.' and '-', not starting with '.' or '-', at most 128.
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_REFERENCE = re.compile(rf"(?P<repository>\S+/lmforge-[a-z0-9]+):{_TAG}")

# What the images are built from (relative to the repository root), by glob; generated files are not inputs.
IMAGE_SOURCES = (
    "pyproject.toml",
    "images/*/Dockerfile",
    "images/*/requirements.lock",
    "src/**/*.py",
    "src/lmforge/presets/*.yaml",
    "components/**/*.py",
    "pipelines/*.py",
)


def source_digest(root: Path = REPO_ROOT) -> str:
    """sha256 over the image sources under ``root`` (path and content of each, in path order)."""
    files = sorted({p for pattern in IMAGE_SOURCES for p in root.glob(pattern) if p.is_file()})
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def release_tag() -> str:
    """The release tag: the package version (without a local ``+...`` part)."""
    return __version__.split("+")[0]


def computed_tag(root: Path = REPO_ROOT) -> str:
    """The content tag of images built from the sources under ``root``."""
    return f"{release_tag()}-{source_digest(root)[:12]}"


@cache
def content_tag() -> str:
    """This code's content tag: computed in a checkout (``images/`` beside the package), else the image's."""
    if (REPO_ROOT / "images").is_dir() and (REPO_ROOT / "src" / "lmforge").is_dir():
        return computed_tag()
    return os.environ.get(CONTENT_TAG_ENV) or release_tag()


def image_tag() -> str:
    """The tag image references name: ``$LMFORGE_IMAGE_TAG`` (``content``: :func:`content_tag`), else the release tag.

    Raises:
        ConfigError: ``$LMFORGE_IMAGE_TAG`` is not a valid image tag.
    """
    tag = os.environ.get(TAG_ENV) or release_tag()
    if tag == CONTENT:
        return content_tag()
    if not re.fullmatch(_TAG, tag):
        raise ConfigError(f"image tag {tag!r}: expected {CONTENT!r} or a tag of letters, digits, '_', '.' and '-'")
    return tag


def image_for(stage: str) -> str:
    """Fully qualified image reference for ``stage``'s component: ``<registry>/lmforge-<runtime>:<tag>``."""
    return _reference(get_stage(stage).runtime)


def service_image(name: str) -> str:
    """Fully qualified reference of an image no step runs in (:data:`SERVICE_IMAGES`), built and tagged alike."""
    if name not in SERVICE_IMAGES:
        raise KeyError(f"{name!r} is not a service image; service images: {', '.join(SERVICE_IMAGES)}")
    return _reference(name)


def _reference(image: str) -> str:
    registry = os.environ.get(REGISTRY_ENV, DEFAULT_REGISTRY).rstrip("/")
    return f"{registry}/lmforge-{image}:{image_tag()}"


def with_tag(value: str, tag: str) -> str:
    """``value`` under ``tag`` if it is an lmforge image reference ``<registry>/lmforge-<image>:<tag>``, else as is."""
    match = _REFERENCE.fullmatch(value)
    return f"{match['repository']}:{tag}" if match else value
