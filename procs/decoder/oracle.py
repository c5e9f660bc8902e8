"""Oracle plans from acceptance tables: the future knowledge behind oracle-static/-dynamic.

The plans are pure (lists and ints): the decoder and the replay simulator hand the very same
plan to `make_policy(..., oracle_plan=...)`; each passes a `position()` callable that says
how many tokens the request has committed, which is all the tables need. At run time the
tables come from `memspec trace`'s files, looked up by the prompt's token ids: an oracle
knows the future only of a traced prompt under greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from memspec.common.config import PoolConfig
from memspec.common.errors import RequestError
from memspec.procs.decoder.policies import OraclePlan, SchedView
from memspec.procs.decoder.replay import Table, dynamic_scores, oracle_static
from memspec.procs.decoder.tablefiles import (
    pool_fingerprint,
    read_tables,
    tables_path,
    traced_sets,
    trajectories_path,
    trajectory_rows,
)

ORACLE_POLICIES = ("oracle-static", "oracle-dynamic")
OracleIndex = dict[tuple[int, ...], dict[str, list[int]]]


def static_plan(tables: Mapping[str, Table], gamma: int) -> OraclePlan:
    """oracle-static: the single draft that finishes this trajectory in fewest iterations."""
    best, _ = oracle_static(tables, gamma)

    def plan(_view: SchedView) -> str:
        return best

    return plan


def dynamic_plan(tables: Mapping[str, Table], gamma: int, interval: int,
                 position: Callable[[], int]) -> OraclePlan:
    """oracle-dynamic: each draft scored by what it would commit over the next interval
    from the current position, so the cache manager keeps the drafts that are about to pay
    off resident under the same memory limit as MemSpec."""
    length = min(len(t) for t in tables.values())

    def plan(view: SchedView) -> Mapping[str, float] | None:
        pos = position()
        if pos >= length:
            return None
        usable = {d: t for d, t in tables.items() if d in view.drafts}
        return dynamic_scores(usable, pos, gamma, interval, view.active, view.resident)

    return plan


def make_plan(policy: str, tables: Mapping[str, Table], gamma: int, interval: int,
              position: Callable[[], int]) -> OraclePlan | None:
    """The plan an oracle policy needs (None for every other policy)."""
    if policy == "oracle-static":
        return static_plan(tables, gamma)
    if policy == "oracle-dynamic":
        return dynamic_plan(tables, gamma, interval, position)
    return None


def oracle_index(pool: PoolConfig) -> OracleIndex:
    """Prompt ids -> per-draft tables, over every traced prompt set whose tables match the
    pool's drafts (empty when none do: oracle requests then get a one-line error)."""
    fp = pool_fingerprint(pool)
    out: OracleIndex = {}
    for which in traced_sets(pool):
        tt = read_tables(tables_path(pool, which), pool.gamma, fp)
        if tt is None:
            continue
        rows = trajectory_rows(trajectories_path(pool, which), list(tt.rows))
        for pid, row in rows.items():
            out[tuple(row["prompt_ids"])] = tt.rows[pid]["tables"]
    return out


def prompt_tables(index: OracleIndex, policy: str, ids: list[int], greedy: bool
                  ) -> dict[str, list[int]]:
    """This prompt's tables, or a one-line RequestError saying why an oracle cannot run."""
    if not greedy:
        raise RequestError(f"policy '{policy}' replays greedy acceptance tables",
                           "use temperature 0, or another policy")
    tables = index.get(tuple(ids))
    if tables is None:
        raise RequestError(f"policy '{policy}' has no acceptance tables for this prompt",
                           "run `memspec trace` and use a traced prompt "
                           "(prompts/<domain>.jsonl, prompts/train.jsonl), or another policy")
    return tables
