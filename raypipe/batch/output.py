"""The output folder is the job's checkpoint: Parquet part files, each written atomically.

Why not Ray Data's `CheckpointConfig`: it records finished ids in a second place, after the data
file is written, so a job killed between the two writes re-processes rows that are already in the
output (twice). Here the data file *is* the record: a part file exists whole or not at all
(`storage.write_atomic`), and the ids already done are read back from the part files themselves.
A part's name is a hash of the ids it holds, so a write task that Ray retries after it had in fact
succeeded rewrites the same file instead of adding a copy. The one way an id could still land in
two files (a retried block whose rows were grouped differently) is removed by `reconcile`, which
every run calls at its start and end.

`_raypipe_batch.json` records the options that decide what a row contains (model, task, prompts,
pooling); a re-run with different ones into the same output is refused rather than mixed in.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq

from raypipe.errors import InvalidInput
from raypipe.storage import join, list_files, write_atomic

JOB_FILE = "_raypipe_batch.json"
PART_PREFIX = "part-"


def part_name(ids: list[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()[:24]
    return f"{PART_PREFIX}{digest}.parquet"


def write_part(fs, root: str, table: pa.Table) -> str:
    """Write `table` as one part file named by its ids; returns the file's path."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    path = join(root, part_name(table.column("id").to_pylist()))
    write_atomic(fs, path, buffer.getvalue())
    return path


def part_files(fs, root: str) -> list[str]:
    return [info.path for info in list_files(fs, root, recursive=False)
            if info.base_name.startswith(PART_PREFIX) and info.base_name.endswith(".parquet")]


def ids_by_file(fs, root: str) -> dict[str, list[str]]:
    return {path: pq.read_table(path, columns=["id"], filesystem=fs).column("id").to_pylist()
            for path in part_files(fs, root)}


def done_ids(fs, root: str) -> set[str]:
    return {i for ids in ids_by_file(fs, root).values() for i in ids}


def reconcile(fs, root: str) -> int:
    """Make every id appear in one part file only; returns how many duplicate rows were dropped."""
    seen: set[str] = set()
    dropped = 0
    for path, ids in ids_by_file(fs, root).items():
        dupes = seen.intersection(ids)
        seen.update(ids)
        if not dupes:
            continue
        table = pq.read_table(path, filesystem=fs)
        keep = pa.array([i not in dupes for i in ids])
        dropped += len(ids) - pa.compute.sum(keep).as_py()
        rest = table.filter(keep)
        if rest.num_rows:
            write_part(fs, root, rest)  # a new name (fewer ids), written before the old file goes
        fs.delete_file(path)
    return dropped


def check_job(fs, root: str, fingerprint: dict) -> None:
    """Record the job's options in a new output folder; refuse different ones in an existing one."""
    path = join(root, JOB_FILE)
    try:
        with fs.open_input_stream(path) as stream:
            recorded = json.loads(stream.read())
    except FileNotFoundError:
        write_atomic(fs, path, json.dumps(fingerprint, indent=1, sort_keys=True).encode())
        return
    if recorded != fingerprint:
        changed = sorted(k for k in set(recorded) | set(fingerprint) if recorded.get(k) != fingerprint.get(k))
        raise InvalidInput(f"the output folder holds results of a job with different {', '.join(changed)}; "
                           "use a new output folder", item="output", code="output_mismatch")


def count_errors(fs, root: str) -> dict[str, int]:
    counts: collections.Counter = collections.Counter()
    for path in part_files(fs, root):
        for code in pq.read_table(path, columns=["error"], filesystem=fs).column("error").to_pylist():
            if code is not None:
                counts[code] += 1
    return dict(counts)
