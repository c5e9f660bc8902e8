"""Word-shingle hashes: does a prompt's text occur in the drafts' training text?

A shingle is 8 consecutive lower-cased words; any passage of 8 or more words shared with
the training text shows up as a shared shingle, whatever the whitespace or markup around
it. Hashes are 64-bit and process-independent (the words are hashed with blake2b, the
shingle is a fixed linear mix of its words), so a check run in CI gives the same answer
as the run that built the prompt files.

Two uses:

- building the prompt sets: :class:`ShingleIndex` holds every shingle of the training
  text (a few million), and :meth:`ShingleIndex.overlap` is the exact share of a prompt's
  shingles found there;
- CI, where no corpus is built: :func:`sample` keeps the shingles whose hash is 0 mod
  ``SAMPLE_MOD`` (the same ones on both sides: the choice depends only on the text), and
  their upper ``KEPT_BITS`` bits are committed (``prompts/train_shingles.bin``, ~0.7 MB;
  a shingle that is not training text matches one by chance with probability ~1%).
"""

from __future__ import annotations

import hashlib
import lzma
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

WORDS = 8
SAMPLE_MOD = 8
KEPT_BITS = 26
_WORD = re.compile(r"\w+")
_MASK = (1 << 64) - 1
# one odd 64-bit multiplier per position in the shingle (fixed: changing them changes
# every committed fingerprint)
_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9,
                 0xD6E8FEB86659FD93, 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53,
                 0x94D049BB133111EB, 0xBF58476D1CE4E5B9][:WORDS], dtype=np.uint64)


def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


class _WordHashes(dict):
    """Cache: a corpus has far fewer distinct words than words."""

    def __missing__(self, word: str) -> int:
        value = self[word] = _word_hash(word)
        return value


_CACHE = _WordHashes()


def shingle_hashes(text: str) -> np.ndarray:
    """uint64 hash of every 8-word shingle of ``text`` (one per position, with repeats)."""
    words = _WORD.findall(text.lower())
    if len(words) < WORDS:
        return np.zeros(0, dtype=np.uint64)
    w = np.fromiter((_CACHE[x] for x in words), dtype=np.uint64, count=len(words))
    n = len(words) - WORDS + 1
    h = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(WORDS):
            h += w[j:j + n] * _MIX[j]
        # splitmix64 finaliser, so the low bits used for sampling are well mixed
        h ^= h >> np.uint64(30)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(27)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(31)
    return h


def sample(hashes: np.ndarray) -> np.ndarray:
    """The sampled shingles' committed form: the upper bits of hashes that are 0 mod 8."""
    kept = hashes[hashes % np.uint64(SAMPLE_MOD) == 0]
    return (kept >> np.uint64(64 - KEPT_BITS)).astype(np.uint32)


class ShingleIndex:
    """Sorted unique shingle hashes of a body of text; membership by binary search."""

    def __init__(self, hashes: np.ndarray):
        self.hashes = np.unique(hashes)

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> ShingleIndex:
        return cls(np.concatenate([shingle_hashes(t) for t in texts] or [np.zeros(0, np.uint64)]))

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        if not hashes.size or not self.hashes.size:
            return np.zeros(hashes.shape, dtype=bool)
        pos = np.searchsorted(self.hashes, hashes).clip(0, self.hashes.size - 1)
        return self.hashes[pos] == hashes

    def overlap(self, text: str) -> float:
        """Share of ``text``'s shingles found in the index (0 for texts under 8 words)."""
        h = shingle_hashes(text)
        return float(self.contains(h).mean()) if h.size else 0.0

    def sampled(self) -> np.ndarray:
        return np.unique(sample(self.hashes))


def sampled_hits(text: str, fingerprint: np.ndarray) -> tuple[int, int]:
    """(hits, sampled): how many of ``text``'s sampled shingles are in ``fingerprint``
    (sorted, as :func:`load_fingerprint` and :meth:`ShingleIndex.sampled` return it)."""
    s = np.unique(sample(shingle_hashes(text)))
    if not s.size or not fingerprint.size:
        return 0, int(s.size)
    pos = np.searchsorted(fingerprint, s).clip(0, fingerprint.size - 1)
    return int((fingerprint[pos] == s).sum()), int(s.size)


def save_fingerprint(path: Path, fingerprint: np.ndarray) -> None:
    """Sorted values as uint16 gaps, xz-compressed (np.savez stamps times: not reproducible).

    The first value is split into two gaps' worth of high and low halves so every gap fits.
    """
    fp = np.unique(fingerprint.astype(np.int64))
    gaps = np.diff(fp, prepend=0)
    if gaps.size:
        gaps = np.concatenate([[gaps[0] >> 16, gaps[0] & 0xFFFF], gaps[1:]])
    if gaps.size and gaps.max() > 0xFFFF:
        raise ValueError("fingerprint too sparse for 16-bit gaps")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(gaps.astype("<u2").tobytes(), preset=9))


def load_fingerprint(path: Path) -> np.ndarray:
    """The sorted uint32 values :func:`save_fingerprint` wrote."""
    gaps = np.frombuffer(lzma.decompress(path.read_bytes()), dtype="<u2").astype(np.int64)
    if gaps.size < 2:
        return np.zeros(0, dtype=np.uint32)
    values = np.cumsum(np.concatenate([[(gaps[0] << 16) + gaps[1]], gaps[2:]]))
    return values.astype(np.uint32)
