"""`Recorder`: a section's results, on disk after every entry, so a section cut mid-way still reports what
it finished."""

from __future__ import annotations

import json
import os
import pathlib


class Recorder:
    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.data: dict = {"results": [], "skipped": []}
        self._write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self._write()

    def add(self, **row) -> None:
        """One measurement or check (a row of the section's table)."""
        self.data["results"].append(row)
        self._write()

    def skip(self, item: str, reason: str) -> None:
        self.data["skipped"].append({"item": item, "reason": reason})
        self._write()

    def _write(self) -> None:
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(staging, self.path)  # a reader (or a kill) never sees half a file


def read(path: str | os.PathLike) -> dict:
    """What a section's process left, or an empty record if it wrote nothing."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return {"results": [], "skipped": []}
