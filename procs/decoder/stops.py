"""Stop strings on streamed text: cut at the first one, never stream a piece of one.

Text streams out piece by piece, and a stop string may arrive split across pieces (and
tokens). So the tail that could still become a stop string is held back until the next
piece settles it; the first complete stop string ends the request, and the text before it
is everything the client sees (vLLM and the OpenAI API behave the same way).
"""

from __future__ import annotations

from memspec.common.limits import check_stops


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        check_stops(stops)  # the request's limits (common/limits.py)
        self.stops = list(stops)
        self.held = ""
        self.hit = False

    def push(self, piece: str) -> str:
        """The text `piece` releases: all of it, less a tail that may begin a stop string,
        or, once a stop string is complete, what comes before it (then nothing more)."""
        if self.hit:
            return ""
        buf = self.held + piece
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit, self.held = True, ""
            return buf[:min(found)]
        hold = self._partial(buf)
        self.held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        """The held tail, at the end of the text (it never became a stop string)."""
        out, self.held = ("" if self.hit else self.held), ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest tail of `buf` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
