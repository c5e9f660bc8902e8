"""`memspec bench faults`: what a decoder crash costs a request, and how fast it is back.

Greedy requests through the three real processes, each with a `kill -9` of the decoder at
a random early point of its stream (after its first or second token message). Every request
must complete with the tokens of an uninterrupted run (resumed on the restarted decoder:
launch/resume.py). Per kill it records the decoder's recovery (the crash noticed by the
supervisor -> the new decoder's Ready), its start-up split (procs/decoder/startup.py: the
process start and imports, then each phase), the part of the recovery outside the decoder
(noticing the exit, the spawn, the Ready's relay) and the request's pause (crash noticed ->
its tokens flowing again: the recovery plus the continuation's prefill and first interval).
Kills alternate between the two successors a server can have: the standby decoder
(procs/decoder/standby.py: what `memspec up` keeps while idle) and a fresh process (the
cold path: `--no-standby`, or a crash before the standby is prepared).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.messages import Done, Message, Submit, Tokens
from memspec.common.provenance import result_provenance
from memspec.launch.supervisor import Supervisor
from memspec.zoo.prompts import DOMAINS, load_prompts

GOAL_S = 3.0  # median decoder recovery the runtime aims for on a CPU


def _log(msg: str) -> None:
    print(f"[faults] {msg}", file=sys.stderr, flush=True)


def _isa() -> str:
    from memspec.common.isa import chosen_isa

    return chosen_isa()


PATHS = ("standby", "cold")  # the successor: the standby decoder, or a fresh process


def _standby_memory_mb(pid: int) -> dict[str, float]:
    """What an idle standby costs: its resident and its unique (private) memory."""
    import psutil

    try:
        full = psutil.Process(pid).memory_full_info()
    except psutil.Error:
        return {"rss_mb": 0.0, "uss_mb": 0.0}
    return {"rss_mb": round(full.rss / 2**20, 1), "uss_mb": round(full.uss / 2**20, 1)}


def _prepare(sup: Supervisor, path: str, deadline_s: float = 120.0) -> dict[str, float]:
    """Make the next crash take `path`: a prepared standby waiting, or none at all."""
    if path == "cold":
        sup.set_standby(False)
        return {}
    sup.set_standby(True)
    end = time.monotonic() + deadline_s
    while not sup.standby_ready:
        if time.monotonic() > end:
            raise MemspecError(f"no standby decoder was ready after {deadline_s:.0f}s",
                               f"see the decoder's log in {sup.run_dir}")
        sup.tick(50)
    return _standby_memory_mb(sup.standby.pid)


def run_faults(pool: str | None, kills: int, max_new: int, seed: int = 0) -> dict[str, Any]:
    """`kills` kills per path (standby, cold), the paths interleaved."""
    prompts = [r["prompt"] for r in load_prompts("dev", DOMAINS, 1)]
    rng = random.Random(seed)
    sup = Supervisor(pool, standby=True)
    load_before = os.getloadavg()[1]
    rows: list[dict[str, Any]] = []
    memory: list[dict[str, float]] = []
    t0 = time.perf_counter()
    try:
        sup.start()
        first = dict(sup.procs["decoder"].info.startup)
        _log(f"ready; references for {len(prompts)} prompts, then {kills} kills with a "
             f"standby decoder and {kills} without, interleaved")
        ref = {}
        for p in prompts:
            done = sup.run(Submit(req_id=secrets.token_hex(4), prompt=p, policy="target-only",
                                  max_new_tokens=max_new), timeout_s=600)
            if not isinstance(done, Done):
                raise MemspecError(f"a reference request failed ({done})",
                                   f"see the logs in {sup.run_dir}")
            ref[p] = done.token_ids
        for i in range(2 * kills):
            path = PATHS[i % 2]
            mem = _prepare(sup, path)
            if mem:
                memory.append(mem)
            prompt = prompts[(i // 2) % len(prompts)]
            dec = sup.procs["decoder"]
            pid, restarts, at = dec.pid, dec.restarts, rng.choice([1, 2])
            seen: list[int] = []
            killed_at: list[float] = []

            def on_reply(msg: Message, pid=pid, at=at, seen=seen, killed_at=killed_at) -> None:
                if isinstance(msg, Tokens) and msg.ids:
                    seen.append(len(msg.ids))
                    if len(seen) == at and pid is not None:
                        os.kill(pid, 9)
                        killed_at.append(time.monotonic())

            done = sup.run(Submit(req_id=secrets.token_hex(4), prompt=prompt, policy="memspec",
                                  max_new_tokens=max_new), on_reply, timeout_s=600)
            if not isinstance(done, Done):
                raise MemspecError(f"request {i + 1} was lost to the kill "
                                   f"({getattr(done, 'message', 'timed out')})",
                                   f"see the logs in {sup.run_dir}")
            if dec.restarts != restarts + 1 or not killed_at:
                raise MemspecError(f"kill {i + 1} did not land mid-request",
                                   f"use more tokens (--max-new-tokens > {max_new})")
            split = dict(dec.info.startup)
            rows.append({"path": path, "recovery_s": dec.recovery_s,
                         "noticed_s": dec.ready_at - dec.recovery_s - killed_at[0],
                         "resume_wait_s": done.stats.resume_wait_s,
                         "resumed_after": done.stats.resumed_tokens,
                         "identical": done.token_ids == ref[prompt],
                         "resumed": done.stats.resumed, "split": split,
                         "outside_decoder_s": dec.recovery_s - sum(split.values()),
                         # the continuation's own start: its prefill (prompt and the tokens
                         # resumed after) and the wait for its first ranking
                         "prefill_s": done.stats.time.prefill,
                         "first_ranking_s": done.stats.time.prediction})
            _log(f"kill {i + 1}/{2 * kills} ({path}): back in {dec.recovery_s:.2f}s, stream "
                 f"paused {done.stats.resume_wait_s:.2f}s, tokens "
                 f"{'identical' if rows[-1]['identical'] else 'DIFFERENT'}")
    finally:
        sup.shutdown()
    return {"kills": kills, "max_new_tokens": max_new, "isa": _isa(),
            "paths": {path: _summary([r for r in rows if r["path"] == path])
                      for path in PATHS},
            "standby_memory_mb": {k: statistics.median(m[k] for m in memory)
                                  for k in ("rss_mb", "uss_mb")} if memory else {},
            "first_start_split_s": first, "all_identical": all(r["identical"] for r in rows),
            "all_resumed": all(r["resumed"] == 1 for r in rows), "goal_s": GOAL_S,
            "wall_s": round(time.perf_counter() - t0, 1),
            "loadavg_5min": [round(load_before, 2), round(os.getloadavg()[1], 2)],
            "cpus": os.cpu_count(), "rows": rows}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    rec = [r["recovery_s"] for r in rows]
    wait = [r["resume_wait_s"] for r in rows]
    phases = list(dict.fromkeys(ph for r in rows for ph in r["split"]))
    return {"recovery_s": {"median": statistics.median(rec), "max": max(rec)},
            "resume_wait_s": {"median": statistics.median(wait), "max": max(wait)},
            "split_median_s": {ph: statistics.median(r["split"].get(ph, 0.0) for r in rows)
                               for ph in phases},
            "outside_decoder_median_s": statistics.median(r["outside_decoder_s"]
                                                          for r in rows),
            "continuation_median_s": {k: statistics.median(r[k] for r in rows)
                                      for k in ("prefill_s", "first_ranking_s")}}


def format_table(res: dict[str, Any]) -> str:
    paths = res["paths"]
    sb = paths["standby"]["recovery_s"]["median"]
    verdict = "meets" if sb <= res["goal_s"] else "MISSES"
    lines = [f"decoder kill -9 mid-request, {res['kills']} times with a standby decoder and "
             f"{res['kills']} without, interleaved ({res['max_new_tokens']} greedy tokens per "
             f"request, {res['isa']} kernels, {res['cpus']} CPUs)",
             f"{'seconds':<52}{'standby':>10}{'cold':>10}"]

    def row(label: str, get) -> None:  # noqa: ANN001
        lines.append(f"{label:<52}" + "".join(f"{get(paths[p]):10.3f}" for p in PATHS))

    row("decoder recovery (crash noticed -> ready), median",
        lambda s: s["recovery_s"]["median"])
    row("  max", lambda s: s["recovery_s"]["max"])
    row("request paused (-> its tokens again), median", lambda s: s["resume_wait_s"]["median"])
    row("  max", lambda s: s["resume_wait_s"]["max"])
    lines.append("recovery split, medians (first start of this run at the right):")
    first = res["first_start_split_s"]
    phases = list(dict.fromkeys(ph for p in PATHS for ph in paths[p]["split_median_s"]))
    for ph in phases:
        lines.append(f"  {ph:<50}" + "".join(
            f"{paths[p]['split_median_s'].get(ph, 0.0):10.3f}" for p in PATHS)
            + f"{first.get(ph, 0.0):10.3f}")
    row("  supervisor (noticing the exit, spawn or go, Ready)",
        lambda s: s["outside_decoder_median_s"])
    row("then the resumed request's prefill", lambda s: s["continuation_median_s"]["prefill_s"])
    lines.append(f"with a standby: median recovery {sb:.2f} s ({verdict} the "
                 f"{res['goal_s']:.0f} s goal); requests: "
                 f"{'all' if res['all_identical'] else 'NOT all'} identical to an "
                 f"uninterrupted run, {'all' if res['all_resumed'] else 'NOT all'} resumed")
    mem = res["standby_memory_mb"]
    if mem:
        lines.append(f"an idle standby decoder: RSS {mem['rss_mb']:.0f} MB, of which "
                     f"{mem['uss_mb']:.0f} MB its own (USS; the rest shared libraries)")
    load = res["loadavg_5min"]
    lines.append(f"{res['wall_s']:.0f} s; 5-min load {load[0]:.1f} -> {load[1]:.1f}")
    return "\n".join(lines)


def main_bench_faults(args) -> int:
    if args.kills < 1:
        raise MemspecError(f"--kills {args.kills} is below 1", "ask for at least 1 (default 10)")
    res = run_faults(args.pool, args.kills, args.max_new_tokens)
    print(format_table(res))
    if args.json:
        res = {"provenance": result_provenance(args.pool), **res}  # what it measured
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["all_identical"] and res["all_resumed"] else 1
