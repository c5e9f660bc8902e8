"""What a process the supervisor started does first: die with the supervisor, take its
priority and its log format.

The supervisor used to do the first two in `preexec_fn`, between fork and exec, but that
runs Python in a child forked from a process whose other threads (the HTTP server, the
Python API's caller) may hold locks: CPython documents that it can deadlock. So the
supervisor only passes its pid, the niceness and the log level in the environment, and the
child applies them here, after exec. A supervisor that died before this ran is caught by
comparing the parent's pid: the child exits at once instead of living on as an orphan.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
from typing import Any

from memspec.common import logs

PARENT_ENV = "MEMSPEC_PARENT_PID"  # the supervisor's pid
NICE_ENV = "MEMSPEC_NICE"  # niceness increment (the loader's and predictor's: 10)
# the supervisor's time.monotonic() when it spawned the process (Linux's CLOCK_MONOTONIC is
# one clock for every process): the decoder books its process start and imports from it
SPAWNED_ENV = "MEMSPEC_SPAWNED_AT"
NO_GC_ENV = "MEMSPEC_START_NO_GC"  # "1": no cyclic collection until freeze_heap (memspec/__init__)
PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send `sig` when the parent exits; False where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start(proc: str) -> None:
    """Set up a supervised process `proc` from its environment; a no-op for what a process
    run by hand does not ask for."""
    logs.setup(proc)
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        parent_death_signal()
        if os.getppid() != int(parent):  # the supervisor died before prctl took effect
            sys.exit(0)
    nice = os.environ.get(NICE_ENV, "")
    if nice.isdigit() and int(nice) > 0:
        # relative to the parent's: the supervisor already set it right after the spawn
        # (`renice`), so the imports before this ran at it too; this is then a no-op
        try:
            base = os.getpriority(os.PRIO_PROCESS, int(parent) if parent.isdigit() else 0)
            target = min(19, base + int(nice))
            if os.getpriority(os.PRIO_PROCESS, 0) < target:
                os.setpriority(os.PRIO_PROCESS, 0, target)
        except OSError:
            pass


def renice(pid: int, increment: int) -> None:
    """A child's niceness, `increment` above ours, from the parent right after the spawn
    (not in the child: a preexec_fn can deadlock a process with threads)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0)
                                                 + increment))
    except OSError:
        pass  # gone already, or not ours to change: the child sets its own at start


def freeze_heap(collect: bool = True) -> None:
    """Move what the process built while starting (modules, the engine, tables) out of the
    garbage collector's reach: it lives as long as the process, and a full collection that
    walks it (~200k objects: ~140 ms in the decoder, measured on AVX2) would otherwise land
    in the middle of some request every few dozen requests. Collections, held off while
    a supervised process started (NO_GC_ENV), run again from here. ``collect=False`` skips
    the collection before the freeze (the decoder's start: 40-90 ms on its path to ready,
    to free ~7k objects, ~0.7 MB and no tensors, that stay frozen instead)."""
    if collect:
        gc.collect()
    gc.freeze()
    package = sys.modules.get("memspec")  # (memspec/__init__ held them; a caller's own stays off)
    if package is not None and package.__dict__.pop("_gc_held", False):
        gc.enable()


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; elsewhere
    nothing). glibc keeps the memory of large temporaries freed in its heap: the numpy
    predictor's USS read 165 MB after 20 rankings and 117 MB after a trim. ~1 ms; called
    once an answer is sent."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


class SignalWake:
    """A file descriptor that becomes readable when a signal arrives, for a ZeroMQ poller.

    A stop flag set by a Python signal handler is seen only when the poll returns: pyzmq
    retries a poll that a signal interrupted for the rest of its timeout (the loader's
    heartbeat wait made every shutdown ~0.5 s longer). `signal.set_wakeup_fd` has the C-level
    handler write a byte here at once, so registering `fd` ends the wait."""

    def __init__(self) -> None:
        import socket

        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        try:
            signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
            self._set = True
        except ValueError:  # not the main thread (a test serving in a thread): no wake-ups
            self._set = False
        self.fd = self._r.fileno()

    def drain(self) -> None:
        try:
            while self._r.recv(512):
                pass
        except OSError:  # nothing more to read
            pass

    def close(self) -> None:
        if self._set:
            signal.set_wakeup_fd(-1)
        self._r.close()
        self._w.close()
