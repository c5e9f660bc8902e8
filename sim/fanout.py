"""Pure-Python work spread over every core: forked workers, results back as JSON.

The exact optimum (optimum.py) is single-threaded Python and takes seconds per trajectory;
a bench run asks for hundreds. Forked workers share the parent's inputs without copying
or serialising them, and send back only plain JSON values over a pipe (no pickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from memspec.common.errors import MemspecError


def workers() -> int:
    """Every core this process may use, or MEMSPEC_SIM_WORKERS."""
    env = os.environ.get("MEMSPEC_SIM_WORKERS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else os.cpu_count() or 1)


def fan_out(fn: Callable[[int], Any], n: int, procs: int | None = None) -> list[Any]:
    """[fn(0), ..., fn(n-1)], item i computed in worker i % procs; fn's values must be
    JSON-serialisable. One worker (or one item) runs in this process."""
    procs = min(procs or workers(), n)
    if procs <= 1 or not hasattr(os, "fork"):
        return [fn(i) for i in range(n)]
    kids: list[tuple[int, int]] = []
    for w in range(procs):
        r, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker: its share, as one JSON document, then out
            os.close(r)
            code = 0
            try:
                body = json.dumps({"ok": [fn(i) for i in range(w, n, procs)]})
            except BaseException as exc:  # noqa: BLE001 (reported by the parent)
                body, code = json.dumps({"error": f"{type(exc).__name__}: {exc}"}), 1
            with os.fdopen(wfd, "w") as f:
                f.write(body)
            os._exit(code)
        os.close(wfd)
        kids.append((pid, r))
    out: list[Any] = [None] * n
    errors = []
    for w, (pid, r) in enumerate(kids):
        with os.fdopen(r) as f:
            raw = f.read()
        os.waitpid(pid, 0)
        try:
            got = json.loads(raw)
        except ValueError:
            got = {"error": "the worker died without a result"}
        if "error" in got:
            errors.append(got["error"])
            continue
        for k, v in zip(range(w, n, procs), got["ok"]):
            out[k] = v
    if errors:
        raise MemspecError(f"a worker failed: {errors[0]}", "run again with one worker to see "
                           "where (MEMSPEC_SIM_WORKERS=1)")
    return out
