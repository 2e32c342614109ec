"""KFP component: fail fast before any GPU step, and fingerprint the input data."""

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
) -> NamedTuple("PreflightOutputs", [("corpus_fingerprint", str), ("qa_fingerprint", str)]):
    """Check inputs are readable, the registry writable and the S3 Secret present; fingerprint the data.

    Args:
        corpus_uri: Raw corpus URI (local, ``s3://`` or ``demo://``).
        qa_uri: Q&A JSONL URI (local, ``s3://`` or ``demo://``).
        release_root: Registry root that ``promote`` will write to; a probe object is written and deleted.
        s3_secret_name: Secret holding the S3 credentials (checked only inside a cluster; skipped with IRSA).
        launch: The training steps' LaunchConfig JSON: validated here (a bad field fails before any GPU step),
            and with num_nodes > 1 the cluster must serve its job kind (TrainJob or PyTorchJob).

    Returns:
        corpus_fingerprint and qa_fingerprint: sha256 of the data's content, fed to downstream cache keys.
    """
    from collections import namedtuple

    from lmforge.component_io import setup_logging
    from lmforge.launch import parse_launch
    from lmforge.preflight import run_checks

    setup_logging()
    report = run_checks(
        corpus_uri=corpus_uri,
        qa_uri=qa_uri,
        release_root=release_root,
        s3_secret_name=s3_secret_name,
        launch=parse_launch(launch),
    )
    outputs = namedtuple("PreflightOutputs", ["corpus_fingerprint", "qa_fingerprint"])
    return outputs(report.fingerprints["corpus"], report.fingerprints["qa"])
