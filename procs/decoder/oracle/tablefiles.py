"""Acceptance tables on disk: one JSON file per prompt set, tied to the drafts that made them.

Tables are only valid for the exact draft weights, gamma and target precision they came
from, so every file records all three; a reader that finds other weights treats the file as
absent (and `memspec trace` rebuilds it) instead of silently replaying stale acceptance.
The target's greedy trajectory depends on its numerics (int4 and fp32 argmaxes differ on
near-ties, and so can two CPU kernel paths whose reductions add in other orders), so traces
made by the engine live in one folder per numerics key (``traces/<dtype>-<kernel path>/``,
see :func:`numerics_key`); the top folder keeps the fp32 Hugging Face trajectories that
draft training and `memspec zoo eval` use. Pure I/O, read by the decoder's oracle policies and
written and read by the offline tools (zoo/tablestore.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memspec.common.config import PoolConfig, tomllib
from memspec.common.draftfiles import pool_fingerprint  # noqa: F401 - the tables' key
from memspec.common.files import read_jsonl
from memspec.common.paths import DEFAULT_POOL, default_target_dir, expand_path, memspec_home
from memspec.common.tuned import knob
from memspec.procs.decoder.forward.precision import resolve_dtype

# 2: with the context lookup on, a head takes a looked-up token outside its vocabulary (it
# embeds target ids); tables of version 1 let its own guess stand there, and are re-made
FORMAT = "memspec-tables/2"
TABLES_PREFIX = "tables-"


def tables_format() -> str:
    """The format, plus the rows a head scores when ``head.VOCAB`` cuts them, where it
    stops proposing (``head.STOP``) and where it proposes nothing (``head.FIRST``): tables
    made with another setting propose otherwise and are re-made."""
    rows, stop, first = knob("head.VOCAB"), knob("head.STOP"), knob("head.FIRST")
    return FORMAT + (f"+head-rows-{rows}" if rows else "") + \
        (f"+head-stop-{stop}" if stop else "") + (f"+head-first-{first}" if first else "")


def traces_dir(dtype: str | None = None) -> Path:
    """Where traces live: one folder per numerics key for the engine's traces."""
    root = memspec_home() / "traces"
    return root / dtype if dtype else root


def runtime_dtype(pool: PoolConfig, device: str | torch.device | None = None) -> str:
    """The precision the decoder runs this pool's target in (`dtype = "auto"` resolved for
    the device it picks: CUDA when present, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_dtype(pool.dtype, pool.target, device)


def numerics_key(dtype: str, device: str | torch.device = "cpu") -> str:
    """What decides the target's bits: its dtype and, on a CPU, the kernel path
    (``memspec.common.isa``), which also fixes the activation precision (the C++ forward
    runs fp32 rows, int8-quantised per 32 inside the block kernels; the PyTorch forward,
    ``-torch``, bf16 rows where the path has native bf16, else fp32). Traces, tables and
    cost calibrations are keyed by it."""
    if torch.device(device).type == "cuda":
        return f"{dtype}-cuda"
    from memspec.common.isa import chosen_isa

    native = os.environ.get("MEMSPEC_NATIVE", "1") != "0" or dtype == "float32"
    return f"{dtype}-{chosen_isa()}" + ("" if native else "-torch")


def runtime_key(pool: PoolConfig, device: str | torch.device | None = None) -> str:
    """The numerics key of the decoder's target for this pool: whose traces it reads."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return numerics_key(runtime_dtype(pool, device), device)


def _suffix(pool: PoolConfig) -> str:
    """Cached trajectories belong to one target: another target gets its own files."""
    return "" if pool.target.resolve() == default_target_dir().resolve() \
        else f"-{pool.target.name}"


def trajectories_path(pool: PoolConfig, which: str, dtype: str | None = None) -> Path:
    return traces_dir(dtype) / f"{which}{_suffix(pool)}.jsonl"


def tables_path(pool: PoolConfig, which: str, dtype: str | None = None) -> Path:
    """Tables belong to one pool's drafts (trajectories only to its target): another pool on
    the same target (small models, datastores) keeps its own file, not the default's."""
    return traces_dir(dtype) / f"{TABLES_PREFIX}{which}{_suffix(pool)}{_drafts_suffix(pool)}.json"


def _drafts_key(drafts: Sequence[tuple[str, Path]]) -> str:
    return "\n".join(sorted(f"{name}={Path(path).resolve()}" for name, path in drafts))


@functools.cache
def _default_drafts_key() -> str | None:
    try:
        raw = tomllib.loads(DEFAULT_POOL.read_text())
        return _drafts_key([(d["name"], expand_path(d["path"], DEFAULT_POOL.parent))
                            for d in raw.get("drafts", [])])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _drafts_suffix(pool: PoolConfig) -> str:
    key = _drafts_key([(d.name, d.path) for d in pool.drafts])
    if key == _default_drafts_key():
        return ""
    return "@" + hashlib.sha256(key.encode()).hexdigest()[:10]  # ("@": in no set's name)


def traced_sets(pool: PoolConfig, dtype: str | None = None) -> list[str]:
    """Every prompt set with a tables file for this pool's target, by name."""
    suffix = _suffix(pool) + _drafts_suffix(pool) + ".json"
    names = sorted(p.name for p in traces_dir(dtype).glob(f"{TABLES_PREFIX}*{suffix}"))
    names = [n for n in names if n.count(".") == 1]  # not an interrupted writer's .tmp
    sets = [n[len(TABLES_PREFIX):len(n) - len(suffix)] for n in names]
    return [w for w in sets if "@" not in w]  # (another pool's tables on this target)


@dataclass
class TraceTables:
    """A_d(t) for every trajectory of one prompt set: rows[id] = {"domain", "tables"}.

    ``dtype``: the target precision of the trajectories ("" for the fp32 HF ones)."""

    gamma: int
    drafts: list[str]
    fingerprint: dict[str, str]
    rows: dict[str, dict] = field(default_factory=dict)
    dtype: str = ""

    def to_json(self) -> dict:
        return {"format": tables_format(), "gamma": self.gamma, "drafts": self.drafts,
                "fingerprint": self.fingerprint, "dtype": self.dtype, "rows": self.rows}

    def complete(self, row_id: str) -> bool:
        """Whether a row has a table of every draft (a trace in progress may not yet)."""
        row = self.rows.get(row_id)
        return row is not None and set(row.get("tables", {})) >= set(self.drafts)


def read_tables(path: Path, gamma: int, fingerprint: Mapping[str, str],
                dtype: str | None = None, partial: bool = False) -> TraceTables | None:
    """The file's tables if they match these drafts, gamma (and target ``dtype`` when
    given), else None (stale or absent). Rows missing a draft's table are left out unless
    ``partial`` (the tracer resuming its own work)."""
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != tables_format() \
            or raw.get("gamma") != gamma \
            or raw.get("fingerprint") != dict(fingerprint):
        return None
    if dtype is not None and raw.get("dtype", "") != dtype:
        return None
    tt = TraceTables(gamma, list(raw["drafts"]), dict(raw["fingerprint"]), dict(raw["rows"]),
                     str(raw.get("dtype", "")))
    if not partial:
        tt.rows = {k: v for k, v in tt.rows.items() if tt.complete(k)}
    return tt


def write_tables(path: Path, tt: TraceTables) -> None:
    """Atomic: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(tt.to_json()))
    os.replace(tmp, path)


def trajectory_rows(path: Path, ids: Sequence[str] | None = None) -> dict[str, dict]:
    """Trajectory rows by id (a torn last line from an interrupted writer is skipped)."""
    return read_jsonl(path, "id", ids)
