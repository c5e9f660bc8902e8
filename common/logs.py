"""Log lines of every memspec process, through `logging`: one format with a timestamp (ISO
8601, milliseconds, UTC offset), the level and the process (name and pid), so the decoder's,
loader's, predictor's and supervisor's files merge into one timeline by sorting:

    2025-01-31T14:03:27.512+01:00 WARNING supervisor[4711]: decoder exited with code -9; ...

Modules log to `logging.getLogger(__name__)` (all under `memspec.`), which carries no
handler until a process (or the `memspec` command) calls `setup` with its name; a program
that embeds memspec (the Python API) keeps its own logging configuration. `MEMSPEC_LOG_LEVEL` (or `memspec up --log-level`) sets the level of every
process; user-facing output (streamed text, `[memspec]` notes, the one-line
`memspec: error:` messages) is printed, not logged, and never changes with it.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import sys

LEVEL_ENV = "MEMSPEC_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"
ROOT = "memspec"
# what `setup` writes before the message (the supervisor strips it to quote a child's line)
PREFIX = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d [A-Z]+ \S+\[\d+\]: ")


class Formatter(logging.Formatter):
    def __init__(self, proc: str) -> None:
        super().__init__()
        self.proc = proc

    def format(self, record: logging.LogRecord) -> str:
        stamp = dt.datetime.fromtimestamp(record.created).astimezone()
        head = (f"{stamp.isoformat(timespec='milliseconds')} {record.levelname} "
                f"{self.proc}[{record.process}]: ")
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return head + text


def level_name(value: str | None = None) -> str:
    """`value`, else $MEMSPEC_LOG_LEVEL, else info; an unknown name is a one-line error."""
    from memspec.common.errors import ConfigError

    name = (value or os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL).lower()
    if name not in LEVELS:
        raise ConfigError(f"unknown log level {name!r}", f"use one of: {', '.join(LEVELS)}")
    return name


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a line is logged."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: ANN201 - the logging module's own attribute
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def setup(proc: str, level: str | None = None) -> None:
    """Send every memspec logger's lines to stderr in the one format, as process `proc`
    (`decoder`, `loader`, `predictor`, `supervisor`), at `level` (default:
    $MEMSPEC_LOG_LEVEL, else info). Idempotent; touches no logger outside `memspec.`."""
    root = logging.getLogger(ROOT)
    root.setLevel(level_name(level).upper())
    for h in [h for h in root.handlers if getattr(h, "_memspec", False)]:
        root.removeHandler(h)
    handler = _Stderr()
    handler.setFormatter(Formatter(proc))
    handler._memspec = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.propagate = False


def message_of(line: str) -> str:
    """A log line without its timestamp, level and process."""
    return PREFIX.sub("", line, count=1)


def reset() -> None:
    """Undo `setup` (memspec's records go to the application's handlers again)."""
    root = logging.getLogger(ROOT)
    for h in [h for h in root.handlers if getattr(h, "_memspec", False)]:
        root.removeHandler(h)
    root.setLevel(logging.NOTSET)
    root.propagate = True
