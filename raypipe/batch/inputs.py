"""What a batch job processes: every image and video file under a prefix, or the rows of a manifest.

The result is one Arrow table with `id` (stable across runs: the resume key), `uri` (where to read
the bytes) and, from a manifest's columns, `prompt` and `lora` (the adapter a row is generated with).
Listing ids are paths relative to the input prefix, so the same files listed again give the same ids. Manifest paths may be URIs (`s3://...`),
absolute local paths, or paths relative to the manifest's folder.
"""

from __future__ import annotations

import os
import posixpath

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.json as pajson
import pyarrow.parquet as pq

from raypipe.errors import InvalidInput
from raypipe.storage import S3Options, is_s3, list_files, open_filesystem, uri_of

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")
MANIFEST_EXTENSIONS = (".parquet", ".jsonl", ".json")


def is_manifest(uri: str) -> bool:
    return uri.lower().endswith(MANIFEST_EXTENSIONS)


def list_inputs(uri: str, s3: S3Options | None = None, *, path_column: str = "path", id_column: str = "id",
                prompt_column: str | None = None, lora_column: str | None = None) -> pa.Table:
    """`(id, uri[, prompt][, lora])` for every input, sorted by id, ids unique: a manifest's `prompt_column` and
    `lora_column` (an empty or missing value is None) become `prompt` and `lora`."""
    texts = {name: column for name, column in (("prompt", prompt_column), ("lora", lora_column)) if column}
    if texts and not is_manifest(uri):  # a folder has no columns: every row would silently take the defaults
        raise InvalidInput(f"{' and '.join(f'{n}_column' for n in texts)} name columns of a manifest "
                           f"({', '.join(MANIFEST_EXTENSIONS)}); {uri!r} is a folder or prefix", item="input",
                           code="missing_column")
    table = _read_manifest(uri, s3, path_column, id_column, texts) if is_manifest(uri) else _list_visuals(uri, s3)
    ids = table.column("id")
    if len(ids) != len(set(ids.to_pylist())):
        raise InvalidInput(f"input ids are not unique in {uri!r}; give the manifest a unique {id_column!r} column",
                           item="input", code="duplicate_ids")
    return table.sort_by("id")


def kind_of(uri: str) -> str:
    """A row's kind of visual item, by its file extension (anything else is read as an image)."""
    return "video" if uri.lower().endswith(VIDEO_EXTENSIONS) else "image"


def _list_visuals(uri: str, s3: S3Options | None) -> pa.Table:
    fs, root = open_filesystem(uri, s3)
    where = uri_of(fs, root)
    listed = list_files(fs, root)
    if not listed and fs.get_file_info(root).type == pafs.FileType.NotFound:
        raise InvalidInput(f"{where} does not exist" + (" (no such bucket or prefix)" if is_s3(uri) else ""),
                           item="input", code="input_not_found")
    files = [info for info in listed if info.path.lower().endswith(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)]
    if not files:
        raise InvalidInput(f"no image or video files under {where} (looked for {', '.join(IMAGE_EXTENSIONS + VIDEO_EXTENSIONS)})",
                           item="input", code="input_not_found")
    ids = [info.path[len(root) + 1:] for info in files]
    return pa.table({"id": pa.array(ids, pa.string()), "uri": pa.array([uri_of(fs, i.path) for i in files], pa.string())})


def _read_manifest(uri: str, s3, path_column: str, id_column: str, texts: dict[str, str]) -> pa.Table:
    fs, path = open_filesystem(uri, s3)
    if path.lower().endswith(".parquet"):
        table = pq.read_table(path, filesystem=fs)
    else:
        with fs.open_input_stream(path) as stream:
            table = pajson.read_json(stream)
    missing = [c for c in (path_column, *texts.values()) if c not in table.column_names]
    if missing:
        raise InvalidInput(f"manifest {uri!r} has no column {missing[0]!r} (columns: {table.column_names})",
                           item="input", code="missing_column")
    folder = posixpath.dirname(path)
    paths = [str(p) for p in table.column(path_column).to_pylist()]
    uris = [p if is_s3(p) or os.path.isabs(p) else uri_of(fs, posixpath.join(folder, p)) for p in paths]
    ids = [str(i) for i in table.column(id_column).to_pylist()] if id_column in table.column_names else paths
    columns = {"id": pa.array(ids, pa.string()), "uri": pa.array(uris, pa.string())}
    for name, column in texts.items():
        columns[name] = pa.array([None if v is None or v == "" else str(v) for v in table.column(column).to_pylist()],
                                 pa.string())
    return pa.table(columns)
