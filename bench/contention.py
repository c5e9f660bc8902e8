"""`memspec bench contention`: speed on a machine that other programs also use.

A user's device is never idle. In one run, per prompt (the README's and dev prompts), under
each load in turn, every variant back to back in a rotating order:

- loads: `quiet`; `busy1` (one same-priority spin loop); `busy2` (two); `busy1-nice10`
  (one at nice 10); `membw` (a loop copying a 256 MB array: the memory bus); `startstop`
  (one spin loop that starts `ON_S` into the request and stops at `OFF_S`: how fast the
  decoder takes the core back, from per-token timelines: the run against the same
  request run just before with the load paused throughout, token for token);
- variants: memspec and target-only through the three processes (`memspec up`, one server
  each, so no policy learns from another's requests), the same with `threads=1` per request
  (the one-thread pipeline), llama.cpp on the same GGUF at every core and at one thread
  (its C API, greedy); on `quiet` also memspec and target-only as they ran before the
  decoder's threads followed the free CPU (`MEMSPEC_POOL=openmp
  MEMSPEC_THREAD_POLICY=static`: OpenMP loops, threads from the helpers alone).

Every clock runs from the call to the last token (prefill included; an end-of-generation
token not counted). Ratios are geometric means over prompts with 95% intervals (prompts
resampled within domains); a bound holds when the interval's lower end clears it. At the
end the memspec server sits idle (`IDLE_S`) and the CPU of all its processes is read.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from memspec.bench.floor import UpProcess, prompts, settle
from memspec.bench.peers import LlamaCpp, order, unavailable
from memspec.common.errors import MemspecError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.common.provenance import provenance

SPIN = "while True: pass"
NICE_SPIN = "import os\nos.nice(10)\nwhile True: pass"
# ~256 MB read and written per pass: far past every cache, as a video or a browser's
# decoder streams memory
MEMBW = ("import numpy as np\na = np.ones(1 << 25)\nb = np.empty_like(a)\n"
         "while True:\n    np.copyto(b, a)")
# each load program's first line: Linux kills it with the bench (PR_SET_PDEATHSIG), so an
# interrupted or killed bench leaves no spin loop eating a core behind it
DIE_WITH_BENCH = ("import ctypes, signal\ntry:\n    ctypes.CDLL(None).prctl(1, signal.SIGKILL, "
                  "0, 0, 0)\nexcept (OSError, AttributeError):\n    pass\n")
LOADS: dict[str, list[str]] = {"quiet": [], "busy1": [SPIN], "busy2": [SPIN, SPIN],
                               "busy1-nice10": [NICE_SPIN], "membw": [MEMBW],
                               "startstop": [SPIN]}
ON_S, OFF_S = 0.15, 0.55        # the startstop load, seconds after the call
STARTSTOP_TOKENS = 3            # x max_new: the request must outlast the load by a second
SETTLE_S = 0.3                  # unmeasured, before each run (llama.cpp's workers spin on)
LOAD_SETTLE_S = 0.5             # a load runs this long before the first run beside it
IDLE_S = 30.0
WINDOW_S = 0.1                  # the timeline plot's rate window
SPAN = 20                       # tokens a recovery is judged over
BACK = 0.85                     # "back to the quiet figure": a window at this share of it
BEFORE = {"MEMSPEC_POOL": "openmp", "MEMSPEC_THREAD_POLICY": "static"}
OURS = ("memspec", "target-only")
VARIANTS = ("memspec", "memspec-t1", "target-only", "target-only-t1", "llama.cpp",
            "llama.cpp-t1")
QUIET_ONLY = ("memspec-before", "target-only-before")
# (ratio, a, b, loads it is a bound on, bound)
BOUNDS: tuple[tuple[str, str, str, tuple[str, ...], float], ...] = (
    ("memspec_over_memspec_t1", "memspec", "memspec-t1", ("busy1", "busy2", "membw"), 0.9),
    ("target_only_over_target_only_t1", "target-only", "target-only-t1", ("busy1",), 0.9),
    ("memspec_over_llama_cpp", "memspec", "llama.cpp", ("busy1",), 2.0),
    ("target_only_over_llama_cpp", "target-only", "llama.cpp", (), 0.0),
    ("llama_cpp_over_llama_cpp_t1", "llama.cpp", "llama.cpp-t1", (), 0.0),
    ("memspec_over_before", "memspec", "memspec-before", ("quiet",), 0.97),
    ("target_only_over_before", "target-only", "target-only-before", ("quiet",), 0.97),
)
RECOVERY_BOUND_S = 0.5
IDLE_BOUND = 0.02


def _log(msg: str) -> None:
    print(f"[bench contention] {msg}", file=sys.stderr, flush=True)


class Load:
    """The programs of one load, started together; `startstop`'s is paused (SIGSTOP) until
    `during` resumes it for its window of a run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs = [subprocess.Popen([sys.executable, "-c", DIE_WITH_BENCH + code],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL) for code in LOADS[name]]
        if name == "startstop":
            self._signal(signal.SIGSTOP)
        time.sleep(LOAD_SETTLE_S if self.procs else 0.0)
        self.marks: tuple[float, float] | None = None

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, sig)

    def during(self, t0: float) -> threading.Thread | None:
        """For `startstop`: resume the load ON_S after `t0` and pause it at OFF_S (the
        times it really happened kept in `marks`, relative to t0)."""
        if self.name != "startstop":
            return None

        def run() -> None:
            time.sleep(max(0.0, t0 + ON_S - time.perf_counter()))
            self._signal(signal.SIGCONT)
            on = time.perf_counter() - t0
            time.sleep(max(0.0, t0 + OFF_S - time.perf_counter()))
            self._signal(signal.SIGSTOP)
            self.marks = (on, time.perf_counter() - t0)

        th = threading.Thread(target=run, daemon=True)
        th.start()
        return th

    def stop(self) -> None:
        self._signal(signal.SIGCONT)  # a stopped process takes no SIGTERM until it runs
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


class Ours(UpProcess):
    """A `memspec up` serving one variant (its own processes), reached with the Python API."""

    def __init__(self, name: str, pool: str | None, run_dir: str,
                 env: dict[str, str] | None = None) -> None:
        from memspec.launch.api import Runtime

        self.name, self.rt = name, None
        self.policy = name.split("-t1")[0].removesuffix("-before")
        self.threads = 1 if name.endswith("-t1") else None
        ep = f"ipc://{run_dir}/{name}.sock"
        super().__init__(["--endpoint", ep] + (["--pool", pool] if pool else []), env)
        self.rt = Runtime(ep).start()

    def run(self, prompt: str, max_new: int, eos: set[int], trace: bool) -> dict[str, Any]:
        from memspec.common.metrics import as_json

        t0 = time.perf_counter()
        r = self.rt.generate(prompt, max_new_tokens=max_new, policy=self.policy,
                             threads=self.threads, trace=trace)
        secs = time.perf_counter() - t0
        ids = [t for t in r.token_ids if t not in eos]
        st = as_json(r.stats)
        out: dict[str, Any] = {"tokens": len(ids), "seconds": secs, "ids": ids,
                               "e2e_s": st["time"]["e2e"], "timeline": []}
        if trace and st.get("trace"):
            out["timeline"] = [[round(it["t_start"] + it["t_draft"] + it["t_verify"]
                                      + it["t_catchup"], 5), it["emitted"], it.get("threads", 0)]
                               for it in st["trace"]["iterations"]]
        return out

    def stop(self) -> None:
        if getattr(self, "rt", None) is not None:
            self.rt.close()
        super().stop()


class Peer:
    """llama.cpp (C API, greedy) at a thread count, with each token's time kept."""

    def __init__(self, threads: int, gamma: int) -> None:
        self.llama = LlamaCpp(threads, gamma)

    def run(self, ids: Sequence[int], max_new: int, eos: set[int]) -> dict[str, Any]:
        times: list[float] = []
        t0 = time.perf_counter()
        out = self.llama.greedy(ids, max_new, eos, times)
        return {"tokens": len(out), "seconds": time.perf_counter() - t0, "ids": out,
                "timeline": [[round(t, 5), 1, self.llama.threads] for t in times]}


def timed_run(call: Callable[[], dict[str, Any]], load: Load, during: bool) -> dict[str, Any]:
    """One run after an unmeasured pause; with `during`, the startstop load runs in its
    window of it."""
    time.sleep(SETTLE_S)
    t0 = time.perf_counter()
    th = load.during(t0) if during else None
    run = call()
    run["decode_tok_s"] = decode_rate(run["timeline"])
    run["threads"] = thread_counts(run["timeline"])
    if th is not None:
        th.join()
        run["load_on_off_s"] = load.marks
    return run


def decode_rate(timeline: list[list[float]]) -> float:
    """Tokens a second from the first token to the last (the prefill left out)."""
    if len(timeline) < 2 or timeline[-1][0] <= timeline[0][0]:
        return 0.0
    return sum(n for _, n, _ in timeline[1:]) / (timeline[-1][0] - timeline[0][0])


def thread_counts(timeline: list[list[float]]) -> dict[str, int]:
    """Iterations per decoder thread count (the controller's choices over the request)."""
    out: dict[str, int] = {}
    for *_, th in timeline:
        out[str(th)] = out.get(str(th), 0) + 1
    return out


def token_times(timeline: list[list[float]]) -> list[float]:
    return [t for t, n, _ in timeline for _ in range(int(n))]


def rate_back_s(timeline: list[list[float]], off: float, quiet: list[list[float]]
                ) -> float | None:
    """Seconds from the load's end (`off`) until the run makes its tokens at `BACK` of the
    speed its quiet run made the same tokens (greedy: the same tokens, so the same drafts
    and acceptance), over `SPAN` tokens; None when the request ended before."""
    ts, qs = token_times(timeline), token_times(quiet)
    for i in range(min(len(ts), len(qs)) - SPAN):
        if ts[i] < off:
            continue
        if qs[i + SPAN] - qs[i] >= BACK * (ts[i + SPAN] - ts[i]):
            return ts[i] - off
    return None


def threads_back_s(timeline: list[list[float]], off: float) -> float | None:
    """Seconds from the load's end to the first iteration at the run's most threads."""
    most = max((th for *_, th in timeline), default=0)
    return next((max(0.0, t - off) for t, _, th in timeline if t >= off and th == most), None)


def gmean(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x > 0]
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(rows: list[dict[str, Any]], loads: Sequence[str]) -> dict[str, Any]:
    from memspec.bench.stats import headline_ratios

    out: dict[str, Any] = {}
    strata = {r["id"]: r["domain"] for r in rows}
    for load in loads:
        runs: dict[str, dict[str, list[tuple[float, float]]]] = {}
        for r in rows:
            for v, run in r["loads"].get(load, {}).items():
                if run["seconds"] > 0 and run["tokens"] > 0:
                    runs.setdefault(v, {})[r["id"]] = [(run["tokens"], run["seconds"])]
        pairs = {k: (a, b) for k, a, b, _, _ in BOUNDS}
        gm, ci = headline_ratios(runs, strata, pairs)
        tok_s = {v: gmean([t / s for (t, s), in per.values()]) for v, per in runs.items()}
        bounds = {k: {"bound": bound, "gmean": gm[k], "ci95": ci[k],
                      "met": bool(ci[k][0] >= bound)}
                  for k, _, _, on, bound in BOUNDS if load in on and k in gm}
        identical = all(run["ids"] == r["loads"][load]["target-only"]["ids"]
                        for r in rows if load in r["loads"]
                        for v, run in r["loads"][load].items()
                        if v.startswith(OURS) and run.get("ids") is not None)
        out[load] = {"tok_s_gmean": tok_s, "ratios": gm, "ci95": ci, "bounds": bounds,
                     "identical_tokens": identical}
    if "startstop" in loads:
        rec: dict[str, list] = {}
        for r in rows:
            for v, run in r["loads"].get("startstop", {}).items():
                rec.setdefault(v, []).append(run.get("recovery", {}))
        out["startstop"]["recovery"] = {
            v: {"rate_back_s": [x.get("rate_back_s") for x in xs],
                "threads_back_s": [x.get("threads_back_s") for x in xs],
                "worst_rate_back_s": max((x["rate_back_s"] for x in xs
                                          if x.get("rate_back_s") is not None), default=None),
                "median_rate_back_s": _median([x["rate_back_s"] for x in xs
                                               if x.get("rate_back_s") is not None]),
                "worst_threads_back_s": max((x["threads_back_s"] for x in xs
                                             if x.get("threads_back_s") is not None),
                                            default=None),
                "ended_first": sum(bool(x.get("ended_first")) for x in xs),
                "never_back": sum(x.get("rate_back_s") is None and not x.get("ended_first")
                                  for x in xs)}
            for v, xs in rec.items()}
        for v in OURS:
            r = out["startstop"]["recovery"].get(v)
            if r is not None:
                r["met"] = r["never_back"] == 0 and r["worst_rate_back_s"] is not None \
                    and r["worst_rate_back_s"] <= RECOVERY_BOUND_S
    return out


def idle_cpu(server: Ours, seconds: float) -> dict[str, Any]:
    """CPU of the server's processes (supervisor, decoder, loader, predictor, standby) over
    `seconds` with no request: their share of one core."""
    import psutil

    root = psutil.Process(server.p.pid)
    procs = [root, *root.children(recursive=True)]

    def times() -> dict[int, tuple[str, float]]:
        out = {}
        for p in procs:
            try:
                t = p.cpu_times()
                name = next((a.split(".")[-2] for a in p.cmdline() if a.startswith("memspec.")),
                            "supervisor")
                out[p.pid] = (name, t.user + t.system)
            except psutil.Error:
                pass
        return out

    a = times()
    t0 = time.perf_counter()
    time.sleep(seconds)
    b = times()
    dt = time.perf_counter() - t0
    per = {f"{name}:{pid}": (v - a[pid][1]) / dt for pid, (name, v) in b.items() if pid in a}
    return {"seconds": dt, "share_of_one_core": sum(per.values()), "per_process": per,
            "bound": IDLE_BOUND, "met": sum(per.values()) < IDLE_BOUND}


def run(pool: str | None, per_domain: int, max_new: int, loads: Sequence[str],
        idle_s: float = IDLE_S, log: Callable[[str], None] = _log) -> dict[str, Any]:
    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import encode_prompt, load_tokenizer

    cfg = load_pool(pool)
    why = unavailable(Path(cfg.target))
    if why is not None:
        raise MemspecError(f"bench contention runs llama.cpp beside memspec, and {why}")
    tok = load_tokenizer(Path(cfg.target))
    eos = {int(t) for t in ([tok.eos_token_id] if tok.eos_token_id is not None else [])}
    rows = prompts(per_domain) if per_domain > 0 else prompts(1)[:1]  # 0: the README's only
    cores = os.cpu_count() or 1
    log(f"{len(rows)} prompts x {len(loads)} loads ({', '.join(loads)}) x variants "
        f"({', '.join(VARIANTS)}; quiet also {', '.join(QUIET_ONLY)}); {max_new} new tokens "
        f"({STARTSTOP_TOKENS * max_new} under startstop)")
    with tempfile.TemporaryDirectory(prefix="memspec-contention-") as tmp:
        servers: dict[str, Ours] = {}
        try:
            for v in VARIANTS[:4] + (QUIET_ONLY if "quiet" in loads else ()):
                log(f"starting the {v} server")
                servers[v] = Ours(v, pool, tmp, BEFORE if v.endswith("-before") else None)
            peers = {"llama.cpp": Peer(cores, cfg.gamma), "llama.cpp-t1": Peer(1, cfg.gamma)}
            for s in servers.values():  # each server's own first request: its warm-up
                s.run(rows[0]["prompt"], 8, eos, False)
            for p in peers.values():
                p.run(encode_prompt(tok, rows[0]["prompt"]), 8, eos)
            for s in servers.values():
                settle(s.rt, f"the {s.name} server")
            out_rows = []
            t_start = time.perf_counter()
            for i, r in enumerate(rows):
                ids = encode_prompt(tok, r["prompt"])
                row: dict[str, Any] = {"id": r["id"], "domain": r["domain"], "loads": {}}
                for load in order(i, loads):
                    variants = VARIANTS + (QUIET_ONLY if load == "quiet" else ())
                    n = max_new * (STARTSTOP_TOKENS if load == "startstop" else 1)
                    got: dict[str, Any] = {}
                    ld = Load(load)
                    try:
                        for v in order(i, variants):
                            call = partial(peers[v].run, ids, n, eos) if v in peers else \
                                partial(servers[v].run, r["prompt"], n, eos, trace=True)
                            if load == "startstop":  # the same request with the load
                                ref = timed_run(call, ld, False)  # paused throughout: its
                                got[v] = timed_run(call, ld, True)  # quiet twin
                                got[v]["reference_timeline"] = ref.pop("timeline")
                                got[v]["reference_tok_s"] = ref["tokens"] / ref["seconds"]
                            else:
                                got[v] = timed_run(call, ld, False)
                                del got[v]["timeline"]
                    finally:
                        ld.stop()
                    row["loads"][load] = got
                out_rows.append(row)
                _recoveries(row)
                left = (time.perf_counter() - t_start) / (i + 1) * (len(rows) - i - 1)
                log(f"{i + 1}/{len(rows)} {r['id']}: " + "; ".join(
                    f"{load} " + " ".join(f"{v} {g['tokens'] / g['seconds']:.0f}"
                                          for v, g in row["loads"][load].items()
                                          if g["seconds"] > 0)
                    for load in loads) + f" tok/s (~{left / 60:.1f} min left)")
            log(f"the memspec server idle for {idle_s:.0f} s: its processes' CPU")
            idle = idle_cpu(servers["memspec"], idle_s)
        finally:
            for s in servers.values():
                s.stop()
    return {"provenance": provenance(), "machine": machine_line(),
            "machine_info": machine_info(), "pool": pool or "pool.toml (default)",
            "max_new_tokens": max_new, "startstop_tokens": STARTSTOP_TOKENS * max_new,
            "startstop_on_off_s": [ON_S, OFF_S], "loads": list(loads), "variants": VARIANTS,
            "quiet_only": QUIET_ONLY, "llama_cpp_threads": cores,
            "clock": "call to last token, prefill included; end-of-generation token not "
                     "counted", "summary": summarise(out_rows, loads), "idle": idle,
            "rows": _hashed_ids(out_rows)}


def _hashed_ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's token ids as a short hash once the summary has compared them."""
    import hashlib
    import json

    for r in rows:
        for runs in r["loads"].values():
            for run in runs.values():
                ids = run.pop("ids", None)
                if ids is not None:
                    run["ids_sha1"] = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]
    return rows


def _recoveries(row: dict[str, Any]) -> None:
    """Each startstop run's recovery against its quiet twin (the same request with the
    load paused throughout, run just before it)."""
    for run in row["loads"].get("startstop", {}).values():
        marks = run.get("load_on_off_s")
        if not marks or not run.get("timeline"):
            continue
        after = sum(1 for t in token_times(run["timeline"]) if t >= marks[1])
        back = rate_back_s(run["timeline"], marks[1], run["reference_timeline"])
        run["recovery"] = {"tokens_after_load": after,
                           "ended_first": after <= SPAN or (  # too short to judge
                               back is None and not judgeable(run, marks[1])),
                           "rate_back_s": back,
                           "threads_back_s": threads_back_s(run["timeline"], marks[1])}


def judgeable(run: dict[str, Any], off: float) -> bool:
    """Whether the run could show its rate back within the bound: a window of SPAN tokens
    starts at or after `RECOVERY_BOUND_S` past the load's end. One that ended sooner and was
    not back yet is too short to judge, not "never back" (31 tokens after the load, the
    threads back after 0.12-0.18 s of them: no 20-token window started after that)."""
    ts = token_times(run["timeline"])
    n = min(len(ts), len(token_times(run["reference_timeline"])))
    return any(ts[i] >= off + RECOVERY_BOUND_S for i in range(max(0, n - SPAN)))


def _print(res: dict[str, Any]) -> None:
    s = res["summary"]
    print(f"machine: {res['machine']}; llama.cpp at {res['llama_cpp_threads']} and 1 threads")
    for load in res["loads"]:
        x = s[load]
        print(f"{load}: tok/s " + ", ".join(f"{v} {t:.0f}" for v, t in x["tok_s_gmean"].items())
              + f"; identical tokens {x['identical_tokens']}")
        for k, g in x["ratios"].items():
            if not math.isnan(g):
                b = x["bounds"].get(k)
                tail = (f"  bound {b['bound']}: {'met' if b['met'] else 'NOT met'}"
                        if b else "")
                print(f"  {k} {g:.3f} [{x['ci95'][k][0]:.3f}, {x['ci95'][k][1]:.3f}]{tail}")
    rec = s.get("startstop", {}).get("recovery", {})
    for v, r in rec.items():
        worst = r["worst_rate_back_s"]
        back = f"within {worst:.2f} s" if worst is not None else "never"
        bound = ("" if "met" not in r else
                 f"  bound {RECOVERY_BOUND_S} s: {'met' if r['met'] else 'NOT met'}")
        print(f"startstop {v}: back to {BACK:.0%} of its quiet speed over the same tokens "
              f"{back} of the load's end (worst run; median {r['median_rate_back_s']}; "
              f"never back in {r['never_back']} runs, {r['ended_first']} too short); "
              f"threads back within {r['worst_threads_back_s']} s{bound}")
    idle = res["idle"]
    print(f"idle memspec up: {100 * idle['share_of_one_core']:.2f}% of one core over "
          f"{idle['seconds']:.0f} s (bound < {100 * IDLE_BOUND:.0f}%)")


def _plot(res: dict[str, Any], folder: Path, name: str) -> Path:
    from memspec.common.plotting import finish_figure, pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    last = folder
    for load in res["loads"]:
        x = res["summary"][load]
        fig, axes = plt.subplots(1, 2 if load == "startstop" else 1,
                                 figsize=(13 if load == "startstop" else 7, 4), squeeze=False)
        ax = axes[0][0]
        names = list(x["tok_s_gmean"])
        ax.bar(range(len(names)), [x["tok_s_gmean"][v] for v in names],
               color=["C0" if v.startswith("memspec") else "C1" if v.startswith("target")
                      else "C2" for v in names])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("end-to-end tokens/s (gmean over prompts)")
        ax.set_title(f"{load}", fontsize=10)
        if load == "startstop":
            ax2 = axes[0][1]
            row = next((r for r in res["rows"] if "startstop" in r["loads"]), None)
            for v, run in (row["loads"]["startstop"].items() if row else []):
                tl = run.get("timeline")
                if not tl or v.endswith("-before"):
                    continue
                ts = [t for t, n, _ in tl for _ in range(int(n))]
                mids, rates = [], []
                for k in range(len(ts)):
                    lo = ts[k] - WINDOW_S
                    c = sum(1 for u in ts[:k + 1] if u > lo)
                    mids.append(ts[k])
                    rates.append(c / WINDOW_S)
                ax2.plot(mids, rates, lw=1, label=v)
                on_off = run.get("load_on_off_s")
            if row and on_off:
                ax2.axvspan(on_off[0], on_off[1], color="grey", alpha=0.25,
                            label="busy core")
            ax2.set_xlabel("seconds since the call")
            ax2.set_ylabel(f"tokens/s over {WINDOW_S * 1e3:.0f} ms")
            ax2.set_title(f"one prompt's timeline ({row['id'] if row else ''})", fontsize=10)
            ax2.legend(fontsize=7)
        last = finish_figure(fig, folder / f"{name}_{load}.png", res["machine"], 110, 8)
    return last


def main_bench_contention(args: Any) -> int:
    loads = [x.strip() for x in (args.loads or ",".join(LOADS)).split(",") if x.strip()]
    bad = [x for x in loads if x not in LOADS]
    if bad:
        raise MemspecError(f"unknown load {', '.join(bad)}", f"use some of {', '.join(LOADS)}")
    res = run(args.pool, args.per_domain, args.max_new_tokens, loads, args.idle_s)
    _print(res)
    name = Path(args.json).stem if args.json else "bench_contention"
    save_outputs(res, args, lambda r, folder: _plot(r, folder, name), indent=None)
    return 0
