"""`memspec bench tune`'s plan_budget section: how wide oracle-dynamic's plan search may go.

oracle-dynamic plans a request's runs and loads before its prompt prefills
(procs/decoder/oracle/oracle.py), on the request's end-to-end clock. A wider search (more drafts
planned over, `PLAN_BUDGET` states past the narrowest) can find a faster plan, and takes
longer to find it. On traced dev prompts, per budget: the plan's own value (its iterations
at the cost model's mean iteration) plus the seconds the search took on this machine,
which is what the oracle pays for a request. The budget that pays least is chosen.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from memspec.common.config import PoolConfig
from memspec.common.errors import ConfigError
from memspec.procs.decoder.oracle.oracle import DynamicPlan, oracle_index, prompt_tables
from memspec.procs.decoder.oracle.tablefiles import runtime_key, trajectories_path, trajectory_rows
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.sim.costmodel import CostModel

BUDGETS = (0, 30, 100, 300, 10**6)  # 10**6: the exact search over every draft
REPEATS = 3  # timings per prompt and budget (the least counts: other work only adds)


def _log(msg: str) -> None:
    print(f"[bench tune] {msg}", file=sys.stderr, flush=True)


def tune_plan_budget(pool: PoolConfig, prompt_ids: Sequence[str], cost: CostModel,
                     current: int) -> dict[str, Any]:
    """Per budget over the dev prompts `prompt_ids` (traced): mean plan seconds, mean plan
    value in seconds, and their sum, which chooses."""
    numerics = runtime_key(pool)
    index = oracle_index(pool, numerics, sets=("dev",))  # (dev2, test2 are never read)
    rows = trajectory_rows(trajectories_path(pool, "dev", numerics), list(prompt_ids))
    traced = [r["prompt_ids"] for r in rows.values() if tuple(r["prompt_ids"]) in index]
    tables = [prompt_tables(index, "oracle-dynamic", ids, True, pool.lookup, pool.gamma)
              for ids in traced]
    lens = [len(ids) for ids in traced]
    if not tables:
        raise ConfigError("no traced dev prompt has tables for this pool's drafts",
                          "run `memspec trace --sets dev:4` first")
    costs, unit = cost.plan_costs(), cost.mean_iteration_s or 1.0
    plan_s: dict[int, list[float]] = {b: [] for b in BUDGETS}
    value_s: dict[int, list[float]] = {b: [] for b in BUDGETS}
    for i, (tabs, n) in enumerate(zip(tables, lens)):
        drafts = {d: t for d, t in tabs.items() if d != LOOKUP}
        for b in BUDGETS:
            best = float("inf")
            for _ in range(REPEATS):
                t0 = time.perf_counter()
                plan = DynamicPlan(drafts, pool.gamma, pool.N, pool.K, costs, lambda: 0, n,
                                   budget=b, lookup=tabs.get(LOOKUP))
                value = plan.initial(frozenset()).value
                best = min(best, time.perf_counter() - t0)
            plan_s[b].append(best)
            value_s[b].append(value * unit)
        if (i + 1) % 5 == 0 or i + 1 == len(tables):
            _log(f"plan budget: {i + 1}/{len(tables)} dev prompts")
    out = []
    for b in BUDGETS:
        p, v = statistics.fmean(plan_s[b]), statistics.fmean(value_s[b])
        out.append({"value": b, "plan_s": p, "value_s": v, "total_s": p + v})
    least = min(r["total_s"] for r in out)
    best = next((r for r in out if r["value"] == current and r["total_s"] <= least + 1e-12),
                min(out, key=lambda r: r["total_s"]))
    _log(f"plan budget: {best['value']} (plan {1e3 * best['plan_s']:.1f} ms + value "
         f"{1e3 * best['value_s']:.1f} ms a request)")
    return {"grid": list(BUDGETS), "rows": out, "chosen": best["value"], "figure": best,
            "prompts": len(tables), "numerics": numerics}
