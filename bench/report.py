"""docs/RESULTS.md, the README's figures block and the terminal summary, from one result.

Everything here reads the `memspec bench --json` object only, so `memspec bench
--from-json docs/results/bench.json --results docs/RESULTS.md --plots docs/plots --readme
README.md` regenerates every document from a committed run.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from memspec.bench.figures import POLICY_ORDER, RATIO_LABELS, SPLIT_LABELS
from memspec.bench.heldout import current_names
from memspec.zoo.prompts import split_name

README_BEGIN = "<!-- memspec bench: begin -->"
README_END = "<!-- memspec bench: end -->"
FIGURES = ("real_ratios", "real_throughput", "sim_vs_real", "breakdown",
           "sim_throughput_steady", "sweeps", "ucb_c")
PAPER_PREDICTOR = {"prompt_only": (0.319, 0.558), "recent_only": (0.571, 0.793),
                   "prompt_recent": (0.716, 0.957)}


BY_SET = ("real", "sim", "sim_vs_real")  # sections keyed by prompt set
# MUST_HOLD rows name `memspec bench`'s default set; they read a result's own (test2)
HELD = "dev2"


def held_out(result: dict[str, Any]) -> str:
    """The set a result's figures are of besides mixed (dev2, or test2 read once)."""
    return split_name(str(result.get("held_out") or "test"))  # (as `current_names` reads it)


def _get(result: dict[str, Any], path: tuple[str, ...]) -> Any:
    """`path` in `result` (in today's set names); a per-set section's HELD is the result's
    own held-out set."""
    if len(path) > 1 and path[0] in BY_SET and path[1] == HELD:
        path = (path[0], held_out(result), *path[2:])
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


class Bound(NamedTuple):
    """A must-hold row: `get` reads the value; a statistic with a 95% interval (`ci`) is
    met only when the interval's far end clears the bound (a point estimate a hair over
    it is not evidence), and one whose interval is missing is not met."""

    label: str
    get: Getter
    op: str
    bound: float
    ci: Getter | None = None


class Check(NamedTuple):
    label: str
    value: float | None
    op: str
    bound: float
    ok: bool
    ci: list[float] | None = None
    note: str = ""  # why it is not met when the value alone would say it is ("no CI")


OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b, "==": lambda a, b: a == b}


def _ratio(label: str, which: str, key: str, op: str, bound: float,
           clock: str = "steady") -> Bound:
    """A headline ratio of the real runs on one set, with its interval."""
    g, c = ("gmean_e2e", "ci95_e2e") if clock == "e2e" else ("gmean", "ci95")
    return Bound(label, lambda r: _num(r, "real", which, g, key), op, bound,
                 lambda r: _get(r, ("real", which, c, key)))


def _oracle_row(which: str) -> Bound:
    """oracle-dynamic at or above every online variant end to end: the ratio (variant /
    oracle-dynamic) with the highest CI95 upper end must stay <= 1."""
    path = ("real", which, "oracle_bound", "e2e", "worst")
    return Bound(f"{which}: oracle-dynamic >= every online policy (real, end to end; the "
                 f"worst policy / oracle-dynamic)",
                 lambda r: _num(r, *path, "gmean"), "<=", 1.0,
                 lambda r: _get(r, (*path, "ci95")))


def _split_gap(r: dict[str, Any], which: str) -> float | None:
    """The worst run's gap between its measured time parts and its wall time, over every
    policy of a set (None: no real runs, or a result from before the split)."""
    rows = (_get(r, ("real", which, "breakdown")) or {}).values()
    gaps = [b.get("parts_gap_max") for b in rows if isinstance(b, dict)]
    gaps = [g for g in gaps if isinstance(g, (int, float))]
    return max(gaps) if gaps and len(gaps) == len(rows) else None


def _head_for_pool(r: dict[str, Any]) -> float | None:
    same = _get(r, ("predictor", "head_for_this_pool"))
    return None if same is None else float(bool(same))


def _peer_row(label: str, key: str, op: str, bound: float) -> Bound:
    """memspec beside what a user would run instead, same GGUF and dev2 prompts, end to
    end (bench/peers.py)."""
    return Bound(f"{HELD}: {label}, end to end on the same GGUF", lambda r: _num(
        r, "peers", "gmean", key), op, bound, lambda r: _get(r, ("peers", "ci95", key)))


# issue #10's must-hold list, issue #11's bench figures, then issue #22's
MUST_HOLD: tuple[Bound, ...] = (
    Bound("prompt sets disjoint by source (train/dev/dev2/mixed)",
          lambda r: 1.0 if _get(r, ("split", "disjoint")) else 0.0, "==", 1.0),
    _ratio("mixed: oracle-dynamic / oracle-static (real, steady)", "mixed",
           "oracle_dynamic_over_oracle_static", ">=", 1.10),
    Bound("mixed: predictor prompt+recent top-1 minus prompt-only top-1",
          lambda r: _margin(_num(r, "predictor", "mixed", "prompt_recent", "top1"),
                            _num(r, "predictor", "mixed", "prompt_only", "top1")), ">", 0.0),
    Bound("mixed: predictor prompt+recent top-1 minus the domain rule's",
          lambda r: _margin(_num(r, "predictor", "mixed", "prompt_recent", "top1"),
                            _num(r, "predictor", "mixed", "domain_rule", "top1")), ">", 0.0),
    _ratio(f"{HELD}: memspec / oracle-dynamic (real, steady)", HELD,
           "memspec_over_oracle_dynamic", ">=", 0.95),
    _ratio("mixed: memspec / oracle-dynamic (real, steady)", "mixed",
           "memspec_over_oracle_dynamic", ">=", 0.95),
    Bound(f"{HELD}: memspec fallback incl. target alone while loading, share of decode (real)",
          lambda r: _num(r, "real", HELD, "breakdown", "memspec", "fallback_of_decode"),
          "<", 0.055),
    Bound("mixed: memspec fallback incl. target alone while loading, share of decode (real)",
          lambda r: _num(r, "real", "mixed", "breakdown", "memspec", "fallback_of_decode"),
          "<", 0.055),
    Bound(f"{HELD}: memspec prediction on the critical path, share of decode (real)",
          lambda r: _num(r, "real", HELD, "breakdown", "memspec", "prediction_of_decode"),
          "<", 0.039),
    Bound("mixed: memspec prediction on the critical path, share of decode (real)",
          lambda r: _num(r, "real", "mixed", "breakdown", "memspec", "prediction_of_decode"),
          "<", 0.039),
    Bound(f"{HELD}: the predictor's own encoding, share of memspec's decode (real)",
          lambda r: _num(r, "real", HELD, "breakdown", "memspec", "predictor_of_decode"),
          "<=", 0.05),
    Bound("mixed: the predictor's own encoding, share of memspec's decode (real)",
          lambda r: _num(r, "real", "mixed", "breakdown", "memspec", "predictor_of_decode"),
          "<=", 0.05),
    # the gate keeps gated memspec from ranking on a CPU where heads do not pay: the bound
    # is also held where the predictor does work, with the gate off
    Bound(f"{HELD}: the predictor's own encoding, share of memspec-ungated's decode (real)",
          lambda r: _num(r, "real", HELD, "breakdown", "memspec-ungated",
                         "predictor_of_decode"), "<=", 0.05),
    Bound("mixed: the predictor's own encoding, share of memspec-ungated's decode (real)",
          lambda r: _num(r, "real", "mixed", "breakdown", "memspec-ungated",
                         "predictor_of_decode"), "<=", 0.05),
    Bound("every headline ratio: |simulator / real - 1| (steady)",
          lambda r: _num(r, "sim_vs_real", "max_rel_error"), "<=", 0.03),
    _ratio(f"#11 {HELD}: memspec / target-only (real, steady)", HELD,
           "memspec_over_target_only", ">=", 1.5),
    _ratio(f"#11 {HELD}: memspec / general-static (real, steady)", HELD,
           "memspec_over_general_static", ">=", 1.3),
    _ratio(f"#11 {HELD}: memspec / mab-async (real, steady)", HELD,
           "memspec_over_mab_async", ">=", 1.25),
    _oracle_row(HELD),
    _oracle_row("mixed"),
    Bound(f"{HELD}: time split parts add up to the wall time (worst run, every policy)",
          lambda r: _split_gap(r, HELD), "<=", 0.02),
    Bound("mixed: time split parts add up to the wall time (worst run, every policy)",
          lambda r: _split_gap(r, "mixed"), "<=", 0.02),
    Bound("mixed: predictor prompt+recent top-1 minus recent-only top-1",
          lambda r: _margin(_num(r, "predictor", "mixed", "prompt_recent", "top1"),
                            _num(r, "predictor", "mixed", "recent_only", "top1")), ">=", 0.0),
    Bound("predictor Table 2 is of a head trained for the runs' pool",
          _head_for_pool, "==", 1.0),
    _peer_row("memspec / llama.cpp plain (its C API, every core)",
              "memspec_over_llama_cpp", ">=", 1.5),
    _peer_row("memspec / llama.cpp with its prompt lookup (llama-cpp-python)",
              "memspec_over_llama_cpp_lookup", ">", 1.0),
)


def _interval(ci: Any) -> list[float] | None:
    ok = isinstance(ci, (list, tuple)) and len(ci) == 2 and all(
        isinstance(x, (int, float)) and x == x for x in ci)
    return [float(ci[0]), float(ci[1])] if ok else None


def check(row: Bound, result: dict[str, Any]) -> Check:
    result = current_names(result)
    held = held_out(result)
    if held != HELD:  # a row's HELD is the result's held-out set (_get reads it)
        row = row._replace(label=row.label.replace(f"{HELD}:", f"{held}:", 1)
                           .replace(f"{HELD} prompts", f"{held} prompts"))
    v = row.get(result)
    if v is None:
        return Check(row.label, None, row.op, row.bound, False, None, "no value")
    if row.ci is None:
        return Check(row.label, v, row.op, row.bound, OPS[row.op](v, row.bound))
    ci = _interval(row.ci(result))
    if ci is None:
        return Check(row.label, v, row.op, row.bound, False, None, "no CI")
    end = ci[0] if row.op in (">=", ">") else ci[1]
    return Check(row.label, v, row.op, row.bound, OPS[row.op](end, row.bound), ci)


def checks(result: dict[str, Any]) -> list[Check]:
    result = current_names(result)
    return [check(row, result) for row in MUST_HOLD]


def _f(v: Any, fmt: str = "{:.3f}") -> str:
    return "n/a" if not isinstance(v, (int, float)) or v != v else fmt.format(v)


def _pct(v: Any) -> str:
    return _f(v if v is None else 100 * v, "{:.1f}%")


def _ms(v: Any) -> str:
    """Seconds as milliseconds (n/a: nothing was measured, e.g. no ranking after the prompt's)."""
    return _f(v if v is None else 1e3 * v, "{:.1f} ms")


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
    """The real-run ratios per set: end to end first (the headline), steady beside it, each
    with its interval, then the simulator's steady value."""
    real, svr = r.get("real") or {}, r.get("sim_vs_real") or {}
    if not real:
        return ["No real runs in this result (`--real-per-domain 0`)."]
    sets = list(real)
    head = "| ratio | " + " | ".join(f"{s} end to end [95% CI] | {s} steady [95% CI] | "
                                     f"{s} simulator (steady)" for s in sets) + " |"
    lines = [head, "|---" * (1 + 3 * len(sets)) + "|"]
    for k, label in RATIO_LABELS.items():
        if not any(k in (real[s].get("gmean_e2e") or real[s]["gmean"]) for s in sets):
            continue
        cells = []
        for s in sets:
            sec = real[s]
            sim = (svr.get(s) or {}).get("ratios", {}).get(k, {})
            err = sim.get("rel_error")
            cells.append(f"{_f((sec.get('gmean_e2e') or {}).get(k))} "
                         f"{_ci((sec.get('ci95_e2e') or {}).get(k))} | "
                         f"{_f(sec['gmean'].get(k))} {_ci(sec['ci95'].get(k))} | "
                         f"{_f(sim.get('sim'))}"
                         + (f" ({100 * err:+.1f}%)" if isinstance(err, (int, float)) else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def check_line(c: Check) -> str:
    """One must-hold verdict for the terminal."""
    ci = f" {_ci(c.ci)}" if c.ci else ""
    why = f"; {c.note}" if c.note else ""
    return (f"  [{'ok' if c.ok else 'MISS'}] {c.label}: {_f(c.value, '{:.4f}')}{ci} "
            f"(must be {c.op} {c.bound}{'' if not c.ci else ', its CI95 too'}{why})")


def summary_text(r: dict[str, Any]) -> str:
    r = current_names(r)
    lines = [f"memspec bench{' [SMOKE RUN]' if r.get('smoke') else ''}: K={r['K']} N={r['N']} "
             f"gamma={r['gamma']} {r['max_new_tokens']} tokens, target {r.get('dtype', '?')}, "
             f"{r['storage']} (load/iteration {r['load_over_iteration']:.2f})"
             + provenance_text(r)]
    if r.get("held_out_reads") is not None:
        lines.append(f"held-out set {held_out(r)}: read by {r['held_out_reads']} run(s) of "
                     "`memspec bench`, this one included (prompts/"
                     f"{held_out(r)}_reads.jsonl)")
    lines += ["real runs (tokens/s ratios, GMEAN over prompts: end to end, steady beside):"]
    lines += headline_lines(r)
    cold = r.get("cold_decoder")
    if cold:
        m = cold["memspec_over_target_only_e2e"]
        lines.append(f"memspec / target-only end to end as a fresh process's first request "
                     f"({cold['prompts']} {held_out(r)} prompts x {cold['repeats']}): GMEAN "
                     f"{_f(m['gmean'])}, worst {_f(m['min'])}; tokens identical: "
                     f"{cold['identical_tokens']}")
    lines += peer_lines(r)[:1]
    lines += [check_line(c) for c in checks(r)]
    est = r.get("estimate_full_run")
    if est:
        lines.append(f"full run (default sizes) would take ~{est['total_min']} min "
                     f"({est['real_requests']} real requests ~{est['real_min']} min, simulator "
                     f"~{est['simulator_min']} min, sweeps ~{est['sweeps_min']} min); "
                     f"{est['note']}")
    return "\n".join(lines)


def provenance_text(r: dict[str, Any]) -> str:
    """"; commit abc1234 (clean)" or with uncommitted changes; "" for older results."""
    prov = r.get("provenance") or {}
    if not prov:
        return ""
    if not prov.get("commit"):
        return "; code not identified (no git checkout)"
    state = ("clean tree" if prov.get("clean") else
             f"uncommitted changes in {prov.get('dirty_files')} paths")
    return f"; commit {prov['commit'][:12]} ({state})"


def predictor_lines(r: dict[str, Any]) -> list[str]:
    pred = current_names(r).get("predictor") or {}
    sets = [s for s in ("dev2", "mixed") if isinstance(pred.get(s), dict)]
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
    same = {True: "yes", False: "**no**", None: "its sidecar does not say"}[
        pred.get("head_for_this_pool")]
    lines += ["", f"Head {pred.get('head', '?')} (trained for the runs' pool: {same}). "
              f"Trained on {pred.get('trained_on', '?')}; scheduling points measured: "
              + ", ".join(f"{s} {n[s]}" for s in sets) + ". The domain rule ranks the "
              "prompt's own domain draft first (mixed: its listed domains in order), then "
              "the general draft; the majority rule ranks drafts by training-label frequency."]
    return lines


def ablation_lines(r: dict[str, Any]) -> list[str]:
    """memspec vs prediction-only, in numbers from the result."""
    out = []
    for s, sec in (r.get("real") or {}).items():
        k = "memspec_over_prediction_only"
        bm, bp = sec["breakdown"].get("memspec", {}), sec["breakdown"].get("prediction-only", {})
        tm = (sec.get("first_draft_token_s") or {})
        out.append(
            f"- {s} (real): memspec / prediction-only end to end "
            f"{_f((sec.get('gmean_e2e') or {}).get(k))} {_ci((sec.get('ci95_e2e') or {}).get(k))}"
            f", steady {_f(sec['gmean'].get(k))} {_ci(sec['ci95'].get(k))}; fallback incl. "
            f"target alone (of decode) {_pct(bm.get('fallback_of_decode'))} vs "
            f"{_pct(bp.get('fallback_of_decode'))}, prediction (of decode) "
            f"{_pct(bm.get('prediction_of_decode'))} vs {_pct(bp.get('prediction_of_decode'))}"
            f", the predictor's own encoding (of decode) {_pct(bm.get('predictor_of_decode'))}"
            f" vs {_pct(bp.get('predictor_of_decode'))} ({_f(bm.get('snapshots_per_request'))}"
            f" vs {_f(bp.get('snapshots_per_request'))} snapshots a request, the prompt's "
            f"included; {_ms(bm.get('predictor_s_per_ranking'))} vs "
            f"{_ms(bp.get('predictor_s_per_ranking'))} a later ranking)"
            f", catch-up (of wall time) {_pct(bm.get('catchup_frac'))} vs "
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


def peer_lines(r: dict[str, Any]) -> list[str]:
    """memspec and target-only through the three processes beside llama.cpp: a one-line
    summary first, then a table of tokens/s and ratios."""
    p = r.get("peers")
    if not p:
        return []
    g, ci, t = p["gmean"], p["ci95"], p["tok_s"]
    L = [f"memspec end to end beside llama.cpp on the same GGUF ({p['prompts']} "
         f"{held_out(r)} prompts, {p['threads']} threads): {_f(g.get('memspec_over_llama_cpp'))}x its plain decoding "
         f"{_ci(ci.get('memspec_over_llama_cpp'))}, "
         f"{_f(g.get('memspec_over_llama_cpp_lookup'))}x its prompt lookup "
         f"{_ci(ci.get('memspec_over_llama_cpp_lookup'))}", ""]
    L += [f"Every clock runs from the call to the last token ({p['clock']}); llama.cpp "
          f"{p.get('version', '?')} on {p.get('gguf', '?')}, {p['threads']} threads; "
          f"`llama.cpp` is its C API (decode and argmax, no Python sampling), `-py` is "
          f"llama-cpp-python's `create_completion`, `+lookup` its `LlamaPromptLookupDecoding` "
          f"({p['gamma']} tokens a proposal). llama.cpp's greedy tokens equal memspec's on "
          f"{_pct(p.get('llama_cpp_tokens_identical'))} of the prompts.", "",
          "| run | tokens/s (mean over prompts) |", "|---|---|"]
    L += [f"| {n} | {_f(v, '{:.1f}')} |" for n, v in t.items()]
    L += ["", "| ratio | GMEAN [95% CI] |", "|---|---|"]
    from memspec.bench.peers import RATIOS

    L += [f"| {' / '.join(RATIOS[k]) if k in RATIOS else k} | {_f(v)} {_ci(ci.get(k))} |"
          for k, v in g.items()]
    return L


def must_hold_lines(r: dict[str, Any]) -> list[str]:
    L = ["A bound on a ratio with a 95% interval is met only when the whole interval clears "
         "it (the lower end for >=, the upper end for <=); without an interval it is not met.",
         "", "| check | value | 95% CI | bound | |", "|---|---|---|---|---|"]
    for c in checks(r):
        verdict = "met" if c.ok else "**not met**" + (f" ({c.note})" if c.note else "")
        L.append(f"| {c.label} | {_f(c.value, '{:.4f}')} | {_ci(c.ci) if c.ci else '-'} | "
                 f"{c.op} {c.bound} | {verdict} |")
    return L


def split_table(sec: dict[str, Any]) -> list[str]:
    """Per policy: throughput, and its wall time split into parts that add up to it."""
    head = ["policy", "e2e tok/s", "steady tok/s", "mean acc. length", "first draft token",
            *SPLIT_LABELS.values(), "parts vs wall, worst run"]
    L = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for p in _pols(sec["steady"]):
        b = sec["breakdown"][p]
        cells = [p, _f(sec["e2e"][p], "{:.2f}"), _f(sec["steady"][p], "{:.2f}"),
                 _f(sec["mean_acceptance_length"][p]),
                 _f(sec["first_draft_token_s"].get(p), "{:.3f} s"),
                 *(_pct(b.get(f"{k}_frac")) for k in SPLIT_LABELS),
                 _pct(b.get("parts_gap_max"))]
        L.append("| " + " | ".join(cells) + " |")
    return L


def figure_names(plots: Path | None, drawn: Sequence[Path], names: Sequence[str]
                 ) -> list[str]:
    """Of `names`, the figures this run drew into `plots` (never a stale file left there)."""
    if plots is None:
        return []
    here = {Path(p).stem for p in drawn if Path(p).parent.resolve() == plots.resolve()}
    return [n for n in names if n in here]


def write_results(r: dict[str, Any], path: Path, plots: Path | None,
                  drawn: Sequence[Path] = (), source: Path | None = None) -> None:
    """docs/RESULTS.md; figures are linked only when this run drew them (`drawn`);
    `source`: the JSON the figures are in (a run on another machine keeps its own)."""
    renamed = current_names(r)
    old_names = renamed.get("sim") != r.get("sim") or renamed.get("real") != r.get("real")
    r = renamed
    m = r.get("machine", {})
    sp = r.get("split", {})
    used = sp.get("used", {})
    L: list[str] = ["# memspec results", ""]
    if r.get("smoke"):
        L += ["> **SMOKE RUN**: fewer prompts or repeats than the full run (the sizes are "
              "below); the intervals say how far each ratio can be trusted.", ""]
    src = str(source or "docs/results/bench.json")
    L += [f"Written by `memspec bench --json {src} --plots {plots or 'docs/plots'} --results "
          f"{path}` (or regenerated from the JSON with `--from-json {src}`); every number "
          f"below is in {src}.", "",
          "## Setup", "",
          f"- machine: {m.get('cpu', '?')} ({m.get('cores', '?')} cores, "
          f"{m.get('isa', '?')} kernels), "
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
          f"- used: simulator {used.get('sim_per_domain')} {held_out(r)} prompts per domain and "
          f"{used.get('sim_mixed')} mixed; real runs {used.get('real_per_domain')} {held_out(r)} "
          f"prompts per domain and {used.get('real_mixed')} mixed, {used.get('repeats')} "
          f"repeats, policies interleaved per prompt"]
    if r.get("provenance"):
        L.append(f"- code:{provenance_text(r)[1:]}")
    if old_names:
        L.append("- set names: the JSON predates the rename of the test split to dev2 (a "
                 "second dev set, read by many runs); its \"test\" sections are dev2's")
    L += ["", "## Must hold", ""] + must_hold_lines(r)
    L += ["", "## Headline: real three-process runs", "",
          "GMEAN over prompts of per-prompt tokens/s ratios (each policy pooled over its "
          "repeats): end to end (request start to last token, prefill, binds and scheduling "
          "included) first, steady (decode time only) beside it, each with a 95% bootstrap "
          "interval over prompts; the simulator's value of the steady statistic on the same "
          "prompts last (its error in brackets). A drafting policy under its own name runs "
          "with the speculation gate, `-ungated` without it; lookup-only runs the context "
          "lookup alone (no draft; real runs only); target-only-1t is target-only on one "
          "decoder thread, the pipeline's setting before its threads followed the work "
          "(earlier figures' baseline; real runs only): target-only is the fastest plain "
          "decoding the pipeline has.", ""]
    L += headline_lines(r)
    for s, sec in (r.get("real") or {}).items():
        L += ["", f"### {s}: {sec['prompts']} prompts, {sec['repeats']} repeats, "
              f"{sec['runs']} runs, token mismatches vs the traced greedy target: "
              f"{sec['token_mismatches']}", "",
              "Shares of each policy's wall time; the parts add up to it (`other` is what no "
              "clock measured; the last column is the worst run's gap between its measured "
              "parts and its wall time). Target alone is split by why it ran: gated (by "
              "choice: target-only, a closed gate) or fallback (nothing preferred resident).",
              ""] + split_table(sec)
    if r.get("peers"):
        L += ["", f"## Beside llama.cpp (same GGUF, same {held_out(r)} prompts)", ""] \
            + peer_lines(r)
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
        L += ["", f"## Sweeps (simulator, {held_out(r)} prompts, GMEAN over domains)", "",
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
    names = figure_names(plots, drawn, FIGURES)
    if plots and names:
        rel = os.path.relpath(plots, path.parent)
        L += ["", "## Figures", ""] + [f"![{n}]({rel}/{n}.png)" for n in names]
    L.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(L))


def readme_block(r: dict[str, Any], readme: Path, plots: Path | None,
                 drawn: Sequence[Path] = ()) -> str:
    """The README's figures: headline table (end to end first, steady beside) and the
    plots this run drew, between the bench markers."""
    r = current_names(r)
    L = [README_BEGIN,
         "Regenerated by `memspec bench ... --readme README.md` from docs/results/bench.json"
         + (" (**SMOKE RUN**: fewer prompts or repeats than the full run; docs/RESULTS.md "
            "gives the sizes)." if r.get("smoke") else "."),
         ""]
    L += ["GMEAN over prompts of per-prompt tokens/s ratios, end to end (request start to "
          "last token) then steady, with 95% intervals; docs/RESULTS.md has the rest.", ""]
    L += headline_lines(r)
    if r.get("peers"):
        L += ["", peer_lines(r)[0] + " (docs/RESULTS.md: the table)."]
    for n in figure_names(plots, drawn, ("real_ratios", "real_throughput")):
        L += ["", f"![{n}]({os.path.relpath(plots, readme.parent)}/{n}.png)"]
    L.append(README_END)
    return "\n".join(L)


def write_readme(r: dict[str, Any], readme: Path, plots: Path | None,
                 drawn: Sequence[Path] = ()) -> None:
    """Replace the block between the bench markers (append one when there is none)."""
    text = readme.read_text() if readme.is_file() else ""
    block = readme_block(r, readme, plots, drawn)
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: block, text)
    else:
        text = text.rstrip("\n") + "\n\n## Headline figures\n\n" + block + "\n"
    readme.write_text(text)
