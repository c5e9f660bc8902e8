"""The runtime's knobs, as `memspec bench tune` chose them on dev (tuned.json, committed).

A constant in the code that changes what the runtime does (the speculation gate's
memory, how often the predictor ranks, the prefill chunk) reads its value from here, so
every such value names the dev sweep that chose it and a re-tune changes one file. The
pool-level knobs (`lookup`, `ucb_c`) stay in the pool file a user edits; tuned.json
records what the default pool should say, and a test keeps the two equal.

A real-run sweep (`memspec bench tune`'s lookup_gate section) starts each setting's
server with ``MEMSPEC_TUNED`` naming a scratch copy of the file with that setting in it,
so that the runtime under test is the one users run, not a patched one.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from memspec.common.errors import ConfigError
from memspec.common.paths import PACKAGE_ROOT

TUNED_FILE = PACKAGE_ROOT / "tuned.json"
TUNED_ENV = "MEMSPEC_TUNED"  # another tuned.json, for a sweep's setting
FIX = "restore tuned.json from the checkout (git checkout tuned.json) or run `memspec bench tune`"


@functools.cache
def tuned_knobs(path: Path = TUNED_FILE) -> dict[str, dict[str, Any]]:
    """Every knob's record ({value, grid, chosen_by, dev}), by name."""
    fix = FIX if Path(path) == TUNED_FILE else \
        f"point {TUNED_ENV} at a tuned.json that `memspec bench tune` wrote, or unset it"
    try:
        knobs = json.loads(Path(path).read_text())["knobs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the tuned knobs in {path}: {exc}", fix) from None
    if not isinstance(knobs, dict) or not all(isinstance(v, dict) and "value" in v
                                              for v in knobs.values()):
        raise ConfigError(f"{path} has a knob without a value", fix)
    return knobs


def tuned_path() -> Path:
    """The file knobs are read from: ``MEMSPEC_TUNED`` where a sweep sets it."""
    return Path(os.environ[TUNED_ENV]) if os.environ.get(TUNED_ENV) else TUNED_FILE


def knob(name: str) -> Any:
    """The tuned value of `name` (e.g. ``gate.ALPHA``)."""
    path = tuned_path()
    knobs = tuned_knobs(path)
    if name not in knobs:
        raise ConfigError(f"{path.name} has no knob {name!r}", FIX)
    return knobs[name]["value"]
