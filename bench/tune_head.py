"""`memspec bench tune`'s head sections, each knob chosen on dev by real runs.

- **head_vocab** (``head.VOCAB``): how many rows of its draft vocabulary a head scores. The
  LM rows are most of a head step's work (16,384 rows of the target's LM head against one
  layer), and a draft vocabulary is frequency-ranked, so its first rows are the tokens a
  head gets right most often; the context lookup still proposes tokens past the cut (a
  head embeds any target id).
- **head_stop** (``head.STOP``): the top probability below which a head's own proposal
  ends the iteration's proposals. On a 2-core CPU each proposal is a draft step and
  another verify row (a 5-row int4 verify costs ~2 target steps on AVX2), and most
  rejected proposals were proposed unsure, so stopping there trades a few accepted
  tokens for cheaper iterations.
- **head_first** (``head.FIRST``): the top probability below which a head proposes nothing
  (its iteration a target step). The first proposal costs no draft step, only a second
  verify row, so its floor is lower than head.STOP's, and chosen the same way.

- **lookup_first** (``engine.LOOKUP_FIRST``): the shortest context-suffix match at which a
  head's iteration runs the lookup alone (0: never). Where the context repeats, the lookup
  proposes first inside a head's chain anyway, and the head's steps (~a fifth of a target
  step) buy only what comes after the lookup's chain.

- **head_prior** (``gate.HEAD_PRIOR``): with LOOKUP_FIRST, what a head's record in the gate
  starts from: its tokens an iteration on dev at the positions the lookup leaves it (a walk
  of the dev traces, `head_prior_tokens`), worth a weight of iterations from a grid.

Each setting runs memspec on its own warm server (a scratch tuned.json;
bench/realsweep.py) beside target-only and general-static without the gate (what the
head's iterations alone are worth) with the same setting, every dev prompt's variants back
to back. head_vocab's setting scores most for memspec over target-only with no prompt
below the floor; head_stop's is where the head's own iterations run fastest without memspec
leaving its interval (`choose_stop`); ties go to `prefer`'s largest value.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from memspec.bench.realsweep import FLOOR, Setting, choose_setting, dev_rows, run_settings
from memspec.bench.tune_lookup_gate import brief, tuned_with
from memspec.common.config import PoolConfig
from memspec.common.errors import ConfigError
from memspec.common.tuned import TUNED_ENV, tuned_path

ROWS = (None, 8192, 4096, 2048, 1024)  # None: every row the head was trained with
PRIOR_WEIGHTS = (None, 4, 8, 16)  # iterations the dev prior is worth (None: no prior)
FIRSTS = (0, 2, 3, 4, 6)  # 0: off; 2 is the pool's shortest lookup suffix
# 0: always gamma proposals (a first grid, to 0.7, chose its edge; 0.9 was never chosen, and
# with Q4_1 heads a proposal costs less, so 0.4 took its place)
STOPS = (0.0, 0.4, 0.55, 0.7, 0.8)
FIRST_FLOORS = (0.0, 0.2, 0.35, 0.5)  # 0: a head always proposes one
# (a server per policy and setting: three processes each, ~1.2 GB; 11 fit in 24 GB)
COMPARED = ("memspec", "general-static-ungated")


def _show(value: Any) -> str:
    return "all" if value is None else str(value)


ByValue = Mapping[Any, Mapping[str, Mapping[str, Any]]]  # value -> policy -> its summary


def choose_memspec(by_value: ByValue, prefer: Callable[[Any], Any]) -> Any:
    return choose_setting({v: s["memspec"] for v, s in by_value.items()}, prefer=prefer)


def sweep_head_knob(knob: str, grid: Sequence[Any], prefer: Callable[[Any], Any],
                    pool_file: Path, per_domain: int, max_new: int, repeats: int,
                    choose: Callable[[ByValue, Callable[[Any], Any]], Any] = choose_memspec
                    ) -> dict[str, Any]:
    """`knob` at every value of `grid`, each on its own servers (COMPARED policies)."""
    def log(msg: str) -> None:
        print(f"[bench tune] {knob}: {msg}", file=sys.stderr, flush=True)

    def variant(policy: str, value: Any) -> str:
        return f"{policy}@{_show(value)}"

    base = json.loads(tuned_path().read_text())
    rows = dev_rows(per_domain)
    with tempfile.TemporaryDirectory(prefix="memspec-tune-") as tmp:
        settings = {"target-only": Setting("target-only", str(pool_file))}
        for i, value in enumerate(grid):
            env = {TUNED_ENV: str(tuned_with(base, {knob: value}, Path(tmp) / f"v{i}.json"))}
            for policy in COMPARED:
                settings[variant(policy, value)] = Setting(policy, str(pool_file), env)
        res = run_settings(settings, rows, max_new, repeats, log)
    by_value = {v: {p: res["summary"][variant(p, v)] for p in COMPARED} for v in grid}
    best = choose(by_value, prefer)
    fig = by_value[best]["memspec"]
    log(f"chosen {_show(best)} (memspec / target-only {fig['gmean']:.3f}, worst prompt "
        f"{fig['min']:.3f})")
    return {"grid": {knob.split(".")[-1]: list(grid)},
            "rows": [{"value": v, "variant": variant("memspec", v), **brief(s["memspec"]),
                      **{p.replace("-", "_"): brief(s[p]) for p in COMPARED[1:]}}
                     for v, s in by_value.items()],
            "chosen": best, "figure": brief(fig), "floor": FLOOR, "prompts": len(rows),
            "repeats": repeats, "identical_tokens": res["identical_tokens"]}


def tune_head_vocab(pool_file: Path, per_domain: int, max_new: int, repeats: int
                    ) -> dict[str, Any]:
    return sweep_head_knob("head.VOCAB", ROWS, lambda n: n or 1 << 30, pool_file, per_domain,
                           max_new, repeats)


def choose_stop(by_value: ByValue, prefer: Callable[[Any], Any]) -> float:
    """The floor under which head iterations run fastest (general-static without the gate:
    a head's iteration every time) among those that keep memspec within its interval at
    0 (no stop; always among them). Judged on memspec alone the floor is noise: its gate
    runs the heads only where they pay (mostly the lookup runs), so two sweeps chose 0.7
    and 0.0 with every value inside the others' intervals, while the heads' own
    iterations gained 10-20% at every floor from 0.55 up in both."""
    low = by_value[0.0]["memspec"]["ci95"][0]  # (0.0: the floor off, in both grids)
    scores = {v: s["general-static-ungated"]["gmean"] for v, s in by_value.items()
              if s["memspec"]["gmean"] >= low}
    top = max(scores.values())
    return max((v for v, g in scores.items() if g >= top * 0.999), key=prefer)


def tune_head_stop(pool_file: Path, per_domain: int, max_new: int, repeats: int
                   ) -> dict[str, Any]:
    # ties go to the lower floor: fewer changes to what a head proposes
    return sweep_head_knob("head.STOP", STOPS, lambda s: -s, pool_file, per_domain, max_new,
                           repeats, choose=choose_stop)


def tune_head_first(pool_file: Path, per_domain: int, max_new: int, repeats: int
                    ) -> dict[str, Any]:
    # as head.STOP: the fastest head iterations that keep memspec within its interval at 0
    return sweep_head_knob("head.FIRST", FIRST_FLOORS, lambda s: -s, pool_file, per_domain,
                           max_new, repeats, choose=choose_stop)


def tune_lookup_first(pool_file: Path, per_domain: int, max_new: int, repeats: int
                      ) -> dict[str, Any]:
    # ties go to the longer match: fewer head iterations handed to the lookup
    return sweep_head_knob("engine.LOOKUP_FIRST", FIRSTS, lambda n: n or 1 << 30, pool_file,
                           per_domain, max_new, repeats)


def head_prior_tokens(pool: PoolConfig, first: int) -> tuple[float, int]:
    """Mean tokens an iteration of the pool's general head where LOOKUP_FIRST = `first`
    leaves it, over every traced dev prompt, and the iterations that mean is over. The walk
    replays the engine's choice: from each position, the lookup's iteration where the
    context ends with a suffix of `first`+ tokens seen before (its acceptance alone, gamma
    long), else the head's (its table: the head with the lookup inside)."""
    from memspec.bench.evaluation import load_pool_tables, trajectories_path, trajectory_rows
    from memspec.procs.decoder.drafts.lookup import NgramIndex, lookup_table

    tt = load_pool_tables(pool, "dev")
    rows = trajectory_rows(trajectories_path(pool, "dev", tt.dtype), list(tt.rows))
    total = iterations = 0
    for pid, row in tt.rows.items():
        traj = rows.get(pid)
        table = row["tables"].get(pool.general)
        if traj is None or table is None:
            continue
        prompt, tokens = traj["prompt_ids"], traj["tokens"][:len(table)]
        looked = lookup_table(prompt, tokens, pool.gamma, pool.lookup)
        seq = [*prompt, *tokens]
        P, t = len(prompt), 0
        idx = NgramIndex(pool.lookup, prompt)
        while t < len(tokens):
            idx.extend(seq[len(idx.tokens):P + t])  # (the committed tokens, as the engine's)
            if first and idx.match(seq[max(0, P + t - idx.n_max):P + t]) >= first:
                t += (looked[t] or 0) + 1
                continue
            total += table[t] + 1
            iterations += 1
            t += table[t] + 1
    if not iterations:
        raise ConfigError("no dev traces of the pool's general draft",
                          "run `memspec trace --sets dev` first")
    return total / iterations, iterations


def tune_head_prior(pool_file: Path, per_domain: int, max_new: int, repeats: int
                    ) -> dict[str, Any]:
    from memspec.common.config import load_pool
    from memspec.procs.decoder.engine import lookup_first_match

    pool = load_pool(str(pool_file))
    tokens, n = head_prior_tokens(pool, lookup_first_match("cpu"))
    tokens = round(tokens, 3)
    print(f"[bench tune] gate.HEAD_PRIOR: the general head brings {tokens} tokens an iteration "
          f"where the lookup leaves it (dev, {n} iterations)", file=sys.stderr, flush=True)
    grid = tuple(None if w is None else (tokens, w) for w in PRIOR_WEIGHTS)
    # ties go to no prior, then to the lighter one
    res = sweep_head_knob("gate.HEAD_PRIOR", grid, lambda v: 1 << 30 if v is None else -v[1],
                          pool_file, per_domain, max_new, repeats)
    res["prior_tokens"], res["prior_iterations"] = tokens, n
    return res
