"""Ranking head: encoder embedding(s) (+ a has-recent flag) -> one score per draft.

Saved as ``head.safetensors`` (weights; draft names, dims and views also in its metadata)
next to ``head.json`` (names, dims, training info, accuracy, the pool's fingerprint), both
small enough to commit. Loading checks both files against the pool's drafts and, when the
sidecar records one, the pool's fingerprint (sha256 of every draft's weights): a head trained
for another pool, even one whose drafts share the names, or a corrupt file, fails with one
line instead of ranking the wrong drafts. The format and its checks are nphead.py's
(torch-free), where the predictor process's numpy twin of this head also lives; this module
is the trainable torch head, for training and offline scoring.

Two input views: ``joint`` embeds ``prompt [SEP] recent`` once (the prompt has most of the
pieces, so the mean-pooled vector follows it: on mixed answers the old head ranked like the
prompt alone); ``split`` embeds the prompt and the recent text apart and sets them side by
side (zeros for no recent text), so the head weighs each on its own. The trainer picks one
on dev (zoo/train_predictor.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from memspec.common.errors import ModelError
from memspec.procs.predictor.nphead import (  # noqa: F401  (re-exported)
    FORMAT,
    N_FLAGS,
    RETRAIN,
    VIEWS,
    check_fingerprint,
    default_head_path,
    read_head_file,
    read_info,
    sidecar,
)


class RankHead(nn.Module):
    """Linear (hidden=0) or one-hidden-layer MLP over ``[embedding(s) ; flags]``."""

    def __init__(self, names: Sequence[str], embed_dim: int = 384, hidden: int = 0,
                 dropout: float = 0.0, views: str = "joint") -> None:
        super().__init__()
        if not names or len(set(names)) != len(names):
            raise ValueError("a head needs distinct draft names")
        if views not in VIEWS:
            raise ValueError(f"unknown head views {views!r}")
        self.names = list(names)
        self.embed_dim = embed_dim
        self.hidden = hidden
        self.views = views
        self.fingerprint: dict[str, str] | None = None  # the pool it was trained for, if known
        d_in = embed_dim * self.width + N_FLAGS
        if hidden:
            self.net = nn.Sequential(nn.Dropout(dropout), nn.Linear(d_in, hidden), nn.GELU(),
                                     nn.Dropout(dropout), nn.Linear(hidden, len(names)))
        else:
            self.net = nn.Sequential(nn.Dropout(dropout), nn.Linear(d_in, len(names)))

    @property
    def width(self) -> int:
        """Embeddings per input: 1 (joint) or 2 (prompt, recent)."""
        return 2 if self.views == "split" else 1

    @staticmethod
    def features(emb: torch.Tensor, has_recent: torch.Tensor | Sequence[bool]) -> torch.Tensor:
        flag = torch.as_tensor(has_recent, dtype=torch.long).reshape(-1)
        return torch.cat([emb, nn.functional.one_hot(flag, N_FLAGS).to(emb.dtype)], dim=-1)

    def forward(self, emb: torch.Tensor, has_recent: torch.Tensor | Sequence[bool]) -> torch.Tensor:
        """Logits, one column per draft in ``self.names`` order."""
        if emb.shape[-1] != self.embed_dim * self.width:
            raise ModelError(f"a {self.views}-view head reads {self.embed_dim * self.width}-d "
                             f"inputs, got {emb.shape[-1]}-d",
                             "build them with memspec.procs.predictor.head.split_input")
        return self.net(self.features(emb, has_recent))

    def probs(self, emb: torch.Tensor, has_recent: Sequence[bool]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.softmax(self.forward(emb, has_recent).float(), dim=-1)

    def reorder(self, names: Sequence[str]) -> RankHead:
        """The same head with output columns permuted to ``names`` (the pool's order)."""
        if list(names) == self.names:
            return self
        last = self.net[-1]
        idx = torch.tensor([self.names.index(n) for n in names])
        with torch.no_grad():
            last.weight.copy_(last.weight[idx].clone())
            last.bias.copy_(last.bias[idx].clone())
        self.names = list(names)
        return self


def split_input(prompt_emb: torch.Tensor, recent_emb: torch.Tensor,
                has_recent: torch.Tensor | Sequence[bool]) -> torch.Tensor:
    """A split-view head's input: ``[prompt ; recent]``, recent zeroed where there is none
    (the recent-only embedding of an empty text is not "no text")."""
    keep = torch.as_tensor(has_recent, dtype=torch.bool).reshape(-1, 1)
    return torch.cat([prompt_emb, recent_emb * keep.to(recent_emb.dtype)], dim=-1)


def save_head(head: RankHead, path: Path, info: dict[str, Any] | None = None) -> Path:
    """Write ``path`` (safetensors) and its ``.json`` sidecar; returns the sidecar path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "names": json.dumps(head.names),
            "embed_dim": str(head.embed_dim), "hidden": str(head.hidden), "views": head.views}
    _write_safetensors({k: v.detach().float() for k, v in head.state_dict().items()}, meta, path)
    doc = {"format": FORMAT, "drafts": head.names, "embed_dim": head.embed_dim,
           "hidden": head.hidden, "views": head.views, "flags": ["prompt_only", "prompt_recent"],
           **(info or {})}
    sidecar(path).write_text(json.dumps(doc, indent=2) + "\n")
    return sidecar(path)


def _write_safetensors(tensors: dict[str, torch.Tensor], meta: dict[str, str],
                       path: Path) -> None:
    """Byte-reproducible safetensors (sorted header keys; the library's metadata order is
    random), so retraining with the same seed leaves the committed file unchanged."""
    header: dict[str, Any] = {"__metadata__": meta}
    blobs, offset = [], 0
    for name in sorted(tensors):
        blob = tensors[name].contiguous().cpu().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def load_head(path: Path, names: Sequence[str] | None = None,
              fingerprint: Mapping[str, str] | None = None) -> RankHead:
    """Load and validate (nphead.read_head_file); with ``names`` the head must cover exactly
    those drafts (any order), and its columns come back in ``names`` order; with
    ``fingerprint`` (the pool's) a head whose sidecar records another is refused. A sidecar
    without one (heads trained before fingerprints) loads, its ``fingerprint`` None for the
    caller to judge."""
    file = read_head_file(path, names, fingerprint)
    head = RankHead(file.names, embed_dim=file.embed_dim, hidden=file.hidden, views=file.views)
    head.fingerprint = file.fingerprint
    try:
        head.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in file.state.items()},
                             strict=True)
    except RuntimeError:
        raise ModelError(f"predictor head {file.path} has unexpected tensors or shapes",
                         RETRAIN) from None
    head.eval()
    return head.reorder(names) if names is not None else head
