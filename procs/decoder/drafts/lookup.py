"""Context lookup: propose what followed the same words the last time they appeared.

Small targets repeat themselves (lists, code, restated clauses, loops): on the dev set a
suffix of 3+ committed tokens that occurred before is followed by the same token 66-90% of
the time, more often than a small draft guesses right. When the context ends with such a
suffix (the committed tokens plus this iteration's proposals so far), the engine proposes
the token that followed its most recent earlier occurrence instead of the draft's guess,
and feeds it to the draft for the next proposal (prompt-lookup decoding inside a draft's
chain). Greedy only; verification is unchanged, so output stays the target's own.

Pure (ints and dicts): the engine and the acceptance tables (zoo/tables.py) share it, so a
table is the engine's behaviour exactly. Only committed tokens are indexed: a suffix is
looked up among occurrences whose successor is committed.

On its own (``LOOKUP``, the `lookup-only` policy), the lookup is a draft with no model:
it proposes while the context keeps matching, and an iteration without a match is a plain
target step, so it costs a verify only when it has something to verify.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

MAX_NGRAM = 8  # longest suffix tried first (a longer match is a more precise one)


class NgramIndex:
    """The most recent successor position of every n-gram (n_min <= n <= MAX_NGRAM) of the
    committed tokens; a lookup is at most MAX_NGRAM dict probes."""

    def __init__(self, n_min: int, tokens: Iterable[int] = ()) -> None:
        if n_min < 1:
            raise ValueError("n_min must be >= 1")
        self.n_min = n_min
        self.n_max = max(MAX_NGRAM, n_min)
        self.tokens: list[int] = []
        self._at: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks = self.tokens
        for tok in tokens:
            j = len(toks)  # the new token's position: successor of the n-grams ending at j-1
            toks.append(int(tok))
            for n in range(self.n_min, min(self.n_max, j) + 1):
                self._at[tuple(toks[j - n:j])] = j

    def match(self, tail: Sequence[int]) -> int:
        """The length of the longest (>= n_min) suffix of ``tail`` seen before (0: none): a
        longer match is stronger evidence that what followed it comes again."""
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            if tuple(tail[len(tail) - n:]) in self._at:
                return n
        return 0

    def propose(self, tail: Sequence[int]) -> int | None:
        """The token after the longest (>= n_min) suffix of ``tail`` seen before, or None.
        ``tail``: the last tokens of the context (committed + proposed), newest last."""
        n = self.match(tail)
        return self.tokens[self._at[tuple(tail[len(tail) - n:])]] if n else None


def lookup_table(prompt_ids: Sequence[int], tokens: Sequence[int], gamma: int, n_min: int
                 ) -> list[int | None]:
    """The lookup's own acceptance along a greedy trajectory, for the oracle's plan: at each
    ``t`` (tokens committed), None where it proposes nothing (that iteration is a plain
    target step), else how many of its up to gamma chained proposals the target accepts.
    The engine may propose fewer (``LookupDepth``) and then accepts at most that many: the
    table is what the lookup could gain there, never less."""
    idx = NgramIndex(n_min, prompt_ids)
    seq = [int(x) for x in prompt_ids] + [int(x) for x in tokens]
    P, n = len(prompt_ids), len(tokens)
    out: list[int | None] = []
    for t in range(n):
        tail = seq[max(0, P + t - idx.n_max):P + t]
        c = idx.propose(tail)
        if c is None:
            out.append(None)
        else:
            a = 0
            while c is not None and a < min(gamma, n - t) and c == seq[P + t + a]:
                tail.append(c)
                a += 1
                c = idx.propose(tail)
            out.append(a)
        idx.extend(seq[P + t:P + t + 1])
    return out
