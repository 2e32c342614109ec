"""Atomic, resumable training checkpoints on a local path or ``s3://`` prefix.

A checkpoint is a directory ``<dir>/step-00001234/`` whose ``manifest.json`` (kind ``checkpoint``, the
step, every file's sha256) is written last: a checkpoint without a manifest is incomplete and is never
resumed from. Locally, files are written into a hidden ``.step-….partial-…`` directory that is renamed
into place after the manifest; on S3, every rank uploads its files first, then rank 0 writes the
manifest. Only the newest ``keep_last`` complete checkpoints are kept; deleting removes the manifest
first, so a half-deleted checkpoint is never mistaken for a complete one.

What goes into a checkpoint is the training loop's business (:mod:`lmforge.train.loop`); this module
only decides when, where and how atomically.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmforge import __version__, storage
from lmforge.artifacts import MANIFEST, describe_files, read_manifest
from lmforge.config import CheckpointConfig
from lmforge.errors import ConfigError, StorageError
from lmforge.train.distributed import DistContext

logger = logging.getLogger("lmforge.train")

KIND = "checkpoint"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_name(step: int) -> str:
    """Directory name of the checkpoint taken after optimizer step ``step``."""
    return f"step-{step:08d}"


def _subdirs(root: str) -> dict[int, bool]:
    """``{step: complete}`` for every ``step-*`` directory or prefix under ``root``."""
    found: dict[int, bool] = {}
    if storage.is_s3(root):
        names = storage.list_files(root) if storage.exists(root) else []
        for name in names:
            top, _, rest = name.partition("/")
            if match := _STEP_DIR.match(top):
                step = int(match[1])
                found[step] = found.get(step, False) or rest == MANIFEST
        return found
    if not Path(root).is_dir():
        return found
    for child in Path(root).iterdir():
        if child.is_dir() and (match := _STEP_DIR.match(child.name)):
            found[int(match[1])] = (child / MANIFEST).is_file()
    return found


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    return sorted(step for step, complete in _subdirs(root).items() if complete)


def _remove(uri: str) -> None:
    """Delete one checkpoint directory or prefix, manifest first."""
    if storage.is_s3(uri):
        names = storage.list_files(uri)
        for name in sorted(names, key=lambda n: n != MANIFEST):
            storage.delete(storage.join(uri, name))
        return
    path = Path(uri)
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


class Checkpointer:
    """Saves and finds checkpoints for one run; every method is called on every rank."""

    def __init__(self, cfg: CheckpointConfig, ctx: DistContext) -> None:
        if cfg.dir is None:
            raise ConfigError("checkpoint.dir is not set")
        self.cfg = cfg
        self.root = cfg.dir.rstrip("/") if storage.is_s3(cfg.dir) else str(Path(cfg.dir))
        self.ctx = ctx
        self.last_save = time.monotonic()

    # -- when ---------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` by step count or by time (this rank's clock)."""
        by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        by_time = self.cfg.every_minutes > 0 and time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes
        return by_steps or by_time

    # -- where from -----------------------------------------------------------------------------------
    def resume_step(self) -> int | None:
        """The step to resume from (newest complete checkpoint), or None to start fresh (same on all ranks)."""
        steps = complete_steps(self.root) if self.ctx.is_main else []
        steps = self.ctx.broadcast_object(steps)
        if self.cfg.resume == "never":
            if steps:
                raise ConfigError(
                    f"checkpoint.resume is 'never' but {self.root} already holds checkpoints "
                    f"(newest {step_name(steps[-1])}); use a new checkpoint.dir or resume: auto"
                )
            return None
        return steps[-1] if steps else None

    def fetch(self, step: int, workdir: str | Path) -> Path:
        """A local, verified copy of checkpoint ``step`` (the directory itself when local)."""
        uri = storage.join(self.root, step_name(step))
        local = storage.localize(uri, workdir) if storage.is_s3(uri) else Path(uri)
        manifest = read_manifest(local, verify=True)
        if manifest.get("kind") != KIND or manifest.get("step") != step:
            raise StorageError(f"{uri}: manifest is not the checkpoint of step {step}")
        return local

    # -- writing --------------------------------------------------------------------------------------
    def save(self, step: int, write_files: Callable[[Path], None], *, extra: dict[str, Any] | None = None) -> str:
        """Write checkpoint ``step`` atomically; ``write_files(dir)`` writes this rank's files into ``dir``.

        Returns the checkpoint's URI. A complete checkpoint of the same step is left as it is (a
        deterministic run would write the same state again).
        """
        final = storage.join(self.root, step_name(step))
        exists = self.ctx.broadcast_object(step in complete_steps(self.root) if self.ctx.is_main else None)
        if exists:
            self.last_save = time.monotonic()
            return final
        start = time.perf_counter()
        if storage.is_s3(self.root):
            self._save_s3(step, final, write_files, extra or {})
        else:
            self._save_local(step, final, write_files, extra or {})
        self.ctx.barrier()
        if self.ctx.is_main:
            self._prune()
            logger.info("checkpoint %s written in %.1fs", final, time.perf_counter() - start)
        self.last_save = time.monotonic()
        return final

    def _manifest(self, step: int, files: dict[str, Any], extra: dict[str, Any]) -> bytes:
        manifest = {
            "kind": KIND,
            "step": step,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "lmforge_version": __version__,
            "world_size": self.ctx.world_size,
            "files": files,
            **extra,
        }
        return json.dumps(manifest, indent=2, sort_keys=True).encode()

    def _save_local(self, step: int, final: str, write_files: Callable[[Path], None], extra: dict[str, Any]) -> None:
        nonce = self.ctx.broadcast_object(uuid.uuid4().hex[:8])
        staging = Path(self.root, f".{step_name(step)}.partial-{nonce}")
        staging.mkdir(parents=True, exist_ok=True)
        write_files(staging)
        self.ctx.barrier()  # every rank's files are in place
        if self.ctx.is_main:
            storage.write_bytes(str(staging / MANIFEST), self._manifest(step, describe_files(staging), extra))
            if Path(final).exists():  # an incomplete leftover (a delete that was cut short)
                shutil.rmtree(final)
            os.replace(staging, final)

    def _save_s3(self, step: int, final: str, write_files: Callable[[Path], None], extra: dict[str, Any]) -> None:
        with tempfile.TemporaryDirectory(prefix="lmforge-ckpt-") as scratch:
            write_files(Path(scratch))
            files = describe_files(scratch)
            for name in files:
                storage.upload_file(Path(scratch, name), storage.join(final, name))
        every_rank = self.ctx.all_gather_object(files)  # also a barrier: all uploads are done
        if self.ctx.is_main:
            merged = {name: meta for rank_files in every_rank for name, meta in rank_files.items()}
            storage.write_bytes(storage.join(final, MANIFEST), self._manifest(step, merged, extra))

    def _prune(self) -> None:
        """Keep the newest ``keep_last`` complete checkpoints; drop older ones and stale partial writes."""
        found = _subdirs(self.root)
        complete = sorted(s for s, ok in found.items() if ok)
        keep = set(complete[-self.cfg.keep_last :])
        newest = complete[-1] if complete else -1
        for step, ok in found.items():
            if step not in keep and (ok or step < newest):
                logger.info("deleting old checkpoint %s", step_name(step))
                _remove(storage.join(self.root, step_name(step)))
        if not storage.is_s3(self.root):
            for leftover in Path(self.root).glob(".step-*.partial-*"):
                shutil.rmtree(leftover, ignore_errors=True)
