"""Ranking-head files and the head's inference in numpy, without torch.

The file format (``head.safetensors`` + its ``head.json`` sidecar), its checks and their
one-line errors live here, torch-free, so the predictor process reads a head and ranks with
it without importing torch; head.py builds its trainable torch ``RankHead`` from the very
same checked file (``read_head_file``). See head.py for the head itself: ``[embedding(s) ;
one-hot has-recent flag]`` -> Linear, or Linear -> GELU -> Linear, -> one logit per draft.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from memspec.common.errors import ModelError
from memspec.procs.predictor import DEFAULT_HEAD
from memspec.procs.predictor.npencoder import gelu

FORMAT = "memspec-predictor-head/1"
N_FLAGS = 2  # one-hot [prompt only, prompt + recent]: the two inputs look different
RETRAIN = "retrain it: memspec predictor train"
VIEWS = ("joint", "split")


def sidecar(path: Path) -> Path:
    return Path(path).with_suffix(".json")


def default_head_path() -> Path:
    return DEFAULT_HEAD


def read_info(path: Path) -> dict[str, Any]:
    side = sidecar(path)
    if not side.is_file():
        raise ModelError(f"predictor head {path} has no {side.name} beside it", RETRAIN)
    try:
        doc = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{side} is not valid JSON ({type(exc).__name__})", RETRAIN) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ModelError(f"{side} is not a {FORMAT} file", RETRAIN)
    return doc


def check_fingerprint(path: Path, saved: object, fingerprint: Mapping[str, str]) -> None:
    """A sidecar's pool fingerprint must be the pool's: same names are not same drafts."""
    if not isinstance(saved, dict) or saved == dict(fingerprint):
        return
    differ = sorted(k for k in {*saved, *fingerprint} if saved.get(k) != fingerprint.get(k))
    raise ModelError(f"predictor head {Path(path).name} was trained for another pool "
                     f"(fingerprint differs on {', '.join(differ)})",
                     RETRAIN + " --pool <this pool's file>")


def head_shapes(n_drafts: int, d_in: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The tensors of a head (RankHead's ``net`` state dict: Dropout, Linear[, GELU,
    Dropout, Linear]) and their shapes."""
    if not hidden:
        return {"net.1.weight": (n_drafts, d_in), "net.1.bias": (n_drafts,)}
    return {"net.1.weight": (hidden, d_in), "net.1.bias": (hidden,),
            "net.4.weight": (n_drafts, hidden), "net.4.bias": (n_drafts,)}


@dataclass
class HeadFile:
    """A head file's contents, checked against the pool (draft names, fingerprint)."""

    path: Path
    names: list[str]  # as saved (the file's column order)
    embed_dim: int
    hidden: int
    views: str
    fingerprint: dict[str, str] | None  # the pool it was trained for, if the sidecar says
    state: dict[str, np.ndarray]

    @property
    def width(self) -> int:
        """Embeddings per input: 1 (joint) or 2 (prompt, recent)."""
        return 2 if self.views == "split" else 1

    def shapes_fit(self) -> bool:
        want = head_shapes(len(self.names), self.embed_dim * self.width + N_FLAGS, self.hidden)
        return want == {k: tuple(v.shape) for k, v in self.state.items()}


def read_head_file(path: Path, names: Sequence[str] | None = None,
                   fingerprint: Mapping[str, str] | None = None) -> HeadFile:
    """Read and check a head file; with ``names`` the head must cover exactly those drafts
    (any order), with ``fingerprint`` (the pool's) a head whose sidecar records another is
    refused. A sidecar without one (heads trained before fingerprints) loads, its
    ``fingerprint`` None for the caller to judge. Tensor shapes are the caller's to check
    (torch's load_state_dict, or ``HeadFile.shapes_fit``)."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"predictor head not found at {path}",
                         "train one: memspec predictor train")
    doc = read_info(path)
    try:
        with safe_open(str(path), framework="np") as f:
            meta = f.metadata() or {}
        state = load_file(str(path))
        saved_names = json.loads(meta.get("names", "null"))
        embed_dim, hidden = int(meta["embed_dim"]), int(meta["hidden"])
        views = meta.get("views", "joint")
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelError(f"predictor head {path} is corrupt ({type(exc).__name__})",
                         RETRAIN) from None
    if saved_names != doc.get("drafts"):
        raise ModelError(f"{path.name} and {sidecar(path).name} disagree on the draft names",
                         RETRAIN)
    if names is not None and sorted(names) != sorted(saved_names):
        raise ModelError(f"predictor head ranks drafts {saved_names}, the pool has {list(names)}",
                         RETRAIN + " for this pool, or set pool.predictor_head")
    if fingerprint is not None:
        check_fingerprint(path, doc.get("pool_fingerprint"), fingerprint)
    if views not in VIEWS or not isinstance(saved_names, list) or not saved_names \
            or len(set(saved_names)) != len(saved_names):
        raise ModelError(f"predictor head {path} has unknown views {views!r}", RETRAIN)
    return HeadFile(path, list(saved_names), embed_dim, hidden, views,
                    doc.get("pool_fingerprint"), state)


class NumpyHead:
    """RankHead's inference (eval mode: no dropout) in float32 numpy; columns in ``names``
    order."""

    def __init__(self, file: HeadFile) -> None:
        self.names = list(file.names)
        self.embed_dim, self.hidden, self.views = file.embed_dim, file.hidden, file.views
        self.fingerprint = file.fingerprint
        self.width = file.width
        s = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in file.state.items()}
        self.layers = [(s["net.1.weight"], s["net.1.bias"])]
        if file.hidden:
            self.layers.append((s["net.4.weight"], s["net.4.bias"]))

    @staticmethod
    def features(emb: np.ndarray, has_recent: Sequence[bool] | np.ndarray) -> np.ndarray:
        flag = np.asarray(has_recent, dtype=np.int64).reshape(-1)
        return np.concatenate([emb, np.eye(N_FLAGS, dtype=emb.dtype)[flag]], axis=-1)

    def logits(self, emb: np.ndarray, has_recent: Sequence[bool] | np.ndarray) -> np.ndarray:
        """One column per draft in ``self.names`` order."""
        emb = np.asarray(emb, dtype=np.float32)
        if emb.shape[-1] != self.embed_dim * self.width:
            raise ModelError(f"a {self.views}-view head reads {self.embed_dim * self.width}-d "
                             f"inputs, got {emb.shape[-1]}-d",
                             "build them with memspec.procs.predictor.nphead.split_input")
        x = self.features(emb, has_recent)
        for i, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if i + 1 < len(self.layers):
                x = gelu(x)
        return x

    def probs(self, emb: np.ndarray, has_recent: Sequence[bool] | np.ndarray) -> np.ndarray:
        return softmax(self.logits(emb, has_recent))

    def reorder(self, names: Sequence[str]) -> NumpyHead:
        """The same head with output columns permuted to ``names`` (the pool's order)."""
        if list(names) == self.names:
            return self
        idx = [self.names.index(n) for n in names]
        w, b = self.layers[-1]
        self.layers[-1] = (w[idx].copy(), b[idx].copy())
        self.names = list(names)
        return self


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float32."""
    x = np.asarray(x, dtype=np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def split_input(prompt_emb: np.ndarray, recent_emb: np.ndarray,
                has_recent: Sequence[bool] | np.ndarray) -> np.ndarray:
    """A split-view head's input: ``[prompt ; recent]``, recent zeroed where there is none
    (the recent-only embedding of an empty text is not "no text"); head.split_input's twin."""
    keep = np.asarray(has_recent, dtype=bool).reshape(-1, 1)
    return np.concatenate([prompt_emb, recent_emb * keep.astype(recent_emb.dtype)], axis=-1)


def load_numpy_head(path: Path, names: Sequence[str] | None = None,
                    fingerprint: Mapping[str, str] | None = None) -> NumpyHead:
    """head.load_head's twin for the predictor process: the same checks and errors, a numpy
    head whose columns come back in ``names`` order."""
    file = read_head_file(path, names, fingerprint)
    if not file.shapes_fit():
        raise ModelError(f"predictor head {file.path} has unexpected tensors or shapes",
                         RETRAIN)
    head = NumpyHead(file)
    return head.reorder(names) if names is not None else head
