"""Real end-to-end requests through the three processes, traced, cached, resumable.

Every request goes through a cold-start supervisor (slots emptied before each request, as
the paper measures) with `trace=True`, so one run feeds the cost model's fit, the headline
ratios and the simulator's comparison. Results are appended to a JSONL file keyed by
(variant, prompt id, max_new_tokens, ucb_c, gate, repeat); a rerun only does what is
missing.
:func:`interleaved` orders a benchmark's requests so that every prompt's policies run back
to back, in an order rotated per prompt and repeat: slow drifts of the machine (other
jobs, thermal state) then fall on every policy alike instead of on one policy's block.

A request's `policy` is a bench variant's name: a drafting policy under its own name runs
with the speculation gate on, `<policy>-ungated` with it off (:func:`variant`), so that
every baseline is measured with the tool memspec has and without it; `<policy>-1t` runs it
on one decoder thread (what the pipeline gave the decoder before threads followed the work,
so the speed-up is shown against both baselines). The name and the gate are in the cache
key, so runs of two variants never stand in for each other.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from memspec.common.errors import ConfigError, MemspecError
from memspec.common.files import read_jsonl
from memspec.common.metrics import Summary, as_json
from memspec.common.paths import DEFAULT_POOL
from memspec.launch.api import Result, Runtime
from memspec.procs.decoder.sched.policies import GATED

UNGATED = "-ungated"
ONE_THREAD = "-1t"  # the decoder on one thread throughout (the pipeline's old setting)


def variant(name: str) -> tuple[str, bool | None]:
    """(the policy the decoder runs, its gate) for a bench variant's name: `X-ungated`
    runs drafting policy X with the gate off, a drafting policy's own name with it on
    (explicitly: a pool that turns it off changes no figure's meaning), any other policy
    with no gate (None); `X-1t` is X on one decoder thread."""
    name = name.removesuffix(ONE_THREAD)
    if name.endswith(UNGATED) and name[:-len(UNGATED)] in GATED:
        return name[:-len(UNGATED)], False
    return name, (True if name in GATED else None)


def variant_threads(name: str) -> int | None:
    """The decoder threads a variant is capped at (None: the runtime's own choice)."""
    return 1 if name.endswith(ONE_THREAD) else None


@dataclass(frozen=True)
class RealRequest:
    policy: str  # a bench variant's name (see `variant`)
    prompt_id: str
    domain: str
    prompt: str
    max_new_tokens: int
    ucb_c: float | None = None
    repeat: int = 0

    @property
    def key(self) -> str:
        base = f"{self.policy}|{self.prompt_id}|{self.max_new_tokens}|{self.ucb_c}"
        gate = variant(self.policy)[1]
        if gate is not None:
            base += f"|gate={'on' if gate else 'off'}"
        return base if not self.repeat else f"{base}|r{self.repeat}"


def interleaved(prompts: Sequence[dict], policies: Sequence[str], max_new_tokens: int,
                repeats: int, ucb: dict[str, float] | None = None) -> list[RealRequest]:
    """Every (repeat, prompt): all policies back to back, rotated by prompt and repeat;
    an ungated variant takes its policy's UCB c."""
    ucb = ucb or {}
    out = []
    for rep in range(repeats):
        for i, p in enumerate(prompts):
            k = (i + rep * max(1, len(policies) // 2)) % len(policies)
            for pol in [*policies[k:], *policies[:k]]:
                c = ucb.get(pol, ucb.get(variant(pol)[0]))
                out.append(RealRequest(pol, p["id"], p["domain"], p["prompt"],
                                       max_new_tokens, c, rep))
    return out


PROGRESS_S = 10.0


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


def run_fingerprint(pool_path: str | None) -> str:
    """What a cached real run depends on beyond its request: the pool's drafts and knobs,
    the tuned knobs (tuned.json), the predictor head it ranks with, the target's numerics (dtype and CPU kernel path) and
    the runtime's code. A run made with anything else is measured again, never mixed into
    new figures."""
    from memspec.common.config import load_pool
    from memspec.common.tuned import tuned_path
    from memspec.procs.decoder.oracle.tablefiles import pool_fingerprint, runtime_key
    from memspec.procs.predictor.ranker import head_path_for

    pool = load_pool(pool_path)
    h = hashlib.sha256(json.dumps(pool_fingerprint(pool), sort_keys=True).encode())
    h.update(Path(pool.source).read_bytes())
    head = head_path_for(pool)  # a retrained head ranks differently: new runs
    h.update(head.read_bytes() if head.is_file() else f"no head at {head.name}".encode())
    h.update(runtime_key(pool).encode())
    h.update(tuned_path().read_bytes())  # the knobs the runtime reads (a re-tune: new runs)
    root = Path(__file__).resolve().parent.parent
    for sub in ("procs", "common", "launch"):
        for f in sorted((root / sub).rglob("*")):
            if f.suffix in (".py", ".cpp", ".h") and "__pycache__" not in f.parts:
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def read_results(path: Path, fingerprint: str | None = None) -> dict[str, RealResult]:
    """Cached runs by key (only those made with `fingerprint`, when given); a cache from
    before typed summaries is a one-line error."""
    out = {}
    for key, row in read_jsonl(path, "key").items():
        if fingerprint is not None and row.get("fingerprint") != fingerprint:
            continue
        try:
            out[key] = RealResult(row, msgspec.convert(row["stats"], Summary))
        except (msgspec.ValidationError, KeyError) as exc:
            raise ConfigError(f"{path} holds a run this memspec cannot read ({exc})",
                              "run `memspec bench --recalibrate` to measure again") from None
    return out


def _runtime(pool_path: str | None) -> Runtime:
    """The three processes as a user's program starts them (the public API), with drafts'
    slots emptied before each request (as the paper measures) and no standby decoder (its
    start-up while the server idles would land on a peer's timing)."""
    return Runtime(pool=pool_path, cold_start=True, standby=False).start()


def _one(rt: Runtime, req: RealRequest) -> Result:
    policy, gate = variant(req.policy)
    try:
        return rt.generate(req.prompt, policy=policy, max_new_tokens=req.max_new_tokens,
                           trace=True, ucb_c=req.ucb_c, gate=gate,
                           threads=variant_threads(req.policy))
    except MemspecError as exc:
        raise MemspecError(f"real run {req.key} failed: {exc.problem}",
                           "see the decoder log under the run directory") from None


def run_real(requests: Sequence[RealRequest], out: Path, pool_path: str | None = None
             ) -> dict[str, RealResult]:
    """Run whatever of `requests` is not in `out` yet (with this code and pool); returns
    every result by key."""
    fp = run_fingerprint(pool_path)
    done = read_results(out, fp)
    todo = [r for r in requests if r.key not in done]
    if todo:
        _log(f"{len(todo)} requests through the three processes (cold start, traced)")
        out.parent.mkdir(parents=True, exist_ok=True)
        rt = _runtime(pool_path)
        t0 = last = time.perf_counter()
        try:
            decoder = rt.status().procs["decoder"]
            with out.open("a") as f:
                for i, r in enumerate(todo):
                    msg = _one(rt, r)
                    row = {"key": r.key, "policy": r.policy, "id": r.prompt_id,
                           "domain": r.domain, "max_new_tokens": r.max_new_tokens,
                           "ucb_c": r.ucb_c, "gate": variant(r.policy)[1],
                           "repeat": r.repeat, "token_ids": msg.token_ids,
                           "stats": as_json(msg.stats), "fingerprint": fp,
                           "bandwidth_bytes_s": decoder.bandwidth_bytes_s}
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    done[r.key] = RealResult(row, msg.stats)
                    el = time.perf_counter() - t0
                    if i + 1 == len(todo) or time.perf_counter() - last >= PROGRESS_S:
                        last = time.perf_counter()
                        _log(f"{i + 1}/{len(todo)} {r.policy} {r.prompt_id}: "
                             f"{msg.stats.tokens_per_s_steady:.1f} tok/s; "
                             f"~{el / (i + 1) * (len(todo) - i - 1) / 60:.1f} min left")
        finally:
            rt.close()
    return {r.key: done[r.key] for r in requests}


def peer_runs(rows: Sequence[dict], pool_path: str | None, max_new: int, gamma: int,
              out: Path) -> dict[str, Any]:
    """memspec and target-only through the three processes beside llama.cpp on the same
    GGUF and prompts (bench/peers.py), interleaved per prompt; each of ours timed by the
    client, from submitting to the reply (what a user waits)."""
    from memspec.bench import peers
    from memspec.common.config import load_pool
    from memspec.procs.decoder.models import encode_prompt, eos_token_ids, load_tokenizer

    pool = load_pool(pool_path)
    tokenizer = load_tokenizer(pool.target)
    eos = set(eos_token_ids(pool.target, tokenizer))
    rt: Runtime | None = None

    def ours(prompt: str, policy: str) -> tuple[list[int], float, dict[str, Any]]:
        nonlocal rt
        if rt is None:
            rt = _runtime(pool_path)
        t0 = time.perf_counter()
        try:
            msg = rt.generate(prompt, policy=policy, max_new_tokens=max_new)
        except MemspecError as exc:
            raise MemspecError(f"peer run of {policy} failed: {exc.problem}",
                               "see the decoder log under the run directory") from None
        spent = time.perf_counter() - t0
        st = msg.stats
        return list(msg.token_ids), spent, {
            "e2e_s": st.time.e2e, "prefill_s": st.time.prefill, "decode_s": st.time.decode,
            "sched_s": st.time.sched, "mean_acceptance_length": st.mean_acceptance_length,
            "loads": st.loads, "drafts_used": dict(st.drafts_used)}

    try:
        return peers.run(rows, ours, lambda p: encode_prompt(tokenizer, p), eos, max_new,
                         gamma, out, run_fingerprint(pool_path))
    finally:
        if rt is not None:
            rt.close()


def pool_copy(pool_path: str | None, out: Path, settings: Mapping[str, str]) -> str:
    """A copy of the pool at `out` with `settings` (TOML values, as text) set in [pool],
    relative paths made absolute and the pool's predictor head named unless `settings`
    names one (a head trained beside the pool file would not be found beside the copy)."""
    from memspec.common.config import load_pool
    from memspec.procs.predictor.ranker import head_path_for

    src = Path(pool_path) if pool_path else DEFAULT_POOL
    base = src.resolve().parent
    head = head_path_for(load_pool(src, check=False))

    def absolute(m: re.Match) -> str:
        value = m.group(2)
        if value.startswith(("/", "$", "~")):
            return m.group(0)
        return f'{m.group(1)}"{(base / value).resolve()}"'

    text = re.sub(r'^(\s*(?:path|target)\s*=\s*)"([^"]*)"', absolute, src.read_text(),
                  flags=re.M)
    values = {"predictor_head": f'"{head.resolve()}"', **settings}
    lines = [ln for ln in text.splitlines()
             if not ln.strip().startswith(tuple(values))]
    i = next(i for i, ln in enumerate(lines) if ln.strip() == "[pool]")
    lines[i + 1:i + 1] = [f"{k} = {v}" for k, v in values.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return str(out)


def pinned_pool(pool_path: str | None, bandwidth_bytes_s: float, out: Path,
                load_iter_ratio: float | None = None) -> str:
    """A copy of the pool with the edge-emulated bandwidth fixed, so every supervisor
    started for one benchmark loads drafts equally fast; `load_iter_ratio` (the measured
    one) is what oracle-dynamic then plans loads with."""
    settings = {"bandwidth_mb_s": f"{bandwidth_bytes_s / 1e6:.6f}"}
    if load_iter_ratio:
        settings["load_iter_ratio"] = f"{load_iter_ratio:.4f}"
    return pool_copy(pool_path, out, settings)
