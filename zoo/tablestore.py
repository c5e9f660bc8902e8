"""Acceptance tables on disk: one JSON file per prompt set, tied to the drafts that made them.

Tables are only valid for the exact draft weights and gamma they came from, so every file
records both; a reader that finds other weights treats the file as absent (and `memspec
trace` rebuilds it) instead of silently replaying stale acceptance. Pure I/O: the decoder's
oracle policies, the predictor trainer and the simulator all read through here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from memspec.common.config import PoolConfig
from memspec.common.errors import ConfigError
from memspec.common.paths import default_target_dir, memspec_home

FORMAT = "memspec-tables/1"
SETS = ("train", "dev", "test", "mixed")  # the prompt splits, see memspec.zoo.prompts


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def pool_fingerprint(pool: PoolConfig) -> dict[str, str]:
    """sha256 of every draft's weights file, by draft name (pool order)."""
    from memspec.procs.decoder.slots import draft_weights_file

    return {d.name: file_sha256(draft_weights_file(d.path)) for d in pool.drafts}


def traces_dir() -> Path:
    return memspec_home() / "traces"


def _suffix(pool: PoolConfig) -> str:
    """Cached trajectories belong to one target: another target gets its own files."""
    return "" if pool.target.resolve() == default_target_dir().resolve() \
        else f"-{pool.target.name}"


def trajectories_path(pool: PoolConfig, which: str) -> Path:
    return traces_dir() / f"{which}{_suffix(pool)}.jsonl"


def tables_path(pool: PoolConfig, which: str) -> Path:
    return traces_dir() / f"tables-{which}{_suffix(pool)}.json"


@dataclass
class TraceTables:
    """A_d(t) for every trajectory of one prompt set: rows[id] = {"domain", "tables"}."""

    gamma: int
    drafts: list[str]
    fingerprint: dict[str, str]
    rows: dict[str, dict] = field(default_factory=dict)

    def tables(self, prompt_id: str) -> dict[str, list[int]] | None:
        row = self.rows.get(prompt_id)
        return row["tables"] if row else None

    def ids(self, domain: str | None = None) -> list[str]:
        return [i for i, r in self.rows.items() if domain is None or r["domain"] == domain]

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
    if raw.get("format") != FORMAT or raw.get("gamma") != gamma \
            or raw.get("fingerprint") != dict(fingerprint):
        return None
    return TraceTables(gamma, list(raw["drafts"]), dict(raw["fingerprint"]), dict(raw["rows"]))


def write_tables(path: Path, tt: TraceTables) -> None:
    """Atomic: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tt.to_json()))
    os.replace(tmp, path)


def load_pool_tables(pool: PoolConfig, which: str,
                     fingerprint: Mapping[str, str] | None = None) -> TraceTables:
    """Tables for this pool or a one-line error saying how to make them."""
    if which.split("-L")[0] not in SETS:
        raise ConfigError(f"unknown prompt set '{which}'", f"use one of {', '.join(SETS)}")
    fp = fingerprint if fingerprint is not None else pool_fingerprint(pool)
    got = read_tables(tables_path(pool, which), pool.gamma, fp)
    if got is None:
        raise ConfigError(f"no acceptance tables for this pool's drafts ({which} set, "
                          f"gamma={pool.gamma})", "run `memspec trace` first")
    return got


def trajectory_rows(path: Path, ids: Sequence[str] | None = None) -> dict[str, dict]:
    """Trajectory rows by id (a torn last line from an interrupted writer is skipped)."""
    out: dict[str, dict] = {}
    if not path.is_file():
        return out
    want = set(ids) if ids is not None else None
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if want is None or row.get("id") in want:
            out[row["id"]] = row
    return out
