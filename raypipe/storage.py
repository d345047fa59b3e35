"""Object storage and local folders behind one interface: pyarrow filesystems.

`s3://bucket/prefix` URIs (any S3-compatible store) open a pyarrow `S3FileSystem` configured from
`S3Options`, else from the standard AWS environment variables: `AWS_ENDPOINT_URL_S3` /
`AWS_ENDPOINT_URL`, `AWS_REGION` / `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY`. Anything else is a local path. pyarrow rather than s3fs/boto3: Ray Data
already depends on it, and its S3 client runs in every Ray worker without extra set-up.

`write_atomic` is the primitive that batch resume relies on: a reader sees either the whole file or
no file. Locally that is write-to-temporary-then-rename; on S3 an object only becomes visible when
its upload completes.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import urllib.parse

import pyarrow.fs as pafs


@dataclasses.dataclass(frozen=True, slots=True)
class S3Options:
    endpoint_url: str | None = None  # e.g. http://127.0.0.1:9000; None: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL
    region: str | None = None  # None: AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
    access_key: str | None = None  # None: the AWS credential chain (environment, profile, instance role)
    secret_key: str | None = None


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def open_filesystem(uri: str, options: S3Options | None = None) -> tuple[pafs.FileSystem, str]:
    """`(filesystem, path inside it)` for a URI; the path has no trailing slash."""
    uri = os.fspath(uri)
    if not is_s3(uri):
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    options = options or S3Options()
    kwargs = {"region": options.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
              or "us-east-1"}
    endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parts = urllib.parse.urlsplit(endpoint)
        kwargs["endpoint_override"] = parts.netloc or parts.path
        kwargs["scheme"] = parts.scheme or "https"
    if options.access_key:
        kwargs.update(access_key=options.access_key, secret_key=options.secret_key)
    return pafs.S3FileSystem(**kwargs), uri[len("s3://"):].rstrip("/")


def join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def list_files(fs: pafs.FileSystem, root: str, *, recursive: bool = True) -> list[pafs.FileInfo]:
    """Files (not folders, not zero-byte directory markers ending in '/') under `root`, sorted by path."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=recursive, allow_not_found=True))
    except FileNotFoundError:
        return []
    return sorted((i for i in infos if i.type == pafs.FileType.File and not i.path.endswith("/")),
                  key=lambda i: i.path)


def read_bytes(fs: pafs.FileSystem, path: str, max_bytes: int | None = None) -> bytes:
    """The object's bytes; at most `max_bytes + 1` of them, so a caller can refuse an oversized one."""
    with fs.open_input_stream(path) as stream:
        return stream.read(max_bytes + 1) if max_bytes is not None else stream.read()


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write `data` so that readers see the whole file or none of it."""
    if isinstance(fs, pafs.LocalFileSystem):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; output files are ordinary files
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    with fs.open_output_stream(path) as out:  # S3: the object appears when the upload completes
        out.write(data)


def uri_of(fs: pafs.FileSystem, path: str) -> str:
    """The URI a user would write for `path` on `fs`."""
    return f"s3://{path}" if isinstance(fs, pafs.S3FileSystem) else path
