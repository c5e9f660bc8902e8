"""The prompt sets `memspec trace` writes tables for, and loading them for offline tools.

The file format, names and readers live with the runtime that also reads them
(procs/decoder/oracle/tablefiles.py); they are re-exported here for the offline code.
"""

from __future__ import annotations

from collections.abc import Mapping

from memspec.common.config import PoolConfig
from memspec.common.errors import ConfigError
from memspec.procs.decoder.oracle.tablefiles import (  # noqa: F401 - the offline tools' names
    FORMAT,
    TraceTables,
    numerics_key,
    pool_fingerprint,
    read_tables,
    runtime_dtype,
    runtime_key,
    tables_path,
    traces_dir,
    trajectories_path,
    trajectory_rows,
    write_tables,
)
from memspec.zoo.prompts import SPLITS

SETS = SPLITS  # the prompt splits, see memspec.zoo.prompts


def load_pool_tables(pool: PoolConfig, which: str,
                     fingerprint: Mapping[str, str] | None = None,
                     dtype: str | None = None) -> TraceTables:
    """The engine's tables for this pool (in the runtime's precision unless `dtype`), or a
    one-line error saying how to make them."""
    if which.split("-L")[0] not in SETS:
        raise ConfigError(f"unknown prompt set '{which}'", f"use one of {', '.join(SETS)}")
    fp = fingerprint if fingerprint is not None else pool_fingerprint(pool)
    dtype = dtype or runtime_key(pool)
    got = read_tables(tables_path(pool, which, dtype), pool.gamma, fp, dtype)
    if got is None:
        raise ConfigError(f"no acceptance tables for this pool's drafts ({which} set, "
                          f"gamma={pool.gamma}, target in {dtype})",
                          f"run `memspec trace --sets {which.split('-L')[0]}` first")
    return got
