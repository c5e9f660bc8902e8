"""Snapshot -> per-draft probabilities: encoder + head + the target tokenizer, no sockets.

Kept apart from the process so the evaluation (offline scoring of trajectories) and tests
rank exactly as the running predictor does. Runs in numpy (npencoder.py, nphead.py) and
imports no torch, nor any module that does: the process's start-up would pay ~2.3 s of CPU
and ~200 MB for it. So the target's tokenizer is the decoder's light one where it fits
(procs/decoder/tokenizer.py; models.py, with torch, only for the others) and the pool's
fingerprint comes from common/draftfiles.py.

Any pool ranks: a pool with no head trained for its drafts (none beside the pool file, and
the committed head ranks other drafts) falls back to the cosine similarity between the
snapshot's embedding and each draft's description (``description`` in the pool, else a
phrase for its domain), as a softmax; without the encoder, to a uniform ranking. The
ranker says which in ``notice``, and the process logs it once. A head found by default whose
sidecar records another pool's fingerprint (same draft names, other weights) is refused the
same way; one that records none (trained before fingerprints) ranks, with a ``warning``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memspec.common.config import DraftSpec, PoolConfig
from memspec.common.draftfiles import pool_fingerprint
from memspec.common.errors import ModelError
from memspec.procs.decoder.tokenizer import serving_tokenizer
from memspec.procs.predictor import pool_head_path
from memspec.procs.predictor.framing import recent_text
from memspec.procs.predictor.npencoder import NumpyEncoder
from memspec.procs.predictor.nphead import (
    NumpyHead,
    default_head_path,
    load_numpy_head,
    softmax,
    split_input,
)

Encoder = NumpyEncoder  # what Ranker.load builds the encoder with (tests replace it)
SIMILARITY_TEMPERATURE = 0.05  # cosine similarities of MiniLM sentences differ by ~0.1-0.3
PROMPT_CACHE = 16  # split-view prompt embeddings kept: a request's snapshots share its prompt
# what a draft named only by its domain is about, in words the encoder places well
DOMAIN_PHRASES = {
    "general": "everyday questions, stories, explanations and general knowledge",
    "code": "programming: source code, Python functions, algorithms and software APIs",
    "math": "mathematics: arithmetic word problems, equations, numbers and proofs",
    "law": "law: legal text, licences, contracts, statutes and terms of use",
    "medical": "medicine: diseases, symptoms, clinical findings, drugs and treatment",
}


def head_path_for(pool: PoolConfig, override: Path | None = None) -> Path:
    """The head to load: an explicit one (``--head``, ``pool.predictor_head``), else the
    pool's own (written beside it by ``memspec predictor train --pool``), else the
    committed head."""
    if override or pool.predictor_head:
        return Path(override or pool.predictor_head)
    own = pool_head_path(pool.source)
    return own if own is not None and own.is_file() else default_head_path()


def target_tokenizer(path: Path) -> Any:
    """The target's tokenizer (recent ids are its ids), as models.load_serving_tokenizer
    gives it (the light one, else transformers'), without importing torch where the light
    tokenizer fits (the default pool's target: a generic tokenizers-backed class)."""
    if (Path(path) / "config.json").is_file():
        tokenizer = serving_tokenizer(Path(path))
        if tokenizer is not None:
            return tokenizer
    from memspec.procs.decoder.models import load_serving_tokenizer  # imports torch

    return load_serving_tokenizer(path)  # the full tokenizer, or what is wrong with the folder


def train_hint(pool: PoolConfig) -> str:
    return "train one: memspec predictor train" + (f" --pool {pool.source}"
                                                   if pool.source else "")


def describe(draft: DraftSpec) -> str:
    """The text a draft is ranked by when no head knows it."""
    return draft.description or DOMAIN_PHRASES.get(draft.domain, draft.domain)


@dataclass
class Ranker:
    encoder: NumpyEncoder | None  # None: nothing to rank, or no encoder (uniform ranking)
    head: NumpyHead | None  # columns in ``names`` order; None: the fallback ranking
    tokenizer: object  # the target's (recent ids are target LM ids)
    names: list[str]
    T: int
    profiles: np.ndarray | None = None  # [drafts, dim] description embeddings (fallback)
    notice: str = ""  # how this ranker ranks, when it is not a trained head
    warning: str = ""  # a trained head ranks, but nothing says it was trained for this pool
    prompt_cache: OrderedDict[str, np.ndarray] = field(default_factory=OrderedDict)

    @classmethod
    def load(cls, pool: PoolConfig, head: Path | None = None) -> Ranker:
        """Head first (cheap, most likely to be wrong), then tokenizer, then encoder. A head
        named explicitly must fit the pool; one found by default may not (fallback)."""
        names = [d.name for d in pool.drafts]
        if not names:  # a target-only pool: answer every snapshot with an empty ranking
            return cls(None, None, target_tokenizer(pool.target), [], pool.T)
        path = head_path_for(pool, head)
        try:
            rank_head = load_numpy_head(path, names, pool_fingerprint(pool))
        except ModelError as exc:
            if head or pool.predictor_head:
                raise
            return cls.fallback(pool, exc.problem)
        warning = "" if rank_head.fingerprint is not None else (
            f"predictor head {path} records no pool fingerprint, so it may rank other drafts' "
            f"acceptance; {train_hint(pool)}")
        tokenizer = target_tokenizer(pool.target)
        return cls(Encoder(), rank_head, tokenizer, names, pool.T, warning=warning)

    @classmethod
    def fallback(cls, pool: PoolConfig, why: str) -> Ranker:
        names = [d.name for d in pool.drafts]
        tokenizer = target_tokenizer(pool.target)
        train = train_hint(pool)
        try:
            encoder = Encoder()
        except ModelError as exc:
            return cls(None, None, tokenizer, names, pool.T,
                       notice=f"no predictor head ({why}) and no encoder ({exc.problem}): "
                              f"every draft ranks equally; {train}")
        profiles = encoder.embed([describe(d) for d in pool.drafts])
        return cls(encoder, None, tokenizer, names, pool.T, profiles,
                   notice=f"no predictor head for these drafts ({why}): ranking by similarity "
                          f"of the prompt to each draft's description; {train}")

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def bad_ids(self, ids: Sequence[int]) -> bool:
        n = self.vocab_size
        return any(i < 0 or i >= n for i in ids)

    def rank(self, prompts: Sequence[str], recent_ids: Sequence[Sequence[int]]
             ) -> tuple[list[list[float]], float]:
        """Probabilities (pool order) for each snapshot, and the seconds spent (one batch)."""
        t0 = time.perf_counter()
        if not self.names:
            return [[] for _ in prompts], 0.0
        if self.encoder is None:
            return [[1.0 / len(self.names)] * len(self.names) for _ in prompts], 0.0
        recents = [recent_text(self.tokenizer, ids, self.T) for ids in recent_ids]
        if self.head is None:
            assert self.profiles is not None
            emb = np.asarray(self.encoder.embed(prompts, recents))
            probs = softmax(emb @ np.asarray(self.profiles).T / SIMILARITY_TEMPERATURE)
        else:
            emb = np.asarray(self.head_input(prompts, recents))
            probs = self.head.probs(emb, [bool(r) for r in recents])
        return np.asarray(probs).tolist(), time.perf_counter() - t0

    def head_input(self, prompts: Sequence[str], recents: Sequence[str]) -> Any:
        """What the head reads: one ``prompt [SEP] recent`` embedding (joint), or the
        prompt's (cached: a request's snapshots share it) beside the recent text's (split;
        only the recent text is encoded per snapshot, a shorter input than the joint one).
        An array of the encoder's own type (numpy here)."""
        assert self.encoder is not None and self.head is not None
        if self.head.views == "joint":
            return self.encoder.embed(prompts, recents)
        cached = [self._prompt_embedding(p) for p in prompts]
        prompt_emb = np.stack([np.asarray(e) for e in cached])
        recent_emb = np.zeros_like(prompt_emb)
        rows = [i for i, r in enumerate(recents) if r]
        if rows:
            recent_emb[rows] = np.asarray(
                self.encoder.embed([""] * len(rows), [recents[i] for i in rows]))
        return _like(split_input(prompt_emb, recent_emb, [bool(r) for r in recents]),
                     cached[0])

    def _prompt_embedding(self, prompt: str) -> Any:
        cache = self.prompt_cache
        if prompt in cache:
            cache.move_to_end(prompt)
        else:
            assert self.encoder is not None
            cache[prompt] = self.encoder.embed([prompt])[0]
            while len(cache) > PROMPT_CACHE:
                cache.popitem(last=False)
        return cache[prompt]


def _like(out: np.ndarray, sample: object) -> Any:
    """``out`` as the encoder's own array type: numpy in the process; a torch tensor where a
    torch encoder stands in (tests compare with the trainer's inputs; torch is loaded then)."""
    if isinstance(sample, np.ndarray):
        return out
    import torch

    return torch.from_numpy(out)
