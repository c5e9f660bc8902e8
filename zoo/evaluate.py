"""`memspec zoo eval`: how well each draft of a pool predicts the target, per domain.

Acceptance comes from tables A_d(t) computed with the engine's own runners over the
target's greedy trajectories in the runtime's precision (zoo/tables.py), for draft models
and heads alike: a model draft costs one teacher-forced pass per trajectory, the heads
share one target pass per trajectory (their input features) and unroll their proposals
as the engine does. Every draft, the oracle-static and the oracle-dynamic baselines then
come from replays. Two measurements on the real runtime anchor the numbers: the real
engine's accepted counts against the table replay (exactness), and the cost ratio the
paper's memory problem is about (cold draft load vs one SD iteration).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memspec.common.config import PoolConfig, load_pool
from memspec.common.draftfiles import draft_weights_file
from memspec.common.errors import ConfigError
from memspec.common.machine import machine_info
from memspec.common.metrics import gmean
from memspec.procs.decoder.drafts.head import HEAD_KIND
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.inprocess import slot_capacity
from memspec.procs.decoder.models import open_engine
from memspec.procs.decoder.oracle.replay import oracle_dynamic, oracle_static, pooled, replay_static
from memspec.procs.decoder.slots import BoundDraft, SlotBuffer, load_into_slot
from memspec.zoo.engine_trajectories import engine_trajectories
from memspec.zoo.prompts import load_prompts
from memspec.zoo.tables import (
    acceptance_table,
    capped_engine_accepts,
    engine_lookup,
    head_table,
    runtime_table,
    target_features,
)
from memspec.zoo.tablestore import numerics_key, pool_fingerprint, trajectories_path

# train prompts are the drafts' own data; test2 is read once, by a round's headline bench
EVAL_SPLITS = ("dev", "dev2", "mixed")
MAX_NEW_TOKENS = 128
ENGINE_CHECK_PER_DOMAIN = 2
LOAD_REPEATS = 3

Tables = dict[str, list[list[int]]]  # draft -> one table per trajectory


def _log(msg: str) -> None:
    print(f"[zoo eval] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- inputs


def pool_domains(pool: PoolConfig) -> list[str]:
    """The domains the pool's drafts claim, in pool order (one prompt set each)."""
    return list(dict.fromkeys(d.domain for d in pool.drafts))


def split_prompts(split: str, domains: Sequence[str], per_domain: int) -> list[dict]:
    """The first ``per_domain`` prompts of each domain of an evaluation split.

    dev2 (the old test split, read by many runs: a second dev set) is for the figures
    (`zoo eval --split dev2`, `memspec bench`); anything chosen by looking at the numbers
    is chosen on dev.
    """
    if split not in EVAL_SPLITS:
        raise ConfigError(f"'{split}' is not an evaluation split",
                          f"use --split {' | '.join(EVAL_SPLITS)}")
    return load_prompts(split, domains, per_domain)


def traces_path(pool: PoolConfig, split: str) -> Path:
    """The split's trajectories, the file `memspec trace` also reads and writes."""
    return trajectories_path(pool, split)


def runtime_traces_path(pool: PoolConfig, split: str, dtype: str) -> Path:
    """The split's trajectories as the engine commits them in ``dtype`` (beside the fp32
    ones `memspec trace` batches)."""
    return trajectories_path(pool, f"{split}-{dtype}")


# --------------------------------------------------------------------------- tables


def draft_tables(bound: BoundDraft, trajs: Sequence[dict], gamma: int, vocab: int) -> list[list[int]]:
    return [acceptance_table(bound.model, t["prompt_ids"], t["tokens"], gamma, bound.to_draft,
                             bound.to_target, vocab) for t in trajs]


def all_tables(pool: PoolConfig, trajs: Sequence[dict], vocab: int) -> Tables:
    """Model drafts through their HF modules (fp32 trajectories of `memspec trace`). One
    slot, refilled per draft: tables never need two drafts resident."""
    slot = SlotBuffer(slot_capacity(pool))
    out: Tables = {}
    for d in pool.drafts:
        t0 = time.perf_counter()
        bound = load_into_slot(d.name, d.path, slot, target_vocab=vocab)
        out[d.name] = draft_tables(bound, trajs, pool.gamma, vocab)
        _log(f"tables: {d.name} over {len(trajs)} trajectories in "
             f"{time.perf_counter() - t0:.1f}s")
    return out


def bind_pool(pool: PoolConfig, engine: SpecEngine) -> dict[str, BoundDraft]:
    """Every draft of the pool in its own slot, added to the engine (heads: ~10 MB each)."""
    out = {}
    for d in pool.drafts:
        size = draft_weights_file(d.path).stat().st_size
        out[d.name] = load_into_slot(d.name, d.path, SlotBuffer(size), engine.vocab,
                                     engine.target_parts)
        engine.add_draft(out[d.name])
    return out


def runtime_tables(engine: SpecEngine, bound: dict[str, BoundDraft], trajs: Sequence[dict]
                   ) -> Tables:
    """A_d(t) of every draft through the engine's runners; the heads share one target
    pass per trajectory (the features it writes are the ones the engine would)."""
    heads = any(b.kind == HEAD_KIND for b in bound.values())
    out: Tables = {n: [] for n in bound}
    t0 = time.perf_counter()
    for i, t in enumerate(trajs):
        prompt, tokens = t["prompt_ids"], t["tokens"]
        ids = torch.tensor(list(prompt) + list(tokens), dtype=torch.long, device=engine.device)
        feat = target_features(engine, ids) if heads and tokens else None
        for name, b in bound.items():
            if not tokens:
                out[name].append([])
            elif b.kind == HEAD_KIND:
                out[name].append(head_table(b, feat, ids, len(prompt), tokens, engine.gamma,
                                            engine_lookup(engine, b, prompt, tokens)))
            else:
                out[name].append(runtime_table(engine, b, prompt, tokens))
        if (i + 1) % 20 == 0 or i + 1 == len(trajs):
            _log(f"tables: {i + 1}/{len(trajs)} trajectories x {len(bound)} drafts "
                 f"({time.perf_counter() - t0:.0f}s)")
    return out


def acceptance_report(tables: Tables, trajs: Sequence[dict], general: str,
                      domains: Sequence[str], gamma: int, interval: int) -> dict[str, Any]:
    """Per draft x domain acceptance and the oracle ratios; pure, from the tables alone."""
    drafts = list(tables)
    mal: dict[str, dict[str, float]] = {d: {} for d in drafts}
    rate: dict[str, dict[str, float]] = {d: {} for d in drafts}
    ost: dict[str, float] = {}
    odyn: dict[str, float] = {}
    choice: dict[str, dict[str, int]] = {}
    for dom in domains:
        idx = [i for i, t in enumerate(trajs) if t["domain"] == dom and t["tokens"]]
        per = [{d: tables[d][i] for d in drafts} for i in idx]
        for d in drafts:
            p = pooled([replay_static(tp, d, gamma) for tp in per])
            mal[d][dom], rate[d][dom] = p["mean_acceptance_length"], p["acceptance_rate"]
        statics = [oracle_static(tp, gamma) for tp in per]
        choice[dom] = dict(Counter(name for name, _ in statics))
        ost[dom] = pooled([r for _, r in statics])["mean_acceptance_length"]
        odyn[dom] = pooled([oracle_dynamic(tp, gamma, interval) for tp in per])[
            "mean_acceptance_length"]
    st_over_gen = {dom: ost[dom] / mal[general][dom] for dom in domains}
    dyn_over_st = {dom: odyn[dom] / ost[dom] for dom in domains}
    return {
        "drafts": drafts,
        "domains": list(domains),
        "mean_acceptance_length": mal,
        "acceptance_rate": rate,
        "oracle_static_mean_acceptance_length": ost,
        "oracle_dynamic_mean_acceptance_length": odyn,
        "oracle_static_choice": choice,
        "oracle_static_over_general": {**st_over_gen, "gmean": gmean(list(st_over_gen.values()))},
        "oracle_dynamic_over_oracle_static": {**dyn_over_st,
                                              "gmean": gmean(list(dyn_over_st.values()))},
        "oracle_dynamic_interval": interval,
    }


# --------------------------------------------------------------------------- measurements


def drop_page_cache(path: Path) -> None:
    """Evict one file from the page cache so the next read comes from storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # only clean pages can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_load_s(pool: PoolConfig, vocab: int, repeats: int = LOAD_REPEATS,
                   parts=None) -> tuple[dict[str, float], dict[str, float]]:
    """Median cold (and one warm) read-into-slot + bind per draft; the slot is preallocated
    (``parts``: the resident target's, which heads bind to)."""
    slot = SlotBuffer(slot_capacity(pool))
    cold: dict[str, float] = {}
    warm: dict[str, float] = {}
    for d in pool.drafts:
        weights = draft_weights_file(d.path)
        times = []
        for _ in range(repeats):
            drop_page_cache(weights)
            t0 = time.perf_counter()
            load_into_slot(d.name, d.path, slot, target_vocab=vocab, parts=parts)
            times.append(time.perf_counter() - t0)
        cold[d.name] = statistics.median(times)
        t0 = time.perf_counter()
        load_into_slot(d.name, d.path, slot, target_vocab=vocab, parts=parts)
        warm[d.name] = time.perf_counter() - t0
        _log(f"load {d.name}: cold {cold[d.name] * 1e3:.1f} ms, warm {warm[d.name] * 1e3:.1f} ms")
    return cold, warm


def _compare(engine_acc: Sequence[int], engine_pos: Sequence[int], table_acc: Sequence[int],
             table_pos: Sequence[int]) -> tuple[int, int, int | None]:
    """(compared, mismatching, first mismatch position) while both runs are at one position."""
    compared = mismatched = 0
    first = None
    for ea, ep, ta, tp in zip(engine_acc, engine_pos, table_acc, table_pos):
        if ep != tp:
            break
        compared += 1
        if ea != ta:
            mismatched += 1
            first = ep if first is None else first
    return compared, mismatched, first


def engine_check(engine: SpecEngine, name: str, trajs: Sequence[dict],
                 tables: Sequence[Sequence[int]]) -> tuple[dict[str, Any], list[float]]:
    """Run the real engine with one draft; compare per-iteration accepted with the replay.

    Also returns the steady iteration times (the first iteration of a run is excluded: it
    prefills the draft over the whole prompt).
    """
    report: dict[str, Any] = {"draft": name, "prompts": 0, "iterations_compared": 0,
                              "mismatching_iterations": 0, "trajectory_divergences": 0,
                              "mismatches": []}
    times: list[float] = []
    # a table is the draft's own iterations: none handed to the lookup (LOOKUP_FIRST)
    first, engine.lookup_first = engine.lookup_first, 0
    try:
        for traj, table in zip(trajs, tables):
            _check_one(engine, name, traj, table, report, times)
    finally:
        engine.lookup_first = first
    return report, times


def _check_one(engine: SpecEngine, name: str, traj: dict, table: Sequence[int],
           report: dict[str, Any], times: list[float]) -> None:
    tokens = traj["tokens"]
    if not tokens:
        return
    out, stats = engine.generate(traj["prompt_ids"], len(tokens), select=lambda s: name)
    recs = stats.records
    times += [r.duration for r in recs[1:]]
    emitted = [r.emitted for r in recs]
    eng_acc = capped_engine_accepts([r.accepted for r in recs], emitted, len(tokens))
    eng_pos = [sum(emitted[:i]) for i in range(len(recs))]
    rep = replay_static({name: table}, name, engine.gamma)
    n, bad, first = _compare(eng_acc, eng_pos, rep.accepted, rep.positions)
    report["prompts"] += 1
    report["iterations_compared"] += n
    report["mismatching_iterations"] += bad
    report["trajectory_divergences"] += int(out != tokens)
    if first is not None:
        report["mismatches"].append({"id": traj["id"], "position": first})


# --------------------------------------------------------------------------- the command


def evaluate(pool: PoolConfig, engine: SpecEngine, trajs: Sequence[dict],
             check_per_domain: int = ENGINE_CHECK_PER_DOMAIN) -> dict[str, Any]:
    """Everything but the trajectories: tables, oracles, exactness, load and iteration cost.
    ``engine`` holds the target in the runtime's precision, ``trajs`` are its own greedy
    trajectories (`engine_trajectories`)."""
    vocab = engine.vocab
    # the prompts' domains: a pool's domains, or "mixed" for the mixed workload
    domains = list(dict.fromkeys(t["domain"] for t in trajs))
    bound = bind_pool(pool, engine)
    tables = runtime_tables(engine, bound, trajs)
    report = acceptance_report(tables, trajs, pool.general, domains, pool.gamma, pool.N)
    picked = [i for dom in domains
              for i in [j for j, t in enumerate(trajs) if t["domain"] == dom][:check_per_domain]]
    _log(f"engine check: {pool.general} on {len(picked)} prompts")
    spec = pool.general_draft
    check, times = engine_check(engine, spec.name, [trajs[i] for i in picked],
                                [tables[spec.name][i] for i in picked])
    load_s, warm_s = measure_load_s(pool, vocab, parts=engine.target_parts)
    iter_s = statistics.median(times) if times else float("nan")
    report.update({
        "table_vs_engine": check,
        "draft_load_s": load_s,
        "draft_load_warm_s": warm_s,
        "sd_iteration_s": iter_s,
        "sd_iteration_samples": len(times),
        "load_over_iteration": {d: s / iter_s for d, s in load_s.items()},
        "draft_bytes": {d.name: draft_weights_file(d.path).stat().st_size for d in pool.drafts},
        "draft_kinds": {n: b.kind for n, b in bound.items()},
        "fingerprint": pool_fingerprint(pool),  # sha256 of each draft's weights
        "gamma": pool.gamma,
        "trajectories": sum(1 for t in trajs if t["tokens"]),
        "trajectory_tokens": sum(len(t["tokens"]) for t in trajs),
        "max_new_tokens": MAX_NEW_TOKENS,
        "machine": machine_info(),
    })
    return report


def format_report(r: dict[str, Any]) -> str:
    """The JSON object as a readable table."""
    doms, lines = r["domains"], []
    head = f"{'':>16}" + "".join(f"{d:>10}" for d in doms)
    lines.append(f"mean acceptance length ({r.get('split', 'dev')} split, gamma={r['gamma']}, "
                 f"{r['prompts_per_domain']} prompts/domain, {r['max_new_tokens']} new tokens)")
    lines.append(head)
    for d in r["drafts"]:
        lines.append(f"{d:>16}" + "".join(f"{r['mean_acceptance_length'][d][x]:>10.3f}"
                                          for x in doms))
    for key, label in (("oracle_static_mean_acceptance_length", "oracle-static"),
                       ("oracle_dynamic_mean_acceptance_length", "oracle-dynamic")):
        lines.append(f"{label:>16}" + "".join(f"{r[key][x]:>10.3f}" for x in doms))
    lines.append("")
    lines.append(head + f"{'gmean':>10}")
    for key, label in (("oracle_static_over_general", "ostatic/general"),
                       ("oracle_dynamic_over_oracle_static", "odyn/ostatic")):
        lines.append(f"{label:>16}" + "".join(f"{r[key][x]:>10.3f}" for x in [*doms, "gmean"]))
    lines.append("")
    lines.append(f"one SD iteration ({r['table_vs_engine']['draft']}, gamma={r['gamma']}): "
                 f"{r['sd_iteration_s'] * 1e3:.1f} ms (median of {r['sd_iteration_samples']})")
    for d in r["drafts"]:
        lines.append(f"load {d:>10}: cold {r['draft_load_s'][d] * 1e3:8.1f} ms  warm "
                     f"{r['draft_load_warm_s'][d] * 1e3:8.1f} ms  load/iteration "
                     f"{r['load_over_iteration'][d]:6.2f}  {r['draft_bytes'][d] / 2**20:6.1f} MB")
    c = r["table_vs_engine"]
    lines.append(f"table vs engine: {c['mismatching_iterations']} mismatching of "
                 f"{c['iterations_compared']} iterations on {c['prompts']} prompts"
                 f" ({c['trajectory_divergences']} trajectory divergences)")
    return "\n".join(lines)


def main_eval(args) -> int:
    t0 = time.perf_counter()
    pool = load_pool(getattr(args, "pool", None))
    if not pool.drafts:
        raise ConfigError("the pool has no drafts to evaluate", "add [[drafts]] sections")
    per_domain = int(getattr(args, "prompts_per_domain", 20) or 20)
    split = getattr(args, "split", None) or "dev"
    prompts = split_prompts(split, pool_domains(pool), per_domain)
    engine, tok, dtype = open_engine(pool)
    out = runtime_traces_path(pool, split, numerics_key(dtype))
    _log(f"trajectories ({dtype} target, batch 1): {len(prompts)} prompts -> {out}")
    trajs = engine_trajectories(engine, dtype, tok, prompts, out, MAX_NEW_TOKENS, "zoo eval")
    report = evaluate(pool, engine, trajs)
    report["target_dtype"] = dtype
    report["numerics"] = numerics_key(dtype)
    report["prompts_per_domain"] = per_domain
    report["split"] = split
    report["wall_s"] = time.perf_counter() - t0
    if getattr(args, "json", False):
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0
