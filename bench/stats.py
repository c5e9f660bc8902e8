"""Headline ratios: GMEAN over prompts of per-prompt throughput ratios, with a bootstrap CI.

One statistic for the real runs and for the simulator's value beside them, so the two are
compared like for like: for every prompt, each policy's tokens/s pooled over its repeats
(total tokens over total seconds: decode time for steady, the whole request for end to
end), the ratio of two policies on that prompt, then the geometric mean over prompts. The 95% interval is a two-level bootstrap: prompts resampled
with replacement within each domain (every resample keeps the domain mix), and each
chosen prompt's repeats resampled per policy (the machine's run-to-run noise), then the
2.5/97.5 percentiles of the GMEAN.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

BOOTSTRAP = 2000
# the issues' ratios: numerator, denominator (bench variants, bench/realruns.py `variant`:
# a drafting policy's own name runs gated, `-ungated` without the gate)
HEADLINE = {
    "memspec_over_general_static": ("memspec", "general-static"),
    "memspec_over_oracle_static": ("memspec", "oracle-static"),
    "memspec_over_mab_async": ("memspec", "mab-async"),
    "memspec_over_prediction_only": ("memspec", "prediction-only"),
    "memspec_over_general_static_ungated": ("memspec", "general-static-ungated"),
    "memspec_over_mab_async_ungated": ("memspec", "mab-async-ungated"),
    "memspec_over_memspec_ungated": ("memspec", "memspec-ungated"),
    "memspec_over_lookup_only": ("memspec", "lookup-only"),
    "memspec_over_target_only": ("memspec", "target-only"),
    # beside the one-thread pipeline target-only that earlier figures were taken against
    "memspec_over_target_only_1t": ("memspec", "target-only-1t"),
    "target_only_over_target_only_1t": ("target-only", "target-only-1t"),
    "memspec_over_oracle_dynamic": ("memspec", "oracle-dynamic"),
    "oracle_dynamic_over_oracle_static": ("oracle-dynamic", "oracle-static"),
}


Runs = Mapping[str, Mapping[str, Sequence[tuple[float, float]]]]  # policy -> id -> repeats


def _rate(runs: Sequence[tuple[float, float]]) -> float:
    t = sum(sec for _, sec in runs)
    return sum(tok for tok, _ in runs) / t if t > 0 else 0.0


def headline_ratios(runs: Runs, strata: Mapping[str, str],
                    pairs: Mapping[str, tuple[str, str]] = HEADLINE, n: int = BOOTSTRAP,
                    seed: int = 0) -> tuple[dict[str, float], dict[str, list[float]]]:
    """({ratio: GMEAN}, {ratio: [lo, hi]}) from {policy: {prompt id: [(tokens, seconds) per
    repeat]}}; `n` = 0 skips the interval (NaN bounds)."""
    pairs = {k: ab for k, ab in pairs.items() if ab[0] in runs and ab[1] in runs}
    ids = {k: sorted(p for p in runs[a] if p in runs[b] and _rate(runs[a][p]) > 0
                     and _rate(runs[b][p]) > 0) for k, (a, b) in pairs.items()}
    gm: dict[str, float] = {}
    ci: dict[str, list[float]] = {}
    nan = float("nan")
    for k, (a, b) in pairs.items():
        logs = [math.log(_rate(runs[a][p]) / _rate(runs[b][p])) for p in ids[k]]
        gm[k] = math.exp(sum(logs) / len(logs)) if logs else nan
        ci[k] = [nan, nan]
    if n < 1:
        return gm, ci
    rng = np.random.default_rng(seed)
    for k, (a, b) in pairs.items():
        by: dict[str, list[str]] = defaultdict(list)
        for p in ids[k]:
            by[strata.get(p, "")].append(p)
        if not by:
            continue
        names = [p for g in by.values() for p in g]
        # prompts resampled within each domain (indices into `names`), then each chosen
        # prompt's repeats per policy
        idx, first = [], 0
        for g in by.values():
            idx.append(first + rng.integers(0, len(g), size=(n, len(g))))
            first += len(g)
        chosen = np.concatenate(idx, axis=1)  # [resample, prompt]
        num = _resampled_rates(rng, [runs[a][p] for p in names], chosen)
        den = _resampled_rates(rng, [runs[b][p] for p in names], chosen)
        ok = (num > 0) & (den > 0)
        logs = np.log(np.where(ok, num, 1.0) / np.where(ok, den, 1.0))
        count = ok.sum(axis=1)
        xs = np.sort(logs.sum(axis=1)[count > 0] / count[count > 0])
        if len(xs):
            lo, hi = xs[int(0.025 * (len(xs) - 1))], xs[int(round(0.975 * (len(xs) - 1)))]
            ci[k] = [math.exp(lo), math.exp(hi)]
    return gm, ci


def _resampled_rates(rng: np.random.Generator, runs: Sequence[Sequence[tuple[float, float]]],
                     chosen: np.ndarray) -> np.ndarray:
    """[resample, prompt] tokens/s of each chosen prompt (an index into `runs`) over its
    repeats drawn with replacement, as many draws as it has repeats."""
    reps = max(len(r) for r in runs)
    tok, sec = np.zeros((len(runs), reps)), np.zeros((len(runs), reps))
    for i, r in enumerate(runs):
        for j, (t, s) in enumerate(r):
            tok[i, j], sec[i, j] = t, s
    c = np.array([len(r) for r in runs])[chosen][..., None]
    draw = np.floor(rng.random((*chosen.shape, reps)) * c).astype(np.int64)
    used = np.arange(reps) < c
    t = np.where(used, tok[chosen[..., None], draw], 0.0).sum(axis=-1)
    s = np.where(used, sec[chosen[..., None], draw], 0.0).sum(axis=-1)
    return np.divide(t, s, out=np.zeros_like(t), where=s > 0)
