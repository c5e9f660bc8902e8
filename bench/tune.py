"""`memspec bench tune`: every knob the runtime uses, chosen on dev by one committed sweep.

Writes tuned.json (read by the runtime through common/tuned.py): per knob its value, the
grid it was chosen from, and the dev figure that chose it. dev2 and test2 prompts are never
read.

- **gate** (ALPHA, FIRST_LOOK, NEAR_MISS, STOP_INSIDE, PROBE_SHARE, PRIOR_TAU): `bench gate`'s sweep
  (bench/gate_sweep.py), on a grid that brackets each value it chose before, and then its
  choice against the committed constants in real runs on dev (bench/tune_gate_check.py:
  the simulator has mispredicted this gate three times); the winner ships;
- **ranking** (RANK_HORIZON, PREDICTOR_SHARE): when memspec asks the predictor again, and
  how much of a request's decode time its encoding may take; replayed with the predictor's
  own rankings at every position (sim/scores.py);
- **ucb_c** for the MAB policies (one value in the pool, for both), on a grid that brackets
  its optimum (a best value at an edge widens the grid once);
- **lookup** (the context lookup's minimum suffix; 0: off): each value re-traces dev (the
  lookup changes what every draft proposes), in a scratch artefact folder;
- **CHUNKED_WAIT_S**: how long a prefill goes on in chunks awaiting the first ranking,
  simulated with the measured predictor and with one ten times slower;
- **PREFILL_CHUNK**: the prefill piece while a ranking is awaited, timed for real in
  process: the smallest piece costing at most `CHUNK_COST` over one whole prefill;
- **lookup_gate** (LOOKUP_LOOKS, LOOKUP_FAILING): when the gate starts to judge the context
  lookup, in real runs, one warm server per setting (bench/tune_lookup_gate.py: the
  simulator has no table for the lookup run alone);
- **lookup_depth** (DEPTH_PRIOR, DEPTH_WEIGHT): how long the context lookup's proposals are
  (procs/decoder/drafts/lookup_depth.py): the prior from lookup-only's accepted counts on dev per
  suffix-match bucket, the prior's weight in real runs, one warm server per setting
  (bench/tune_lookup_depth.py);
- **head_vocab** (head.VOCAB): how many rows of its frequency-ranked draft vocabulary a head
  scores, in real runs, one warm server per setting (bench/tune_head.py);
- **head_stop** (head.STOP): the top probability below which a head's own proposal ends an
  iteration's proposals, likewise (bench/tune_head.py);
- **head_first** (head.FIRST): the top probability below which a head proposes nothing
  and its iteration is a target step, likewise;
- **lookup_first** (engine.LOOKUP_FIRST): the shortest context-suffix match at which a
  head's iteration runs the lookup alone (0: never); real runs, as head_vocab.
- **head_prior** (gate.HEAD_PRIOR): with LOOKUP_FIRST, the prior a head's record in the
  gate starts from (its dev tokens an iteration where the lookup leaves it) and its weight;
  real runs, as head_vocab.
- **plan_budget** (oracle.PLAN_BUDGET): how wide oracle-dynamic's plan search may go, its
  search time counted beside the plan it finds (bench/tune_plan.py).

The real-run sections run in that order, each on the values chosen before it in the same
run (`SoFar`). head.VOCAB, head.STOP and head.FIRST key the acceptance tables, so where
this run chose others, head_prior and plan_budget read dev tables traced again with them
(`tables_home`), and the pool's tables are re-made by `memspec trace` before the new tuned.json ships.

The simulator replays the runtime's own loop on the traced dev prompts at the measured cost
model and at cheaper iterations (SPEC_SCALES), as `bench gate` does; it is deterministic,
so ties keep the current value. Every simulated choice must also keep memspec at or above
the floors `bench gate` uses (GMEAN_FLOOR, FLOOR) against target-only.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from memspec.bench.evaluation import UCB_C as EVAL_UCB_C
from memspec.bench.gate_sweep import FLOOR, GMEAN_FLOOR, SPEC_SCALES, gate_constants, gmean, sweep
from memspec.common.config import PoolConfig, load_pool
from memspec.common.errors import ConfigError
from memspec.common.paths import DEFAULT_POOL, HOME_ENV, PACKAGE_ROOT, memspec_home
from memspec.common.plotting import save_outputs
from memspec.common.provenance import result_provenance
from memspec.common.tuned import TUNED_ENV, TUNED_FILE
from memspec.procs.decoder import engine as engine_mod
from memspec.procs.decoder.sched import loop as loop_mod
from memspec.sim.costmodel import CostModel
from memspec.sim.simulate import SimRequest, simulate

GATE_GRID: dict[str, tuple[Any, ...]] = {
    "ALPHA": (0.05, 0.1, 0.2, 0.3),
    "FIRST_LOOK": (2, 4, 8),
    "NEAR_MISS": (0.25, 0.5, 0.75),
    "STOP_INSIDE": (0, 8, 10**6),  # 0: never, 10**6: always (a choice, not a range)
    "PROBE_SHARE": (0.01, 0.02),  # capped: the probes may cost at most 2% of a request
    "PRIOR_TAU": (0.0, 1.8, 2.0, 2.2, 2.5, 10**6),  # 0: no free look, 10**6: always one
}
RANK_HORIZON = (0, 32, 64, 128, 320, 10**6)  # 10**6: never ask again
PREDICTOR_SHARE = (0.01, 0.02, 0.04, 0.08)
UCB_C = EVAL_UCB_C  # the grid `memspec bench` tunes c on too
LOOKUP = (0, 1, 2, 3, 4)
CHUNKED_WAIT_S = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0)
PREDICTOR_SLOWER = (1.0, 10.0)  # the measured predictor, and one ten times slower
PREFILL_CHUNK = (16, 32, 64, 128)
CHUNK_COST = 1.03  # a chunked prefill may cost this much of one whole prefill (median)
CHUNK_REPEATS = 3


def _log(msg: str) -> None:
    print(f"[bench tune] {msg}", file=sys.stderr, flush=True)


def _scaled(cost: CostModel, f: float) -> CostModel:
    return replace(cost, spec_s={d: s * f for d, s in cost.spec_s.items()})


def _rate(policy: str, req: SimRequest, cost: CostModel, cfg, general: str,  # noqa: ANN001
          ucb_c: float = 2.0) -> float:
    s = simulate(policy, req, cost, cfg, ucb_c, resident=(general,)).report()
    return s.generated_tokens / s.time.e2e if s.time.e2e > 0 else 0.0


def _over_target(policy: str, reqs: Sequence[SimRequest], cost: CostModel, cfg,  # noqa: ANN001
                 general: str, ucb_c: float = 2.0) -> dict[str, float]:
    """`policy` over target-only end to end at every spec scale: the geometric mean over
    the scales (what a choice is ranked by), the worst scale's mean and the worst prompt."""
    means, worst = [], 1e9
    for f in SPEC_SCALES:
        c = _scaled(cost, f)
        r = [_rate(policy, q, c, cfg, general, ucb_c) / _rate("target-only", q, c, cfg, general)
             for q in reqs]
        means.append(gmean(r))
        worst = min(worst, min(r))
    return {"over_scales": gmean(means), "worst_gmean": min(means), "worst_prompt": worst}


def _safe(row: Mapping[str, Any]) -> bool:
    return row["worst_gmean"] >= GMEAN_FLOOR and row["worst_prompt"] >= FLOOR


def choose(rows: Sequence[dict[str, Any]], current: Any, key: str = "over_scales",
           safe: Callable[[Mapping[str, Any]], bool] = _safe) -> dict[str, Any]:
    """The safe row that scores most (ties: the current value), else the best of all."""
    pool = [r for r in rows if safe(r)] or list(rows)
    top = max(r[key] for r in pool)
    tied = [r for r in pool if r[key] >= top - 1e-12]
    return next((r for r in tied if r["value"] == current), tied[0])


@contextlib.contextmanager
def module_value(module, name: str, value: Any) -> Iterator[None]:  # noqa: ANN001
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# --------------------------------------------------------------------------- sections


def tune_gate(reqs, cost, cfg, general) -> dict[str, Any]:  # noqa: ANN001
    res = sweep(reqs, cost, cfg, general, grid=GATE_GRID, progress=_log)
    best = res["best"]
    return {"grid": res["grid"], "chosen": best["setting"],
            "figure": {k: best[k] for k in ("over_scales", "worst_gmean", "worst_prompt")},
            "current": None if res["current"] is None else
            {k: res["current"][k] for k in ("setting", "over_scales", "worst_gmean",
                                            "worst_prompt")},
            "settings": len(res["table"])}


def tune_ranking(reqs, cost, cfg, general) -> dict[str, Any]:  # noqa: ANN001
    from memspec.procs.decoder.sched.gate import SpecGate

    rows = []
    for h in RANK_HORIZON:
        for share in PREDICTOR_SHARE:
            with gate_constants({"RANK_HORIZON": h}), \
                    module_value(loop_mod, "PREDICTOR_SHARE", share):
                rows.append({"value": (h, share), **_over_target("memspec", reqs, cost, cfg,
                                                                   general)})
    best = choose(rows, (SpecGate.RANK_HORIZON, loop_mod.PREDICTOR_SHARE))
    return {"grid": {"RANK_HORIZON": list(RANK_HORIZON),
                     "PREDICTOR_SHARE": list(PREDICTOR_SHARE)},
            "rows": rows, "chosen": best["value"], "figure": best}


def tune_ucb(reqs, cost, cfg, general, current: float) -> dict[str, Any]:  # noqa: ANN001
    grid = list(UCB_C)

    def row(c: float) -> dict[str, Any]:
        per = {p: _over_target(p, reqs, cost, cfg, general, c) for p in ("mab-sync", "mab-async")}
        return {"value": c, "over_scales": gmean([v["over_scales"] for v in per.values()]),
                "by_policy": per}

    rows = [row(c) for c in grid]
    for _ in range(2):  # an optimum at the top edge widens the grid that way
        if max(rows, key=lambda r: r["over_scales"])["value"] != grid[-1]:
            break
        grid.append(grid[-1] * 3)
        rows.append(row(grid[-1]))
    # among equals the largest c: as much exploration as costs nothing on dev (below some
    # c the bandits are greedy, and every smaller c scores the same)
    best = choose(rows[::-1], current, safe=lambda r: True)
    edge = best["value"] in (grid[0], grid[-1])
    return {"grid": grid, "rows": rows, "chosen": best["value"], "figure": best,
            "bracketed": not edge}


def tune_chunked_wait(reqs, cost, cfg, general) -> dict[str, Any]:  # noqa: ANN001
    rows = []
    for w in CHUNKED_WAIT_S:
        by = {}
        for slow in PREDICTOR_SLOWER:
            c = replace(cost, predict_s=cost.predict_s * slow)
            with module_value(loop_mod, "CHUNKED_WAIT_S", w):
                by[str(slow)] = _over_target("memspec", reqs, c, cfg, general)
        rows.append({"value": w, "over_scales": gmean([v["over_scales"] for v in by.values()]),
                     "worst_gmean": min(v["worst_gmean"] for v in by.values()),
                     "worst_prompt": min(v["worst_prompt"] for v in by.values()),
                     "by_predictor_speed": by})
    best = choose(rows, loop_mod.CHUNKED_WAIT_S)
    return {"grid": list(CHUNKED_WAIT_S), "predictor_slower": list(PREDICTOR_SLOWER),
            "rows": rows, "chosen": best["value"], "figure": best}


def _scratch_home(root: Path) -> Path:
    """An artefact folder sharing every built artefact but the traces (a lookup setting's
    traces must not replace the pool's); its files are copies, so a trace writing one
    leaves the real one alone."""
    home = root / "home"
    home.mkdir()
    for entry in memspec_home().iterdir():
        if entry.name == "traces":
            continue
        if entry.is_dir():
            (home / entry.name).symlink_to(entry)
        else:
            shutil.copy2(entry, home / entry.name)
    return home


@contextlib.contextmanager
def home_env(home: Path | None) -> Iterator[None]:
    """$MEMSPEC_HOME set to `home` for the duration (None: unchanged)."""
    old = os.environ.get(HOME_ENV)
    if home is not None:
        os.environ[HOME_ENV] = str(home)
    try:
        yield
    finally:
        if home is not None:
            if old is None:
                os.environ.pop(HOME_ENV, None)
            else:
                os.environ[HOME_ENV] = old


def _pool_with_lookup(pool_file: Path, lookup: int, folder: Path) -> Path:
    """The pool file with `lookup` set, its relative paths made absolute."""
    import re

    base = pool_file.resolve().parent
    text = pool_file.read_text()
    text = re.sub(r'(?m)^lookup\s*=.*$', f"lookup = {lookup}", text)
    if not re.search(r"(?m)^lookup\s*=", text):
        text = text.replace("[pool]", f"[pool]\nlookup = {lookup}", 1)
    text = re.sub(r'(?m)^(path\s*=\s*")(?![/$])', lambda m: m.group(1) + str(base) + "/", text)
    out = folder / f"lookup{lookup}.toml"
    out.write_text(text)
    return out


def trace_dev(pool_file: Path, per_domain: int, home: Path, what: str) -> None:
    """`memspec trace` of the first `per_domain` dev prompts per domain into the artefact
    folder `home` (a scratch one: the pool's own traces stay as they are)."""
    cmd = [sys.executable, "-m", "memspec", "trace", "--pool", str(pool_file), "--sets",
           f"dev:{per_domain}", "--check-per-domain", "0"]
    done = subprocess.run(cmd, env=dict(os.environ, **{HOME_ENV: str(home)}),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        raise ConfigError(f"tracing dev {what} failed: "
                          f"{done.stderr.strip().splitlines()[-1:]}",
                          f"run `memspec trace --sets dev:{per_domain}` alone to see why")


def tune_lookup(pool_file: Path, per_domain: int, cost: CostModel, max_new: int,
                current: int) -> dict[str, Any]:
    from memspec.bench.evaluation import sim_config, traced_requests

    rows = []
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        home = _scratch_home(Path(tmp))
        for n in LOOKUP:
            t0 = time.perf_counter()
            path = _pool_with_lookup(pool_file, n, Path(tmp))
            if n != current:  # the current setting's dev traces are the pool's own
                shutil.rmtree(home / "traces", ignore_errors=True)
                trace_dev(path, per_domain, home, f"with lookup = {n}")
            with home_env(home if n != current else None):
                pool = load_pool(str(path))
                reqs = traced_requests(pool, "dev", per_domain, scores=False)
            cfg = sim_config(pool, cost, max_new_tokens=max_new)
            row = {"value": n}
            for policy in ("memspec", "general-static"):
                row[policy] = _over_target(policy, reqs, cost, cfg, pool.general)
            row.update({k: row["memspec"][k] for k in ("over_scales", "worst_gmean",
                                                       "worst_prompt")})
            rows.append(row)
            _log(f"lookup {n}: memspec / target-only {row['over_scales']:.3f}, general-static "
                 f"{row['general-static']['over_scales']:.3f} ({time.perf_counter() - t0:.0f} s)")
    best = choose(rows, current)
    return {"grid": list(LOOKUP), "rows": rows, "chosen": best["value"], "figure": best}


def tune_prefill_chunk(pool: PoolConfig, prompts: Sequence[str]) -> dict[str, Any]:
    """Chunked against whole prefills of the same prompts, interleaved per prompt (the
    VM's speed drifts over minutes); per chunk the median of per-prompt ratios."""
    from memspec.procs.decoder.forward.threads import apply_threads, decoder_threads
    from memspec.procs.decoder.inprocess import build_local
    from memspec.procs.decoder.models import encode_prompt
    from memspec.procs.decoder.sched.acceptance import SamplingParams

    rt = build_local(pool, with_drafts=False)
    # threads as the decoder sets them (PyTorch's only where the forward calls its kernels)
    apply_threads(decoder_threads()[0], torch_ops=not rt.engine.exact_chunks)
    ids = [encode_prompt(rt.tokenizer, p) for p in prompts]

    def prefill(tokens: list[int], chunk: int) -> float:
        with module_value(engine_mod, "PREFILL_CHUNK", chunk or 10**9):
            t0 = time.perf_counter()
            rt.engine.start(tokens, 1, SamplingParams(), None, (lambda: True) if chunk else None)
            return time.perf_counter() - t0

    for t in ids[:2]:
        prefill(t, 0)  # warm-up
    ratios: dict[int, list[float]] = {c: [] for c in PREFILL_CHUNK}
    for rep in range(CHUNK_REPEATS):
        for t in ids:
            order = (0, *PREFILL_CHUNK) if rep % 2 == 0 else (*reversed(PREFILL_CHUNK), 0)
            got = {c: prefill(t, c) for c in order}
            for c in PREFILL_CHUNK:
                ratios[c].append(got[c] / got[0])
        _log(f"prefill chunk: repeat {rep + 1}/{CHUNK_REPEATS}")
    rows = [{"value": c, "over_whole": statistics.median(ratios[c])} for c in PREFILL_CHUNK]
    ok = [r for r in rows if r["over_whole"] <= CHUNK_COST]
    best = min(ok, key=lambda r: r["value"]) if ok else min(rows, key=lambda r: r["over_whole"])
    lens = sorted(len(t) for t in ids)
    return {"grid": list(PREFILL_CHUNK), "rows": rows, "chosen": best["value"], "figure": best,
            "rule": f"smallest chunk with median prefill time <= {CHUNK_COST} x one piece",
            "prompt_tokens_median": lens[len(lens) // 2]}


# --------------------------------------------------------------------------- the file


def knobs_from(res: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """tuned.json's knobs: value, grid, and the dev figure that chose it."""
    out: dict[str, dict[str, Any]] = {}
    from memspec.bench.tune_gate_check import gate_dev_figure

    g = res["gate"]
    for k, v in g["chosen"].items():
        out[f"gate.{k}"] = {"value": v, "grid": g["grid"][k], "chosen_by": "gate",
                            "dev": gate_dev_figure(g)}
    r = res["ranking"]
    for i, k in enumerate(("gate.RANK_HORIZON", "loop.PREDICTOR_SHARE")):
        name = k.split(".")[1]
        out[k] = {"value": r["chosen"][i], "grid": r["grid"][name], "chosen_by": "ranking",
                  "dev": f"memspec / target-only e2e {r['figure']['over_scales']:.3f} "
                         f"(worst prompt {r['figure']['worst_prompt']:.3f})"}
    w = res["chunked_wait"]
    out["loop.CHUNKED_WAIT_S"] = {
        "value": w["chosen"], "grid": w["grid"], "chosen_by": "chunked_wait",
        "dev": f"memspec / target-only e2e {w['figure']['over_scales']:.3f} over predictor "
               f"speeds x{w['predictor_slower']}"}
    p = res["prefill_chunk"]
    out["engine.PREFILL_CHUNK"] = {
        "value": p["chosen"], "grid": p["grid"], "chosen_by": "prefill_chunk",
        "dev": f"chunked / whole prefill {p['figure']['over_whole']:.3f} (median of dev "
               f"prompts; {p['rule']})"}
    u = res["ucb_c"]
    out["pool.ucb_c"] = {"value": u["chosen"], "grid": u["grid"], "chosen_by": "ucb_c",
                         "bracketed": u["bracketed"],
                         "dev": f"MAB policies / target-only e2e "
                                f"{u['figure']['over_scales']:.3f} (gmean of both)"}
    lg = res["lookup_gate"]
    f = lg["figure"]
    for i, k in enumerate(("LOOKUP_LOOKS", "LOOKUP_FAILING")):
        out[f"gate.{k}"] = {
            "value": lg["chosen"][i], "grid": lg["grid"][k], "chosen_by": "lookup_gate",
            "dev": f"memspec / target-only e2e {f['gmean']:.3f} [{f['ci95'][0]:.3f}, "
                   f"{f['ci95'][1]:.3f}], worst prompt {f['min']:.3f} (real runs, "
                   f"{lg['prompts']} prompts x {lg['repeats']}; lookup-only "
                   f"{lg['lookup_only']['gmean']:.3f})"}
    ld = res["lookup_depth"]
    f = ld["figure"]
    dev = (f"memspec / target-only e2e {f['gmean']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}], "
           f"worst prompt {f['min']:.3f} (real runs, {ld['prompts']} prompts x {ld['repeats']})")
    out["lookup.DEPTH_PRIOR"] = {"value": ld["prior"], "grid": None, "chosen_by": "lookup_depth",
                                 "dev": f"lookup-only's accepted counts by suffix match "
                                        f"{ld['counts']} on dev"}
    out["lookup.DEPTH_WEIGHT"] = {"value": ld["chosen"], "grid": ld["grid"]["DEPTH_WEIGHT"],
                                  "chosen_by": "lookup_depth", "dev": dev}
    out["head.VOCAB"] = _real_run_knob(res, "head_vocab", "VOCAB")
    out["head.STOP"] = _floor_knob(res, "head_stop", "STOP")
    if "head_first" in res:  # (a section newer than the committed file's: until it runs
        out["head.FIRST"] = _floor_knob(res, "head_first", "FIRST")  # the file's value stands)
    lf = res["lookup_first"]
    ungated = {r["value"]: r["general_static_ungated"]["gmean"] for r in lf["rows"]}
    out["engine.LOOKUP_FIRST"] = _real_run_knob(
        res, "lookup_first", "LOOKUP_FIRST", f"; general-static without the gate "
        f"{ungated[lf['chosen']]:.3f} against {ungated.get(0, float('nan')):.3f} at 0")
    hp = res["head_prior"]
    out["gate.HEAD_PRIOR"] = _real_run_knob(
        res, "head_prior", "HEAD_PRIOR", f"; the prior: {hp['prior_tokens']} tokens an "
        f"iteration over {hp['prior_iterations']} dev head iterations")
    pb = res["plan_budget"]
    f = pb["figure"]
    out["oracle.PLAN_BUDGET"] = {
        "value": pb["chosen"], "grid": pb["grid"], "chosen_by": "plan_budget",
        "dev": f"oracle-dynamic's plan search {1e3 * f['plan_s']:.1f} ms + its plan "
               f"{1e3 * f['value_s']:.1f} ms a request (mean of {pb['prompts']} dev prompts, "
               f"{pb['numerics']})"}
    lk = res["lookup"]
    out["pool.lookup"] = {
        "value": lk["chosen"], "grid": lk["grid"], "chosen_by": "lookup",
        "dev": f"memspec / target-only e2e {lk['figure']['over_scales']:.3f}, general-static "
               f"{lk['figure']['general-static']['over_scales']:.3f}"}
    return out


def _floor_knob(res: Mapping[str, Any], section: str, name: str) -> dict[str, Any]:
    """A head floor a real-run section chose (``choose_stop``): the head's own iterations
    against the floor off, and memspec's dev figure."""
    sec = res[section]
    f = sec["figure"]
    ungated = {r["value"]: r["general_static_ungated"]["gmean"] for r in sec["rows"]}
    return {"value": sec["chosen"], "grid": sec["grid"][name], "chosen_by": section,
            "dev": f"general-static without the gate / target-only e2e "
                   f"{ungated[sec['chosen']]:.3f} against {ungated.get(0.0, float('nan')):.3f} "
                   f"at 0; memspec {f['gmean']:.3f} [{f['ci95'][0]:.3f}, {f['ci95'][1]:.3f}], "
                   f"worst prompt {f['min']:.3f} (real runs, {sec['prompts']} prompts x "
                   f"{sec['repeats']})"}


def _real_run_knob(res: Mapping[str, Any], section: str, name: str, more: str = ""
                   ) -> dict[str, Any]:
    """A knob a real-run head section chose (bench/tune_head.py), with memspec's dev figure."""
    sec = res[section]
    f = sec["figure"]
    return {"value": sec["chosen"], "grid": sec["grid"][name], "chosen_by": section,
            "dev": f"memspec / target-only e2e {f['gmean']:.3f} [{f['ci95'][0]:.3f}, "
                   f"{f['ci95'][1]:.3f}], worst prompt {f['min']:.3f}{more} (real runs, "
                   f"{sec['prompts']} prompts x {sec['repeats']})"}


SECTIONS = ("gate", "ranking", "ucb_c", "chunked_wait", "lookup", "prefill_chunk", "lookup_gate",
            "lookup_depth", "head_vocab", "head_stop", "head_first", "lookup_first",
            "head_prior",
            "plan_budget")


def section_stamp(pool_file: Path) -> dict[str, Any]:
    """What a section re-chosen now was chosen on: commit, clean tree, machine, kernel
    path, the pool (its file and its drafts' bytes) and the day. A section kept from an
    earlier tune (``--only``) keeps its own, so each knob says which drafts it was tuned for."""
    prov = result_provenance(pool_file)
    prov.pop("tuned", None)  # the file being written: its own hash means nothing here
    return {**prov, "date": time.strftime("%Y-%m-%d", time.gmtime())}


def stamp_sections(res: dict[str, Any], names: Iterable[str], stamp: Mapping[str, Any]
                   ) -> None:
    """Put `stamp` on the sections this run chose (the others keep theirs)."""
    for name in names:
        if isinstance(res.get(name), dict):
            res[name] = {**res[name], "provenance": dict(stamp)}


class SoFar:
    """What real runs start from: tuned.json with every value this run has chosen so far.

    A real-run section's servers read their knobs from a tuned.json (``MEMSPEC_TUNED``
    names a copy with the setting under test). Built on the committed file alone, each
    section was chosen beside the old values of every other: the simulated gate's new
    constants were never run for real, and the set written together was never measured
    together (at fb6b9f0 it kept the head closed on the README prompt, 0.948x the old
    set). So before each real section the chosen values so far go into a scratch copy
    that the section builds on."""

    def __init__(self, committed: Mapping[str, Any], folder: Path) -> None:
        self.committed, self.folder, self.n = committed, folder, 0
        self.before = os.environ.get(TUNED_ENV)

    def apply(self, res: Mapping[str, Any]) -> Path:
        merged = {**self.committed.get("sections", {}), **res}
        data = {**self.committed, "knobs": {**self.committed["knobs"], **knobs_from(merged)}}
        self.n += 1  # a new name each time: a reader caches a file's knobs by its path
        path = self.folder / f"tuned-so-far-{self.n}.json"
        path.write_text(json.dumps(data))
        os.environ[TUNED_ENV] = str(path)
        return path

    def restore(self) -> None:
        if self.before is None:
            os.environ.pop(TUNED_ENV, None)
        else:
            os.environ[TUNED_ENV] = self.before


READS_TABLES = ("head_prior", "plan_budget")  # sections that read the dev tables in-process


@contextlib.contextmanager
def tables_home(pool_file: Path, per_domain: int, folder: Path, reads: bool
                ) -> Iterator[None]:
    """Where a section that reads the dev tables finds tables made with this run's values.

    The tables are keyed by the head's knobs (``tables_format``: head.VOCAB, head.STOP,
    head.FIRST), so once this run chose other values the pool's own tables no longer load (the first full
    re-tune stopped there, at head_prior). Then the dev prompts are traced again under the
    values so far, into a scratch artefact folder, and the section reads those."""
    from memspec.bench.evaluation import load_pool_tables
    from memspec.procs.decoder.oracle.tablefiles import tables_format

    if not reads:
        yield
        return
    try:
        load_pool_tables(load_pool(str(pool_file)), "dev")
        have = True
    except ConfigError:
        have = False
    if have:
        yield
        return
    fmt = tables_format()
    root = folder / ("home-" + re.sub(r"[^A-Za-z0-9.]+", "-", fmt))  # one per head knobs
    home = root / "home"
    if not home.is_dir():  # (plan_budget reads the tables head_prior's trace made)
        root.mkdir()
        home = _scratch_home(root)
        _log(f"the dev tables for this run's head knobs ({fmt}): tracing dev:{per_domain} "
             "into a scratch folder")
        trace_dev(pool_file, per_domain, home, "for this run's head knobs")
    with home_env(home):
        yield


def run(pool_file: Path, cost_path: str, per_domain: int, max_new: int,
        only: Sequence[str] | None = None, previous: Mapping[str, Any] | None = None,
        repeats: int = 1) -> dict[str, Any]:
    from memspec.bench.evaluation import read_cost_model, set_prompts, sim_config, traced_requests

    pool = load_pool(str(pool_file))
    cost = read_cost_model(Path(cost_path))
    cfg = sim_config(pool, cost, max_new_tokens=max_new)
    res: dict[str, Any] = dict((previous or {}).get("sections", {}))
    want = set(only or SECTIONS)
    unknown = want - set(SECTIONS)
    if unknown:
        raise ConfigError(f"unknown tune section(s) {', '.join(sorted(unknown))}",
                          f"valid: {', '.join(SECTIONS)}")
    t0 = time.perf_counter()
    stamp = section_stamp(pool_file)  # the code, machine and pool these sections measure
    plain = scored = None
    if want & {"gate", "ucb_c", "lookup"}:
        plain = traced_requests(pool, "dev", per_domain, scores=False)
    if want & {"ranking", "chunked_wait"}:
        scored = traced_requests(pool, "dev", per_domain, scores=True)
    if "gate" in want:
        from memspec.bench.tune_gate_check import check_gate

        res["gate"] = check_gate(pool_file, per_domain, max_new, repeats,
                                 tune_gate(plain, cost, cfg, pool.general))
    with gate_constants(res["gate"]["chosen"]) if "gate" in res else contextlib.nullcontext():
        if "ranking" in want:
            res["ranking"] = tune_ranking(scored, cost, cfg, pool.general)
            _log(f"ranking: {res['ranking']['chosen']}")
        if "chunked_wait" in want:
            res["chunked_wait"] = tune_chunked_wait(scored, cost, cfg, pool.general)
            _log(f"chunked wait: {res['chunked_wait']['chosen']}")
        if "ucb_c" in want:
            res["ucb_c"] = tune_ucb(plain, cost, cfg, pool.general, pool.ucb_c)
            _log(f"ucb c: {res['ucb_c']['chosen']}")
        if "lookup" in want:
            res["lookup"] = tune_lookup(pool_file, per_domain, cost, max_new, pool.lookup)
    if "prefill_chunk" in want:
        texts = [p["prompt"] for p in set_prompts(pool, "dev", per_domain)]
        res["prefill_chunk"] = tune_prefill_chunk(pool, texts)
        _log(f"prefill chunk: {res['prefill_chunk']['chosen']}")
    from memspec.bench.tune_head import (
        tune_head_first,
        tune_head_prior,
        tune_head_stop,
        tune_head_vocab,
        tune_lookup_first,
    )
    from memspec.bench.tune_lookup_depth import tune_lookup_depth
    from memspec.bench.tune_lookup_gate import tune_lookup_gate

    real: dict[str, Callable[[], dict[str, Any]]] = {  # in order, each on those before it
        "lookup_gate": lambda: tune_lookup_gate(pool_file, per_domain, max_new, repeats),
        "lookup_depth": lambda: tune_lookup_depth(pool_file, per_domain, max_new, repeats,
                                                  pool.gamma),
        "head_vocab": lambda: tune_head_vocab(pool_file, per_domain, max_new, repeats),
        "head_stop": lambda: tune_head_stop(pool_file, per_domain, max_new, repeats),
        "head_first": lambda: tune_head_first(pool_file, per_domain, max_new, repeats),
        "lookup_first": lambda: tune_lookup_first(pool_file, per_domain, max_new, repeats),
        "head_prior": lambda: tune_head_prior(pool_file, per_domain, max_new, repeats),
    }
    from memspec.bench.tune_plan import tune_plan_budget
    from memspec.procs.decoder.oracle import oracle

    ids = [p["id"] for p in set_prompts(pool, "dev", per_domain)]
    real["plan_budget"] = lambda: tune_plan_budget(pool, ids, cost, oracle.PLAN_BUDGET)
    if want & set(real):
        so_far = SoFar(json.loads(TUNED_FILE.read_text()),
                       Path(tempfile.mkdtemp(prefix="memspec-tune-so-far-")))
        try:
            for name, section in real.items():
                if name in want:
                    _log(f"{name}: from {so_far.apply(res).name} (the values chosen so far "
                         "in this run)")
                    with tables_home(pool_file, per_domain, so_far.folder, name in READS_TABLES):
                        res[name] = section()
        finally:
            so_far.restore()
            shutil.rmtree(so_far.folder, ignore_errors=True)
    stamp_sections(res, want, stamp)
    missing = set(SECTIONS) - set(res)
    if missing:
        raise ConfigError(f"no earlier tune holds {', '.join(sorted(missing))}",
                          "run `memspec bench tune` without --only once")
    return {"split": "dev",
            "prompts": len(plain or scored or []) or (previous or {}).get("prompts"),
            "per_domain": per_domain, "max_new_tokens": max_new, "cost_model": cost_path,
            "pool": str(pool_file.resolve().relative_to(PACKAGE_ROOT))
            if pool_file.resolve().is_relative_to(PACKAGE_ROOT) else str(pool_file),
            "spec_scales": list(SPEC_SCALES), "floors": [GMEAN_FLOOR, FLOOR],
            "seconds": round(time.perf_counter() - t0, 1),
            "knobs": knobs_from(res), "sections": res}


def _print(res: Mapping[str, Any]) -> None:
    print(f"knobs chosen on dev ({res['per_domain']} prompts per domain, "
          f"{res['max_new_tokens']} tokens; cost model {res['cost_model']}):")
    for name, k in res["knobs"].items():
        print(f"  {name} = {k['value']}  (grid {k['grid']}; {k['dev']})")


def _plot(res: Mapping[str, Any], folder: Path) -> Path:
    from memspec.common.plotting import pyplot

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    s = res["sections"]
    fig, axes = plt.subplots(1, 13, figsize=(41, 3.4))
    ax = axes[0]
    for share in s["ranking"]["grid"]["PREDICTOR_SHARE"]:
        rows = [r for r in s["ranking"]["rows"] if r["value"][1] == share]
        ax.plot([str(r["value"][0]) for r in rows], [r["over_scales"] for r in rows], "o-",
                label=f"predictor share {share}")
    ax.set_title("RANK_HORIZON (tokens)")
    ax.legend(fontsize=6)
    for ax, key, title in ((axes[1], "ucb_c", "UCB c (MAB policies)"),
                           (axes[2], "lookup", "lookup (min suffix; 0 off)"),
                           (axes[3], "chunked_wait", "CHUNKED_WAIT_S")):
        rows = s[key]["rows"]
        ax.plot([str(r["value"]) for r in rows], [r["over_scales"] for r in rows], "o-")
        ax.set_title(title)
    ax = axes[4]
    rows = s["prefill_chunk"]["rows"]
    ax.bar([str(r["value"]) for r in rows], [r["over_whole"] for r in rows])
    ax.axhline(CHUNK_COST, color="r", ls="--", lw=0.8)
    ax.set_ylim(0.9, max(1.1, *(r["over_whole"] for r in rows)))
    ax.set_title("PREFILL_CHUNK: chunked / whole")
    ax = axes[5]
    lg = s["lookup_gate"]
    rows = lg["rows"]
    ax.errorbar(range(len(rows)), [r["gmean"] for r in rows],
                yerr=[[r["gmean"] - r["ci95"][0] for r in rows],
                      [r["ci95"][1] - r["gmean"] for r in rows]], fmt="o", capsize=3)
    ax.axhline(lg["lookup_only"]["gmean"], color="#888", ls=":", lw=0.8, label="lookup-only")
    ax.set_xticks(range(len(rows)), [r["variant"].split("@")[1] for r in rows], rotation=30,
                  fontsize=7)
    ax.set_title("LOOKUP_LOOKS/FAILING (real runs)")
    ax.legend(fontsize=6)
    ax = axes[6]
    rows = s["lookup_depth"]["rows"] if "lookup_depth" in s else []
    ax.errorbar(range(len(rows)), [r["gmean"] for r in rows],
                yerr=[[r["gmean"] - r["ci95"][0] for r in rows],
                      [r["ci95"][1] - r["gmean"] for r in rows]], fmt="o", capsize=3)
    ax.set_xticks(range(len(rows)), [r["variant"].split("@")[1] for r in rows], rotation=30,
                  fontsize=7)
    ax.set_title("lookup DEPTH_WEIGHT (real runs)")
    ax = axes[7]
    _head_rows(ax, s.get("head_vocab", {}).get("rows", []), "head.VOCAB rows (real runs)")
    _head_rows(axes[8], s.get("head_stop", {}).get("rows", []),
               "head.STOP floor (real runs)")
    _head_rows(axes[10], s.get("lookup_first", {}).get("rows", []),
               "engine.LOOKUP_FIRST match (real runs; 0 off)")
    _head_rows(axes[11], [{**r, "value": None if r["value"] is None else r["value"][1]}
                          for r in s.get("head_prior", {}).get("rows", [])],
               "gate.HEAD_PRIOR weight (real runs; all: none)")
    _head_rows(axes[12], s.get("head_first", {}).get("rows", []),
               "head.FIRST floor (real runs; 0 off)")
    for ax in (*axes[:4], *axes[5:9], *axes[10:]):
        ax.axhline(1.0, color="k", lw=0.6)
    ax = axes[9]
    rows = s.get("plan_budget", {}).get("rows", [])
    names = ["all" if r["value"] >= 10**6 else str(r["value"]) for r in rows]
    ax.bar(names, [1e3 * r["value_s"] for r in rows], label="plan (its iterations)")
    ax.bar(names, [1e3 * r["plan_s"] for r in rows], bottom=[1e3 * r["value_s"] for r in rows],
           label="plan search")
    ax.set_ylim(0.9 * min((1e3 * r["value_s"] for r in rows), default=0), None)
    ax.set_ylabel("ms a request", fontsize=7)
    ax.set_title("oracle PLAN_BUDGET (states)")
    ax.legend(fontsize=6)
    axes[0].set_ylabel("over target-only, e2e (simulated, dev)")
    fig.tight_layout()
    out = folder / "tune.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _head_rows(ax, rows: Sequence[Mapping[str, Any]], title: str) -> None:  # noqa: ANN001
    """A head section's settings: memspec and the general-static variants it ran beside."""
    for key, label in ((None, "memspec"), ("general_static", "general-static"),
                       ("general_static_ungated", "general-static-ungated")):
        pts = [r if key is None else r[key] for r in rows if key is None or key in r]
        if not pts:
            continue
        ax.errorbar(range(len(pts)), [r["gmean"] for r in pts],
                    yerr=[[r["gmean"] - r["ci95"][0] for r in pts],
                          [r["ci95"][1] - r["gmean"] for r in pts]], fmt="o", capsize=3,
                    label=label)
    ax.set_xticks(range(len(rows)), ["all" if r["value"] is None else str(r["value"])
                                     for r in rows], fontsize=7)
    ax.set_title(title)
    ax.legend(fontsize=6)


def main_bench_tune(args) -> int:  # noqa: ANN001
    if not args.cost_model:
        raise ConfigError("bench tune replays a measured cost model",
                          "pass --cost-model docs/results/bench.json (a `memspec bench --json` output)")
    pool_file = Path(args.pool) if args.pool else DEFAULT_POOL
    only = [s.strip() for s in args.only.split(",")] if getattr(args, "only", None) else None
    previous = json.loads(TUNED_FILE.read_text()) if only and TUNED_FILE.is_file() else None
    res = run(pool_file, args.cost_model, args.per_domain, args.max_new_tokens, only, previous,
              repeats=max(1, args.repeats))
    res["provenance"] = result_provenance(pool_file)
    TUNED_FILE.write_text(json.dumps(res, indent=1) + "\n")
    _print(res)
    print(f"wrote {TUNED_FILE.name}")
    save_outputs(res, args, _plot)
    return 0
