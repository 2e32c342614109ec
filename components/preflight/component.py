"""KFP component: fail fast before any GPU step, and fingerprint the input data and the production release."""

from typing import NamedTuple

from kfp import dsl

from components.images import image_for


@dsl.component(base_image=image_for("preflight"), install_kfp_package=False)
def preflight(
    corpus_uri: str,
    qa_uri: str,
    release_root: str,
    s3_secret_name: str = "lmforge-s3",
    launch: str = "{}",
    gpu_count: int = 1,
    preset: str = "tiny-cpu",
    promote_overrides: str = "{}",
) -> NamedTuple(
    "PreflightOutputs",
    [("corpus_fingerprint", str), ("qa_fingerprint", str), ("production_fingerprint", str), ("gpu_limit", str)],
):
    """Check inputs are readable, the registry writable and the S3 Secret present; fingerprint data and baseline.

    Args:
        corpus_uri: Raw corpus URI (local, ``s3://`` or ``demo://``).
        qa_uri: Q&A JSONL URI (local, ``s3://`` or ``demo://``).
        release_root: Registry root that ``promote`` will write to; a probe object is written and deleted.
        s3_secret_name: Secret holding the S3 credentials (checked only inside a cluster; skipped with IRSA).
        launch: The training steps' LaunchConfig JSON: validated here (a bad field fails before any GPU step),
            and with num_nodes > 1 the cluster must serve its job kind (TrainJob or PyTorchJob).
        gpu_count: GPUs per GPU-stage pod (at least 0); returned as the string ``gpu_limit``.
        preset: lmforge preset; with ``promote_overrides`` it names the release the gate compares against.
        promote_overrides: The promote stage's overrides (its ``model_name`` names the production release).

    Returns:
        corpus_fingerprint, qa_fingerprint: sha256 of the data's content, fed to downstream cache keys.
        production_fingerprint: sha256 of the production release the gate compares against (evaluate's cache key).
        gpu_limit: ``gpu_count`` as a string: the KFP backend's driver reads an accelerator limit only from a
            string parameter (an integer one is dropped), so the GPU steps take their limit from here.
    """
    from collections import namedtuple

    from lmforge.component_io import setup_logging
    from lmforge.config import resolve_stage_config
    from lmforge.errors import ConfigError
    from lmforge.launch import parse_launch
    from lmforge.preflight import run_checks

    setup_logging()
    if gpu_count < 0:
        raise ConfigError(f"gpu_count: must be at least 0, got {gpu_count}")
    report = run_checks(
        corpus_uri=corpus_uri,
        qa_uri=qa_uri,
        release_root=release_root,
        s3_secret_name=s3_secret_name,
        launch=parse_launch(launch),
        model_name=resolve_stage_config("promote", preset, promote_overrides).model_name,
    )
    outputs = namedtuple(
        "PreflightOutputs", ["corpus_fingerprint", "qa_fingerprint", "production_fingerprint", "gpu_limit"]
    )
    fp = report.fingerprints
    return outputs(fp["corpus"], fp["qa"], fp["production"], str(gpu_count))
