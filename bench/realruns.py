"""Real end-to-end requests through the three processes, traced, cached, resumable.

Every request goes through a cold-start supervisor (slots emptied before each request, as
the paper measures) with `trace=True`, so one run feeds both the cost model's fit and the
simulator's validation. Results are appended to a JSONL file keyed by (policy, prompt id,
max_new_tokens, ucb_c); a rerun only does what is missing.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from memspec.common.errors import ConfigError, MemspecError
from memspec.common.files import read_jsonl
from memspec.common.messages import Done, Error, Submit
from memspec.common.metrics import Summary, as_json
from memspec.common.paths import DEFAULT_POOL
from memspec.launch.supervisor import Supervisor


@dataclass(frozen=True)
class RealRequest:
    policy: str
    prompt_id: str
    domain: str
    prompt: str
    max_new_tokens: int
    ucb_c: float | None = None

    @property
    def key(self) -> str:
        return f"{self.policy}|{self.prompt_id}|{self.max_new_tokens}|{self.ucb_c}"


def _log(msg: str) -> None:
    print(f"[real] {msg}", file=sys.stderr, flush=True)


@dataclass
class RealResult:
    """One finished real run as cached (the JSONL row), with its typed summary."""

    row: dict[str, Any]
    stats: Summary

    @property
    def token_ids(self) -> list[int]:
        return self.row["token_ids"]


def read_results(path: Path) -> dict[str, RealResult]:
    """Cached runs by key; a cache from before typed summaries is a one-line error."""
    out = {}
    for key, row in read_jsonl(path, "key").items():
        try:
            out[key] = RealResult(row, msgspec.convert(row["stats"], Summary))
        except (msgspec.ValidationError, KeyError) as exc:
            raise ConfigError(f"{path} holds a run this memspec cannot read ({exc})",
                              "run `memspec bench --recalibrate` to measure again") from None
    return out


def _one(sup: Supervisor, req: RealRequest) -> Done:
    msg = sup.run(Submit(req_id=secrets.token_hex(4), prompt=req.prompt, policy=req.policy,
                         max_new_tokens=req.max_new_tokens, trace=True, ucb_c=req.ucb_c))
    if not isinstance(msg, Done):
        reason = msg.message if isinstance(msg, Error) else "no reply"
        raise MemspecError(f"real run {req.key} failed: {reason}",
                           "see the decoder log under the run directory")
    return msg


def run_real(requests: Sequence[RealRequest], out: Path, pool_path: str | None = None
             ) -> dict[str, RealResult]:
    """Run whatever of `requests` is not in `out` yet; returns every result by key."""
    done = read_results(out)
    todo = [r for r in requests if r.key not in done]
    if todo:
        _log(f"{len(todo)} requests through the three processes (cold start, traced)")
        out.parent.mkdir(parents=True, exist_ok=True)
        sup = Supervisor(pool_path, cold_start=True)
        t0 = time.perf_counter()
        try:
            sup.start()
            with out.open("a") as f:
                for i, r in enumerate(todo):
                    msg = _one(sup, r)
                    info = sup.procs["decoder"].info
                    row = {"key": r.key, "policy": r.policy, "id": r.prompt_id,
                           "domain": r.domain, "max_new_tokens": r.max_new_tokens,
                           "ucb_c": r.ucb_c, "token_ids": msg.token_ids,
                           "stats": as_json(msg.stats),
                           "bandwidth_bytes_s": getattr(info, "bandwidth_bytes_s", None)}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    done[r.key] = RealResult(row, msg.stats)
                    el = time.perf_counter() - t0
                    _log(f"{i + 1}/{len(todo)} {r.policy} {r.prompt_id}: "
                         f"{msg.stats.tokens_per_s_steady:.1f} tok/s; "
                         f"eta {el / (i + 1) * (len(todo) - i - 1):.0f}s")
        finally:
            sup.shutdown()
    return {r.key: done[r.key] for r in requests}


def pinned_pool(pool_path: str | None, bandwidth_bytes_s: float, out: Path) -> str:
    """A copy of the pool with the edge-emulated bandwidth fixed (and relative paths made
    absolute), so every supervisor started for one benchmark loads drafts equally fast."""
    src = Path(pool_path) if pool_path else DEFAULT_POOL
    base = src.resolve().parent

    def absolute(m: re.Match) -> str:
        value = m.group(2)
        if value.startswith(("/", "$", "~")):
            return m.group(0)
        return f'{m.group(1)}"{(base / value).resolve()}"'

    text = re.sub(r'^(\s*(?:path|target|predictor_head)\s*=\s*)"([^"]*)"', absolute,
                  src.read_text(), flags=re.M)
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("bandwidth_mb_s")]
    i = next(i for i, ln in enumerate(lines) if ln.strip() == "[pool]")
    lines.insert(i + 1, f"bandwidth_mb_s = {bandwidth_bytes_s / 1e6:.6f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return str(out)
