"""What a draft's gamma steps cost on this machine, timed at start once per draft shape.

The speculation gate prices a draft it has not run yet at the calibrated verify plus its
gamma draft steps. Without a measurement those steps were a fixed guess, a fifth of a target
step each: right for a small draft model, four to five times too dear for a one-layer head
(0.04 of a step each on 2 cores, int4 target). With the verify line that put a head's first
iteration at ~2 target steps, at the edge of the gate's free first look (PRIOR_TAU), so a
fresh request looked at the head at once or only after ~90 iterations, depending on the
hour's load. So the decoder times each distinct draft shape at start, bound from its checked
bytes in a slot before any load, and keeps the figures in ``$MEMSPEC_HOME/calib/`` under a
key of everything that changes them (the target calibration's key: numerics, threads,
gamma, target files, build and engine code; plus the head and slot code). Drafts of one
shape (a pool's domain heads share the general head's) share one timing; a restarted
decoder reads them instead of spending ~10 ms a shape.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memspec.common.files import atomic_write_text
from memspec.common.paths import memspec_home
from memspec.common.tuned import knob
from memspec.procs.decoder.oracle.calibration import cache_key, draft_gamma_s
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.procs.decoder.slots import SlotBuffer, bind_draft

FORMAT = "memspec-draft-steps/1"
_CODE = [Path(__file__).resolve().parents[1] / n
         for n in ("drafts/head.py", "slots.py", "forward/lean.py", "oracle/draft_prices.py")]


def shape_key(spec: Any, data_size: int) -> str:
    """What a draft step's cost depends on besides the machine: its kind, its config (the
    layer's sizes), its file's size (packed or not) and the LM rows a head scores."""
    h = hashlib.sha256()
    config = Path(spec.path) / "config.json"
    h.update(f"{spec.kind}:{data_size}:{knob('head.VOCAB')}".encode())
    h.update(config.read_bytes() if config.is_file() else b"")
    return h.hexdigest()[:16]


def price_drafts(costs: GateCosts, engine: Any, pool: Any, slot: SlotBuffer | None,
                 files: Mapping[str, Any], numerics: str, log=lambda msg: None) -> GateCosts:
    """`costs` with a measured line for every checked draft that runs a model (datastores
    cost only their verify); drafts of a shape not timed yet are timed in `slot`."""
    base = hashlib.sha256()
    for part in (FORMAT, cache_key(engine, pool, numerics)):
        base.update(part.encode())
    for f in _CODE:
        base.update(f.read_bytes())
    path = memspec_home() / "calib" / f"drafts-{base.hexdigest()[:16]}.json"
    try:
        raw = json.loads(path.read_text())
        known = {str(k): float(v) for k, v in raw["gamma_s"].items()} \
            if raw.get("format") == FORMAT else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        known = {}
    timed = False
    for name, f in files.items():
        if costs.model_free(name):
            continue
        spec = pool.draft(name)
        key = shape_key(spec, f.layout.data_size)
        if key not in known:
            if slot is None:
                continue
            known[key] = _time(engine, pool, slot, name, f)
            timed = True
            log(f"timed draft '{name}': {pool.gamma} steps {1e3 * known[key]:.2f} ms")
        costs = costs.with_draft(name, known[key])
    if timed:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"format": FORMAT, "numerics": numerics,
                                            "gamma_s": known}, indent=1))
    return costs


def _time(engine: Any, pool: Any, slot: SlotBuffer, name: str, f: Any) -> float:
    """gamma steps of `name` bound from its checked bytes in `slot` (empty at start)."""
    f.fill(slot, name)
    bound = bind_draft(name, pool.draft(name).path, slot, f.layout, target_vocab=engine.vocab,
                       parts=engine.target_parts)
    try:
        return draft_gamma_s(engine, bound, pool.gamma)
    finally:
        slot.generation += 1  # (its bytes are overwritten by the first load)
        slot.draft = None
