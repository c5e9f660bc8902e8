"""How many CPU threads the decoder's forwards use: what the machine actually leaves free.

Two things take cores from the decoder. Its own helpers: the predictor encodes a snapshot
and the loader reads, checks and copies a draft on the same cores; the scheduling loop
knows when (a snapshot not yet answered, a load in flight) and says so before every
interval. And every other program on the device (a browser, a camera pipeline, a
compiler), which nothing tells us about: a decoder on both cores of a 2-core machine beside
one busy program shares two cores among three runnable threads, and loses to the same
decoder on one thread.

So the count follows measurements, taken while the decoder runs (`CpuProbe`):
- each of our forward threads' time spent runnable but waiting for a CPU (the kernel's
  schedstat run delay): a share above `DROP_WAIT` in two windows in a row (`WINDOW_S`, a
  few steps each; one may be a burst, such as a process starting) means another program
  holds the CPU, and the count drops by one;
- at a request after a pause, the runnable threads of other programs (/proc/loadavg):
  the count starts at the cores they leave;
- the idle time of the CPUs this process may use (/proc/stat): while the count is below the
  cores, a core idle for `RESTORE_IDLE` of `IDLE_WINDOW_S` gives a thread back. A restore
  that the next windows take back doubles the idle window (up to `MAX_IDLE_WINDOW_S`), so a
  program that runs in bursts does not make the count flap every window.

`CpuShare` is that decision, pure (tests inject the readings); `ThreadPlan` is the loop's
hook that combines it with the helpers' state and a request's cap. The forward's own pool
(csrc/pool.h) never waits for a thread that has not started, so a wrong count costs the
help of a thread, not a time slice per product. ``MEMSPEC_DECODER_THREADS=N`` fixes the
count; ``MEMSPEC_THREAD_POLICY=static`` restores the count that follows the helpers alone
(the before-and-after switch of `memspec bench contention`, with ``MEMSPEC_POOL=openmp``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from memspec.common.errors import ConfigError

ENV = "MEMSPEC_DECODER_THREADS"
POLICY_ENV = "MEMSPEC_THREAD_POLICY"
DROP_WAIT = 0.15          # of a window that a forward thread waited for a CPU: it is shared
WINDOW_S = 0.02           # how often the waits are judged (~4 decode steps)
RESTORE_IDLE = 0.5        # cores idle over an idle window: one more thread may run
IDLE_WINDOW_S = 0.1       # the first idle window after a drop (/proc/stat ticks are 10 ms)
# the longest, after restores taken back again and again: a load that ends waits at most
# this long for its thread back (issue: within 0.5 s; at 1.6 s one start-and-stop run kept
# its last 48 tokens on one thread); a restore taken back costs a window of shared cores,
# not a stall (the pool never waits for a thread that has not started)
MAX_IDLE_WINDOW_S = 0.4
STABLE_S = 2.0            # a restore that holds this long resets the idle window
REST_S = 0.25             # no forward for this long: the decoder was idle (see rest())


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def decoder_threads() -> tuple[int, int]:
    """(threads with the helpers idle, threads while one works): every usable core, and
    every core but one; `MEMSPEC_DECODER_THREADS` fixes both."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        cores = usable_cores()
        return cores, max(1, cores - 1)
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{ENV}={raw!r} is not a positive integer",
                          f"set {ENV} to a thread count such as 1, or unset it")
    return n, n


def adaptive() -> bool:
    """Whether the count follows the free CPU (the default) or the helpers alone."""
    raw = os.environ.get(POLICY_ENV, "").strip() or "adaptive"
    if raw not in ("adaptive", "static"):
        raise ConfigError(f"{POLICY_ENV}={raw!r} is not a thread policy",
                          f"set {POLICY_ENV} to adaptive or static, or unset it")
    return raw == "adaptive" and not os.environ.get(ENV, "").strip()


@dataclass
class Reading:
    """One look at the machine: when, each forward thread's cumulative CPU wait, and the
    cumulative idle and stolen seconds of the CPUs this process may use."""

    t: float
    waits: dict[int, float]
    idle: float
    steal: float = 0.0


@dataclass
class CpuShare:
    """How many threads the CPU that is free allows, from readings over time."""

    cores: int
    drop_wait: float = DROP_WAIT
    window_s: float = WINDOW_S
    restore_idle: float = RESTORE_IDLE
    idle_window_s: float = IDLE_WINDOW_S
    allowed: int = 0
    drops: int = 0
    restores: int = 0
    history: list[tuple[float, int]] = field(default_factory=list)  # (t, allowed) changes
    _mark: Reading | None = None
    _idle_mark: Reading | None = None
    _window: float = IDLE_WINDOW_S
    _restored_at: float = -1.0
    _was_shared: bool = False

    def __post_init__(self) -> None:
        self.allowed = self.allowed or self.cores
        self._window = self.idle_window_s

    def rest(self, r: Reading, others: int = 0) -> int:
        """The decoder is back after a pause (between requests; `r` read now), and
        `others` threads of other programs are runnable right now: the count starts at the
        cores they leave, and the windows start afresh, so the pause neither dilutes a wait
        nor counts as a free core. (Not the idle time over the pause: it mostly tells what
        ran long ago, and a program that ran seconds before would start a quiet request on
        one thread.)"""
        self._set(r.t, max(1, self.cores - max(0, others)))
        self._mark = self._idle_mark = r
        self._was_shared = False
        self._window, self._restored_at = self.idle_window_s, -1.0
        return self.allowed

    def due(self, t: float) -> bool:
        """Whether a reading at `t` could change anything (the caller skips reading else)."""
        return self._mark is None or t - self._mark.t >= self.window_s \
            or (self.allowed < self.cores and self._idle_mark is not None
                and t - self._idle_mark.t >= self._window)

    def update(self, r: Reading, running: int) -> int:
        """The count allowed after reading `r`, with `running` threads in the forward now."""
        if self._mark is None or self._idle_mark is None:
            self._mark = self._idle_mark = r
            return self.allowed
        dt = r.t - self._mark.t
        if dt >= self.window_s:
            waited = max((w - self._mark.waits.get(tid, w) for tid, w in r.waits.items()),
                         default=0.0)
            self._mark = r
            shared = running > 1 and waited / dt >= self.drop_wait
            if shared and self._was_shared:
                self._drop(r, running)
                return self.allowed
            self._was_shared = shared  # one window may be a burst (a process starting)
        if self._restored_at >= 0 and r.t - self._restored_at >= STABLE_S:
            self._window = self.idle_window_s
            self._restored_at = -1.0
        di = r.t - self._idle_mark.t
        if di >= self._window:
            idle = (r.idle - self._idle_mark.idle) / di
            self._idle_mark = r
            if self.allowed < self.cores and idle >= self.restore_idle:
                self._set(r.t, self.allowed + 1)
                self._restored_at = r.t
        return self.allowed

    def _drop(self, r: Reading, running: int) -> None:
        self._was_shared = False
        self._set(r.t, max(1, min(self.allowed, running) - 1))
        if self._restored_at >= 0 and r.t - self._restored_at < STABLE_S:
            self._window = min(MAX_IDLE_WINDOW_S, self._window * 2)  # taken back: wait longer
        self._restored_at = -1.0
        self._idle_mark = r

    def _set(self, t: float, n: int) -> None:
        if n == self.allowed:
            return
        if n < self.allowed:
            self.drops += 1
        else:
            self.restores += 1
        self.allowed = n
        self.history.append((t, n))
        del self.history[:-64]


class CpuProbe:
    """Reads the machine for `CpuShare`: /proc/self/task/TID/schedstat (the second field is
    the nanoseconds a thread waited runnable for a CPU) and /proc/stat's lines of the CPUs
    this process may use (idle + iowait, and steal, in clock ticks). Files stay open and
    are re-read from offset 0 (~5 us each)."""

    def __init__(self, cpus: Iterable[int] | None = None) -> None:
        if cpus is None:
            try:
                cpus = os.sched_getaffinity(0)
            except (AttributeError, OSError):
                cpus = range(os.cpu_count() or 1)
        self.cpus = {f"cpu{c}" for c in cpus}
        self.tick = 1.0 / os.sysconf("SC_CLK_TCK")
        self._stat = os.open("/proc/stat", os.O_RDONLY)
        self._loadavg = os.open("/proc/loadavg", os.O_RDONLY)
        self._tasks: dict[int, int] = {}

    def _wait(self, tid: int) -> float | None:
        fd = self._tasks.get(tid)
        try:
            if fd is None:
                fd = self._tasks[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            return int(os.pread(fd, 128, 0).split()[1]) * 1e-9
        except (OSError, IndexError, ValueError):  # the thread is gone
            if fd is not None:
                os.close(self._tasks.pop(tid))
            return None

    def others_runnable(self, samples: int = 3, gap_s: float = 0.0003) -> int:
        """Threads of other programs runnable now: /proc/loadavg's count of runnable
        threads (the reader included), the least of a few samples, so that a program
        that runs holds its place and one that woke for a moment does not."""
        least = None
        for i in range(samples):
            if i:
                time.sleep(gap_s)
            n = int(os.pread(self._loadavg, 128, 0).split()[3].split(b"/")[0])
            least = n if least is None else min(least, n)
        return max(0, (least or 1) - 1)

    def read(self, tids: Iterable[int]) -> Reading:
        waits = {tid: w for tid in tids if (w := self._wait(tid)) is not None}
        idle = steal = 0.0
        for line in os.pread(self._stat, 1 << 16, 0).split(b"\n"):
            if not line.startswith(b"cpu"):
                break
            parts = line.split()
            if parts[0].decode() in self.cpus:
                idle += int(parts[4]) + int(parts[5])
                steal += int(parts[8]) if len(parts) > 8 else 0
        return Reading(time.monotonic(), waits, idle * self.tick, steal * self.tick)


def open_probe() -> CpuProbe | None:
    """A probe where /proc offers the readings (Linux with schedstat), else None: the count
    then follows the helpers alone."""
    try:
        probe = CpuProbe()
        probe.read([threading.get_native_id()])
        if not probe.read([threading.get_native_id()]).waits:
            return None
        return probe
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def native_pools() -> list[Any]:
    """The native forward's modules loaded in this process (each has its own pool)."""
    from memspec.procs.decoder.forward import native

    return [ext for ext in native._EXT.values() if ext is not None]


def apply_threads(n: int, torch_ops: bool = True) -> None:
    """Forwards run on `n` threads: the native pools' count, and PyTorch's where the
    forward calls PyTorch's kernels (`torch_ops`: a layer our kernels do not tile). Where it
    does not, PyTorch keeps one thread: its OpenMP workers spin on after each op (sampling,
    a copy) and would take the core from the pool's worker."""
    exts = native_pools()
    openmp = os.environ.get("MEMSPEC_POOL", "") == "openmp"  # (parallel loops are PyTorch's)
    torch.set_num_threads(n if torch_ops or openmp or not exts else 1)
    for ext in exts:
        ext.set_threads(n)


class ThreadPlan:
    """The loop's `on_helpers` hook: every core while the helpers rest, one fewer while one
    of them works, never more than the free CPU allows (`CpuShare`, when a probe is given)
    nor the running request's cap (`Submit.threads`)."""

    def __init__(self, idle: int, shared: int, probe: CpuProbe | None = None,
                 apply: Callable[[int], None] | None = None,
                 tids: Callable[[], list[int]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle, self.shared = idle, shared
        self._clock = clock
        self.current = 0
        self.switches = 0
        self.cap: int | None = None
        self.busy = False
        self.probe = probe
        self.share = CpuShare(max(idle, 1)) if probe is not None else None
        self._apply = apply or apply_threads
        self._tids = tids or _forward_tids
        self._caller = threading.get_native_id()
        self._last = -1e9  # the first call is a return from rest: from this reading on
        if self.share is not None and probe is not None:
            self.share.rest(probe.read([self._caller]))

    def limit(self, cap: int | None) -> None:
        """A request's cap, applied at once (its prefill may start before the loop asks)."""
        self.cap = cap
        self(self.busy)

    def __call__(self, helpers_busy: bool) -> None:
        self.busy = helpers_busy
        n = self.shared if helpers_busy else self.idle
        if self.cap is not None:
            n = min(n, self.cap)
        if self.share is not None and self.probe is not None:
            now = self._clock()
            rested = now - self._last > REST_S
            self._last = now
            if rested:
                self.share.rest(self.probe.read([self._caller]), self._others())
            elif self.share.due(now):
                running = max(self.current, 1)
                tids = [self._caller, *self._tids()[:running - 1]]
                self.share.update(self.probe.read(tids), running)
            n = min(n, self.share.allowed)
        if n != self.current:
            self._apply(n)
            self.current = n
            self.switches += 1

    def _others(self) -> int:
        try:
            return self.probe.others_runnable() if self.probe is not None else 0
        except (OSError, ValueError, IndexError, AttributeError):
            return 0

    def stats(self) -> dict[str, Any]:
        s = self.share
        return {"threads": self.current, "switches": self.switches,
                "cpu_drops": s.drops if s else 0, "cpu_restores": s.restores if s else 0,
                "cpu_allowed": s.allowed if s else None}


def _forward_tids() -> list[int]:
    return [tid for ext in native_pools() for tid in ext.worker_tids()]


def make_plan(threads: tuple[int, int] | None = None, target: Any = None) -> ThreadPlan:
    """The plan a CPU decoder runs with: adaptive unless the environment fixes the count or
    asks for the static policy (or /proc offers no readings). `target`: the engine's
    target model (its native forward may call PyTorch's kernels, which then get the
    threads too)."""
    idle, shared = threads or decoder_threads()
    probe = open_probe() if adaptive() else None
    torch_ops = not getattr(target, "exact_chunks", False)
    return ThreadPlan(idle, shared, probe, apply=lambda n: apply_threads(n, torch_ops))
