"""File helpers the runtime and the offline tools share: checksums and resumable JSONL.

Resumable jobs (trajectories, real benchmark runs) append one JSON object per line and
flush after each, so a reader may meet a torn last line from an interrupted writer: it is
skipped, and the job redoes that row.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


def sha256_file(path: Path, offset: int = 0, size: int | None = None) -> str:
    """Hex sha256 of `size` bytes from `offset` (default: to the end of the file)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        f.seek(offset)
        left = size
        while left is None or left > 0:
            chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a private temporary file and a rename: a reader never sees half a file,
    and two writers of the same content cannot tear it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_jsonl(path: Path, key: str = "id", ids: Iterable[str] | None = None
               ) -> dict[str, dict[str, Any]]:
    """Rows of a JSON-lines file by `row[key]` (the last row of a key wins; a torn or
    foreign line is skipped); only the keys in `ids` when given."""
    out: dict[str, dict[str, Any]] = {}
    if not Path(path).is_file():
        return out
    want = set(ids) if ids is not None else None
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and key in row and (want is None or row[key] in want):
            out[row[key]] = row
    return out
