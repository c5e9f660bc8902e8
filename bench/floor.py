"""`memspec bench floor`: is memspec ever slower than plain decoding, and does the pipeline
keep the engine's speed? Measured side by side, end to end, on held-out (dev) prompts.

- **cold**: one fresh `memspec generate --json` per prompt and policy (three processes
  started, a decoder that has never run a request), policies interleaved per prompt:
  memspec and general-static against target-only, and target-only `--in-process`
  (the engine alone, every core) against target-only through the three processes;
- **warm**: one long-lived `memspec up` per policy, each serving only its own policy (no
  policy's costs or gate can come from another's requests), and an in-process engine in
  this process; the same prompts, interleaved.

Per prompt: end-to-end tokens/s (request arrival to last token: prefill, loads, binds,
prediction and scheduling all counted) and the ratios; geometric means, the worst prompt,
memspec's time split (which must add up to its wall clock), how often the predictor ranked
and its share of decode time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memspec.common.errors import MemspecError
from memspec.common.machine import machine_info, machine_line
from memspec.common.plotting import save_outputs
from memspec.zoo.prompts import DOMAINS, load_prompts

MEMSPEC = [sys.executable, "-m", "memspec"]
README_PROMPT = "Write a Python function that returns the factorial of n."
COLD = ("target-only", "memspec", "general-static")


def _log(msg: str) -> None:
    print(f"[bench floor] {msg}", file=sys.stderr, flush=True)


def gmean(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return float(statistics.geometric_mean(xs)) if xs else 0.0


def prompts(per_domain: int) -> list[dict]:
    rows = load_prompts("dev", DOMAINS, per_domain=per_domain)
    return [{"id": "readme", "domain": "code", "prompt": README_PROMPT}] + \
        [{"id": r["id"], "domain": r["domain"], "prompt": r["prompt"]} for r in rows]


def generate(prompt: str, policy: str, max_new: int, pool: str | None,
             in_process: bool = False) -> dict[str, Any]:
    """A fresh `memspec generate --json`: its stats (the decoder's clock) and its tokens."""
    cmd = [*MEMSPEC, "generate", "--fresh", "--json", "--policy", policy, "--max-new-tokens",
           str(max_new)]
    cmd += (["--pool", pool] if pool else []) + (["--in-process"] if in_process else [])
    t0 = time.perf_counter()
    out = subprocess.run([*cmd, prompt], capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise MemspecError(f"memspec generate failed: {out.stderr.strip()[-300:]}")
    res = json.loads(out.stdout)
    res["wall_s"] = time.perf_counter() - t0
    return res


def settle(rt, what: str, bound_s: float = 120.0) -> None:  # noqa: ANN001
    """Until a `memspec up`'s standby decoder is prepared (it starts one once idle for a
    second), where the server keeps one: a warm server has it, and its imports must not
    land in a measured request. A server whose decoder restarts within the budget keeps
    none (launch/supervisor.py): nothing to wait for."""
    deadline = time.monotonic() + bound_s
    while True:
        dec = rt.status().procs["decoder"]
        if dec.standby_pid is not None or not dec.standby_kept:
            return
        if time.monotonic() > deadline:
            raise MemspecError(f"{what} prepared no standby decoder in {bound_s:.0f}s",
                               "see its decoder log")
        time.sleep(0.2)


class UpProcess:
    """`memspec up` in a subprocess, its stderr collected, ready once it says so."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.p = subprocess.Popen([*MEMSPEC, "up", "--no-stdin", *args],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE,
                                  env=None if env is None else {**os.environ, **env})
        self.err = bytearray()
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 300
        while b"ready on" not in self.err:
            if self.p.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise MemspecError(f"memspec up did not start: {self.err.decode()[-500:]}")
            time.sleep(0.05)

    def _pump(self) -> None:
        while part := self.p.stderr.read1(4096):
            self.err.extend(part)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()


class Server(UpProcess):
    """`memspec up` serving one policy (its own processes), reached with the Python API."""

    def __init__(self, policy: str, pool: str | None, run_dir: str, name: str = "",
                 env: dict[str, str] | None = None) -> None:
        from memspec.bench.realruns import variant
        from memspec.launch.api import Runtime

        self.policy, self.rt = policy, None
        self._runs = variant(policy)  # (policy, gate): `X-ungated` is X with the gate off
        ep = f"ipc://{run_dir}/{name or policy}.sock"
        super().__init__(["--endpoint", ep] + (["--pool", pool] if pool else []), env)
        self.rt = Runtime(ep).start()

    def settle(self) -> None:
        settle(self.rt, f"the {self.policy} server")

    def generate(self, prompt: str, max_new: int, policy: str | None = None
                 ) -> dict[str, Any]:
        """A request of the server's policy, or of `policy` (e.g. target-only beside it)."""
        from memspec.common.metrics import as_json

        policy, gate = self._runs if policy is None else (policy, None)
        r = self.rt.generate(prompt, max_new_tokens=max_new, policy=policy, gate=gate)
        return {"token_ids": r.token_ids, "stats": as_json(r.stats)}

    def stop(self) -> None:
        if getattr(self, "rt", None) is not None:
            self.rt.close()
        super().stop()


def _row(res: dict[str, Any]) -> dict[str, Any]:
    s = res["stats"]
    t = s["time"]
    return {"e2e_tok_s": s["tokens_per_s_e2e"], "steady_tok_s": s["tokens_per_s_steady"],
            "tokens": s["generated_tokens"], "time": t, "drafted": s["num_draft_tokens"],
            "mean_acceptance_length": s["mean_acceptance_length"], "loads": s["loads"],
            "snapshots": s.get("snapshots", 0), "predictor_s": s.get("predictor_s", 0.0),
            "accepted_counts": s.get("accepted_counts", []), "ids": res["token_ids"]}


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median end-to-end speed (its whole record: split, tokens), with
    every repeat's speed beside it."""
    ranked = sorted(rows, key=lambda r: r["e2e_tok_s"])
    mid = dict(ranked[(len(ranked) - 1) // 2])
    mid["repeats_e2e_tok_s"] = [r["e2e_tok_s"] for r in rows]
    return mid


SHOWN = (("memspec/target-only", "memspec", "target-only"),
         ("pipeline/in-process", "target-only", "in-process"))


def interleaved(rows: list[dict], policies: tuple[str, ...], repeats: int, run_one,
                label: str, log: Callable[[str], None] | None = None,
                shown_pairs: tuple[tuple[str, str, str], ...] = SHOWN) -> list[dict[str, Any]]:
    """Every prompt's policies interleaved, the order alternating, `repeats` times; per
    prompt and policy the median repeat (single runs of fresh processes vary by +-15% on a
    busy 2-core VM)."""
    out = []
    t0 = time.perf_counter()
    for i, r in enumerate(rows):
        got: dict[str, list] = {p: [] for p in policies}
        for rep in range(repeats):
            order = policies if (i + rep) % 2 == 0 else tuple(reversed(policies))
            for p in order:
                got[p].append(_row(run_one(r["prompt"], p)))
        med = {p: _median_row(v) for p, v in got.items()}
        out.append({"id": r["id"], "domain": r["domain"], **med})
        left = (time.perf_counter() - t0) / (i + 1) * (len(rows) - i - 1)
        shown = [f"{name} {med[a]['e2e_tok_s'] / med[b]['e2e_tok_s']:.3f}"
                 for name, a, b in shown_pairs if a in med and b in med]
        (log or _log)(f"{label} {i + 1}/{len(rows)}: {', '.join(shown)} (~{left / 60:.0f} min left)")
    return out


def ratio_summary(runs: list[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    """Per prompt `a` over `b` end to end, their geometric mean and the worst prompt; the
    same from paired repeats (each repeat's `a` over the `b` run beside it, the median per
    prompt: the VM's speed drifts over minutes, and a pair shares its minute); and the
    geometric mean's 95% interval (bench/stats.py: prompts within domains and repeats
    resampled)."""
    ratios = [r[a]["e2e_tok_s"] / r[b]["e2e_tok_s"] for r in runs if r[b]["e2e_tok_s"] > 0]
    paired = [statistics.median(x / y for x, y in zip(r[a]["repeats_e2e_tok_s"],
                                                      r[b]["repeats_e2e_tok_s"]) if y > 0)
              for r in runs if r[b]["e2e_tok_s"] > 0]
    return {"gmean": gmean(ratios), "min": min(ratios, default=0.0), "per_prompt": ratios,
            "ci95": interval(runs, a, b), "paired_gmean": gmean(paired),
            "paired_min": min(paired, default=0.0), "paired_per_prompt": paired}


def interval(runs: list[dict[str, Any]], a: str, b: str) -> list[float]:
    """The 95% interval of the geometric mean of `a` over `b` end to end."""
    from memspec.bench.stats import headline_ratios

    def repeats(row: dict[str, Any]) -> list[tuple[float, float]]:
        return [(row["tokens"], row["tokens"] / v) for v in row["repeats_e2e_tok_s"] if v > 0]

    data = {p: {r["id"]: repeats(r[p]) for r in runs} for p in (a, b)}
    _, ci = headline_ratios(data, {r["id"]: r["domain"] for r in runs}, {"r": (a, b)})
    return ci.get("r", [float("nan"), float("nan")])


def first_requests(rows: list[dict], pool: str | None, max_new: int, repeats: int = 1
                   ) -> dict[str, Any]:
    """memspec and target-only each as a fresh process's first request (`memspec generate
    --json`, policies interleaved per prompt): what a user who starts memspec for one
    prompt gets, beside the warm figures of `memspec bench`'s real runs."""
    runs = interleaved(rows, ("target-only", "memspec"), repeats,
                        lambda prompt, policy: generate(prompt, policy, max_new, pool),
                        "first request")
    return {"prompts": len(runs), "repeats": repeats,
            "memspec_over_target_only_e2e": ratio_summary(runs, "memspec", "target-only"),
            "memspec_e2e_tok_s": [r["memspec"]["e2e_tok_s"] for r in runs],
            "target_only_e2e_tok_s": [r["target-only"]["e2e_tok_s"] for r in runs],
            "identical_tokens": all(r["memspec"]["ids"] == r["target-only"]["ids"]
                                    for r in runs)}


def run(pool: str | None, per_domain: int, max_new: int, repeats: int = 2,
        warm: bool = True) -> dict[str, Any]:
    rows = prompts(per_domain)
    _log(f"{len(rows)} prompts (the README's + {per_domain} dev per domain), {max_new} new "
         f"tokens, {repeats} repeats; cold: {', '.join(COLD)} and target-only in process; "
         "warm: one server per policy")

    def cold_one(prompt: str, policy: str) -> dict[str, Any]:
        if policy == "in-process":
            return generate(prompt, "target-only", max_new, pool, True)
        return generate(prompt, policy, max_new, pool)

    cold = interleaved(rows, (*COLD, "in-process"), repeats, cold_one, "cold")
    out: dict[str, Any] = {"machine": machine_line(), "machine_info": machine_info(),
                           "max_new_tokens": max_new, "prompts": len(rows),
                           "repeats": repeats, "cold": cold, "cold_summary": summarise(cold)}
    if warm:
        out["warm"] = run_warm(rows, pool, max_new, repeats)
        out["warm_summary"] = summarise(out["warm"])
    return out


def run_warm(rows: list[dict], pool: str | None, max_new: int, repeats: int
             ) -> list[dict[str, Any]]:
    import torch

    from memspec.common.config import load_pool
    from memspec.procs.decoder.forward.threads import decoder_threads
    from memspec.procs.decoder.inprocess import build_local, run_request
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    with tempfile.TemporaryDirectory(prefix="memspec-floor-") as tmp:
        servers = {p: Server(p, pool, tmp) for p in COLD}
        try:
            torch.set_num_threads(decoder_threads()[0])
            local = build_local(load_pool(pool))
            for s in servers.values():  # each server's first request is its own warm-up
                s.generate(rows[0]["prompt"], 8)
            for s in servers.values():
                s.settle()
            run_request(local, rows[0]["prompt"], "target-only", 8, SamplingParams())

            def warm_one(prompt: str, policy: str) -> dict[str, Any]:
                if policy == "in-process":
                    return run_request(local, prompt, "target-only", max_new, SamplingParams())
                return servers[policy].generate(prompt, max_new)

            return interleaved(rows, (*COLD, "in-process"), repeats, warm_one, "warm")
        finally:
            for s in servers.values():
                s.stop()


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def ratios(a: str, b: str, key: str = "e2e_tok_s") -> list[float]:
        return [r[a][key] / r[b][key] for r in runs if r[b][key] > 0]

    pays = [r for r in runs if r["general-static"]["e2e_tok_s"] > r["target-only"]["e2e_tok_s"]]
    split = [r["memspec"]["time"] for r in runs]
    decode = sum(t["decode"] for t in split)
    return {
        "memspec_over_target_only_e2e": ratio_summary(runs, "memspec", "target-only"),
        "memspec_over_target_only_steady": gmean(ratios("memspec", "target-only",
                                                        "steady_tok_s")),
        "general_static_over_target_only_e2e": gmean(ratios("general-static", "target-only")),
        "where_general_static_pays": {
            "prompts": len(pays),
            "memspec_over_general_static_e2e": gmean(
                [r["memspec"]["e2e_tok_s"] / r["general-static"]["e2e_tok_s"] for r in pays]),
            "paired": ratio_summary(pays, "memspec", "general-static") if pays else None},
        "pipeline_over_in_process_target_only_e2e": ratio_summary(runs, "target-only",
                                                                  "in-process"),
        "identical_tokens": all(r[p]["ids"] == r["target-only"]["ids"]
                                for r in runs for p in ("memspec", "general-static")),
        "time_split_max_other_share": max((abs(t["other"]) / t["e2e"] for r in runs
                                           for p in COLD for t in [r[p]["time"]] if t["e2e"]),
                                          default=0.0),
        "memspec_predictor_share_of_decode": (sum(r["memspec"]["predictor_s"] for r in runs)
                                              / decode if decode else 0.0),
        "memspec_snapshots_per_request": statistics.fmean(
            [r["memspec"]["snapshots"] for r in runs]) if runs else 0.0,
        "memspec_drafted_share": statistics.fmean(
            [r["memspec"]["drafted"] / max(1, r["memspec"]["tokens"]) for r in runs])
        if runs else 0.0,
    }


def _print(res: dict[str, Any]) -> None:
    print(f"machine: {res['machine']}; {res['prompts']} prompts x {res['max_new_tokens']} tokens")
    for phase in ("cold", "warm"):
        s = res.get(f"{phase}_summary")
        if not s:
            continue
        m = s["memspec_over_target_only_e2e"]
        print(f"{phase}: memspec / target-only e2e gmean {m['gmean']:.3f} "
              f"[{m['ci95'][0]:.3f}, {m['ci95'][1]:.3f}] (min {m['min']:.3f}; paired repeats: "
              f"{m['paired_gmean']:.3f}, min {m['paired_min']:.3f}), "
              f"steady {s['memspec_over_target_only_steady']:.3f}; general-static / target-only "
              f"{s['general_static_over_target_only_e2e']:.3f}; where general-static pays "
              f"({s['where_general_static_pays']['prompts']} prompts) memspec / it "
              f"{s['where_general_static_pays']['memspec_over_general_static_e2e']:.3f}")
        p = s["pipeline_over_in_process_target_only_e2e"]
        print(f"{phase}: pipeline / in-process target-only e2e gmean {p['gmean']:.3f} "
              f"[{p['ci95'][0]:.3f}, {p['ci95'][1]:.3f}] (min {p['min']:.3f}; paired "
              f"{p['paired_gmean']:.3f}, min {p['paired_min']:.3f}); identical tokens {s['identical_tokens']}; time split "
              f"unaccounted <= {100 * s['time_split_max_other_share']:.2f}%; predictor "
              f"{100 * s['memspec_predictor_share_of_decode']:.2f}% of memspec's decode time, "
              f"{s['memspec_snapshots_per_request']:.1f} snapshots a request")


def _plot(res: dict[str, Any], folder: Path, name: str = "bench_floor") -> Path:
    """``name``: the JSON file's stem, so a run per kernel path keeps its own plot."""
    from memspec.common.plotting import finish_figure, pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, phase in zip(axes, ("cold", "warm")):
        runs = res.get(phase) or []
        ids = [r["id"].removeprefix("dev-") for r in runs]
        for off, (a, lab) in enumerate((("memspec", "memspec"), ("general-static", "general-static"),
                                        ("in-process", "target-only in process"))):
            ys = [r[a]["e2e_tok_s"] / r["target-only"]["e2e_tok_s"] for r in runs]
            ax.bar([i + 0.27 * (off - 1) for i in range(len(runs))], ys, 0.27, label=lab)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.97, color="r", ls="--", lw=0.8, label="0.97")
        ax.set_xticks(range(len(runs)), ids, rotation=90, fontsize=6)
        ax.set_title(f"{phase}: end-to-end tokens/s over pipeline target-only")
        ax.legend(fontsize=7)
    return finish_figure(fig, folder / f"{name}.png", res["machine"])


def main_bench_floor(args) -> int:
    res = run(args.pool, args.per_domain, args.max_new_tokens, repeats=max(1, args.repeats),
              warm=not args.no_warm)
    _print(res)
    name = Path(args.json).stem if args.json else "bench_floor"
    save_outputs(res, args, lambda r, folder: _plot(r, folder, name))
    return 0
