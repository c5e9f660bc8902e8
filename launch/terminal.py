"""The terminal side of every command: streamed text, one-line messages, stop signals."""

from __future__ import annotations

import signal
import sys

from memspec.common.errors import MemspecError, RequestError


class Console:
    """Streamed text on stdout, one-line messages on stderr. A message always starts on a
    line of its own: after text that ended mid-line, it is preceded by a newline on stderr
    (a terminal shows both; a file of stdout gets no stray newline). A reader that closed
    stdout (`| head`) ends the text, never the process."""

    def __init__(self) -> None:
        self.mid_line = False
        self.closed = False

    def text(self, s: str) -> None:
        if self.closed or not s:
            return
        try:
            sys.stdout.write(s)
            sys.stdout.flush()
        except (BrokenPipeError, ValueError):
            self.closed = True
            return
        self.mid_line = not s.endswith("\n")

    def end_text(self) -> None:
        """End an answer: its last line gets its newline on stdout."""
        if self.mid_line:
            self.text("\n")

    def message(self, line: str) -> None:
        """One line on stderr, on a line of its own."""
        print(("\n" if self.mid_line else "") + line, file=sys.stderr, flush=True)
        self.mid_line = False

    def note(self, msg: str) -> None:
        self.message(f"[memspec] {msg}")

    def error(self, msg: str) -> None:
        self.message(f"memspec: error: {msg}")


CONSOLE = Console()


class Interrupted(MemspecError):
    """A stop signal ended the command; the exit code is 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


class StopSignals:
    """SIGINT, SIGTERM and SIGHUP (the terminal closed) set `signum`; the caller's loop sees
    it within one tick and stops every process cleanly. Callable, so it serves as a
    `stop()` predicate."""

    def __init__(self) -> None:
        self.signum = 0
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._set)

    def _set(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def __call__(self) -> bool:
        return bool(self.signum)


def check_utf8(text: str, what: str) -> str:
    """`text` if it encodes as UTF-8. Python maps undecodable argv bytes to lone
    surrogates, which no socket can carry; name the byte instead of failing later."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise RequestError(f"{what} is not valid UTF-8 ({byte} at character {exc.start})",
                           "pass UTF-8 text") from None
    return text
