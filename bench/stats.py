"""Headline ratios: GMEAN over prompts of per-prompt throughput ratios, with a bootstrap CI.

One statistic for the real runs and for the simulator's value beside them, so the two are
compared like for like: for every prompt, each policy's tokens/s pooled over its repeats
(total tokens over total decode time), the ratio of two policies on that prompt, then the
geometric mean over prompts. The 95% interval resamples prompts with replacement (within
each domain, so every resample keeps the domain mix) and takes the 2.5/97.5 percentiles.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence

BOOTSTRAP = 2000
HEADLINE = {  # the ratios: numerator, denominator
    "memspec_over_mab_async": ("memspec", "mab-async"),
    "memspec_over_general_static": ("memspec", "general-static"),
    "memspec_over_oracle_dynamic": ("memspec", "oracle-dynamic"),
    "memspec_over_prediction_only": ("memspec", "prediction-only"),
    "memspec_over_target_only": ("memspec", "target-only"),
    "oracle_dynamic_over_oracle_static": ("oracle-dynamic", "oracle-static"),
}


def log_ratios(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """log(a/b) per prompt id present (and positive) in both."""
    return {p: math.log(a[p] / b[p]) for p in a if p in b and a[p] > 0 and b[p] > 0}


def gmean_ci(logs: Mapping[str, float], strata: Mapping[str, str], n: int = BOOTSTRAP,
             seed: int = 0) -> tuple[float, tuple[float, float]]:
    """(GMEAN, (lo, hi)) of exp(logs) over prompts; stratified percentile bootstrap
    (`n` = 0: no interval)."""
    nan = float("nan")
    if not logs:
        return nan, (nan, nan)
    by: dict[str, list[float]] = defaultdict(list)
    for p, v in sorted(logs.items()):
        by[strata.get(p, "")].append(v)
    groups = list(by.values())
    total = sum(len(g) for g in groups)
    mean = sum(sum(g) for g in groups) / total
    if n < 1:
        return math.exp(mean), (nan, nan)
    rng = random.Random(seed)
    means = []
    for _ in range(n):
        s = 0.0
        for g in groups:
            s += sum(g[rng.randrange(len(g))] for _ in g)
        means.append(s / total)
    means.sort()
    lo, hi = means[int(0.025 * (n - 1))], means[int(round(0.975 * (n - 1)))]
    return math.exp(mean), (math.exp(lo), math.exp(hi))


def headline_ratios(per_prompt: Mapping[str, Mapping[str, float]], strata: Mapping[str, str],
                    pairs: Mapping[str, tuple[str, str]] = HEADLINE, n: int = BOOTSTRAP
                    ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """({ratio: GMEAN}, {ratio: [lo, hi]}) from {policy: {prompt id: tokens/s}}."""
    gm: dict[str, float] = {}
    ci: dict[str, list[float]] = {}
    for key, (a, b) in pairs.items():
        if a in per_prompt and b in per_prompt:
            g, (lo, hi) = gmean_ci(log_ratios(per_prompt[a], per_prompt[b]), strata, n)
            gm[key], ci[key] = g, [lo, hi]
    return gm, ci


def pooled_rate(tokens: Sequence[float], seconds: Sequence[float]) -> float:
    t = sum(seconds)
    return sum(tokens) / t if t > 0 else 0.0
