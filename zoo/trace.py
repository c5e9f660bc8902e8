"""`memspec trace`: the engine's greedy trajectories and per-draft acceptance tables.

Everything an oracle, the simulator or the predictor's labels replay must be what the
decoder will see, so trajectories are decoded by the runtime's own engine in the precision
the decoder runs (``dtype = "auto"``: int4 on a CPU with the native forward), one prompt at
a time, and tables come from the engine's runners (zoo/tables.py:runtime_table), exact for
model drafts and heads alike. Files live in ``$MEMSPEC_HOME/traces/<dtype>/``.

Who needs what (trace only that): the predictor trains on ``train`` and ``dev`` and is
measured on ``dev2`` and ``mixed``; `memspec bench` simulates ``dev2`` and ``mixed`` and
tunes UCB's c on ``dev``; oracle policies in real runs need their prompts traced. A set
takes a count: ``--sets dev2:10,mixed:30,dev:8`` traces the first 10 dev2 prompts per
domain, 30 mixed prompts and 8 dev prompts per domain (``--per-domain`` is the default
count). The work is per prompt (trajectory, then every draft's table), so an interrupted
trace keeps every finished prompt and resumes where it stopped; progress and the time left
are printed as it goes. A sample is re-run through the engine with each draft and compared
with the tables, because every later number depends on them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from memspec.common.config import PoolConfig, load_pool
from memspec.common.errors import ConfigError
from memspec.zoo.prompts import READ_ONCE
from memspec.zoo.tablestore import (
    SETS,
    TraceTables,
    numerics_key,
    pool_fingerprint,
    read_tables,
    tables_path,
    trajectories_path,
    write_tables,
)

MAX_NEW_TOKENS = 128
SAVE_EVERY_S = 30.0


def _log(msg: str) -> None:
    print(f"[trace] {msg}", file=sys.stderr, flush=True)


def prompt_set(pool: PoolConfig, which: str, per_domain: int | None = None) -> list[dict]:
    """The pool's domains' prompts of one split (``per_domain``: only the first N of each;
    for ``mixed``, N in all)."""
    from memspec.zoo.evaluate import pool_domains
    from memspec.zoo.prompts import load_prompts

    return load_prompts(which, pool_domains(pool), per_domain or None)


def parse_sets(spec: str, per_domain: int | None) -> list[tuple[str, int | None]]:
    """``"dev2:10,mixed:30,dev"`` -> [("dev2", 10), ("mixed", 30), ("dev", per_domain)]."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if name not in SETS:
            raise ConfigError(f"unknown prompt set '{name}'",
                              f"use --sets with {', '.join(SETS)} (optionally name:count)")
        try:
            n = int(count) if count else per_domain
        except ValueError:
            raise ConfigError(f"bad count in --sets item '{item}'",
                              "write name:count, e.g. dev2:10") from None
        if n is not None and n < 1:
            raise ConfigError(f"count {n} in --sets item '{item}' is not positive",
                              "give at least 1, or leave the count out for every prompt")
        out.append((name, n))
    return out


class Tracer:
    """The pool's target in its runtime precision with every draft bound in its own slot."""

    def __init__(self, pool: PoolConfig, device: str = "cpu") -> None:
        from memspec.procs.decoder.inprocess import slot_capacity
        from memspec.procs.decoder.models import open_engine
        from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

        t0 = time.perf_counter()
        self.pool = pool
        self.engine, self.tokenizer, dtype = open_engine(pool, device)
        self.dtype = numerics_key(dtype, device)  # the key its traces and tables are kept by
        cap = slot_capacity(pool)
        for d in pool.drafts:
            self.engine.add_draft(load_into_slot(d.name, d.path, SlotBuffer(cap),
                                                 target_vocab=self.engine.vocab,
                                                 parts=self.engine.target_parts))
        self.fingerprint = pool_fingerprint(pool)
        _log(f"target in {self.dtype}, {len(pool.drafts)} drafts bound "
             f"({time.perf_counter() - t0:.1f}s)")

    def tables(self, row: dict) -> dict[str, list[int]]:
        from memspec.zoo.tables import runtime_table

        return {d.name: runtime_table(self.engine, self.engine.drafts[d.name],
                                      row["prompt_ids"], row["tokens"])
                for d in self.pool.drafts}

    def trace_set(self, which: str, prompts: Sequence[dict], max_new_tokens: int
                  ) -> tuple[list[dict], TraceTables]:
        """Trajectories and tables of `prompts`, resuming whatever is on disk."""
        from memspec.zoo.trajectories import engine_trajectories

        pool, dtype = self.pool, self.dtype
        tpath = tables_path(pool, which, dtype)
        tt = read_tables(tpath, pool.gamma, self.fingerprint, dtype, partial=True) or \
            TraceTables(pool.gamma, [d.name for d in pool.drafts], self.fingerprint,
                        dtype=dtype)
        last = [time.perf_counter()]

        def add(row: dict) -> None:
            tt.rows[row["id"]] = {"domain": row["domain"], "length": len(row["tokens"]),
                                  "tables": self.tables(row)}
            if time.perf_counter() - last[0] > SAVE_EVERY_S:
                write_tables(tpath, tt)
                last[0] = time.perf_counter()

        out = trajectories_path(pool, which, dtype)
        trajs = engine_trajectories(self.engine, self.tokenizer, list(prompts), out, dtype,
                                    max_new_tokens, on_row=add)
        stale = [t for t in trajs if not tt.complete(t["id"])]
        if stale:  # trajectories written before an interruption, tables not yet
            _log(f"{which}: tables for {len(stale)} earlier trajectories")
            for t in stale:
                add(t)
        write_tables(tpath, tt)
        return trajs, tt

    def check(self, trajs: Sequence[dict], tt: TraceTables, per_domain: int) -> dict[str, Any]:
        """Every draft on `per_domain` prompts of its own domain (mixed: any) through the
        engine, per iteration against the table replay."""
        from memspec.zoo.evaluate import engine_check

        total: dict[str, Any] = {"iterations_compared": 0, "mismatching_iterations": 0,
                                 "trajectory_divergences": 0, "prompts": 0, "by_draft": {}}
        for d in self.pool.drafts:
            picked = [x for x in trajs if x["domain"] in (d.domain, "mixed")
                      and x["tokens"]][:per_domain]
            rep, _ = engine_check(self.engine, d.name, picked,
                                  [tt.rows[t["id"]]["tables"][d.name] for t in picked])
            for k in ("iterations_compared", "mismatching_iterations",
                      "trajectory_divergences", "prompts"):
                total[k] += rep[k]
            total["by_draft"][d.name] = {k: rep[k] for k in ("iterations_compared",
                                                             "mismatching_iterations")}
            _log(f"check {d.name}: {rep['mismatching_iterations']} of "
                 f"{rep['iterations_compared']} iterations differ from the table")
        return total


def run_trace(pool: PoolConfig, sets: Sequence[tuple[str, int | None]],
              check_per_domain: int = 1, max_new_tokens: int = MAX_NEW_TOKENS,
              device: str = "cpu") -> dict[str, Any]:
    if not pool.drafts:
        raise ConfigError("the pool has no drafts to trace", "add [[drafts]] sections")
    t0 = time.perf_counter()
    tracer = Tracer(pool, device)
    report: dict[str, Any] = {"gamma": pool.gamma, "dtype": tracer.dtype,
                              "drafts": [d.name for d in pool.drafts], "sets": {}}
    names = [s for s, _ in sets]
    # the engine check runs on the set the figures come from (dev2 first, as bench reads it)
    checked = next((s for s in ("dev2", "dev", "mixed", "train") if s in names), None)
    for base, count in sets:
        # longer traces (output-length sweeps) live beside the default ones
        which = base if max_new_tokens == MAX_NEW_TOKENS else f"{base}-L{max_new_tokens}"
        prompts = prompt_set(pool, base, count)
        _log(f"{which}: {len(prompts)} prompts -> "
             f"{trajectories_path(pool, which, tracer.dtype)}")
        trajs, tt = tracer.trace_set(which, prompts, max_new_tokens)
        entry: dict[str, Any] = {"trajectories": len(trajs),
                                 "tokens": sum(len(t["tokens"]) for t in trajs),
                                 "tables": str(tables_path(pool, which, tracer.dtype))}
        if base == checked and check_per_domain > 0:
            entry["table_vs_engine"] = tracer.check(trajs, tt, check_per_domain)
        report["sets"][which] = entry
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def main_trace(args) -> int:
    pool = load_pool(getattr(args, "pool", None))
    sets = parse_sets(args.sets or ",".join(s for s in SETS if s not in READ_ONCE),
                      args.per_domain)
    report = run_trace(pool, sets, args.check_per_domain, args.max_new_tokens)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0
