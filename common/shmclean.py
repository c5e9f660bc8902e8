"""Slot-memory segment names and their cleanup, without torch.

The supervisor removes what a decoder it killed left in /dev/shm, and it must stay quick
to start and to stop (importing torch costs seconds both ways), so this lives apart from
`slotmem`. Run tokens carry the supervisor's pid: segments of a supervisor that was itself
killed are found and removed by the next one (`sweep_orphans`).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from memspec.common.errors import MemspecError

SHM_DIR = Path("/dev/shm")
PREFIX = "memspec-"
_OWNED = re.compile(r"memspec-p(\d+)-[0-9a-f]{8}-")


class SlotMemoryError(MemspecError):
    """Slot memory cannot be created or opened (bad handle, no space, wrong size)."""


def owned_run_token(owner_pid: int | None = None) -> str:
    """A run token naming the process that must clean the segments up (default: this one)."""
    return f"p{owner_pid or os.getpid()}-{secrets.token_hex(4)}"


def cleanup_shm(prefix: str = PREFIX) -> list[str]:
    """Unlink leftover segments whose name starts with ``prefix`` (crash recovery, shutdown)."""
    if not prefix.startswith(PREFIX) or "/" in prefix:
        raise SlotMemoryError(f"refusing to clean shm prefix {prefix!r}",
                              f"prefixes must start with {PREFIX!r}")
    return _unlink(lambda name: name.startswith(prefix))


def sweep_orphans() -> list[str]:
    """Unlink segments of owned run tokens whose owner process is gone."""
    def orphan(name: str) -> bool:
        m = _OWNED.match(name)
        return bool(m) and not pid_alive(int(m.group(1)))

    return _unlink(orphan)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def _unlink(match) -> list[str]:  # noqa: ANN001
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in sorted(names):
        if match(name):
            try:
                os.unlink(SHM_DIR / name)
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed
