"""docs/RESULTS.md, the README's figures block and the terminal summary, from one result.

Everything here reads the `memspec bench --json` object only, so `memspec bench
--from-json docs/bench.json --results docs/RESULTS.md --plots docs/plots --readme
README.md` regenerates every document from a committed run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memspec.bench.figures import POLICY_ORDER, RATIO_LABELS

README_BEGIN = "<!-- memspec bench: begin -->"
README_END = "<!-- memspec bench: end -->"
FIGURES = ("real_ratios", "real_throughput", "sim_vs_real", "breakdown",
           "sim_throughput_steady", "sweeps", "ucb_c")
PAPER_PREDICTOR = {"prompt_only": (0.319, 0.558), "recent_only": (0.571, 0.793),
                   "prompt_recent": (0.716, 0.957)}


def _get(result: dict[str, Any], path: tuple[str, ...]) -> Any:
    cur: Any = result
    for k in path:
        if not isinstance(cur, dict) or k not in cur:
            return None
        cur = cur[k]
    return cur


def _num(result: dict[str, Any], *path: str) -> float | None:
    v = _get(result, path)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _margin(a: float | None, b: float | None) -> float | None:
    """a - b (a check that a beats b: margin > 0)."""
    return None if a is None or b is None else a - b


Getter = Callable[[dict[str, Any]], Any]
# (label, value, op, bound): issue #10's must-hold list, then issue #11's bench figures
MUST_HOLD: tuple[tuple[str, Getter, str, float], ...] = (
    ("prompt sets disjoint by source (train/dev/test/mixed)",
     lambda r: 1.0 if _get(r, ("split", "disjoint")) else 0.0, "==", 1.0),
    ("mixed: oracle-dynamic / oracle-static (real)",
     lambda r: _num(r, "real", "mixed", "gmean", "oracle_dynamic_over_oracle_static"),
     ">=", 1.10),
    ("mixed: predictor prompt+recent top-1 minus prompt-only top-1",
     lambda r: _margin(_num(r, "predictor", "mixed", "prompt_recent", "top1"),
                       _num(r, "predictor", "mixed", "prompt_only", "top1")), ">", 0.0),
    ("mixed: predictor prompt+recent top-1 minus the domain rule's",
     lambda r: _margin(_num(r, "predictor", "mixed", "prompt_recent", "top1"),
                       _num(r, "predictor", "mixed", "domain_rule", "top1")), ">", 0.0),
    ("test: memspec / oracle-dynamic (real)",
     lambda r: _num(r, "real", "test", "gmean", "memspec_over_oracle_dynamic"), ">=", 0.95),
    ("mixed: memspec / oracle-dynamic (real)",
     lambda r: _num(r, "real", "mixed", "gmean", "memspec_over_oracle_dynamic"), ">=", 0.95),
    ("test: memspec fallback incl. target alone while loading (real)",
     lambda r: _num(r, "real", "test", "breakdown", "memspec", "fallback_frac"), "<", 0.055),
    ("mixed: memspec fallback incl. target alone while loading (real)",
     lambda r: _num(r, "real", "mixed", "breakdown", "memspec", "fallback_frac"), "<", 0.055),
    ("test: memspec prediction on the critical path (real)",
     lambda r: _num(r, "real", "test", "breakdown", "memspec", "prediction_frac"), "<", 0.039),
    ("mixed: memspec prediction on the critical path (real)",
     lambda r: _num(r, "real", "mixed", "breakdown", "memspec", "prediction_frac"), "<", 0.039),
    ("every headline ratio: |simulator / real - 1|",
     lambda r: _num(r, "sim_vs_real", "max_rel_error"), "<=", 0.03),
    ("#11 test: memspec / target-only (real)",
     lambda r: _num(r, "real", "test", "gmean", "memspec_over_target_only"), ">=", 1.5),
    ("#11 test: memspec / general-static (real)",
     lambda r: _num(r, "real", "test", "gmean", "memspec_over_general_static"), ">=", 1.3),
    ("#11 test: memspec / mab-async (real)",
     lambda r: _num(r, "real", "test", "gmean", "memspec_over_mab_async"), ">=", 1.25),
)


def checks(result: dict[str, Any]) -> list[tuple[str, float | None, str, float, bool]]:
    out = []
    for label, get, op, bound in MUST_HOLD:
        v = get(result)
        ok = v is not None and {">=": v >= bound, ">": v > bound, "<": v < bound,
                                "<=": v <= bound, "==": v == bound}[op]
        out.append((label, v, op, bound, bool(ok)))
    return out


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "n/a" if not isinstance(v, (int, float)) or v != v else fmt.format(v)


def _pct(v: Any) -> str:
    return _f(v if v is None else 100 * v, "{:.1f}%")


def _ci(ci: Any) -> str:
    if not isinstance(ci, (list, tuple)) or len(ci) != 2 or None in ci:
        return "n/a"
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _pols(rows: dict[str, Any]) -> list[str]:
    return [p for p in POLICY_ORDER if p in rows] + [p for p in rows if p not in POLICY_ORDER]


def _domain_table(norm: dict[str, dict[str, float]]) -> list[str]:
    doms = [d for d in next(iter(norm.values())) if d != "GMEAN"] + ["GMEAN"]
    lines = ["| policy | " + " | ".join(doms) + " |", "|---" * (len(doms) + 1) + "|"]
    for p in _pols(norm):
        lines.append(f"| {p} | " + " | ".join(_f(norm[p].get(d)) for d in doms) + " |")
    return lines


def headline_lines(r: dict[str, Any]) -> list[str]:
    """The real-run ratios with intervals and the simulator beside them, per set."""
    real, svr = r.get("real") or {}, r.get("sim_vs_real") or {}
    if not real:
        return ["No real runs in this result (`--real-per-domain 0`)."]
    sets = list(real)
    head = "| ratio | " + " | ".join(f"{s} real GMEAN [95% CI] | {s} simulator"
                                     for s in sets) + " |"
    lines = [head, "|---" * (1 + 2 * len(sets)) + "|"]
    for k, label in RATIO_LABELS.items():
        cells = []
        for s in sets:
            gm, ci = real[s]["gmean"].get(k), real[s]["ci95"].get(k)
            sim = (svr.get(s) or {}).get("ratios", {}).get(k, {})
            err = sim.get("rel_error")
            cells.append(f"{_f(gm)} {_ci(ci)} | {_f(sim.get('sim'))}"
                         + (f" ({100 * err:+.1f}%)" if isinstance(err, (int, float)) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def summary_text(r: dict[str, Any]) -> str:
    lines = [f"memspec bench{' [SMOKE RUN]' if r.get('smoke') else ''}: K={r['K']} N={r['N']} "
             f"gamma={r['gamma']} {r['max_new_tokens']} tokens, target {r.get('dtype', '?')}, "
             f"{r['storage']} (load/iteration {r['load_over_iteration']:.2f})"]
    lines += ["real runs (steady-state tokens/s ratios, GMEAN over prompts):"]
    lines += headline_lines(r)
    cold = r.get("cold_decoder")
    if cold:
        m = cold["memspec_over_target_only_e2e"]
        lines.append(f"memspec / target-only end to end as a fresh process's first request "
                     f"({cold['prompts']} test prompts x {cold['repeats']}): GMEAN "
                     f"{_f(m['gmean'])}, worst {_f(m['min'])}; tokens identical: "
                     f"{cold['identical_tokens']}")
    for label, v, op, bound, ok in checks(r):
        lines.append(f"  [{'ok' if ok else 'MISS'}] {label}: {_f(v, '{:.4f}')} "
                     f"(must be {op} {bound})")
    est = r.get("estimate_full_run")
    if est:
        lines.append(f"full run (default sizes) would take ~{est['total_min']} min "
                     f"({est['real_requests']} real requests ~{est['real_min']} min, simulator "
                     f"~{est['simulator_min']} min, sweeps ~{est['sweeps_min']} min); "
                     f"{est['note']}")
    return "\n".join(lines)


def predictor_lines(r: dict[str, Any]) -> list[str]:
    pred = r.get("predictor") or {}
    sets = [s for s in ("test", "mixed") if isinstance(pred.get(s), dict)]
    if not sets:
        return [pred.get("note", "no predictor figures")] if pred else []
    rows = ("prompt_only", "recent_only", "prompt_recent", "domain_rule", "majority")
    lines = ["| input | " + " | ".join(f"{s} top-1 | {s} top-2" for s in sets)
             + " | paper top-1 / top-2 |", "|---" * (2 + 2 * len(sets)) + "|"]
    for k in rows:
        paper = PAPER_PREDICTOR.get(k)
        cells = " | ".join(f"{_pct((pred[s].get(k) or {}).get('top1'))} | "
                           f"{_pct((pred[s].get(k) or {}).get('top2'))}" for s in sets)
        ref = f"{100 * paper[0]:.1f}% / {100 * paper[1]:.1f}%" if paper else "-"
        lines.append(f"| {k.replace('_', ' ')} | {cells} | {ref} |")
    n = {s: (pred[s].get("prompt_recent") or {}).get("n") for s in sets}
    lines += ["", f"Trained on {pred.get('trained_on', '?')}; scheduling points measured: "
              + ", ".join(f"{s} {n[s]}" for s in sets) + ". The domain rule ranks the "
              "prompt's own domain draft first (mixed: its listed domains in order), then "
              "the general draft; the majority rule ranks drafts by training-label frequency."]
    return lines


def ablation_lines(r: dict[str, Any]) -> list[str]:
    """memspec vs prediction-only, in numbers from the result."""
    out = []
    for s, sec in (r.get("real") or {}).items():
        g = sec["gmean"].get("memspec_over_prediction_only")
        ci = sec["ci95"].get("memspec_over_prediction_only")
        bm, bp = sec["breakdown"].get("memspec", {}), sec["breakdown"].get("prediction-only", {})
        tm = (sec.get("first_draft_token_s") or {})
        out.append(
            f"- {s} (real): memspec / prediction-only {_f(g)} {_ci(ci)}; fallback incl. target "
            f"alone {_pct(bm.get('fallback_frac'))} vs {_pct(bp.get('fallback_frac'))}, "
            f"prediction {_pct(bm.get('prediction_frac'))} vs "
            f"{_pct(bp.get('prediction_frac'))}, catch-up {_pct(bm.get('catchup_frac'))} vs "
            f"{_pct(bp.get('catchup_frac'))}; mean acceptance length "
            f"{_f(sec['mean_acceptance_length'].get('memspec'))} vs "
            f"{_f(sec['mean_acceptance_length'].get('prediction-only'))}; first draft token "
            f"{_f(tm.get('memspec'), '{:.3f}')} s vs {_f(tm.get('prediction-only'), '{:.3f}')} s.")
    if out:
        out.append("- Both run the predictor's top-1 whenever it is resident; memspec also "
                   "keeps the runner-up resident (its K=2 working set), which pays when the "
                   "ranking flips between two drafts (mixed answers) and costs an extra load "
                   "on the loader otherwise. Where the ranking rarely changes inside a "
                   "request (pure-domain prompts) the two differ only by that load.")
    return out


def write_results(r: dict[str, Any], path: Path, plots: Path | None) -> None:
    m = r.get("machine", {})
    sp = r.get("split", {})
    used = sp.get("used", {})
    L: list[str] = ["# memspec results", ""]
    if r.get("smoke"):
        L += ["> **SMOKE RUN**: fewer prompts or repeats than the full run (the sizes are "
              "below); the intervals say how far each ratio can be trusted.", ""]
    L += ["Written by `memspec bench --json docs/bench.json --plots docs/plots --results "
          "docs/RESULTS.md --readme README.md` (or regenerated from the JSON with "
          "`--from-json docs/bench.json`); every number below is in docs/bench.json.", "",
          "## Setup", "",
          f"- machine: {m.get('cpu', '?')} ({m.get('cores', '?')} cores), "
          f"{m.get('torch_threads', '?')} torch threads, device {m.get('device', 'cpu')}, "
          f"torch {m.get('torch', '?')}; target decodes in {r.get('dtype', '?')}",
          f"- pool: drafts {', '.join(r.get('drafts', []))} "
          f"(kind: {', '.join(r.get('draft_kinds', []))}), K={r['K']}, N={r['N']}, "
          f"gamma={r['gamma']}, greedy, {r['max_new_tokens']} new tokens, cold start per "
          f"request (initial draft loads while the prompt prefills)",
          f"- storage profile: {r['storage']}, measured load / SD iteration = "
          f"{r['load_over_iteration']:.2f}",
          f"- prompt sets: {sp.get('kind', '?')} ({', '.join(f'{k} {v}' for k, v in sp.get('counts', {}).items())}); "
          f"shared sources {sp.get('shared_sources')}; UCB c tuned on "
          f"{r.get('ucb_c_tuned_on', '?')}: {r.get('ucb_c_best')}",
          f"- used: simulator {used.get('sim_per_domain')} test prompts per domain and "
          f"{used.get('sim_mixed')} mixed; real runs {used.get('real_per_domain')} test "
          f"prompts per domain and {used.get('real_mixed')} mixed, {used.get('repeats')} "
          f"repeats, policies interleaved per prompt", ""]
    L += ["## Must hold", "", "| check | value | bound | |", "|---|---|---|---|"]
    for label, v, op, bound, ok in checks(r):
        L.append(f"| {label} | {_f(v, '{:.4f}')} | {op} {bound} | "
                 f"{'met' if ok else '**not met**'} |")
    L += ["", "## Headline: real three-process runs", "",
          "GMEAN over prompts of per-prompt steady-state tokens/s ratios (each policy pooled "
          "over its repeats), 95% bootstrap interval over prompts; the simulator's value of "
          "the same statistic on the same prompts beside it (its error in brackets).", ""]
    L += headline_lines(r)
    for s, sec in (r.get("real") or {}).items():
        L += ["", f"### {s}: {sec['prompts']} prompts, {sec['repeats']} repeats, "
              f"{sec['runs']} runs, token mismatches vs the traced greedy target: "
              f"{sec['token_mismatches']}", "",
              "| policy | tok/s | e2e tok/s | mean acc. length | first draft token | desired "
              "| fallback (incl. target alone) | target alone | load wait | prediction | "
              "catch-up |", "|---" * 11 + "|"]
        for p in _pols(sec["steady"]):
            b = sec["breakdown"][p]
            L.append(f"| {p} | {_f(sec['steady'][p], '{:.2f}')} | "
                     f"{_f(sec['e2e'][p], '{:.2f}')} | "
                     f"{_f(sec['mean_acceptance_length'][p])} | "
                     f"{_f(sec['first_draft_token_s'].get(p), '{:.3f} s')} | "
                     f"{_pct(b.get('desired_frac'))} | {_pct(b.get('fallback_frac'))} | "
                     f"{_pct(b.get('target_fallback_frac'))} | {_pct(b.get('load_wait_frac'))}"
                     f" | {_pct(b.get('prediction_frac'))} | {_pct(b.get('catchup_frac'))} |")
    abl = ablation_lines(r)
    if abl:
        L += ["", "## memspec vs prediction-only", ""] + abl
    L += ["", "## Predictor (paper Table 2)", ""] + predictor_lines(r)
    for s, sec in (r.get("sim") or {}).items():
        L += ["", f"## Simulator, {s} ({sec['prompts']} prompts): steady-state tokens/s over "
              "general-static", ""] + _domain_table(sec["normalised_steady"])
        oc = sec.get("oracle_checks", {})
        L += ["", f"oracle-dynamic >= oracle-static and every online policy, per domain: "
              f"{'yes' if oc.get('ok') else 'no'} "
              + "; ".join(f"{d}: oracle-dynamic/oracle-static "
                          f"{_f(v.get('oracle_dynamic_over_oracle_static'))}"
                          + (f", beaten by {v['beaten_by']}" if v.get("beaten_by") else "")
                          for d, v in oc.get("domains", {}).items())]
        g = sec.get("gmean_by_domain", {})
        if "optimum_over_general_static" in g:
            L += ["", f"Exact optimum (DP, relaxed in its favour: parallel loads, free "
                  f"catch-up and prediction) over general-static: "
                  f"{_f(g.get('optimum_over_general_static'))}; memspec reaches "
                  f"{_f(g.get('memspec_over_optimum'))} of it, oracle-dynamic "
                  f"{_f(g.get('oracle_dynamic_over_optimum'))}. The best schedule of "
                  f"speculative intervals only: {_f(g.get('optimum_sd_over_general_static'))}x "
                  f"general-static (memspec {_f(g.get('memspec_over_optimum_sd'))} of it)."]
        h = sec.get("headroom_mean_acceptance_length", {})
        if h:
            L += ["", "| domain | general draft | oracle-static | oracle-dynamic, no memory "
                  "limit (mean acceptance length) |", "|---|---|---|---|"]
            L += [f"| {d} | {_f(v['general'])} | {_f(v['oracle_static'])} | "
                  f"{_f(v['oracle_dynamic_unlimited'])} |" for d, v in h.items()]
        L += ["", "Time to the first draft token (median): "
              + ", ".join(f"{p} {_f(v, '{:.3f}')} s"
                          for p, v in sec.get("first_draft_token_s", {}).items())]
    if r.get("sweeps"):
        L += ["", "## Sweeps (simulator, test prompts, GMEAN over domains)", "",
              "| knob | value | memspec/mab-async | memspec/general-static | "
              "memspec/oracle-dynamic | memspec/target-only | memspec fallback |",
              "|---|---|---|---|---|---|---|"]
        for s in r["sweeps"]:
            L.append(f"| {s['knob']} | {s['value']} | {_f(s.get('memspec_over_mab_async'))} | "
                     f"{_f(s.get('memspec_over_general_static'))} | "
                     f"{_f(s.get('memspec_over_oracle_dynamic'))} | "
                     f"{_f(s.get('memspec_over_target_only'))} | "
                     f"{_pct(s.get('memspec_fallback_frac'))} |")
    if r.get("ucb_c_sweep"):
        L += ["", f"## UCB c on dev ({r.get('ucb_c_tuned_on')})", "",
              "| policy | " + " | ".join(f"c={c}" for c in next(iter(r['ucb_c_sweep'].values())))
              + " |", "|---" * (1 + len(next(iter(r['ucb_c_sweep'].values())))) + "|"]
        for pol, row in r["ucb_c_sweep"].items():
            L.append(f"| {pol} | " + " | ".join(_f(v) for v in row.values()) + " |")
    c = r.get("cost_model")
    if c:
        L += ["", "## Cost model (measured on the real runtime, train prompts)", "",
              f"- SD iteration {1e3 * sum(c['spec_s'].values()) / len(c['spec_s']):.1f} ms, "
              f"target-only step {1e3 * c['target_s']:.1f} ms at an empty context, + "
              f"{1e6 * c.get('per_context_token_s', 0.0):.1f} us per context token (as run: "
              f"{1e3 * c.get('mean_iteration_s', 0.0):.1f} and "
              f"{1e3 * c.get('mean_target_s', 0.0):.1f} ms); draft load "
              f"{1e3 * sum(c['load_s'].values()) / len(c['load_s']):.0f} ms",
              f"- catch-up {1e3 * c['catchup_base_s']:.2f} ms + "
              f"{1e6 * c['catchup_per_token_s']:.1f} us/token, the predictor's time per ranking "
              f"{1e3 * c['predict_s']:.1f} ms (slowing iterations it overlaps by "
              f"{100 * c.get('predictor_slowdown', 0.0):.1f}%), between intervals "
              f"{1e3 * c['sched_s']:.2f} ms"]
    est = r.get("estimate_full_run")
    if est:
        L += ["", f"Full run at the default sizes: ~{est['total_min']} min "
              f"({est['real_requests']} real requests ~{est['real_min']} min); {est['note']}."]
    if plots:
        rel = os.path.relpath(plots, path.parent)
        names = [n for n in FIGURES if (plots / f"{n}.png").is_file()]
        if names:
            L += ["", "## Figures", ""] + [f"![{n}]({rel}/{n}.png)" for n in names]
    L.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(L))


def readme_block(r: dict[str, Any], readme: Path, plots: Path | None) -> str:
    """The README's figures: headline table and plots, between the bench markers."""
    L = [README_BEGIN,
         "Regenerated by `memspec bench ... --readme README.md` from docs/bench.json"
         + (" (**SMOKE RUN**: fewer prompts or repeats than the full run; docs/RESULTS.md "
            "gives the sizes)." if r.get("smoke") else "."),
         ""]
    L += headline_lines(r)
    if plots:
        rel = os.path.relpath(plots, readme.parent)
        for n in ("real_ratios", "real_throughput"):
            if (plots / f"{n}.png").is_file():
                L += ["", f"![{n}]({rel}/{n}.png)"]
    L.append(README_END)
    return "\n".join(L)


def write_readme(r: dict[str, Any], readme: Path, plots: Path | None) -> None:
    """Replace the block between the bench markers (append one when there is none)."""
    text = readme.read_text() if readme.is_file() else ""
    block = readme_block(r, readme, plots)
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip("\n") + "\n\n## Headline figures\n\n" + block + "\n"
    readme.write_text(text)
