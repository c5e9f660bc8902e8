"""Acceptance tables on disk: one JSON file per prompt set, tied to the drafts that made them.

Tables are only valid for the exact draft weights and gamma they came from, so every file
records both; a reader that finds other weights treats the file as absent (and `memspec
trace` rebuilds it) instead of silently replaying stale acceptance. Pure I/O, read by the
decoder's oracle policies and written and read by the offline tools (zoo/tablestore.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memspec.common.config import PoolConfig
from memspec.common.files import read_jsonl, sha256_file
from memspec.common.paths import default_target_dir, memspec_home
from memspec.procs.decoder.slots import draft_weights_file

FORMAT = "memspec-tables/1"
TABLES_PREFIX = "tables-"


def pool_fingerprint(pool: PoolConfig) -> dict[str, str]:
    """sha256 of every draft's weights file, by draft name (pool order)."""
    return {d.name: sha256_file(draft_weights_file(d.path)) for d in pool.drafts}


def traces_dir() -> Path:
    return memspec_home() / "traces"


def _suffix(pool: PoolConfig) -> str:
    """Cached trajectories belong to one target: another target gets its own files."""
    return "" if pool.target.resolve() == default_target_dir().resolve() \
        else f"-{pool.target.name}"


def trajectories_path(pool: PoolConfig, which: str) -> Path:
    return traces_dir() / f"{which}{_suffix(pool)}.jsonl"


def tables_path(pool: PoolConfig, which: str) -> Path:
    return traces_dir() / f"{TABLES_PREFIX}{which}{_suffix(pool)}.json"


def traced_sets(pool: PoolConfig) -> list[str]:
    """Every prompt set with a tables file for this pool's target, by name."""
    suffix = _suffix(pool) + ".json"
    names = sorted(p.name for p in traces_dir().glob(f"{TABLES_PREFIX}*{suffix}"))
    return [n[len(TABLES_PREFIX):len(n) - len(suffix)] for n in names]


@dataclass
class TraceTables:
    """A_d(t) for every trajectory of one prompt set: rows[id] = {"domain", "tables"}."""

    gamma: int
    drafts: list[str]
    fingerprint: dict[str, str]
    rows: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": FORMAT, "gamma": self.gamma, "drafts": self.drafts,
                "fingerprint": self.fingerprint, "rows": self.rows}


def read_tables(path: Path, gamma: int, fingerprint: Mapping[str, str]) -> TraceTables | None:
    """The file's tables if they match these drafts and gamma, else None (stale or absent)."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("gamma") != gamma \
            or raw.get("fingerprint") != dict(fingerprint):
        return None
    return TraceTables(gamma, list(raw["drafts"]), dict(raw["fingerprint"]), dict(raw["rows"]))


def write_tables(path: Path, tt: TraceTables) -> None:
    """Atomic: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tt.to_json()))
    os.replace(tmp, path)


def trajectory_rows(path: Path, ids: Sequence[str] | None = None) -> dict[str, dict]:
    """Trajectory rows by id (a torn last line from an interrupted writer is skipped)."""
    return read_jsonl(path, "id", ids)
