"""psutil-based memory accounting, and the draft-slot count a memory budget allows."""

from __future__ import annotations

import os

import psutil

from memspec.common.errors import ConfigError


def process_rss_mb(pid: int | None = None) -> float:
    try:
        return psutil.Process(pid or os.getpid()).memory_info().rss / 2**20
    except psutil.Error:
        return 0.0


def process_info(pid: int) -> dict:
    """RSS / shared memory of one process, and its PSS (shared pages split among the
    processes that map them: what adds up across memspec's processes) and USS (its own),
    for status reports. PSS / USS read /proc/PID/smaps_rollup (~1 ms); 0 where unreadable."""
    try:
        proc = psutil.Process(pid)
        mem = proc.memory_info()
    except psutil.Error:
        return {"rss_mb": 0.0, "shared_mb": 0.0}
    out = {"rss_mb": round(mem.rss / 2**20, 1),
           "shared_mb": round(getattr(mem, "shared", 0) / 2**20, 1)}
    try:
        full = proc.memory_full_info()
        out.update(pss_mb=round(getattr(full, "pss", 0) / 2**20, 1),
                   uss_mb=round(full.uss / 2**20, 1))
    except (psutil.Error, AttributeError):
        pass
    return out


def slots_for_budget(budget_mb: float, slot_bytes: int, n_drafts: int,
                     kv_bytes: int = 0) -> int:
    """K = how many slots of the largest draft fit in the budget beside the target's KV
    cache at the pool's whole context (`kv_bytes`): one budget covers what the decoder
    holds beside the target's weights (at most one slot per draft)."""
    need_mb, kv_mb = slot_bytes / 2**20, kv_bytes / 2**20
    k = int((budget_mb - kv_mb) // need_mb) if need_mb > 0 else n_drafts
    if k < 1 or budget_mb < kv_mb:
        beside = f" beside the KV cache at max_context ({kv_mb:.1f} MB)" if kv_bytes else ""
        raise ConfigError(
            f"memory_budget_mb = {budget_mb:g} is too small for one draft slot "
            f"({need_mb:.1f} MB){beside}",
            f"raise memory_budget_mb to at least {need_mb + kv_mb:.1f}"
            + (", lower max_context" if kv_bytes else "") + " or use smaller drafts")
    return min(k, n_drafts)
