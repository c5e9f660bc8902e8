"""Snapshot -> per-draft probabilities: encoder + head + the target tokenizer, no sockets.

Kept apart from the process so the evaluation (offline scoring of trajectories) and tests
rank exactly as the running predictor does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from memspec.common.config import PoolConfig
from memspec.procs.decoder.models import load_tokenizer
from memspec.procs.predictor.encoder import Encoder, recent_text
from memspec.procs.predictor.head import RankHead, default_head_path, load_head


def head_path_for(pool: PoolConfig, override: Path | None = None) -> Path:
    return Path(override or pool.predictor_head or default_head_path())


@dataclass
class Ranker:
    encoder: Encoder | None  # None (with head) for a pool without drafts: nothing to rank
    head: RankHead | None  # columns in ``names`` order
    tokenizer: object  # the target's (recent ids are target LM ids)
    names: list[str]
    T: int

    @classmethod
    def load(cls, pool: PoolConfig, head: Path | None = None, device: str = "cpu") -> Ranker:
        """Head first (cheap, most likely to be wrong), then tokenizer, then encoder."""
        names = [d.name for d in pool.drafts]
        if not names:  # a target-only pool: answer every snapshot with an empty ranking
            return cls(None, None, load_tokenizer(pool.target), [], pool.T)
        rank_head = load_head(head_path_for(pool, head), names).to(device)
        tokenizer = load_tokenizer(pool.target)
        return cls(Encoder(device=device), rank_head, tokenizer, names, pool.T)

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
        if self.head is None or self.encoder is None:
            return [[] for _ in prompts], 0.0
        recents = [recent_text(self.tokenizer, ids, self.T) for ids in recent_ids]
        emb = self.encoder.embed(prompts, recents).to(next(self.head.parameters()).device)
        probs = self.head.probs(emb, torch.tensor([bool(r) for r in recents]).to(emb.device))
        return probs.cpu().tolist(), time.perf_counter() - t0
