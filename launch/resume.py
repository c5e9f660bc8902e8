"""What the supervisor keeps per request so that a decoder crash loses none of them.

A request's prompt, sampling parameters and seed are in its `Submit`; what the client has
received is the token ids and text the supervisor relayed (`Progress`). When the decoder
dies, the running request goes back to the front of the queue and the restarted decoder
gets a continuation (`continuation`): the same Submit with `resume_ids` (the relayed tokens,
decoded as context after the prompt; the rest of the token budget generated after them) and
`resume_chars` (the text the client has, so the decoder owes only the rest). Tokens the dead
decoder decoded but never sent are simply decoded again.

Greedy continuations are token-identical to an uninterrupted run: the engine's greedy output
depends only on the token ids. A sampled continuation is drawn from the target's distribution
given the tokens so far, so the whole text is still a correct sample; its random stream is
seeded from the request's seed and the number of tokens resumed after (`resume_seed`), not
the seed itself, which would replay the random numbers that drew the tokens already sent
and bias the continuation. So a seed reproduces a request that was not resumed, and a
resumed request reproduces for the same seed and the same crash point only.

A request that is running at POISON_CRASHES decoder crashes in a row is failed (it may be
what crashes the decoder), and a process that keeps crashing is restarted after a growing
pause (`backoff_s`), so a crash loop costs neither the other requests nor the machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec

from memspec.common.messages import Done, Message, Submit, Tokens
from memspec.common.metrics import Summary

POISON_CRASHES = 2  # decoder crashes in a row during one request that fail it
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # pause before restart, by crashes in a row
STABLE_S = 10.0  # a process ready this long (or a decoder that served a request) is no loop
SEED_LIMIT = 1 << 63


def backoff_s(crashes: int) -> float:
    """The pause before restarting a process that has crashed `crashes` times in a row: none
    for the first (a one-off crash is back at once), then doubling up to 30 s."""
    return BACKOFF_S[min(max(crashes, 1), len(BACKOFF_S)) - 1]


def resume_seed(seed: int, resumed_after: int) -> int:
    """A continuation's seed: fixed by the request's seed and the tokens it resumes after,
    and independent of the random numbers that drew those tokens."""
    digest = hashlib.blake2b(f"memspec-resume:{seed}:{resumed_after}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") % SEED_LIMIT


@dataclass
class Progress:
    """What the client of one request has received, and the crashes it has survived."""

    streamed: list[int] = field(default_factory=list)  # token ids relayed
    chars: int = 0  # characters of text relayed
    crashes: int = 0  # decoder crashes while it ran
    crashed_at: float | None = None  # the last one, until the continuation's first reply
    waited_s: float = 0.0  # the stream's pauses for crashes so far

    def relayed(self, msg: Message, now: float) -> None:
        """A reply of the running request goes to the client."""
        if self.crashed_at is not None and isinstance(msg, (Tokens, Done)):
            self.waited_s += now - self.crashed_at
            self.crashed_at = None
        if isinstance(msg, Tokens):
            self.streamed.extend(msg.ids)
            self.chars += len(msg.text)

    def crashed(self, now: float) -> None:
        self.crashes += 1
        if self.crashed_at is None:
            self.crashed_at = now

    @property
    def poisoned(self) -> bool:
        return self.crashes >= POISON_CRASHES

    def stamp(self, stats: Summary) -> None:
        """The final stats of a resumed request say so, and how long its stream paused."""
        if self.crashes:
            stats.resumed, stats.resume_wait_s = self.crashes, self.waited_s


def continuation(req: Submit, progress: Progress) -> Submit:
    """What the decoder is sent for `req`: the request itself, or after a crash its
    continuation from what the client has (nothing streamed: the request from the start,
    its seed unchanged, so a seeded sample is the one an uninterrupted run gives)."""
    if not progress.streamed and not progress.chars:
        return req
    seed = req.seed
    if seed is not None:
        seed = resume_seed(seed, len(progress.streamed))
    return msgspec.structs.replace(req, resume_ids=list(progress.streamed),
                                   resume_chars=progress.chars, seed=seed)
