"""`memspec bench tune`'s lookup_depth section: how long the context lookup's proposals are,
chosen on dev by real runs.

Each proposal is as long as pays for its verify rows at the costs the decoder calibrated
(procs/decoder/drafts/lookup_depth.py), from how often the lookup's j-th token is accepted once the
ones before it were, by how long the context suffix under its first token matched. That
prior comes from dev: the engine's lookup-only in this process with every proposal gamma
tokens long (its tokens and proposals are the pipeline's; no clock is read), its accepted
counts per verify in each match bucket. Then memspec runs on one
server per prior weight (how many observations the prior is worth before the request's own
verifies move it; off: every proposal gamma tokens) beside target-only, every dev prompt's
variants back to back. The chosen weight scores most over target-only with no prompt below
the floor; ties go to off (the simpler engine), then to the heavier prior.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memspec.bench.realsweep import FLOOR, Setting, choose_setting, dev_rows, run_settings
from memspec.bench.tune_lookup_gate import brief, tuned_with
from memspec.common.tuned import TUNED_ENV, tuned_path

WEIGHTS = (None, 2, 8, 32)  # observations the dev prior is worth (None: depth off)
# buckets of the suffix match under a proposal's first token, by their smallest length: the
# shortest match the pool's lookup takes, longer ones, and 6+ (whole clauses repeated); a
# bucket with fewer than MIN_VERIFIES verifies on dev joins the one below it
MATCH_EDGES = (0, 3, 6)
MIN_VERIFIES = 20


def _log(msg: str) -> None:
    print(f"[bench tune] lookup depth: {msg}", file=sys.stderr, flush=True)


def prior_from_counts(counts: Sequence[int], gamma: int) -> list[float]:
    """q_j = P(token j accepted | tokens 1..j-1 were) from accepted-count histograms of
    gamma-token proposals ([k]: verifies that accepted k)."""
    n = [0] * (gamma + 1)
    for k, c in enumerate(counts[:gamma + 1]):
        n[k] += int(c)
    at_least = [sum(n[k:]) for k in range(gamma + 1)]  # [j]: accepted >= j
    return [round(at_least[j] / at_least[j - 1], 4) if at_least[j - 1] else 0.5
            for j in range(1, gamma + 1)]


def prior_by_match(verifies: Sequence[tuple[int, int]], gamma: int
                   ) -> tuple[list[list[Any]], list[list[Any]]]:
    """``[[smallest match, q]]`` and ``[[smallest match, accepted counts]]`` from (match,
    accepted) pairs of gamma-token proposals."""
    counts: list[list[Any]] = []
    for i, edge in enumerate(MATCH_EDGES):
        top = MATCH_EDGES[i + 1] if i + 1 < len(MATCH_EDGES) else None
        hist = [0] * (gamma + 1)
        for m, a in verifies:
            if m >= edge and (top is None or m < top):
                hist[min(a, gamma)] += 1
        if counts and min(sum(hist), sum(counts[-1][1])) < MIN_VERIFIES:  # too few to
            counts[-1][1] = [x + y for x, y in zip(counts[-1][1], hist)]  # stand alone
        else:
            counts.append([edge, hist])
    return [[edge, prior_from_counts(hist, gamma)] for edge, hist in counts], counts


def dev_lookup_verifies(pool_file: Path, rows: Sequence[dict[str, str]], max_new: int
                        ) -> list[tuple[int, int]]:
    """(match, accepted) of every lookup-only verify on `rows`, gamma-token proposals."""
    import torch

    from memspec.common.config import load_pool
    from memspec.procs.decoder.inprocess import build_local
    from memspec.procs.decoder.models import encode_prompt
    from memspec.procs.decoder.sched.costs import LOOKUP

    rt = build_local(load_pool(pool_file), with_drafts=False)
    rt.engine.depth_costs = None  # no depth: every proposal is gamma tokens
    out: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        with torch.inference_mode():
            _, stats = rt.engine.generate(encode_prompt(rt.tokenizer, row["prompt"]), max_new,
                                          None, lambda _s: LOOKUP)
        out += [(r.match, r.accepted) for r in stats.records if r.proposed]
        _log(f"prior {i + 1}/{len(rows)}: {len(out)} verifies")
    return out


def variant(weight: int | None) -> str:
    return "memspec@depth-off" if weight is None else f"memspec@depth-w{weight}"


def tune_lookup_depth(pool_file: Path, per_domain: int, max_new: int, repeats: int,
                      gamma: int) -> dict[str, Any]:
    base = json.loads(tuned_path().read_text())
    rows = dev_rows(per_domain)
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        _log("the prior: lookup-only with gamma-token proposals on dev (in process)")
        prior, counts = prior_by_match(dev_lookup_verifies(pool_file, rows, max_new), gamma)
        _log(f"accepted counts by match {counts}: q = {prior}")
        settings = {"target-only": Setting("target-only", str(pool_file))}
        for w in WEIGHTS:
            path = tuned_with(base, {"lookup.DEPTH_PRIOR": prior, "lookup.DEPTH_WEIGHT": w},
                              Path(tmp) / f"w{w}.json")
            settings[variant(w)] = Setting("memspec", str(pool_file), {TUNED_ENV: str(path)})
        res = run_settings(settings, rows, max_new, repeats, _log)
    summary = res["summary"]
    best = choose_setting({w: summary[variant(w)] for w in WEIGHTS},
                          prefer=lambda w: (w is None, w or 0))
    fig = summary[variant(best)]
    _log(f"chosen DEPTH_WEIGHT = {best} (memspec / target-only {fig['gmean']:.3f}, worst "
         f"prompt {fig['min']:.3f})")
    return {"grid": {"DEPTH_WEIGHT": list(WEIGHTS)}, "prior": prior, "counts": counts,
            "rows": [{"value": w, "variant": variant(w), **brief(summary[variant(w)])}
                     for w in WEIGHTS],
            "chosen": best, "figure": brief(fig), "floor": FLOOR, "prompts": len(rows),
            "repeats": repeats, "identical_tokens": res["identical_tokens"]}

