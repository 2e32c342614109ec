"""``lmforge registry gc``: what interrupted promotions and publishes left under a release root or a staging
prefix, removed once it is old enough that no writer can still be at work."""

from __future__ import annotations

import logging
import shutil
import time

from lmforge import storage
from lmforge.artifacts import MANIFEST, PUBLISH_CLAIM
from lmforge.release.catalog import (
    CLAIM,
    parse_json_object,
)

# promote's logger: the clean-up of what a promotion left is reported under the same name
log = logging.getLogger("lmforge.promote")


def collect_garbage(
    root: str, *, older_than_s: float, dry_run: bool = False, now: float | None = None
) -> dict[str, list[str]]:
    """Clean what interrupted writers left under ``root`` (a release root or a staging prefix).

    * a promotion's claim (``models/<name>/<version>/.promotion.json``) without a release manifest, older
      than ``older_than_s``: everything under that version is deleted, the claim last, so the version
      can be promoted again;
    * a publisher's claim (``.publishing.json``) without the artifact's manifest, older than that: the
      claim and the files beside it are deleted, so the prefix can be published again;
    * on S3, multipart uploads under ``root`` started longer ago than that are aborted (their parts are
      otherwise stored, and billed, forever; a bucket lifecycle rule does the same: docs/security.md).

    A claim younger than ``older_than_s`` may belong to a promotion that is still copying and is left
    alone. Returns ``{"releases": [...], "artifacts": [...], "uploads": [...]}`` (what was, or with
    ``dry_run`` would be, removed).
    """
    import datetime

    cutoff = (time.time() if now is None else now) - older_than_s
    done: dict[str, list[str]] = {"releases": [], "artifacts": [], "uploads": []}
    names = set(storage.list_files(root)) if storage.exists(root) else set()
    for name in sorted(names):
        folder, _, leaf = name.rpartition("/")
        if leaf not in (CLAIM, PUBLISH_CLAIM) or f"{folder}/{MANIFEST}".lstrip("/") in names:
            continue
        claim_uri = storage.join(root, name)
        claimed_at = (parse_json_object(storage.read_bytes(claim_uri), claim_uri) or {}).get("claimed_at")
        try:
            stamp = datetime.datetime.fromisoformat(str(claimed_at)).timestamp()
        except ValueError:
            log.warning("%s: claimed_at %r is not a time; left alone", claim_uri, claimed_at)
            continue
        if stamp > cutoff:
            continue
        folder_uri = storage.join(root, folder) if folder else root
        done["releases" if leaf == CLAIM else "artifacts"].append(folder_uri)
        if dry_run:
            continue
        inside = sorted(n for n in names if n != name and (not folder or n.startswith(f"{folder}/")))
        for other in inside:
            storage.delete(storage.join(root, other))
        storage.delete(claim_uri)
        if not storage.is_s3(root) and folder:
            shutil.rmtree(folder_uri, ignore_errors=True)  # the empty directories left behind
        log.info(
            "removed the stale claim %s (claimed at %s) and %d files beside it", claim_uri, claimed_at, len(inside)
        )
    if storage.is_s3(root):
        done["uploads"] = _abort_uploads(root, cutoff, dry_run)
    return done


def _abort_uploads(root: str, cutoff: float, dry_run: bool) -> list[str]:
    """Abort the multipart uploads under ``root`` started before ``cutoff``; their ``s3://`` keys."""
    bucket, key = storage.split_s3(root)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    client = storage.s3_client()
    pages = storage._s3_call(
        "list multipart uploads",
        root,
        lambda: list(client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix)),
    )
    aborted = []
    for page in pages:
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() > cutoff:
                continue
            uri = f"{storage.S3_SCHEME}{bucket}/{upload['Key']}"
            aborted.append(uri)
            if not dry_run:
                storage._s3_call(
                    "abort multipart upload",
                    uri,
                    client.abort_multipart_upload,
                    Bucket=bucket,
                    Key=upload["Key"],
                    UploadId=upload["UploadId"],
                )
                log.info("aborted the incomplete multipart upload of %s (started %s)", uri, upload["Initiated"])
    return aborted
