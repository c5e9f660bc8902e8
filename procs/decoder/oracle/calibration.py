"""What a target step, a verify and a draft step cost on this machine, before any request.

The speculation gate (gate.py) must know from a fresh decoder's first request whether a
draft's tokens per iteration pay for an iteration, so the decoder times its own target at
start: one step and one verify of gamma+1 rows at two context lengths (lines in the context:
attention grows with it), a few tenths of a second in all. The lines are kept under
``$MEMSPEC_HOME/calib/`` keyed by everything that changes them (numerics key: dtype and CPU
kernel path; threads; gamma; the target's files; the build and the engine's code), so a
restarted decoder reads them instead. A draft's gamma steps are priced at a fifth of a
target step each unless they were timed (`draft_gamma_s`: the decoder times each draft
shape at start, draft_prices.py); the request's own iterations refine both (the gate's
medians).

Lines timed while the machine was busy (the predictor and loader starting beside the
decoder, a test suite on both cores) would price every target step two or three times too
dear for as long as they stay cached (seen: 9-15 ms steps cached for a 5 ms target), which
makes drafts look cheap to the gate. So a decoder that reads them first re-times one target
step (~30 ms): if the cache is slower than the target is now, it measures again and keeps
whichever lines are faster.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from memspec.common.files import atomic_write_text
from memspec.common.paths import memspec_home
from memspec.procs.decoder.drafts.datastore import DATASTORE_KIND
from memspec.procs.decoder.sched.gate import GateCosts, Line

CONTEXTS = (48, 304)  # two context lengths: the lines' two points
REPS, WARM = 5, 2
STALE = 1.2  # a cached step this much slower than one timed now is re-measured
FORMAT = "memspec-calibration/2"  # /2: with the prefill line
_CODE = [Path(__file__).resolve().parents[1] / n
         for n in ("engine.py", "forward/native.py", "forward/lean.py")]


def _fastest_s(fns: list, reps: int = REPS, warm: int = WARM) -> list[float]:
    """The fastest of `reps` timings of each function, taken in turn: other work on the
    machine only ever adds time, so the minimum is what the code itself costs, and taking
    them in turn keeps their ratio honest under a changing load."""
    for _ in range(warm):
        for fn in fns:
            fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _line(xs: tuple[int, ...], ys: list[float]) -> Line:
    (x0, x1), (y0, y1) = xs, ys
    b = max(0.0, (y1 - y0) / (x1 - x0))
    return (max(0.0, y0 - b * x0), b)


@torch.inference_mode()
def measure_target(engine: Any, gamma: int) -> dict[str, Line]:
    """A target step and a verify of gamma+1 rows at CONTEXTS, through the engine's own
    runner and cache (the rows written are beyond any request's and overwritten later),
    and a prompt's prefill into a fresh cache as a request's is (oracle-dynamic prices
    the loads that run beside it against this line)."""
    target = engine.target
    size = max(engine.max_len, CONTEXTS[-1] + gamma + 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(engine.vocab, 1000), (CONTEXTS[-1] + gamma + 1,), generator=gen)
    ids = ids.to(engine.device)
    filled: list[Any] = []

    def prefill(n: int) -> None:
        """As a request's (Session: a fresh cache, then the prompt, synced)."""
        filled[:] = [target.new_cache(size)]
        target.forward(ids[:n], 0, filled[0], last_only=True)
        if ids.device.type == "cuda":
            torch.cuda.synchronize(ids.device)

    # the long prefill twice (~0.7 s in all on a 2-core CPU): the last fills the cache the
    # steps are timed on
    short, long = _fastest_s([lambda: prefill(CONTEXTS[0]), lambda: prefill(CONTEXTS[-1])],
                             reps=2, warm=0)
    cache = filled[0]
    step, verify = [], []
    for L in CONTEXTS:
        s, v = _fastest_s([lambda L=L: target.forward(ids[L:L + 1], L, cache),
                           lambda L=L: target.forward(ids[L:L + gamma + 1], L, cache)])
        step.append(s)
        verify.append(v)
    return {"step": _line(CONTEXTS, step), "verify": _line(CONTEXTS, verify),
            "prefill": _line(CONTEXTS, [short, long])}


def cache_key(engine: Any, pool: Any, numerics: str) -> str:
    """Everything that changes the lines: numerics (dtype, kernel path), threads, gamma, the
    target's files, the native build and the engine's code."""
    h = hashlib.sha256()
    for part in (FORMAT, numerics, str(torch.get_num_threads()), str(pool.gamma),
                 str(Path(pool.target).resolve()), type(engine.target).__name__):
        h.update(part.encode())
    for f in sorted(Path(pool.target).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for f in _CODE:
        h.update(f.read_bytes())
    try:
        from memspec.procs.decoder.forward.native import build_dir

        isa = getattr(engine.target, "isa", "")
        h.update((build_dir(isa).name if isa else "").encode())
    except Exception:  # no native build: the Python path's code is hashed above
        pass
    return h.hexdigest()[:16]


def gate_costs(engine: Any, pool: Any, numerics: str, log=lambda msg: None) -> GateCosts:
    """The target's lines, cached per key (a cold decoder measures them in ~0.3 s)."""
    key = cache_key(engine, pool, numerics)
    path = memspec_home() / "calib" / f"{key}.json"
    lines = None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") == FORMAT and _sane(raw["step"], raw["verify"]):
            lines = {k: tuple(raw[k]) for k in ("step", "verify", "prefill")}
    except (OSError, ValueError, KeyError, TypeError):
        lines = None
    cached = lines
    cached_s = at(cached["step"], CONTEXTS[0]) if cached is not None else 0.0
    cpu = torch.device(engine.device).type == "cpu"  # (a GPU's helpers do not share its cores)
    if cached is not None and cpu and cached_s > STALE * step_now(engine):
        log(f"the cached target step ({1e3 * cached_s:.2f} ms) is slower than the target is "
            "now: measuring again")
        lines = None
    if lines is None:
        t0 = time.perf_counter()
        lines = measure_target(engine, pool.gamma)
        if not _sane(lines["step"], lines["verify"]):  # a disturbed measurement: once more
            lines = measure_target(engine, pool.gamma)
        if cached is not None and cached_s <= at(lines["step"], CONTEXTS[0]):
            lines = cached  # (the new measurement was the disturbed one)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": FORMAT, "numerics": numerics,
                                            "threads": torch.get_num_threads(),
                                            "gamma": pool.gamma, **lines}, indent=1))
        log(f"calibrated the target in {time.perf_counter() - t0:.2f}s: step "
            f"{1e3 * lines['step'][0]:.2f} ms + {1e6 * lines['step'][1]:.2f} us/token, verify "
            f"{1e3 * lines['verify'][0]:.2f} ms + {1e6 * lines['verify'][1]:.2f} us/token")
    step, verify = lines["step"], lines["verify"]
    # a draft's gamma steps before its shape is timed (draft_prices.py): a fifth of a
    # target step each, a small draft model's
    return GateCosts(target=step, verify=verify, draft_prior_s=0.2 * pool.gamma * step[0],
                     prefill=lines["prefill"],
                     gamma=pool.gamma, free=frozenset(d.name for d in pool.drafts
                                                      if d.kind == DATASTORE_KIND))


def at(line: Line, context: int) -> float:
    return line[0] + line[1] * context


@torch.inference_mode()
def step_now(engine: Any) -> float:
    """One target step at the first calibrated context, the fastest of a few (the cache's
    contents do not change its time, so nothing is prefilled)."""
    target = engine.target
    L = CONTEXTS[0]
    cache = target.new_cache(L + 1)
    ids = torch.zeros(1, dtype=torch.long).to(engine.device)
    return _fastest_s([lambda: target.forward(ids, L, cache)])[0]


def _sane(step: Line, verify: Line) -> bool:
    """A verify of gamma+1 rows costs at least a 1-row step (at the context measured)."""
    return step[0] > 0 and at(verify, CONTEXTS[0]) >= at(step, CONTEXTS[0])


@torch.inference_mode()
def draft_gamma_s(engine: Any, bound: Any, gamma: int) -> float:
    """gamma proposals of a bound draft (a head's steps after a short teacher-forced prefix,
    a model draft's 1-token forwards), timed once when it is first bound."""
    runner = bound.runner
    cache = bound.new_cache(engine.max_len)
    ctx = 32
    ids = torch.randint(0, min(engine.vocab, 1000), (ctx + 1,)).to(engine.device)
    one = ids[-1:]
    cuda = ids.device.type == "cuda"  # (kernels run asynchronously: time them to the end)

    def synced(fn):
        return (lambda: (fn(), torch.cuda.synchronize(ids.device))) if cuda else fn

    if bound.kind == "head":
        feats = torch.zeros((ctx, runner.arch.features), device=engine.device)
        _, hidden = runner.teacher(ids[:ctx], 0, cache, feats)
        return gamma * _fastest_s([synced(lambda: runner.step(one, ctx, cache, hidden))])[0]
    runner.forward(ids[:ctx], 0, cache, last_only=True)
    return gamma * _fastest_s([synced(lambda: runner.forward(one, ctx, cache))])[0]
