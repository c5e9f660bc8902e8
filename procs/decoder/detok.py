"""Incremental detokenisation for streaming: each commit decodes a few tokens, not the text.

Decoding the whole output at every commit costs O(n) per token and O(n^2) per request. A
byte-level BPE token can also end inside a multi-byte character, so a token's text alone
may be a fragment. As vLLM and HF's streamers do, decode a short window that ends at the
new tokens, and hold the text back while it ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Any

from memspec.common.messages import TokenLogprob, TopLogprob
from memspec.common.metrics import LogprobRow

REPLACEMENT = "\ufffd"
WINDOW = 6  # tokens of context before the new ones (merges and leading spaces settle)


class StreamDecoder:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start
        self.read = 0  # tokens whose text has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def push(self, new: list[int]) -> str:
        """The text the new tokens add (possibly empty while a character is incomplete)."""
        self.ids.extend(new)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(REPLACEMENT) or len(after) <= len(before) \
                or not after.startswith(before):
            return ""
        self.prefix = max(self.read, len(self.ids) - WINDOW)
        self.read = len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if after.startswith(before) else ""


def logprob_entries(tokenizer: Any, rows: list[LogprobRow]) -> list[TokenLogprob]:
    """The engine's (token, logprob, alternatives) rows with each token's own text, as the
    OpenAI API reports them (a token that ends inside a character shows U+FFFD, as vLLM's)."""
    def text(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    return [TokenLogprob(token=text(t), id=t, logprob=lp,
                         top=[TopLogprob(token=text(a), id=a, logprob=alp) for a, alp in top])
            for t, lp, top in rows]
