"""Prompt text from source documents: excerpts, flattening, documented functions, a fair
order over documents, and the guard that keeps training text out of held-out prompts.
"""

from __future__ import annotations

import ast
import copy
import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from memspec.zoo.corpora import DOMAINS, Doc, load_corpus, normalise, stable_hash
from memspec.zoo.shingles import ShingleIndex, sampled_hits

MAX_PROMPT_CHARS = 800
EXCERPT_CHARS = 360


def flat_text(text: str) -> str:
    """Text as the leak checks read it: code fences dropped, whitespace collapsed."""
    return normalise(re.sub(r"```(?:python)?", " ", text))


def prompt_body(prompt: str) -> str:
    """The source-derived part of a prompt (after the instruction line), flattened.

    Leakage checks look for this text, not the instruction boilerplate, in training data.
    """
    return flat_text(prompt.split("\n\n", 1)[-1])


def leak_windows(text: str, width: int = 64) -> list[str]:
    """Three fixed windows (start, middle, end) of a normalised text, for substring checks."""
    if len(text) <= width:
        return [text]
    mid = (len(text) - width) // 2
    return [text[:width], text[mid : mid + width], text[-width:]]


def excerpt(text: str, salt: object, k: int = 0, chars: int = EXCERPT_CHARS,
            whole_words: bool = True) -> str:
    """The k-th sentence-aligned passage of about ``chars`` characters from a hashed offset.

    Successive ``k`` step by more than ``chars``, so passages from one doc rarely overlap.
    Where no sentence starts near the offset, the passage starts at the next word
    (``whole_words=False`` keeps the cut word: the train prompts the committed drafts were
    distilled on were made that way).
    """
    flat = normalise(text)
    if len(flat) <= chars:
        return flat
    span = len(flat) - chars
    start = (stable_hash("excerpt", salt) + k * (chars * 6 // 5)) % span
    boundary = flat.find(". ", start)
    if 0 <= boundary < start + chars // 2:
        start = boundary + 2
    elif whole_words and start and flat[start - 1] != " ":
        start = flat.find(" ", start) + 1
    piece = flat[start : start + chars]
    end = piece.rfind(". ")
    return piece[: end + 1] if end > chars // 2 else piece.rsplit(" ", 1)[0]


def documented_functions(source: str) -> list[tuple[str, str]]:
    """Public top-level functions with a real docstring, as signature + docstring stubs."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if doc and len(doc) >= 80:
            stub = copy.copy(node)
            stub.body, stub.decorator_list = [node.body[0]], []
            out.append((node.name, ast.unparse(stub)))
    return out


def round_robin(docs: Sequence[Doc], salt: str) -> Iterator[tuple[Doc, int]]:
    """Docs visited group by group in hashed order, so prompts spread over many groups."""
    by_group: dict[str, list[Doc]] = defaultdict(list)
    for doc in sorted(docs, key=lambda d: stable_hash("doc", salt, d["id"])):
        by_group[doc["group"]].append(doc)
    queues = [by_group[g] for g in sorted(by_group, key=lambda g: stable_hash("grp", salt, g))]
    for rnd in range(max((len(q) for q in queues), default=0) + 50):
        for q in queues:
            yield q[rnd % len(q)], rnd // len(q)


@dataclass
class LeakGuard:
    """Is a text free of the drafts' training text? Exact checks plus the CI fingerprint rule."""

    index: ShingleIndex
    fingerprint: np.ndarray
    train_text: str  # all training documents, normalised, for the window substring check

    @classmethod
    def from_corpora(cls, corpus_dir: Path) -> LeakGuard:
        texts = [d["text"] for dom in DOMAINS for d in load_corpus(corpus_dir, dom, "train")]
        index = ShingleIndex.from_texts(texts)
        return cls(index, index.sampled(), normalise("\n".join(texts)))

    def clean(self, text: str) -> bool:
        flat = normalise(text)
        return (self.index.overlap(flat) <= MAX_OVERLAP and fingerprint_ok(flat, self.fingerprint)
                and not any(w in self.train_text for w in leak_windows(flat)))


MAX_OVERLAP = 0.1


def fingerprint_ok(text: str, fingerprint: np.ndarray) -> bool:
    """The rule CI applies with the committed fingerprint: at most half the sampled shingles
    of a text may be training shingles (a copied passage has all of them)."""
    hits, sampled = sampled_hits(text, fingerprint)
    return 2 * hits <= sampled
