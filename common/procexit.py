"""Ending a process fast once its own cleanup is done."""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def fast_exit(code: int) -> NoReturn:
    """Exit without the interpreter's teardown: with torch loaded that teardown alone takes
    a second or more, and a process that has closed its sockets and unlinked its shared
    memory has nothing left to do (a Ctrl-C must end `generate` within two seconds)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a closed pipe: nothing more can reach it
    os._exit(code)
