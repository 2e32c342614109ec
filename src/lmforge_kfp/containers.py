"""Run the compiled DAG's tasks inside their images: kfp.local's ``DockerRunner`` through the Docker API.

The engine is Docker (its socket, or ``$DOCKER_HOST``) or podman, whose Docker-compatible API
(``podman system service``) lmforge starts for the run and stops after it when no ``$DOCKER_HOST`` is given;
podman reads ``$CONTAINERS_CONF`` (``images/containers.conf`` for hosts like CI's).

kfp 2.17's ``run_docker_container`` starts each container with ``auto_remove=True`` and takes a container that is
already gone when it asks for the exit status as a success (``kfp/local/docker_task_handler.py``): with podman a
failed task always "succeeds" (docs/kubeflow.md has the reproduction). :func:`run_container` replaces it for the run:
the container is kept until its exit status is read, then removed. Each task runs as on a cluster: as the image's
non-root user (uid 10001), with a read-only root file system and a writable ``/tmp``, by default without network.
The run's folders are bind-mounted at their own paths; the image each runtime ran (reference, id and registry
digest) goes to every task as ``$LMFORGE_IMAGES``, which the release manifest records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lmforge.errors import LmforgeError
from lmforge.run_context import IMAGES_ENV, environ_set

log = logging.getLogger(__name__)

ENGINES = ("docker", "podman")
IMAGE_UID = 10001  # the images' user (images/*/Dockerfile)
_RUNTIME = re.compile(r"/lmforge-(?P<runtime>[a-z0-9]+):")
_SERVICE_START_SECONDS = 60


class ContainerEngineError(LmforgeError):
    """No container engine could be reached, or an image the pipeline names is missing."""


@dataclass(frozen=True)
class ContainerSettings:
    """How the tasks' containers run.

    Attributes:
        mounts: host folders bind-mounted read-write at their own paths besides the pipeline root (the release root).
        read_only_mounts: host paths mounted read-only at their own paths (local input data).
        network: the containers' network mode: ``none`` (no network, the default) or ``host`` (S3, MLflow).
        environment: variables every task gets besides kfp.local's.
    """

    mounts: tuple[Path, ...] = ()
    read_only_mounts: tuple[Path, ...] = ()
    network: str = "none"
    environment: Mapping[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def docker_api(engine: str) -> Iterator[None]:
    """``$DOCKER_HOST`` set to a Docker API for ``engine`` while the block runs.

    A given ``$DOCKER_HOST`` is used as it is; Docker otherwise means its default socket; podman otherwise means a
    ``podman system service`` on a private socket, started here and stopped on exit.

    Raises:
        ContainerEngineError: ``engine`` is unknown, not installed, or its API does not answer.
    """
    if engine not in ENGINES:
        raise ContainerEngineError(f"--runner {engine!r}: expected one of subprocess, {', '.join(ENGINES)}")
    if os.environ.get("DOCKER_HOST") or engine == "docker":
        _ping()
        yield
        return
    podman = shutil.which("podman")
    if podman is None:
        raise ContainerEngineError("--runner podman: podman is not installed (Debian: apt-get install podman runc)")
    with tempfile.TemporaryDirectory(prefix="lmforge-podman-") as folder:
        socket = f"unix://{folder}/podman.sock"
        service_log = Path(folder) / "service.log"
        with open(service_log, "wb") as log_file:
            service = subprocess.Popen(
                [podman, "system", "service", "--time=0", socket], stdout=log_file, stderr=subprocess.STDOUT
            )
        try:
            with environ_set({"DOCKER_HOST": socket}):
                _wait_for_service(service, service_log)
                yield
        finally:
            service.terminate()
            try:
                service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()


def _wait_for_service(service: subprocess.Popen[bytes], service_log: Path) -> None:
    """Until ``podman system service`` answers; its own error when it exits first."""
    deadline = time.monotonic() + _SERVICE_START_SECONDS
    while True:
        if service.poll() is not None:
            error = service_log.read_text(errors="replace").strip()
            raise ContainerEngineError(f"podman system service exited ({service.returncode}): {error[-500:]}")
        try:
            _ping()
            return
        except ContainerEngineError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _ping() -> None:
    import docker

    try:
        client = docker.from_env()
        try:
            client.ping()
        finally:
            client.close()
    except docker.errors.DockerException as exc:
        where = os.environ.get("DOCKER_HOST") or "Docker's default socket"
        raise ContainerEngineError(f"no Docker API at {where}: {exc}") from exc


def pipeline_images(pipeline_yaml: Path) -> dict[str, str]:
    """``{runtime: image reference}`` of every task of a compiled pipeline (``lmforge-<runtime>:<tag>``)."""
    images: dict[str, str] = {}
    for doc in yaml.safe_load_all(pipeline_yaml.read_text(encoding="utf-8")):
        executors = ((doc or {}).get("deploymentSpec") or {}).get("executors") or {}
        for executor in executors.values():
            image = (executor.get("container") or {}).get("image")
            match = _RUNTIME.search(image or "")
            if match:
                images[match["runtime"]] = image
    return images


def describe_images(references: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """What each runtime's image is locally: ``{runtime: {"reference", "id", "digest"}}``.

    ``digest`` is the registry digest (``<repository>@sha256:...``) of a pulled or pushed image, ``None`` for one
    only built here; ``id`` is the image's own content digest.

    Raises:
        ContainerEngineError: an image is not in the engine's store (build it: ``make local-images``).
    """
    import docker

    client = docker.from_env()
    try:
        described = {}
        for runtime, reference in sorted(references.items()):
            try:
                image = client.images.get(reference)
            except docker.errors.ImageNotFound:
                raise ContainerEngineError(
                    f"image {reference} (runtime {runtime}) is not in the engine's store: build it "
                    "(make images, or make local-images where no registry is in reach)"
                ) from None
            digests = image.attrs.get("RepoDigests") or []
            described[runtime] = {"reference": reference, "id": image.id, "digest": digests[0] if digests else None}
        return described
    finally:
        client.close()


def run_container(
    client: Any,
    image: str,
    command: list[str],
    volumes: dict[str, Any],
    *,
    settings: ContainerSettings,
    **run_args: Any,
) -> int:
    """Run ``command`` in ``image`` and return its real exit status (kfp.local's ``run_docker_container``'s place).

    The container is removed only after its status is read; its output is printed as it comes (kfp.local's log).
    """
    volumes = dict(volumes)
    for path in settings.mounts:
        volumes[str(path)] = {"bind": str(path), "mode": "rw"}
    for path in settings.read_only_mounts:
        volumes[str(path)] = {"bind": str(path), "mode": "ro"}
    writable = [Path(host) for host, spec in volumes.items() if spec.get("mode", "rw").startswith("rw")]
    user = _user_for(writable)
    environment = {**settings.environment, **(run_args.pop("environment", None) or {})}
    container = client.containers.run(
        image=image,
        command=command,
        detach=True,
        volumes=volumes,
        environment=environment,
        user=user,
        read_only=True,
        tmpfs={"/tmp": "rw,exec,size=4g"},
        network_mode=settings.network,
        **run_args,
    )
    try:
        for chunk in container.logs(stream=True, follow=True):
            sys.stdout.write(chunk.decode(errors="replace"))
        return int(container.wait()["StatusCode"])
    finally:
        container.remove(force=True)


def _user_for(writable: list[Path]) -> str:
    """The containers' user: the images' uid 10001, owning the writable mounts, when lmforge runs as root (as on
    CI); otherwise the caller's own uid and gid, so that what the tasks write stays the caller's."""
    if os.geteuid() != 0:
        return f"{os.getuid()}:{os.getgid()}"
    for folder in writable:
        for path in [folder, *folder.rglob("*")]:
            if path.lstat().st_uid != IMAGE_UID:
                os.lchown(path, IMAGE_UID, IMAGE_UID)
    return f"{IMAGE_UID}:{IMAGE_UID}"


@contextlib.contextmanager
def container_runner(engine: str, pipeline_yaml: Path, settings: ContainerSettings) -> Iterator[Any]:
    """A ``kfp.local.DockerRunner`` for the block, its container call replaced by :func:`run_container`.

    Checks first that the engine answers and that every image the pipeline names is in its store.
    """
    from kfp import local
    from kfp.local import docker_task_handler

    with docker_api(engine):
        images = describe_images(pipeline_images(pipeline_yaml))
        environment = {**settings.environment, IMAGES_ENV: json.dumps(images, sort_keys=True)}
        task_settings = ContainerSettings(settings.mounts, settings.read_only_mounts, settings.network, environment)
        upstream = docker_task_handler.run_docker_container

        def run(client: Any, image: str, command: list[str], volumes: dict[str, Any], **run_args: Any) -> int:
            return run_container(client, image, command, volumes, settings=task_settings, **run_args)

        docker_task_handler.run_docker_container = run
        try:
            yield local.DockerRunner()
        finally:
            docker_task_handler.run_docker_container = upstream
