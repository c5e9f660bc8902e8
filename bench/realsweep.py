"""Settings of a knob compared in real runs on dev: one warm `memspec up` per setting.

For knobs the simulator cannot replay (what it has no table for: the context lookup run
alone, a ranking's cost beside the decoder), each setting serves from its own server: a
pool copy (`pool`) or a scratch tuned.json (`env`, common/tuned.py's MEMSPEC_TUNED), so no
setting learns from another's requests. Every dev prompt's variants run back to back in
an alternating order (the host's speed drifts over minutes) beside the baselines on
theirs; per variant the end-to-end speed over target-only on its own server (geometric
mean, its 95% interval, the worst prompt): servers with the same settings differ by a few
percent. dev2 and test2 prompts are never read.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from memspec.bench.floor import DOMAINS, Server, interleaved, ratio_summary
from memspec.zoo.prompts import load_prompts

FLOOR = 0.9  # a setting with a prompt below this share of target-only is not chosen


@dataclass(frozen=True)
class Setting:
    """One variant's server: the policy it serves, its pool file (None: the default), and
    environment it starts with."""

    policy: str
    pool: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)


def dev_rows(per_domain: int) -> list[dict[str, str]]:
    return [{"id": r["id"], "domain": r["domain"], "prompt": r["prompt"]}
            for r in load_prompts("dev", DOMAINS, per_domain=per_domain)]


OWN = "@target-only"  # a variant's own server running target-only (its summary's baseline)


def run_settings(settings: Mapping[str, Setting], rows: list[dict[str, str]], max_new: int,
                 repeats: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every variant (one of them "target-only") on every row; its summary over target-only
    and the runs (token ids dropped, their identity kept).

    Each variant's server also runs target-only on every row (``<variant>@target-only``),
    and the variant's summary is over that, its own server's: two servers with the same
    settings differ by 4-6% on a 2-core VM (Zen 4: memspec 1.324 against 1.398 over one
    target-only, the same 40 dev prompts interleaved), more than most settings differ."""
    if "target-only" not in settings:
        raise ValueError("a sweep is measured against target-only: give it a server")
    own = tuple(f"{v}{OWN}" for v, s in settings.items() if s.policy != "target-only")
    variants = (*settings, *own)
    log(f"{len(rows)} dev prompts, {max_new} new tokens, {repeats} repeats; one warm server "
        f"per variant, each also timing target-only: {', '.join(settings)}")
    with tempfile.TemporaryDirectory(prefix="memspec-sweep-") as tmp:
        servers: dict[str, Server] = {}
        try:
            for i, (name, s) in enumerate(settings.items()):
                servers[name] = Server(s.policy, s.pool, tmp, name=f"v{i}", env=dict(s.env))
            for s in servers.values():  # each server's first request is its own warm-up
                s.generate(rows[0]["prompt"], 8)
            for s in servers.values():
                s.settle()
            shown = tuple((f"{v}/target-only", v, _baseline(v, own)) for v in settings
                          if v != "target-only")

            def one(prompt: str, v: str) -> dict[str, Any]:
                if v in own:
                    return servers[v.removesuffix(OWN)].generate(prompt, max_new, "target-only")
                return servers[v].generate(prompt, max_new)

            runs = interleaved(rows, variants, repeats, one, "dev", log=log, shown_pairs=shown)
        finally:
            for s in servers.values():
                s.stop()
    summary = {v: {**ratio_summary(runs, v, _baseline(v, own)),
                   "snapshots_per_request": statistics.fmean(r[v]["snapshots"] for r in runs),
                   "mean_acceptance_length": statistics.fmean(
                       r[v]["mean_acceptance_length"] for r in runs)}
               for v in settings if v != "target-only"}
    for s in summary.values():
        s.pop("paired_per_prompt", None)
    return {"summary": summary,
            "identical_tokens": all(r[v]["ids"] == r["target-only"]["ids"]
                                    for r in runs for v in variants),
            "runs": [{k: ({kk: vv for kk, vv in v.items() if kk != "ids"}
                          if isinstance(v, dict) else v) for k, v in r.items()} for r in runs]}


def _baseline(variant: str, own: tuple[str, ...]) -> str:
    """What `variant` is measured over: target-only on its own server where it has one."""
    return f"{variant}{OWN}" if f"{variant}{OWN}" in own else "target-only"


def choose_setting(scores: Mapping[Any, Mapping[str, Any]], prefer: Callable[[Any], Any]
                   ) -> Any:
    """The setting with the highest geometric mean over target-only and no prompt below
    FLOOR (else the highest of all); ties within 0.1% go to `prefer`'s largest key."""
    safe = {k: s for k, s in scores.items() if s["min"] >= FLOOR} or dict(scores)
    top = max(s["gmean"] for s in safe.values())
    return max((k for k, s in safe.items() if s["gmean"] >= top * 0.999), key=prefer)
