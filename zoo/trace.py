"""`memspec trace`: greedy trajectories and per-draft acceptance tables per prompt split.

train and dev (prompts/train.jsonl, dev.jsonl) feed the predictor's labels and every
tuning choice; test and mixed feed the oracle policies, the simulator and `memspec bench`.
``--per-domain N`` traces only the first N prompts of each domain (mixed: N in all).
Both steps resume: finished trajectories and tables for unchanged drafts are kept. A
sample of the tables is checked against the real engine, one prompt per domain per draft,
because every later number depends on them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from memspec.common.config import PoolConfig, load_pool
from memspec.common.errors import ConfigError
from memspec.zoo.tablestore import (
    SETS,
    TraceTables,
    pool_fingerprint,
    read_tables,
    tables_path,
    trajectories_path,
    write_tables,
)

MAX_NEW_TOKENS = 128


def _log(msg: str) -> None:
    print(f"[trace] {msg}", file=sys.stderr, flush=True)


def prompt_set(pool: PoolConfig, which: str, per_domain: int | None = None) -> list[dict]:
    """The pool's domains' prompts of one split (``per_domain``: only the first N of each)."""
    from memspec.zoo.evaluate import pool_domains
    from memspec.zoo.prompts import load_prompts

    return load_prompts(which, pool_domains(pool), per_domain or None)


def build_tables(pool: PoolConfig, trajs: Sequence[dict], vocab: int, which: str,
                 fingerprint: dict[str, str]) -> TraceTables:
    """Tables for every trajectory, reusing the file's rows when the drafts are unchanged."""
    from memspec.zoo.evaluate import all_tables

    path = tables_path(pool, which)
    tt = read_tables(path, pool.gamma, fingerprint) or TraceTables(
        pool.gamma, [d.name for d in pool.drafts], fingerprint)
    todo = [t for t in trajs if t["id"] not in tt.rows and t["tokens"]]
    if todo:
        _log(f"{which}: tables for {len(todo)} trajectories x {len(pool.drafts)} drafts")
        got = all_tables(pool, todo, vocab)
        for i, t in enumerate(todo):
            tt.rows[t["id"]] = {"domain": t["domain"], "length": len(t["tokens"]),
                                "tables": {d: got[d][i] for d in got}}
        write_tables(path, tt)
    _log(f"{which}: {len(tt.rows)} trajectories in {path}")
    return tt


def check_sample(pool: PoolConfig, target, eos: Sequence[int], trajs: Sequence[dict],
                 tt: TraceTables, vocab: int, per_domain: int = 1) -> dict[str, Any]:
    """Every draft on `per_domain` prompts of its own domain through the real engine."""
    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.inprocess import slot_capacity
    from memspec.procs.decoder.slots import SlotBuffer, load_into_slot
    from memspec.zoo.evaluate import engine_check

    total = {"iterations_compared": 0, "mismatching_iterations": 0, "trajectory_divergences": 0,
             "prompts": 0, "by_draft": {}}
    slot = SlotBuffer(slot_capacity(pool))
    for d in pool.drafts:
        picked = [x for x in trajs if x["domain"] == d.domain and x["tokens"]][:per_domain]
        engine = SpecEngine(target, eos, gamma=pool.gamma)
        engine.add_draft(load_into_slot(d.name, d.path, slot, target_vocab=vocab))
        rep, _ = engine_check(engine, d.name, picked,
                              [tt.rows[t["id"]]["tables"][d.name] for t in picked])
        for k in ("iterations_compared", "mismatching_iterations", "trajectory_divergences",
                  "prompts"):
            total[k] += rep[k]
        total["by_draft"][d.name] = {k: rep[k] for k in ("iterations_compared",
                                                         "mismatching_iterations")}
        _log(f"check {d.name}: {rep['mismatching_iterations']} of "
             f"{rep['iterations_compared']} iterations differ from the table")
    return total


def run_trace(pool: PoolConfig, per_domain: int | None = None,
              sets: Sequence[str] = SETS, check_per_domain: int = 1,
              max_new_tokens: int = MAX_NEW_TOKENS) -> dict[str, Any]:
    from memspec.procs.decoder.models import eos_token_ids, load_causal_lm, load_tokenizer
    from memspec.zoo.trajectories import build_trajectories

    if not pool.drafts:
        raise ConfigError("the pool has no drafts to trace", "add [[drafts]] sections")
    t0 = time.perf_counter()
    tok = load_tokenizer(pool.target)
    target = load_causal_lm(pool.target, "target")
    vocab = int(target.get_output_embeddings().weight.shape[0])
    fingerprint = pool_fingerprint(pool)
    report: dict[str, Any] = {"gamma": pool.gamma, "drafts": list(fingerprint), "sets": {}}
    for base in sets:
        # longer traces (output-length sweeps) live beside the default ones
        which = base if max_new_tokens == MAX_NEW_TOKENS else f"{base}-L{max_new_tokens}"
        prompts = prompt_set(pool, base, per_domain)
        out = trajectories_path(pool, which)
        _log(f"{which}: trajectories for {len(prompts)} prompts -> {out}")
        trajs = build_trajectories(target, tok, pool.target, prompts, out,
                                   max_new_tokens=max_new_tokens)
        tt = build_tables(pool, trajs, vocab, which, fingerprint)
        entry: dict[str, Any] = {"trajectories": len(trajs),
                                 "tokens": sum(len(t["tokens"]) for t in trajs),
                                 "tables": str(tables_path(pool, which))}
        if base == ("dev" if "dev" in sets else "test") and check_per_domain > 0:
            entry["table_vs_engine"] = check_sample(
                pool, target, eos_token_ids(pool.target, tok), trajs, tt, vocab,
                check_per_domain)
        report["sets"][which] = entry
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def main_trace(args) -> int:
    pool = load_pool(getattr(args, "pool", None))
    sets = [s for s in (args.sets or ",".join(SETS)).split(",") if s]
    for s in sets:
        if s not in SETS:
            raise ConfigError(f"unknown prompt set '{s}'", f"use --sets {','.join(SETS)}")
    report = run_trace(pool, args.per_domain, sets, args.check_per_domain, args.max_new_tokens)
    print(json.dumps(report, indent=None if args.json else 2))
    return 0
