"""One small API over local paths and ``s3://bucket/key`` URIs.

S3 goes through boto3. The endpoint comes from ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), which
boto3 reads itself; credentials come from the standard AWS chain. Retries on throttling, 5xx and
connection errors are botocore's (``standard`` mode), large files go up as multipart uploads
(boto3's transfer manager).

Writes are never visible half-done: a local file is written to a temporary name and renamed; an S3
object is created by a single PUT or a completed multipart upload. A *prefix* (directory) counts as
complete only once its ``manifest.json`` is written, last (see :mod:`lmforge.artifacts`). A local write
that fails (disk full, permission) raises :class:`StorageError` naming the path and leaves no temporary file.

Names that come from outside (S3 keys in a listing, file names in a manifest) are mapped to local paths only
through :func:`safe_join`, which refuses any name that could land outside its root; listings refuse such keys,
and local directories are listed without following symbolic links (:func:`local_files`).
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from lmforge.errors import StorageError, UnsafePathError

S3_SCHEME = "s3://"


def is_s3(uri: str | os.PathLike[str]) -> bool:
    """True for ``s3://`` URIs."""
    return str(uri).startswith(S3_SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    if not is_s3(uri):
        raise StorageError(f"not an s3:// URI: {uri}")
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"s3 URI has no bucket: {uri}")
    return bucket, key


def join(base: str, *parts: str) -> str:
    """Join path segments onto a local path or an S3 URI."""
    if is_s3(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(base, *parts))


def _name_problem(name: str) -> str | None:
    if not name:
        return "empty name"
    if name.startswith("/"):
        return "absolute path"
    if "\\" in name:
        return "backslash in name"
    if "\0" in name:
        return "NUL byte in name"
    for segment in name.split("/"):
        if segment == "":
            return "empty path segment ('//' or a trailing '/')"
        if segment in (".", ".."):
            return f"'{segment}' path segment"
    return None


def check_name(name: str, where: str) -> str:
    """``name`` when it is a plain relative POSIX path, else :class:`UnsafePathError` naming it and ``where``.

    Refused: empty names, absolute names, backslashes, NUL bytes, and empty, ``.`` or ``..`` segments: each could
    make ``root / name`` land outside ``root`` (AWS S3 keeps ``//`` and ``..`` in keys as they are).
    """
    problem = _name_problem(name)
    if problem is not None:
        raise UnsafePathError(f"{where}: refusing file name {name!r}: {problem}")
    return name


def safe_join(root: str | os.PathLike[str], name: str, *, where: str) -> Path:
    """``root / name`` for a name that came from outside (an S3 key, a manifest), checked to stay inside ``root``.

    Args:
        where: The URI or file the name came from, for the error message.

    Raises:
        UnsafePathError: ``name`` is not a plain relative path (:func:`check_name`), or it resolves outside
            ``root`` through a symbolic link already there.
    """
    check_name(name, where)
    path = Path(root, name)
    if not path.resolve().is_relative_to(Path(root).resolve()):
        raise UnsafePathError(f"{where}: refusing file name {name!r}: it resolves outside {root}")
    return path


def local_files(root: str | os.PathLike[str]) -> list[str]:
    """Relative POSIX paths of the regular files below ``root``, sorted; symbolic links are refused, not followed.

    An artifact, a model folder or a corpus folder holds regular files only: following a link such as
    ``merges.txt -> /etc/secret`` would publish, load or train on whatever it points to.

    Raises:
        UnsafePathError: a symbolic link below ``root``, named with its target.
    """
    root = Path(root)
    names = []
    for dirpath, dirnames, filenames in os.walk(root):  # never follows links to directories
        for entry in (*dirnames, *filenames):
            path = Path(dirpath, entry)
            if path.is_symlink():
                raise UnsafePathError(
                    f"{root}: {path.relative_to(root).as_posix()} is a symbolic link (to {os.readlink(path)}); "
                    "lmforge reads only regular files inside the folder it is given, copy the file in instead"
                )
        names.extend(Path(dirpath, f).relative_to(root).as_posix() for f in filenames if Path(dirpath, f).is_file())
    return sorted(names)


def write_error(path: str | os.PathLike[str], exc: OSError) -> StorageError:
    """The one-line error for a failed local write (disk full, quota, permission), naming ``path``."""
    return StorageError(f"cannot write {path}: {exc.strerror or exc}")


_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""What only a write fails with: a full disk, a quota, a file too large, a read-only file system."""


def copy_error(source: str | os.PathLike[str], dest: str | os.PathLike[str], exc: OSError) -> StorageError:
    """The one-line error for a failed local copy: ``cannot read <source>`` or ``cannot write <dest>``.

    ``shutil.copyfile`` copies with ``sendfile`` and then sets ``filename`` to the *source* whatever failed
    (a full destination disk included), so a write errno names the destination whatever ``filename`` says.
    """
    if exc.errno not in _WRITE_ERRNOS and exc.filename is not None and Path(exc.filename) == Path(source):
        return StorageError(f"cannot read {source}: {exc.strerror or exc}")
    return write_error(dest, exc)


@functools.cache
def s3_client():  # -> botocore client; untyped to keep boto3 stubs optional
    """A cached boto3 S3 client with botocore's standard retry mode."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"max_attempts": int(os.environ.get("LMFORGE_S3_MAX_ATTEMPTS", "8")), "mode": "standard"},
        connect_timeout=10,
        read_timeout=120,
        s3={"addressing_style": "path"},
    )
    try:
        return boto3.client("s3", config=config)
    except ValueError as exc:  # botocore: "Invalid endpoint: minio:9000"
        raise StorageError(f"S3 client: {exc}; AWS_ENDPOINT_URL must be a URL such as http://minio:9000") from exc


def s3_endpoint() -> str:
    """The endpoint URL the S3 client talks to: ``AWS_ENDPOINT_URL``'s, the AWS config's, or AWS S3's own."""
    return s3_client().meta.endpoint_url


def _s3_call(what: str, uri: str, fn, *args, **kwargs):
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "?")
        raise StorageError(f"{what} {uri}: S3 error {code}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"{what} {uri}: {exc}") from exc


def exists(uri: str) -> bool:
    """True when ``uri`` names an existing file/object or a non-empty directory/prefix."""
    if not is_s3(uri):
        return Path(uri).exists()
    if is_file(uri):
        return True
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    resp = _s3_call("list", uri, s3_client().list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=1)
    return resp.get("KeyCount", 0) > 0


def is_file(uri: str) -> bool:
    """True when ``uri`` is an existing file or a single S3 object (not a prefix)."""
    if not is_s3(uri):
        return Path(uri).is_file()
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3(uri)
    if not key or key.endswith("/"):
        return False
    try:
        s3_client().head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise StorageError(f"head {uri}: {exc}") from exc
    except BotoCoreError as exc:  # no credentials, endpoint unreachable
        raise StorageError(f"head {uri}: {exc}") from exc
    return True


def s3_etag(uri: str) -> tuple[str, int]:
    """``(ETag, size)`` of one S3 object, without downloading it."""
    bucket, key = split_s3(uri)
    head = _s3_call("head", uri, s3_client().head_object, Bucket=bucket, Key=key)
    return head["ETag"], int(head["ContentLength"])


def delete(uri: str) -> None:
    """Remove one file or object (missing is fine)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _s3_call("delete", uri, s3_client().delete_object, Bucket=bucket, Key=key)
    else:
        Path(uri).unlink(missing_ok=True)


def list_files(uri: str) -> list[str]:
    """All files below a directory or prefix (recursively), as relative POSIX paths, sorted."""
    if not is_s3(uri):
        root = Path(uri)
        if root.is_file():
            return [root.name]
        if not root.is_dir():
            raise StorageError(f"no such file or directory: {uri}")
        return local_files(root)
    bucket, key = split_s3(uri)
    prefix = key.rstrip("/") + "/" if key else ""
    paginator = s3_client().get_paginator("list_objects_v2")
    names: list[str] = []
    for page in _s3_call("list", uri, lambda: list(paginator.paginate(Bucket=bucket, Prefix=prefix))):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            if not name or (name.endswith("/") and not obj.get("Size")):
                continue  # the prefix itself, or an empty "folder" marker object
            names.append(check_name(name, f"listing {uri}"))
    return sorted(names)


def read_bytes(uri: str) -> bytes:
    """Whole content of a file or object."""
    if not is_s3(uri):
        try:
            return Path(uri).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read {uri}: {exc.strerror}") from exc
    bucket, key = split_s3(uri)
    resp = _s3_call("get", uri, s3_client().get_object, Bucket=bucket, Key=key)
    return resp["Body"].read()


def open_read(uri: str) -> IO[bytes]:
    """A binary stream over a file or object (streamed, not loaded whole)."""
    if not is_s3(uri):
        try:
            return open(uri, "rb")
        except OSError as exc:
            raise StorageError(f"cannot open {uri}: {exc.strerror}") from exc
    bucket, key = split_s3(uri)
    return _s3_call("get", uri, s3_client().get_object, Bucket=bucket, Key=key)["Body"]


def _durable_temp(path: Path, data: bytes) -> Path:
    """``data`` in a fsynced, world-readable temporary file beside ``path`` (the caller renames or links it)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise write_error(path, exc) from exc
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; artifacts are read by other users and containers
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise write_error(path, exc) from exc
        raise
    return Path(tmp)


def write_bytes(uri: str, data: bytes) -> None:
    """Write a file or object atomically (temp name + rename locally; one PUT on S3)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _s3_call("put", uri, s3_client().put_object, Bucket=bucket, Key=key, Body=data)
        return
    tmp = _durable_temp(Path(uri), data)
    try:
        os.replace(tmp, uri)
    except OSError as exc:
        raise write_error(uri, exc) from exc
    finally:
        tmp.unlink(missing_ok=True)


_PRECONDITION_CODES = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


def is_precondition_failure(exc: Exception) -> bool:
    """True for an S3 answer that a conditional write's precondition (If-None-Match / If-Match) failed."""
    from botocore.exceptions import ClientError

    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") in _PRECONDITION_CODES


def _put_s3_if(uri: str, data: bytes, **condition: str | None) -> bool:
    """``PUT`` under an S3 precondition (``IfNoneMatch`` or ``IfMatch``); False when the server refused it."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3(uri)
    try:
        s3_client().put_object(Bucket=bucket, Key=key, Body=data, **condition)
    except ClientError as exc:
        if is_precondition_failure(exc):
            return False
        raise StorageError(f"conditional put {uri}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"conditional put {uri}: {exc}") from exc
    return True


def create_if_absent(uri: str, data: bytes) -> bool:
    """Create ``uri`` with ``data`` unless it exists; True when this call created it.

    S3: ``PUT`` with ``If-None-Match: *`` (the server decides atomically). Local: the data goes to a
    temporary file that is hard-linked to the name, which fails atomically if the name exists.
    """
    if is_s3(uri):
        return _put_s3_if(uri, data, IfNoneMatch="*")
    tmp = _durable_temp(Path(uri), data)
    try:
        os.link(tmp, uri)
    except FileExistsError:
        return False
    except OSError as exc:
        raise write_error(uri, exc) from exc
    finally:
        tmp.unlink(missing_ok=True)
    return True


def upload_file(local: str | Path, uri: str) -> None:
    """Copy one local file to ``uri`` (multipart on S3 above boto3's threshold)."""
    if is_s3(uri):
        bucket, key = split_s3(uri)
        _s3_call("upload", uri, s3_client().upload_file, str(local), bucket, key)
        return
    dest = Path(uri)
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, tmp)
        os.replace(tmp, dest)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise copy_error(local, dest, exc) from exc


def download_file(uri: str, local: str | Path) -> Path:
    """Copy one file or object to a local path; returns that path."""
    local = Path(local)
    tmp = local.with_name(f".{local.name}.tmp")
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
        if is_s3(uri):
            bucket, key = split_s3(uri)
            _s3_call("download", uri, s3_client().download_file, bucket, key, str(tmp))
            os.replace(tmp, local)
        else:
            shutil.copyfile(uri, local)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if is_s3(uri):
            raise write_error(local, exc) from exc
        raise copy_error(uri, local, exc) from exc
    return local


def copy_tree(src: str, dst: str, *, last: tuple[str, ...] = ("manifest.json",)) -> list[str]:
    """Copy every file under ``src`` to ``dst`` (local or S3 either side); files named in ``last`` go last.

    Writing the manifest last means a reader that sees it sees a complete copy.
    Returns the relative paths copied.
    """
    names = list_files(src)  # S3 keys checked, local links refused
    ordered = [n for n in names if n not in last] + [n for n in names if n in last]
    with tempfile.TemporaryDirectory(prefix="lmforge-copy-") as scratch:
        for name in ordered:
            source = join(src, name)
            if is_s3(source):
                source = str(download_file(source, safe_join(scratch, name, where=src)))
            upload_file(source, join(dst, name) if is_s3(dst) else str(safe_join(dst, name, where=src)))
    return ordered


def localize(uri: str, workdir: str | Path) -> Path:
    """A local path holding ``uri``'s content: the path itself if local, else a download into ``workdir``."""
    if not is_s3(uri):
        if not Path(uri).exists():
            raise StorageError(f"no such file or directory: {uri}")
        return Path(uri)
    bucket, key = split_s3(uri)
    target = safe_join(workdir, "/".join(p for p in (bucket, key.rstrip("/")) if p), where=uri)
    if is_file(uri):
        return download_file(uri, target)
    names = list_files(uri)  # every key checked
    if not names:
        raise StorageError(f"no such object or prefix: {uri}")
    for name in names:
        download_file(join(uri, name), safe_join(target, name, where=uri))
    return target


def iter_lines(uri: str) -> Iterator[bytes]:
    """Stream the raw lines of a file or object (newline kept)."""
    stream = open_read(uri)
    try:
        yield from stream.iter_lines(keepends=True) if is_s3(uri) else stream
    finally:
        stream.close()


def read_tagged(uri: str) -> tuple[bytes | None, str | None]:
    """Content and S3 ETag of ``uri`` (``(None, None)`` when absent; the tag is ``None`` locally)."""
    if not is_s3(uri):
        path = Path(uri)
        return (path.read_bytes(), None) if path.is_file() else (None, None)
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = split_s3(uri)
    try:
        resp = s3_client().get_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
            return None, None
        raise StorageError(f"get {uri}: {exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"get {uri}: {exc}") from exc
    return resp["Body"].read(), resp["ETag"]


def swap_if_unchanged(uri: str, data: bytes, etag: str | None, existed: bool) -> bool:
    """Write ``uri`` only if it is unchanged since read (S3 ``If-Match`` / ``If-None-Match``)."""
    if not is_s3(uri):
        write_bytes(uri, data)  # the caller holds the local lock
        return True
    if not existed:
        return create_if_absent(uri, data)
    return _put_s3_if(uri, data, IfMatch=etag)
