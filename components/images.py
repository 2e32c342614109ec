"""The container image of each component (its stage's ``runtime`` in the registry), the service images, the tag.

Tag = ``<package version>-<12 hex of the image sources' sha256>``: the Dockerfiles, ``pyproject.toml`` and the
Python code the images install (``src/``, ``components``, ``pipelines``; generated files excluded). A
changed image is a new tag, so KFP's cache, whose key holds the image reference, never reuses a step run by an
older image under the same version. ``make images`` builds and pushes under the same tag (``lmforge images
--tag``). In a checkout the tag is computed from the files; an installed package (inside an image) reads
``image_tag.txt``, which ``lmforge compile`` writes and the compile test keeps current.

The registry prefix defaults to ``ghcr.io/lmforge`` and is overridden at compile time with
``LMFORGE_IMAGE_REGISTRY`` (``lmforge compile --registry``): the registry you push to.
"""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

from lmforge import __version__
from lmforge.stages import get_stage

DEFAULT_REGISTRY = "ghcr.io/lmforge"
REPO_ROOT = Path(__file__).resolve().parent.parent
TAG_FILE = Path(__file__).resolve().with_name("image_tag.txt")
# Images (images/<name>/Dockerfile) that no step runs in: the lmforge predictor, which the InferenceService the
# serve step writes starts (the pipeline passes its reference as the serve step's predictor_image).
SERVICE_IMAGES: tuple[str, ...] = ("serve",)

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


def computed_tag(root: Path = REPO_ROOT) -> str:
    """The tag of images built from the sources under ``root``."""
    return f"{__version__.split('+')[0]}-{source_digest(root)[:12]}"


@cache
def image_tag() -> str:
    """The images' tag: computed in a checkout (``images/`` beside the package), else read from ``image_tag.txt``."""
    if (REPO_ROOT / "images").is_dir() and (REPO_ROOT / "src" / "lmforge").is_dir():
        return computed_tag()
    return TAG_FILE.read_text(encoding="utf-8").strip()


def image_for(stage: str) -> str:
    """Fully qualified image reference for ``stage``'s component: ``<registry>/lmforge-<runtime>:<tag>``."""
    return _reference(get_stage(stage).runtime)


def service_image(name: str) -> str:
    """Fully qualified reference of an image no step runs in (:data:`SERVICE_IMAGES`), built and tagged alike."""
    if name not in SERVICE_IMAGES:
        raise KeyError(f"{name!r} is not a service image; service images: {', '.join(SERVICE_IMAGES)}")
    return _reference(name)


def _reference(image: str) -> str:
    registry = os.environ.get("LMFORGE_IMAGE_REGISTRY", DEFAULT_REGISTRY).rstrip("/")
    return f"{registry}/lmforge-{image}:{image_tag()}"
