"""Fail-fast checks before any GPU step, and content fingerprints of the external inputs.

The ``preflight`` component runs first: it checks that the S3 endpoint answers (when an input is on S3), that
the corpus and Q&A data are reachable and that a sample of each reads with the stages' own readers (the corpus
field is there and there is at least one document; the Q&A lines are prompt/response or chat examples), that
the release root is writable and its store enforces conditional writes, (inside a cluster) that the S3
credentials Secret exists and, given a launch config for multi-node training, that the cluster serves its job
kind; given a base model (and a pretrained student), that the pipeline can start from it (a GPT-2 or Llama causal
LM with safetensors weights and a fast tokenizer; the student's tokenizer the base's); then it fingerprints the
input data and models. The fingerprints are passed to the stages reading them (``clean``, ``tokenize``,
``pretrain``, ``finetune_lora``, ``distill``) as parameters, so a KFP cache key changes whenever the data behind
an unchanged URI changes.

With a preset it plans every training stage (:mod:`lmforge.plan`) on the launch's ``accelerator``: one console
line per stage, the plan as JSON (its ``plan`` output, which ``evaluate`` sets against what each stage measured)
and ``plan_<stage>_<figure>`` metrics. A stage's hours use the MFU it measured in the newest tracked run of the
same preset when MLflow has one (:mod:`lmforge.tracking.measured`), else the assumed
:data:`~lmforge.plan.DEFAULT_MFU`; a plan whose memory per GPU does not fit the accelerator fails the
``training_plan`` check, naming the stage, the estimate and what to change.

It also predicts what cleaning will keep: the ``clean`` rules (under the chosen ``clean.profile``) run over
the first :data:`RETENTION_SAMPLE_RECORDS` documents of the sample. Below the gate's ``retention_warning`` it warns,
naming the rule that removes most, the setting behind it and the profile that would keep more
(:mod:`lmforge.data.retention`); a warning does not stop the run.

Every failure is one line naming the cause, with a hint where one helps (``clean.text_field`` and the field the
records do have, the Q&A fields expected, ``AWS_ENDPOINT_URL``). :class:`PreflightError` is an
:class:`~lmforge.errors.InputDataError`: running the same inputs again fails the same way.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from lmforge import storage
from lmforge.artifacts import sha256_file
from lmforge.config import CleanConfig, EvaluateConfig, GateConfig, LaunchConfig, StrictModel
from lmforge.data.corpus import CorpusReader, first_file_uri
from lmforge.data.demo import is_demo, materialize
from lmforge.errors import ConfigError, FieldMissingError, LmforgeError, PreflightError, StorageError, did_you_mean
from lmforge.launch import check_training_api, parse_launch, world_size
from lmforge.naming import default_model_name
from lmforge.release import catalog
from lmforge.results import StageResult
from lmforge.stages.configs import resolve_stage_config, sections

log = logging.getLogger("lmforge.preflight")

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
SAMPLE_RECORDS = 1000
RETENTION_SAMPLE_RECORDS = 100  # documents the retention prediction cleans (about 1.5 s on an idle core)
S3_CONNECT_TIMEOUT_S = 5.0
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


@dataclass
class PreflightReport:
    """Outcome of every check (name → ``ok`` or the reason it failed) and the input fingerprints."""

    checks: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, str] = field(default_factory=dict)
    predicted_retention: float | None = None
    warnings: list[str] = field(default_factory=list)
    plan: dict[str, Any] | None = None
    """The training plan (:func:`lmforge.plan.plan_record`), when a preset was given and its configs resolve."""

    @property
    def failed(self) -> dict[str, str]:
        """The checks that did not pass."""
        return {name: result for name, result in self.checks.items() if result != "ok"}


def fingerprint_uri(uri: str) -> str:
    """sha256 over the content of a file, directory, ``s3://`` object/prefix or ``demo://`` corpus.

    Local files are hashed byte for byte; S3 objects contribute their ETag and size (the ETag is an
    MD5 of the content, or of its parts for multipart uploads), so a changed object changes the
    fingerprint without downloading it.
    """
    digest = hashlib.sha256()
    if is_demo(uri):
        with tempfile.TemporaryDirectory(prefix="lmforge-fp-") as workdir:
            digest.update(sha256_file(materialize(uri, workdir)).encode())
        return digest.hexdigest()
    if storage.is_s3(uri):
        names = [""] if storage.is_file(uri) else storage.list_files(uri)
        if not names:
            raise StorageError(f"no such object or prefix: {uri}")
        for name in names:
            etag, size = storage.s3_etag(storage.join(uri, name) if name else uri)
            digest.update(f"{name}\0{etag}\0{size}\n".encode())
        return digest.hexdigest()
    path = Path(uri)
    if not path.exists():
        raise StorageError(f"no such file or directory: {uri}")
    # a folder's symbolic links are refused (storage.local_files), never hashed as if they were its content
    files = [path] if path.is_file() else [path / n for n in sorted(storage.local_files(path), key=PurePosixPath)]
    for file in files:
        name = file.name if path.is_file() else file.relative_to(path).as_posix()
        digest.update(f"{name}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def check_writable(root: str) -> None:
    """Write and delete a probe object under ``root`` (local path or ``s3://``)."""
    probe = storage.join(root, ".lmforge-preflight", uuid.uuid4().hex)
    storage.write_bytes(probe, b"lmforge preflight probe\n")
    storage.delete(probe)


def check_conditional_writes(root: str) -> str:
    """``ok`` when the object store under ``root`` honours ``If-None-Match: *`` and ``If-Match``; a reason otherwise.

    Release claims, release and artifact manifests (conditional create) and ``latest.json``
    (compare-and-swap) are only exclusive if the server enforces these headers; a server that ignores
    them accepts every write and two promotions both "win". The probe creates an object, creates it
    again (must be refused, content kept), replaces it under a wrong ETag (must be refused) and under
    the right one (must succeed), then deletes it. A local ``root`` uses hard links and a file lock
    instead; its conditional create is probed the same way.
    """
    probe = storage.join(root, ".lmforge-preflight", f"conditional-{uuid.uuid4().hex}")
    try:
        if not storage.create_if_absent(probe, b"first"):
            return f"{probe}: a conditional create (If-None-Match: *) of a new object was refused"
        if storage.create_if_absent(probe, b"second") or storage.read_bytes(probe) != b"first":
            return (
                f"{root}: the object store ignores If-None-Match: a conditional create replaced an existing "
                "object, so release claims and manifests would not be exclusive; use a server that enforces "
                "conditional writes (AWS S3, MinIO, SeaweedFS >= 3.8x)"
            )
        if not storage.is_s3(root):
            return "ok"
        _, etag = storage.read_tagged(probe)
        if storage.swap_if_unchanged(probe, b"third", '"0123456789abcdef0123456789abcdef"', existed=True):
            return (
                f"{root}: the object store ignores If-Match: a write under a wrong ETag replaced the object, so "
                "latest.json's compare-and-swap would not detect concurrent promotions"
            )
        if not storage.swap_if_unchanged(probe, b"fourth", etag, existed=True):
            return f"{root}: a write with a matching If-Match was refused; compare-and-swap cannot succeed"
        return "ok"
    finally:
        storage.delete(probe)


def check_secret(name: str) -> str:
    """``ok`` when the Secret exists in this pod's namespace; a reason otherwise.

    Outside a cluster (no service-account namespace file) there is nothing to check. With IRSA
    (``AWS_ROLE_ARN`` set) credentials come from the pod identity, not a Secret.
    """
    if not SERVICE_ACCOUNT_NAMESPACE.is_file():
        return "ok"
    if os.environ.get("AWS_ROLE_ARN"):
        return "ok"
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    config.load_incluster_config()
    namespace = SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    try:
        client.CoreV1Api().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        return f"Secret {namespace}/{name}: HTTP {exc.status} {exc.reason}"
    return "ok"


def s3_endpoint_hint() -> str:
    """A hint naming ``AWS_ENDPOINT_URL`` when the S3 client talks to AWS S3 because no endpoint is set; else ``""``."""
    try:
        endpoint = storage.s3_endpoint()
    except StorageError:  # an invalid endpoint: its own check says so
        return ""
    host = urlsplit(endpoint).hostname or ""
    if host != "amazonaws.com" and not host.endswith(".amazonaws.com"):
        return ""
    return (
        f"no S3 endpoint is configured, so {endpoint} (AWS S3) was used; for MinIO, SeaweedFS or another S3 "
        "server set AWS_ENDPOINT_URL (e.g. http://minio.kubeflow:9000)"
    )


def check_s3_endpoint() -> str:
    """``ok`` when a TCP connection to the S3 endpoint opens within :data:`S3_CONNECT_TIMEOUT_S`; a reason otherwise.

    Without this, an unreachable endpoint costs botocore's retries (about 40 s per call) before the first
    error. Behind a proxy (``HTTPS_PROXY`` and the like) the proxy makes the connection: nothing is checked.
    """
    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return "ok"
    endpoint = storage.s3_endpoint()
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=S3_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        return f"cannot connect to the S3 endpoint {endpoint}: {exc.strerror or exc}"
    return "ok"


def text_field_hint(exc: FieldMissingError) -> str:
    """``clean.text_field`` and the field the records most likely hold their text in."""
    guess = difflib.get_close_matches(exc.field, exc.fields, n=1, cutoff=0.6) or list(exc.text_fields[:1])
    if guess:
        return f"clean.text_field is {exc.field!r}: did you mean clean.text_field={guess[0]!r}?"
    return f"clean.text_field is {exc.field!r}: set it to the field that holds the text"


def check_corpus_sample(
    uri: str, clean: CleanConfig, sample_records: int = SAMPLE_RECORDS, texts: list[str] | None = None
) -> str:
    """``ok`` when the first ``sample_records`` documents read as ``clean`` reads them; a reason otherwise.

    The reader is the ``clean`` stage's, with its ``text_field``, ``max_bad_records`` and ``max_record_bytes``;
    of an ``s3://`` prefix only the first file is read. A corpus read to its end without one non-blank
    document fails. Given ``texts``, the first :data:`RETENTION_SAMPLE_RECORDS` documents' texts are appended.
    """
    reader = CorpusReader(
        first_file_uri(uri),
        text_field=clean.text_field,
        max_bad_records=clean.max_bad_records,
        max_record_bytes=clean.max_record_bytes,
    )
    seen = non_blank = 0
    try:
        with closing(iter(reader)) as documents:
            for document in documents:
                seen += 1
                non_blank += bool(document.text.strip())
                if texts is not None and len(texts) < RETENTION_SAMPLE_RECORDS:
                    texts.append(document.text)
                if seen >= sample_records:
                    return "ok"
    except FieldMissingError as exc:
        return f"{exc}; {text_field_hint(exc)}"
    if not seen:
        return f"{uri}: no documents (the corpus holds no records)"
    if not non_blank:
        return f"{uri}: all {seen} documents are blank"
    return "ok"


def check_qa_sample(uri: str, sample_records: int = SAMPLE_RECORDS) -> str:
    """``ok`` when the first ``sample_records`` lines are valid examples for ``finetune_lora``; a reason otherwise."""
    from lmforge.data.qa import load_examples  # imports transformers: only when a Q&A sample is read

    load_examples(uri, limit=sample_records)
    return "ok"


def resolve_stage_configs(
    preset: str, overrides: Mapping[str, str | dict[str, Any]]
) -> tuple[dict[str, StrictModel], list[str]]:
    """Every config section resolved from ``preset`` and its overrides, and the problems of those that do not.

    ``overrides`` maps a section name (``pretrain``) to its overrides (a JSON object string or a mapping), as the
    pipeline's ``<section>_overrides`` parameters give them.
    """
    names = sections()
    problems = [
        f"unknown config section {name!r}{did_you_mean(name, names)}; sections: {', '.join(names)}"
        for name in overrides
        if name not in names
    ]
    configs: dict[str, StrictModel] = {}
    for section in names:
        try:
            resolved = resolve_stage_config(section, preset, overrides.get(section))
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            if resolved is not None:
                configs[section] = resolved
    return configs, problems


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def run_checks(
    *,
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    s3_secret_name: str,
    launch: LaunchConfig | None = None,
    model_name: str = "",
    clean: CleanConfig | None = None,
    sample_records: int = SAMPLE_RECORDS,
    preset: str = "",
    stage_overrides: Mapping[str, str | dict[str, Any]] | None = None,
    base_model_uri: str = "",
    student_base_uri: str = "",
) -> PreflightReport:
    """Run every check, then fingerprint the inputs; raise :class:`PreflightError` listing all failures.

    With an input or the release root on S3, first check that the S3 endpoint answers; when it does not,
    the checks of the S3 locations are left out (each would wait for botocore's retries). With ``preset``,
    resolve every stage's config from it and ``stage_overrides`` (:func:`resolve_stage_configs`), so a bad value
    fails here and not when its stage starts; when they resolve, plan the training stages on the launch's accelerator
    (``report.plan``, check ``training_plan``). The corpus and the Q&A data are sampled (``sample_records``
    records each) with the stages' readers; the corpus reader takes its settings from ``clean``, else from the
    resolved clean config, else :class:`CleanConfig`'s defaults. With ``launch`` asking for more than one node,
    also check that the cluster serves its job kind. With ``model_name``, also fingerprint the production
    release of that name (``fingerprints["production"]``), the baseline ``evaluate`` compares against: from the
    source the resolved evaluate config names (``evaluate.production_source``: ``latest.json`` or the MLflow alias).
    With ``base_model_uri`` / ``student_base_uri``, check that the pipeline can start from each model
    (:func:`~lmforge.model.base.check_base_model`: architecture, weights, tokenizer; a multi-node launch needs it on
    S3), that the two share a tokenizer when both are given, and fingerprint each (``fingerprints["base_model"]``,
    ``fingerprints["student_base"]``).
    """
    report = PreflightReport()
    settings = _stage_settings(preset, stage_overrides or {}, clean, launch, report)
    clean, production_source, retention_warning, configs = settings
    if report.checks.get("stage_configs") == "ok":
        report.checks["training_plan"] = _one_line(_plan_training(report, configs, launch or LaunchConfig(), preset))
    checks = _Checks(report)
    report.checks["s3_secret"] = check_secret(s3_secret_name) if s3_secret_name else "ok"
    if launch is not None and launch.num_nodes > 1:
        report.checks["training_job_api"] = check_training_api(launch)
    bases = {name: uri for name, uri in (("base_model", base_model_uri), ("student_base", student_base_uri)) if uri}
    if any(storage.is_s3(uri) for uri in (corpus_uri, qa_uri, release_root, *bases.values())):
        checks.s3_reachable = checks.attempt("s3_endpoint", "s3://", check_s3_endpoint)
    _check_data(checks, corpus_uri, qa_uri, clean, sample_records, retention_warning)
    _check_bases(checks, bases, launch)
    if checks.reachable(release_root):
        _check_release_root(checks, release_root, model_name, production_source)
    for name, result in report.checks.items():
        log.info("preflight %s: %s", name, result)
    if report.failed:
        raise _failure(report, checks.s3_checks)
    return report


def _stage_settings(
    preset: str,
    stage_overrides: Mapping[str, str | dict[str, Any]],
    clean: CleanConfig | None,
    launch: LaunchConfig | None,
    report: PreflightReport,
) -> tuple[CleanConfig, str, float | None, dict[str, StrictModel]]:
    """``(clean config, production source, retention warning, resolved configs)``: the given clean config, else the
    preset's; with a ``preset``, every stage's config resolved (check ``stage_configs``, with each fsdp2 mesh against
    the launch's world size) and its evaluate settings."""
    production_source = "registry"
    retention_warning = GateConfig().retention_warning
    configs: dict[str, StrictModel] = {}
    if preset:
        configs, problems = resolve_stage_configs(preset, stage_overrides)
        problems += _mesh_problems(configs, launch)
        report.checks["stage_configs"] = "; ".join(problems) or "ok"
        resolved = configs.get("clean")
        if clean is None and isinstance(resolved, CleanConfig):
            clean = resolved
        production_source = getattr(configs.get("evaluate"), "production_source", production_source)
        evaluate_cfg = configs.get("evaluate")
        if isinstance(evaluate_cfg, EvaluateConfig):
            retention_warning = evaluate_cfg.gate.retention_warning
    return clean or CleanConfig(), production_source, retention_warning, configs


def _plan_training(
    report: PreflightReport, configs: Mapping[str, StrictModel], launch: LaunchConfig, preset: str
) -> str:
    """Plan every training stage on ``launch.accelerator`` into ``report.plan`` and log it; ``ok``, or why the plan
    does not fit."""
    from lmforge.plan import (  # imports torch, transformers and peft: only with a preset to plan
        TRAINING_STAGES,
        Accelerator,
        Utilization,
        plan_line,
        plan_record,
        plan_training,
        refuse_oversized,
    )
    from lmforge.tracking.measured import measured_mfu

    accelerator = Accelerator.named(launch.accelerator)
    measured = {
        stage: Utilization(mfu, f"run {run}") for stage, (mfu, run) in measured_mfu(preset, TRAINING_STAGES).items()
    }
    try:  # a setting only the stage's model reveals (a LoRA target it lacks) fails here too
        plans = plan_training(
            SimpleNamespace(**configs),
            vocab_size=configs["tokenize"].vocab_size,
            launch=launch,
            accelerator=accelerator,
            measured=measured,
        )
    except ConfigError as exc:
        return str(exc)
    report.plan = plan_record(plans, accelerator, preset=preset)
    for plan in plans:
        log.info("preflight plan %s", plan_line(plan, accelerator))
    try:
        refuse_oversized(plans, accelerator)
    except ConfigError as exc:
        return f"{exc}, or set launch.accelerator to a GPU with more memory (it is {accelerator.name})"
    return "ok"


def _mesh_problems(configs: Mapping[str, StrictModel], launch: LaunchConfig | None) -> list[str]:
    """Each training stage whose fsdp2 mesh does not multiply to the launch's world size (none without a launch)."""
    if launch is None:
        return []
    problems = []
    for name, cfg in configs.items():
        distributed = getattr(getattr(cfg, "train", None), "distributed", None)
        if distributed is None or distributed.backend != "fsdp2":
            continue
        try:
            distributed.mesh.degrees(world_size(launch))
        except ValueError as exc:
            problems.append(f"{name}.train.{exc}")
    return problems


@dataclass
class _Checks:
    """Runs checks into ``report``: each one's result, or the error it raised, under its name."""

    report: PreflightReport
    s3_reachable: bool = True
    s3_checks: set[str] = field(default_factory=set)
    """The checks of S3 locations (their failures may come from a missing endpoint setting)."""

    def attempt(self, name: str, where: str, check: Callable[[], str]) -> bool:
        """Run ``check`` of ``where`` as ``name``; whether it said ``ok``."""
        if storage.is_s3(where):
            self.s3_checks.add(name)
        try:
            result = check()
        except (LmforgeError, OSError) as exc:
            detail = str(exc)
            result = detail if where in detail else f"{where}: {detail}"
        self.report.checks[name] = _one_line(result)
        return result == "ok"

    def reachable(self, uri: str) -> bool:
        """Whether ``uri`` can be checked: it is not on S3, or the S3 endpoint answered."""
        return self.s3_reachable or not storage.is_s3(uri)


def _check_data(
    checks: _Checks,
    corpus_uri: str,
    qa_uri: str,
    clean: CleanConfig,
    sample_records: int,
    retention_warning: float | None,
) -> None:
    """Fingerprint the corpus and the Q&A data and read a sample of each with its stage's reader; predict what
    cleaning keeps of the corpus sample."""
    corpus_texts: list[str] = []
    samples = {
        "corpus": lambda: check_corpus_sample(corpus_uri, clean, sample_records, corpus_texts),
        "qa": lambda: check_qa_sample(qa_uri, sample_records),
    }
    for name, uri in (("corpus", corpus_uri), ("qa", qa_uri)):
        if not checks.reachable(uri):
            continue

        def fingerprint(uri: str = uri, name: str = name) -> str:
            checks.report.fingerprints[name] = fingerprint_uri(uri)
            return "ok"

        readable = checks.attempt(f"{name}_readable", uri, fingerprint)
        sampled = readable and checks.attempt(f"{name}_sample", uri, samples[name])
        if sampled and name == "corpus" and corpus_texts:
            _predict_retention(checks.report, corpus_texts, clean, retention_warning)


def _check_bases(checks: _Checks, bases: Mapping[str, str], launch: LaunchConfig | None) -> None:
    """Check (and fingerprint) the base model and the student base given; given both, that they share a tokenizer."""
    for name, uri in bases.items():
        if checks.reachable(uri):

            def check_base(uri: str = uri, name: str = name) -> str:
                return _check_base(name, uri, launch, checks.report)

            checks.attempt(name, uri, check_base)
    report = checks.report
    if len(bases) == 2 and report.checks.get("base_model") == report.checks.get("student_base") == "ok":
        from lmforge.model.base import same_tokenizer

        base, student = bases["base_model"], bases["student_base"]
        checks.attempt("student_base_tokenizer", student, lambda: same_tokenizer(base, student))


def _check_release_root(checks: _Checks, release_root: str, model_name: str, production_source: str) -> None:
    """Check that the release root is writable and honours conditional writes; with ``model_name``, fingerprint its
    production release."""
    if checks.attempt("release_root_writable", release_root, lambda: check_writable(release_root) or "ok"):
        checks.attempt("release_root_conditional_writes", release_root, lambda: check_conditional_writes(release_root))
    if not model_name:
        return

    def production() -> str:
        checks.report.fingerprints["production"] = catalog.production_fingerprint(
            release_root, model_name, production_source
        )
        return "ok"

    where = f"MLflow alias production of {model_name}" if production_source == "mlflow" else None
    checks.attempt("production_release_readable", where or f"{release_root} ({model_name})", production)


def _failure(report: PreflightReport, s3_checks: set[str]) -> PreflightError:
    """The error listing every failed check, with the S3 endpoint hint when an S3 check failed."""
    message = "preflight failed: " + "; ".join(f"{k}: {v}" for k, v in report.failed.items())
    if s3_checks & set(report.failed) and (hint := s3_endpoint_hint()):
        message += f"; hint: {hint}"
    return PreflightError(message)


def _predict_retention(report: PreflightReport, texts: list[str], clean: CleanConfig, warning: float | None) -> None:
    """Record what cleaning is predicted to keep of the sample; below ``warning``, warn with the advice."""
    from lmforge.data.retention import advice  # imports the rules (and lingua on use): only with a sample

    predicted, message = advice(texts, clean, warning if warning is not None else 0.0)
    report.predicted_retention = predicted.fraction
    log.info("preflight predicted retention: clean.profile=%s %s", clean.profile, predicted.summary())
    if message:
        report.warnings.append(message)
        log.warning("preflight: %s", message)


def _check_base(name: str, uri: str, launch: LaunchConfig | None, report: PreflightReport) -> str:
    """``ok`` when the pipeline can start from the model at ``uri`` (then fingerprinted), else the reason."""
    from lmforge.model.base import check_base_model  # imports transformers: only when a base model is given

    if launch is not None and launch.num_nodes > 1 and not storage.is_s3(uri):
        return (
            f"{uri}: launch.num_nodes={launch.num_nodes} runs the training steps as a job whose pods read the "
            f"{name.replace('_', ' ')} themselves; it must be an s3:// URI, not a path of this pod"
        )
    verdict = check_base_model(uri)
    if verdict == "ok":
        report.fingerprints[name] = fingerprint_uri(uri)
    return verdict


def run(
    *,
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    s3_secret_name: str = "lmforge-s3",
    launch: str = "{}",
    gpu_count: int = 1,
    model_name: str = "",
    preset: str = "tiny-cpu",
    base_model_uri: str = "",
    student_base_uri: str = "",
    staging_uri: str = "",
    **section_overrides: str,
) -> StageResult:
    """The ``preflight`` stage: :func:`run_checks`, with the values the later steps take from it.

    ``launch`` is read as the training steps read it, ``gpu_count`` filling in ``gpus_per_node``.

    ``section_overrides`` are the pipeline's ``<section>_overrides`` parameters: with ``preset`` they resolve
    every stage's config here, so a bad override fails before the first stage starts.

    Its summary holds ``corpus_fingerprint``, ``qa_fingerprint``, ``production_fingerprint`` (cache keys),
    ``gpu_limit`` (``gpu_count`` as the string the KFP backend needs for an accelerator limit) and the
    resolved ``model_name`` (the given one, else derived from the corpus by
    :func:`~lmforge.naming.default_model_name`: ``lmforge-demo`` for the demo corpus), the base model's and the
    student base's fingerprints (empty without one) and ``run_root``: ``staging_uri`` when given, else
    ``release_root`` (where the training steps' templated ``checkpoint.dir`` puts checkpoints), and ``plan``: the
    training plan as JSON (:func:`lmforge.plan.plan_record`; empty without a preset), also in the metrics as
    ``plan_<stage>_<figure>``.

    Raises:
        ConfigError: ``gpu_count`` below 0 or an invalid ``launch`` config.
        PreflightError: one or more checks failed; the message lists each.
    """
    if gpu_count < 0:
        raise ConfigError(f"gpu_count: must be at least 0, got {gpu_count}")
    name = model_name or default_model_name(corpus_uri)
    report = run_checks(
        corpus_uri=corpus_uri,
        qa_uri=qa_uri,
        release_root=release_root,
        s3_secret_name=s3_secret_name,
        launch=parse_launch(launch, gpus_per_node=gpu_count),
        model_name=name,
        preset=preset,
        stage_overrides={key.removesuffix("_overrides"): value for key, value in section_overrides.items()},
        base_model_uri=base_model_uri,
        student_base_uri=student_base_uri,
    )
    fp = report.fingerprints
    summary = {
        "corpus_fingerprint": fp["corpus"],
        "qa_fingerprint": fp["qa"],
        "production_fingerprint": fp["production"],
        "gpu_limit": str(gpu_count),
        "model_name": name,
        "base_model_fingerprint": fp.get("base_model", ""),
        "student_base_fingerprint": fp.get("student_base", ""),
        "run_root": staging_uri or release_root,
        "plan": json.dumps(report.plan) if report.plan is not None else "",
        "checks": report.checks,
        "warnings": report.warnings,
        "retention_warning": report.warnings[0] if report.warnings else None,
    }
    metrics = {"checks_passed": float(len(report.checks))} | plan_metrics(report.plan)
    if report.predicted_retention is not None:
        metrics["predicted_retention"] = report.predicted_retention
    return StageResult(metrics=metrics, summary=summary)


PLAN_FIGURES = ("tokens", "flops", "memory_gb_per_gpu", "hours", "gpu_hours", "mfu")


def plan_metrics(plan: Mapping[str, Any] | None) -> dict[str, float]:
    """``plan_<stage>_<figure>`` of every :data:`PLAN_FIGURES` figure of every planned stage (none without a plan)."""
    stages = (plan or {}).get("stages", [])
    return {f"plan_{stage['stage']}_{figure}": float(stage[figure]) for stage in stages for figure in PLAN_FIGURES}
