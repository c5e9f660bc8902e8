"""`memspec bench soak`: does a long-running server hold its memory?

Drives many requests through the three real processes (the policies in turn, prompts from
the dev split, drafts loading and switching as they do in service) and samples the RSS of
decoder, loader and predictor after every request. A server meant to run for days must
plateau: the figure that matters is the decoder's RSS after the last request over its RSS
after the warm-up (the 20th request by default), which should stay within 5%.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.provenance import result_provenance
from memspec.launch.api import Runtime
from memspec.zoo.prompts import DOMAINS, load_prompts

POLICIES = ("memspec", "mab-async", "general-static", "target-only")
CHECKPOINTS = (20, 100, 200)
LIMIT = 1.05  # decoder RSS after the last checkpoint / after the first


def _log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def _prompts(n: int) -> list[str]:
    rows = load_prompts("dev", DOMAINS, per_domain=-(-n // len(DOMAINS)))
    return [r["prompt"] for r in rows]


PROCS = ("decoder", "loader", "predictor")


def _rss(rt: Runtime) -> dict[str, float]:
    """Each process's RSS as `memspec status` reports it."""
    procs = rt.status().procs
    return {n: procs[n].rss_mb for n in PROCS if n in procs and procs[n].pid}


def soak(pool: str | None, requests: int, max_new: int, policies: tuple[str, ...] = POLICIES,
         checkpoints: tuple[int, ...] = CHECKPOINTS, prompts: list[str] | None = None
         ) -> dict[str, Any]:
    """Serve `requests` prompts (default: the dev split's, in turn); RSS per process after
    each one, plus the checkpoints."""
    prompts = prompts or _prompts(min(requests, 40 * len(DOMAINS)))
    series: list[dict[str, float]] = []
    load_before = os.getloadavg()[1]  # other work on the machine, for reading the figures
    t0 = time.perf_counter()
    # no standby decoder: the series is the serving processes' own
    rt = Runtime(pool=pool, standby=False).start()
    try:
        _log(f"ready; {requests} requests of {max_new} tokens, policies {', '.join(policies)}")
        for i in range(requests):
            try:
                rt.generate(prompts[i % len(prompts)], policy=policies[i % len(policies)],
                            max_new_tokens=max_new)
            except MemspecError as exc:
                raise MemspecError(f"request {i + 1} failed: {exc.problem}",
                                   "the processes' logs on stderr say why") from None
            series.append(_rss(rt))
            if (i + 1) in checkpoints or (i + 1) % 20 == 0:
                _log(f"{i + 1}/{requests}: " + ", ".join(f"{n} {v:.0f} MB"
                                                        for n, v in series[-1].items()))
        restarts = {n: p.restarts for n, p in rt.status().procs.items()}
    finally:
        rt.close()
    if any(restarts.values()):
        raise MemspecError(f"a process restarted during the soak ({restarts})",
                           "an RSS series across a restart means nothing; see the logs")
    marks = [c for c in checkpoints if c <= requests]
    at = {str(c): series[c - 1] for c in marks}
    first, last = (series[marks[0] - 1], series[marks[-1] - 1]) if marks else ({}, {})
    growth = {n: round(last[n] / first[n], 4) for n in last if first.get(n)}
    return {"requests": requests, "max_new_tokens": max_new, "policies": list(policies),
            "checkpoints": at, "last_over_first": growth,
            "decoder_within_limit": growth.get("decoder", 0.0) <= LIMIT,
            "limit": LIMIT, "wall_s": round(time.perf_counter() - t0, 1),
            "loadavg_5min": [round(load_before, 2), round(os.getloadavg()[1], 2)],
            "cpus": os.cpu_count(), "series": series}


def format_table(res: dict[str, Any]) -> str:
    marks = list(res["checkpoints"])
    lines = [f"RSS (MB) after N requests ({res['max_new_tokens']} tokens each, policies "
             f"{', '.join(res['policies'])} in turn)",
             f"{'process':<10}" + "".join(f"{'N=' + m:>10}" for m in marks)
             + f"{marks[-1] + '/' + marks[0] if marks else '':>12}"]
    for proc in PROCS:
        row = [res["checkpoints"][m].get(proc, 0.0) for m in marks]
        ratio = res["last_over_first"].get(proc)
        lines.append(f"{proc:<10}" + "".join(f"{v:10.1f}" for v in row)
                     + (f"{ratio:12.3f}" if ratio else ""))
    verdict = "within" if res["decoder_within_limit"] else "OVER"
    load = res.get("loadavg_5min", [0.0, 0.0])
    lines.append(f"decoder growth {verdict} the {100 * (res['limit'] - 1):.0f}% limit "
                 f"({res['wall_s']:.0f} s; 5-min load {load[0]:.1f} -> {load[1]:.1f} "
                 f"on {res.get('cpus')} CPUs)")
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    from memspec.common.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(1, len(res["series"]) + 1)
    for proc in PROCS:
        ax.plot(xs, [s.get(proc, 0.0) for s in res["series"]], label=proc)
    ax.set_xlabel("requests served")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("memory per process over a soak")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main_bench_soak(args) -> int:
    requests = getattr(args, "requests", None) or CHECKPOINTS[-1]
    res = soak(args.pool, requests, args.max_new_tokens)
    print(format_table(res))
    if args.json:
        res = {"provenance": result_provenance(args.pool), **res}  # what it measured
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if args.plots:
        Path(args.plots).mkdir(parents=True, exist_ok=True)
        plot(res, Path(args.plots) / "soak_rss.png")
    return 0 if res["decoder_within_limit"] else 1
