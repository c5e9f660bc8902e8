"""Frozen all-MiniLM-L6-v2 sentence encoder in torch: text -> mean-pooled, L2-normalised
384-d vector, for training and offline scoring (zoo/train_predictor.py, sim/scores.py).

The predictor process runs the numpy twin of this encoder (npencoder.py: same framing, same
math, no torch import); both frame their inputs through framing.py, whose names are
re-exported here for the modules that import them from this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from memspec.common.errors import ModelError
from memspec.common.isa import bf16_native
from memspec.procs.predictor.framing import (  # noqa: F401  (re-exported)
    EMBED_DIM,
    ENCODER_NAME,
    MAX_PIECES,
    PROMPT_HEAD_FRACTION,
    RECENT_MAX,
    WHEEL,
    WIDTH_STEP,
    Framing,
    WordPieces,
    encoder_available,
    encoder_dir,
    load_error,
    recent_text,
    trim_chars,
)
from memspec.procs.predictor.minilm import MiniBert

ENCODER_DTYPES = ("auto", "float32", "bfloat16")
_trim_chars = trim_chars  # its name here before framing.py (tests/test_limits.py reads it)


def encoder_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 where the chosen kernel path has native bf16 (AVX512-BF16, see
    ``memspec.common.isa``; ~1.7x faster than fp32 and half the memory traffic next to the
    decoder; rankings agree with fp32 on 600 of 600 dev2/mixed snapshots' top-1), float32
    elsewhere (emulated bf16 is slower). ``MEMSPEC_ISA`` lowers it like the decoder's."""
    if name not in ENCODER_DTYPES:
        raise ModelError(f"unknown encoder dtype {name!r}", f"use one of {ENCODER_DTYPES}")
    if name == "auto":
        fast = torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() \
            and bf16_native()
        return torch.bfloat16 if fast else torch.float32
    return getattr(torch, name)


class Encoder(Framing):
    """Batched, deterministic (eval mode, no dropout) text embedder. Training and offline
    scoring embed in float32 (the cached embeddings the heads learn from)."""

    def __init__(self, path: Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        path = path or encoder_dir()
        try:
            self._set_tokenizer(WordPieces(path))
            self.model = MiniBert.load(path).to(device=device, dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            raise load_error(path, exc) from None
        self.device = device  # (the weights are copies, not pages of the mapped file: RSS
        # stays flat as new token ids appear)

    def embed_ids(self, batch: Sequence[list[int]], batch_size: int = 32) -> torch.Tensor:
        """Mean-pooled over real tokens (as sentence-transformers does), then L2-normalised."""
        chunks = []
        with torch.inference_mode():
            for start in range(0, len(batch), batch_size):
                part = batch[start:start + batch_size]
                width = -(-max(len(ids) for ids in part) // WIDTH_STEP) * WIDTH_STEP
                ids = torch.full((len(part), width), self.pad_id, dtype=torch.long)
                mask = torch.zeros((len(part), width), dtype=torch.long)
                for i, row in enumerate(part):
                    ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
                    mask[i, :len(row)] = 1
                ids, mask = ids.to(self.device), mask.to(self.device)
                hidden = self.model(ids, mask).float()
                m = mask.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
                chunks.append(torch.nn.functional.normalize(pooled, dim=-1).float().cpu())
        return torch.cat(chunks) if chunks else torch.zeros((0, EMBED_DIM))

    def warm(self) -> None:
        """Run every input width once, so what the runtime (oneDNN primitives, allocator
        pools) keeps per width is there before the first request, not added by later ones."""
        for width in range(WIDTH_STEP, MAX_PIECES + 1, WIDTH_STEP):
            self.embed_ids([[self.cls_id, *[self.sep_id] * (width - 2), self.sep_id]])

    def embed(self, prompts: Sequence[str], recents: Sequence[str] | None = None,
              batch_size: int = 32) -> torch.Tensor:
        """One vector per (prompt, recent text) pair; recent may be "" (prompt only)."""
        return self.embed_ids(self.framed(prompts, recents), batch_size)
