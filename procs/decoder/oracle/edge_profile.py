"""The edge-emulated storage profile's unit: one speculative iteration, timed once per machine.

`storage = "edge-emulated"` without `bandwidth_mb_s` paces every draft load so that a load
takes `load_iter_ratio` speculative iterations (a Jetson's ratio). The iteration is timed at
start with the general draft; the result is kept in `$MEMSPEC_HOME/calib/` under a key of
everything that changes it (the target calibration's key: numerics, threads, gamma, target
files, build and engine code; plus the draft's file, the head and slot code and the pool's
lookup), so a restarted decoder reads it instead of spending a third of a second.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memspec.common.files import atomic_write_text
from memspec.common.paths import memspec_home
from memspec.procs.decoder.models import encode_prompt
from memspec.procs.decoder.oracle.calibration import cache_key
from memspec.procs.decoder.slots import SlotBuffer, bind_draft

FORMAT = "memspec-edge-iteration/1"
PROMPT = "Describe the ocean in two sentences."
TOKENS = 40
_CODE = [Path(__file__).resolve().parents[1] / n
         for n in ("drafts/head.py", "slots.py", "oracle/edge_profile.py")]


def measure(engine: Any, tokenizer: Any, pool: Any, slot: SlotBuffer,
            files: Mapping[str, Any]) -> float:
    """Median SD iteration time with the general draft (another healthy one when it is
    quarantined), bound from checked bytes in `slot`."""
    spec = unit_draft(pool, files)
    layout = files[spec.name].layout
    files[spec.name].fill(slot, spec.name)  # it runs checked bytes only
    engine.add_draft(bind_draft(spec.name, spec.path, slot, layout, target_vocab=engine.vocab,
                                parts=engine.target_parts))
    ids = encode_prompt(tokenizer, PROMPT)
    _, stats = engine.generate(ids, TOKENS, select=lambda s: spec.name)
    engine.remove_draft(spec.name)
    slot.generation += 1
    durs = [r.duration for r in stats.records[1:]] or [r.duration for r in stats.records]
    return statistics.median(durs)


def unit_draft(pool: Any, files: Mapping[str, Any]) -> Any:
    return pool.general_draft if pool.general in files else pool.draft(next(iter(files)))


def iteration_s(engine: Any, tokenizer: Any, pool: Any, slot: SlotBuffer,
                files: Mapping[str, Any], numerics: str) -> tuple[float, bool]:
    """The iteration time and whether it came from the cache."""
    spec = unit_draft(pool, files)
    h = hashlib.sha256()
    for part in (FORMAT, cache_key(engine, pool, numerics), str(pool.lookup), PROMPT,
                 str(TOKENS), str(files[spec.name].path.resolve())):
        h.update(part.encode())
    for f in sorted(Path(spec.path).glob("*")):
        if f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    for f in _CODE:
        h.update(f.read_bytes())
    path = memspec_home() / "calib" / f"edge-{h.hexdigest()[:16]}.json"
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") == FORMAT and float(raw["iteration_s"]) > 0:
            return float(raw["iteration_s"]), True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    value = measure(engine, tokenizer, pool, slot, files)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"format": FORMAT, "numerics": numerics,
                                        "draft": spec.name, "iteration_s": value}, indent=1))
    return value, False
