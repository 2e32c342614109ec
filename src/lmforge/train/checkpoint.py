"""Atomic, resumable training checkpoints on a local path or ``s3://`` prefix.

A checkpoint is a directory ``<dir>/step-00001234/`` whose ``manifest.json`` (kind ``checkpoint``, the
step, every file's sha256) is written last: a checkpoint without a manifest is incomplete and is never
resumed from. Locally, files are written into a hidden ``.step-….partial-…`` directory that is renamed
into place after the manifest; on S3, every rank uploads its files first, then rank 0 writes the
manifest. Only the newest ``keep_last`` complete checkpoints are kept; deleting removes the manifest
first, so a half-deleted checkpoint is never mistaken for a complete one.

What goes into a checkpoint is the training loop's business (:mod:`lmforge.train.loop`); this module
only decides when, where and how atomically, and what may be loaded back.

Trust. Anyone who can write ``checkpoint.dir`` can also rewrite its manifest, so the sha256 check only
catches torn or corrupted files, not tampering. What holds against a hostile writer is that no file of
a checkpoint can run code when it is loaded: weights are safetensors, JSON is JSON, and every pickle
(``optimizer.pt``, DeepSpeed's ``*.pt``) is read only by PyTorch's ``weights_only`` unpickler, which
builds tensors, containers and an explicit allowlist of DeepSpeed's plain data classes and refuses any
other global before it is called (:func:`check_tensor_only`, :func:`tensor_only_deepspeed_loading`).
Such a writer can still poison the model's weights; a signed manifest would be needed to stop that.

Resume (``resume: auto``) takes the newest checkpoint that verifies; a newer one that does not (torn
file, unreadable manifest, unsafe pickle) is moved aside under ``<dir>/quarantine/`` and reported by URI.

Where. ``checkpoint.dir`` may be a template that names what only the run knows (the GPU presets use
``{run_root}/checkpoints/{run_id}/{stage}``): ``{run_root}`` is ``$LMFORGE_RUN_ROOT`` (the pipeline sets it
to the run's staging root, else its release root), ``{run_id}`` is ``$LMFORGE_RUN_ID`` (the pipeline run id,
the same on every retry of a step, so a retried step resumes) and ``{stage}`` the training stage.
:func:`resolve_checkpoint_config` fills them in when training starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmforge import __version__, storage
from lmforge.artifacts import MANIFEST, describe_files, read_manifest
from lmforge.config import CheckpointConfig
from lmforge.config.train import CHECKPOINT_PLACEHOLDERS
from lmforge.errors import ArtifactIncompleteError, ConfigError, UnsafeCheckpointError
from lmforge.run_context import ENV_NAMES, RunContext
from lmforge.train.distributed import DistContext

logger = logging.getLogger("lmforge.train")

KIND = "checkpoint"
QUARANTINE = "quarantine"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")
"""Files that ``torch.load`` reads (pickles); every one is checked by :func:`check_tensor_only` before use."""


def deepspeed_safe_globals() -> list[type]:
    """The non-tensor classes a DeepSpeed ZeRO checkpoint pickles: plain data, no code runs when rebuilt."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _safe_globals() -> list[type]:
    try:
        return deepspeed_safe_globals()
    except ImportError:  # no DeepSpeed installed: its checkpoints cannot be resumed anyway
        return []


def load_tensor_file(path: str | Path, *, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load`` with the ``weights_only`` unpickler (plus DeepSpeed's data classes); never runs code."""
    import torch

    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(Path(path), map_location=map_location, weights_only=True, mmap=mmap)


def check_tensor_only(folder: str | Path, *, uri: str | None = None) -> None:
    """Refuse a checkpoint holding a pickle that the ``weights_only`` unpickler does not accept.

    Every file with a suffix in :data:`PICKLE_SUFFIXES` is loaded by :func:`load_tensor_file`, which
    refuses an unknown global before anything is called, so a crafted file is refused without running.

    Raises:
        UnsafeCheckpointError: naming the file (by ``uri`` when given) and PyTorch's reason.
    """
    folder = Path(folder)
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES):
        try:
            # mmap: checking a large optimizer state does not read its tensors into memory
            load_tensor_file(path, mmap=zipfile.is_zipfile(path))
        except Exception as exc:  # hostile bytes can make the unpickler raise almost anything
            name = storage.join(uri, path.relative_to(folder).as_posix()) if uri else str(path)
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = _unpickler_reason(lines) if lines else type(exc).__name__
            raise UnsafeCheckpointError(
                f"{name}: refused, PyTorch's weights_only loader does not accept it ({reason}); "
                "a checkpoint file is loaded only if it holds nothing but tensors and plain data"
            ) from exc


def _unpickler_reason(lines: list[str]) -> str:
    """The informative part of PyTorch's multi-paragraph weights_only error: the global it refused.

    PyTorch words it as ``Unsupported global: GLOBAL io.open was not an allowed global`` or, for a module it
    blocks outright (``os``, ``subprocess``, ``builtins``' import machinery; torch >= 2.7),
    ``Trying to load unsupported GLOBAL posix.system whose module posix is blocked``; either becomes
    ``Unsupported global: GLOBAL <name>``, with the blocked module said.
    """
    for line in lines:
        if match := re.search(
            r"unsupported (?:global: )?GLOBAL (\S+)(?: whose module (\S+) is blocked)?", line, re.IGNORECASE
        ):
            blocked = f" (module {match[2]} is blocked)" if match[2] else ""
            return f"Unsupported global: GLOBAL {match[1]}{blocked}"
        if match := re.search(r"Unsupported operand: \S+", line):
            return match[0]
    return lines[-1][:300]


@contextlib.contextmanager
def tensor_only_deepspeed_loading(engine: Any) -> Iterator[None]:
    """Inside the block, ``engine.load_checkpoint`` reads every file with the ``weights_only`` unpickler.

    DeepSpeed's own checkpoint engine calls ``torch.load(weights_only=False)``; it is swapped for one that
    loads through :func:`load_tensor_file` (so a file changed after :func:`check_tensor_only` still
    cannot run code), and restored afterwards.
    """
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class TensorOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location: Any = None) -> Any:
            return load_tensor_file(path, map_location=map_location)

    original = engine.checkpoint_engine
    engine.checkpoint_engine = TensorOnlyCheckpointEngine(engine._config)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


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


def resolve_checkpoint_config(cfg: CheckpointConfig, *, stage: str, run: RunContext | None = None) -> CheckpointConfig:
    """``cfg`` with the placeholders of its ``dir`` filled in (see the module docstring); unchanged without any.

    Args:
        run: the run's context; default: this process's environment's.

    Raises:
        ConfigError: a placeholder's fact is not known, naming its environment variable and what to do instead.
    """
    if cfg.dir is None or "{" not in cfg.dir:
        return cfg
    run = RunContext.from_env() if run is None else run
    values = {"stage": stage}
    for name in CHECKPOINT_PLACEHOLDERS:
        if name not in values and "{" + name + "}" in cfg.dir:
            value = getattr(run, name).strip().rstrip("/")
            if not value:
                variable = ENV_NAMES[name]
                raise ConfigError(
                    f"{stage}.train.checkpoint.dir {cfg.dir!r} needs ${variable} (the lmforge pipeline sets it); "
                    f"set it, or set checkpoint.dir to a local path or s3:// URI, or to null to disable checkpoints"
                )
            values[name] = value
    return cfg.model_copy(update={"dir": cfg.dir.format(**values)})


class Checkpointer:
    """Saves and finds checkpoints for one run; every method is called on every rank."""

    def __init__(self, cfg: CheckpointConfig, ctx: DistContext) -> None:
        if cfg.dir is None:
            raise ConfigError("checkpoint.dir is not set")
        self.cfg = cfg
        self.root = cfg.dir.rstrip("/") if storage.is_s3(cfg.dir) else str(Path(cfg.dir))
        self.ctx = ctx
        self.last_save = time.monotonic()
        self.quarantined: list[dict[str, str]] = []

    # -- when ---------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after ``step`` by step count or by time (this rank's clock)."""
        by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        by_time = self.cfg.every_minutes > 0 and time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes
        return by_steps or by_time

    # -- where from -----------------------------------------------------------------------------------
    def uri(self, step: int) -> str:
        """Where checkpoint ``step`` lives (local path or ``s3://`` URI)."""
        return storage.join(self.root, step_name(step))

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
        """A local, verified, tensor-only copy of checkpoint ``step`` (the directory itself when local).

        Raises:
            ArtifactIncompleteError: a file is missing or its sha256 differs (named by URI), or the
                manifest is unreadable or not this step's; :class:`UnsafeCheckpointError` for a pickle
                that could run code.
        """
        uri = self.uri(step)
        local = storage.localize(uri, workdir) if storage.is_s3(uri) else Path(uri)
        try:
            manifest = read_manifest(local, verify=True)
        except ArtifactIncompleteError as exc:  # name the checkpoint, not this machine's temporary copy
            raise type(exc)(str(exc).replace(str(local), uri)) from exc
        except (AttributeError, KeyError, TypeError) as exc:  # valid JSON of the wrong shape
            raise ArtifactIncompleteError(f"{uri}: {MANIFEST} is not a checkpoint manifest ({exc!r})") from exc
        if not isinstance(manifest, dict) or manifest.get("kind") != KIND or manifest.get("step") != step:
            raise ArtifactIncompleteError(f"{uri}: manifest is not the checkpoint of step {step}")
        check_tensor_only(local, uri=uri)
        return local

    def fetch_newest_valid(
        self, workdir: str | Path, check: Callable[[int, Path], None] | None = None
    ) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies, fetched into ``workdir``; newer bad ones are quarantined.

        Called on every rank. Rank 0 tries the complete checkpoints newest first; one that fails
        :meth:`fetch`, or ``check(step, local folder)`` (which reads what resume will read and raises
        :class:`ArtifactIncompleteError` when it is unusable), is moved to ``<dir>/quarantine/``
        (:meth:`quarantine`) and the next older one is tried. The other ranks then fetch the step rank 0
        chose. Returns ``(step, local folder)``, or ``None`` when no checkpoint verifies; either way
        :attr:`quarantined` lists ``{"uri", "moved_to", "reason"}`` of each checkpoint moved aside.
        """
        chosen: int | None = None
        quarantined: list[dict[str, str]] = []
        folder: Path | None = None
        if self.ctx.is_main:
            for step in reversed(complete_steps(self.root)):
                try:
                    folder = self.fetch(step, Path(workdir, step_name(step)))
                    if check is not None:
                        try:
                            check(step, folder)
                        except ArtifactIncompleteError as exc:  # name the checkpoint, not the temporary copy
                            raise type(exc)(str(exc).replace(str(folder), self.uri(step))) from exc
                except ArtifactIncompleteError as exc:  # the content is bad; a storage outage is not caught
                    quarantined.append(self.quarantine(step, str(exc)))
                    continue
                chosen = step
                break
        chosen, quarantined = self.ctx.broadcast_object((chosen, quarantined))
        self.quarantined = quarantined
        if chosen is None:
            return None
        if not self.ctx.is_main:
            folder = self.fetch(chosen, Path(workdir, step_name(chosen)))
        assert folder is not None
        return chosen, folder

    def quarantine(self, step: int, reason: str) -> dict[str, str]:
        """Move checkpoint ``step`` to ``<dir>/quarantine/step-…-<time>`` so resume and prune skip it.

        On S3 the files are copied first and the original deleted after (manifest first), so a crash
        halfway leaves either the bad checkpoint, to be quarantined again, or none.
        """
        uri = self.uri(step)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        moved_to = storage.join(self.root, QUARANTINE, f"{step_name(step)}-{stamp}-{uuid.uuid4().hex[:6]}")
        if storage.is_s3(uri):
            storage.copy_tree(uri, moved_to)
            _remove(uri)
        else:
            Path(moved_to).parent.mkdir(parents=True, exist_ok=True)
            os.replace(uri, moved_to)
        logger.warning("checkpoint %s is not usable (%s); moved to %s, trying an older one", uri, reason, moved_to)
        return {"uri": uri, "moved_to": moved_to, "reason": reason}

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
