"""`memspec bench faults`: what a decoder crash costs a request, and how fast it is back.

Greedy requests through the three real processes, each with a `kill -9` of the decoder at
a random early point of its stream (after its first or second token message). Every request
must complete with the tokens of an uninterrupted run (resumed on the restarted decoder:
launch/resume.py). Per kill it records the decoder's recovery (the crash noticed by the
supervisor -> the new decoder's Ready), its start-up split (procs/decoder/startup.py: the
process start and imports, then each phase), the part of the recovery outside the decoder
(noticing the exit, the spawn, the Ready's relay) and the request's pause (crash noticed ->
its tokens flowing again: the recovery plus the continuation's prefill and first interval).
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
from memspec.launch.supervisor import Supervisor
from memspec.zoo.prompts import load_prompts

DOMAINS = ("general", "code", "math", "law", "medical")
GOAL_S = 3.0  # median decoder recovery the runtime aims for on a CPU


def _log(msg: str) -> None:
    print(f"[faults] {msg}", file=sys.stderr, flush=True)


def _isa() -> str:
    from memspec.common.isa import chosen_isa

    return chosen_isa()


def run_faults(pool: str | None, kills: int, max_new: int, seed: int = 0) -> dict[str, Any]:
    prompts = [r["prompt"] for r in load_prompts("dev", DOMAINS, 1)]
    rng = random.Random(seed)
    sup = Supervisor(pool)
    load_before = os.getloadavg()[1]
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        sup.start()
        first = dict(sup.procs["decoder"].info.startup)
        _log(f"ready; references for {len(prompts)} prompts, then {kills} kills")
        ref = {}
        for p in prompts:
            done = sup.run(Submit(req_id=secrets.token_hex(4), prompt=p, policy="target-only",
                                  max_new_tokens=max_new), timeout_s=600)
            if not isinstance(done, Done):
                raise MemspecError(f"a reference request failed ({done})",
                                   f"see the logs in {sup.run_dir}")
            ref[p] = done.token_ids
        for i in range(kills):
            prompt = prompts[i % len(prompts)]
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
            rows.append({"recovery_s": dec.recovery_s,
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
            _log(f"kill {i + 1}/{kills}: back in {dec.recovery_s:.2f}s, stream paused "
                 f"{done.stats.resume_wait_s:.2f}s, tokens "
                 f"{'identical' if rows[-1]['identical'] else 'DIFFERENT'}")
    finally:
        sup.shutdown()
    rec = [r["recovery_s"] for r in rows]
    wait = [r["resume_wait_s"] for r in rows]
    phases = list(rows[0]["split"]) if rows else []
    return {"kills": kills, "max_new_tokens": max_new, "isa": _isa(),
            "recovery_s": {"median": statistics.median(rec), "max": max(rec)},
            "resume_wait_s": {"median": statistics.median(wait), "max": max(wait)},
            "split_median_s": {ph: statistics.median(r["split"].get(ph, 0.0) for r in rows)
                               for ph in phases},
            "outside_decoder_median_s": statistics.median(r["outside_decoder_s"]
                                                          for r in rows),
            "continuation_median_s": {k: statistics.median(r[k] for r in rows)
                                      for k in ("prefill_s", "first_ranking_s")},
            "first_start_split_s": first, "all_identical": all(r["identical"] for r in rows),
            "all_resumed": all(r["resumed"] == 1 for r in rows), "goal_s": GOAL_S,
            "wall_s": round(time.perf_counter() - t0, 1),
            "loadavg_5min": [round(load_before, 2), round(os.getloadavg()[1], 2)],
            "cpus": os.cpu_count(), "rows": rows}


def format_table(res: dict[str, Any]) -> str:
    r, w = res["recovery_s"], res["resume_wait_s"]
    verdict = "meets" if r["median"] <= res["goal_s"] else "MISSES"
    lines = [f"decoder kill -9 mid-request, {res['kills']} times ({res['max_new_tokens']} "
             f"greedy tokens per request, {res['isa']} kernels, {res['cpus']} CPUs)",
             f"decoder recovery (crash noticed -> ready): median {r['median']:.2f} s, max "
             f"{r['max']:.2f} s ({verdict} the {res['goal_s']:.0f} s goal)",
             f"request paused (crash noticed -> its tokens again): median {w['median']:.2f} s,"
             f" max {w['max']:.2f} s",
             f"requests: {'all' if res['all_identical'] else 'NOT all'} identical to an "
             f"uninterrupted run, {'all' if res['all_resumed'] else 'NOT all'} resumed",
             "recovery split, median seconds (first start of this run beside it):"]
    first = res["first_start_split_s"]
    for ph, v in res["split_median_s"].items():
        lines.append(f"  {ph:<14}{v:8.3f}{first.get(ph, 0.0):10.3f}")
    lines.append(f"  {'supervisor':<14}{res['outside_decoder_median_s']:8.3f}"
                 "   (noticing the exit, the spawn, the Ready)")
    cont = res["continuation_median_s"]
    lines.append(f"then the resumed request: prefill {cont['prefill_s']:.3f} s, first ranking "
                 f"{cont['first_ranking_s']:.3f} s (medians)")
    load = res["loadavg_5min"]
    lines.append(f"{res['wall_s']:.0f} s; 5-min load {load[0]:.1f} -> {load[1]:.1f}")
    return "\n".join(lines)


def main_bench_faults(args) -> int:
    if args.kills < 1:
        raise MemspecError(f"--kills {args.kills} is below 1", "ask for at least 1 (default 10)")
    res = run_faults(args.pool, args.kills, args.max_new_tokens)
    print(format_table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0 if res["all_identical"] and res["all_resumed"] else 1
