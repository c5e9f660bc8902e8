"""Datastore drafts: what the target said after the same words in a domain's own text.

A datastore is an n-gram continuation table built from a domain's token stream (the target's
greedy responses to that domain's train prompts, optionally the domain's corpus): for every
context of n tokens (n_min <= n <= n_max) seen at least ``min_count`` times, the token that
most often followed it. Proposing is greedy n-gram decoding with back-off to shorter
contexts: no model runs, so an iteration costs its verify alone, and what a store is worth
depends on the domain it was built from (a code store knows ``def``/``return`` chains, a math
store "Let's break down"): the drafts memspec chooses among and keeps resident.

Pure (numpy, ints): the engine, the acceptance replay and the builder share it. The tables
are plain int arrays (safetensors in a draft folder), so a loaded slot is bound by viewing
its bytes, as weights are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DATASTORE_KIND = "datastore"
SEP = -1  # between documents in a build stream: no n-gram spans it
_P = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the rolling hash
_MASK = (1 << 64) - 1
TABLE_PARTS = ("keys", "next", "count", "total")


def tail_key(tail: Sequence[int], n: int) -> int:
    """The int64 key of the last ``n`` tokens of ``tail`` (the same as :func:`_keys`)."""
    h = n
    for x in tail[len(tail) - n:]:
        h = (h * _P + int(x) + 1) & _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


def next_labels(tokens: np.ndarray) -> np.ndarray:
    """What follows each position of a build stream in the stream itself (SEP at a document's
    end): the labels build_tables uses when it is given none."""
    t = np.asarray(tokens, dtype=np.int64)
    out = np.full(t.size, SEP, dtype=np.int64)
    out[:-1] = t[1:]
    return out


def _keys(tokens: np.ndarray, n: int, labels: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """(key, next token) of every context of n tokens inside one document; the next token is
    ``labels`` at the context's last position (default: the stream's own next token)."""
    t = tokens.astype(np.int64)
    lab = next_labels(t) if labels is None else np.asarray(labels, dtype=np.int64)
    length = t.size - n + 1
    if length <= 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    nxt = lab[n - 1:]
    valid = nxt >= 0
    h = np.full(length, n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            col = t[k:k + length]
            valid &= col >= 0
            h = h * np.uint64(_P) + (col.astype(np.uint64) + np.uint64(1))
    return h.view(np.int64)[valid], nxt[valid]


def build_tables(tokens: np.ndarray, n_min: int = 1, n_max: int = 6, min_count: int = 2,
                 labels: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The store's tensors (``keys.{n}`` sorted int64, ``next.{n}``, ``count.{n}`` (the
    best next token's count), ``total.{n}`` (the context's count), int32): contexts whose best
    continuation was seen fewer than ``min_count`` times are left out (they would not be
    proposed, and most n-grams are seen once). ``labels`` (one per stream position, SEP for
    none) replace what follows each context: the target's own next token after a corpus
    prefix, say, rather than the corpus's."""
    if labels is not None and len(labels) != len(tokens):
        raise ValueError("labels must be as long as the stream")
    if not 1 <= n_min <= n_max:
        raise ValueError("need 1 <= n_min <= n_max")
    out: dict[str, np.ndarray] = {}
    for n in range(n_min, n_max + 1):
        keys, nxt = _keys(tokens, n, labels)
        order = np.lexsort((nxt, keys))
        keys, nxt = keys[order], nxt[order]
        if keys.size:  # runs of equal (context, next)
            brk = np.flatnonzero((keys[1:] != keys[:-1]) | (nxt[1:] != nxt[:-1])) + 1
            starts = np.concatenate([[0], brk])
            cnt = np.diff(np.concatenate([starts, [keys.size]]))
            pk, pn = keys[starts], nxt[starts]
            groups = np.concatenate([[0], np.flatnonzero(pk[1:] != pk[:-1]) + 1])
            total = np.add.reduceat(cnt, groups)
            best = np.lexsort((-cnt, pk))  # per context, its most frequent next token first
            first = np.concatenate([[True], pk[best][1:] != pk[best][:-1]])
            bk, bn, bc = pk[best][first], pn[best][first], cnt[best][first]
        else:
            bk = bn = bc = total = np.zeros(0, np.int64)
        keep = bc >= min_count
        out[f"keys.{n}"] = np.ascontiguousarray(bk[keep], dtype=np.int64)
        out[f"next.{n}"] = np.ascontiguousarray(bn[keep], dtype=np.int32)
        out[f"count.{n}"] = np.ascontiguousarray(bc[keep], dtype=np.int32)
        out[f"total.{n}"] = np.ascontiguousarray(total[keep], dtype=np.int32)
    return out


def stream(sequences: Iterable[Sequence[int]]) -> np.ndarray:
    """Documents joined into one build stream, separated by SEP."""
    parts: list[np.ndarray] = []
    for seq in sequences:
        parts.append(np.asarray(seq, dtype=np.int64))
        parts.append(np.array([SEP], dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


@dataclass(frozen=True)
class StoreParams:
    """What decides a proposal: the longest context seen wins; it is proposed only if its
    best continuation was seen ``min_count`` times and is at least ``min_conf`` of what
    followed it (an unsure longest match proposes nothing: a shorter one is less precise)."""

    min_count: int = 2
    min_conf: float = 0.5


class Datastore:
    """A bound store: lookups into its tables (numpy views; a slot's bytes, or built)."""

    def __init__(self, tables: Mapping[str, np.ndarray], params: StoreParams = StoreParams()
                 ) -> None:
        ns = sorted(int(k.split(".", 1)[1]) for k in tables if k.startswith("keys."))
        if not ns or ns != list(range(ns[0], ns[-1] + 1)):
            raise ValueError("a datastore needs keys.{n} for a contiguous range of n")
        for n in ns:
            sizes = {tables[f"{p}.{n}"].shape for p in TABLE_PARTS}
            if len(sizes) != 1 or len(next(iter(sizes))) != 1:
                raise ValueError(f"datastore tables for n={n} differ in length")
        self.n_min, self.n_max = ns[0], ns[-1]
        self.params = params
        self._t = {n: tuple(np.asarray(tables[f"{p}.{n}"]) for p in TABLE_PARTS) for n in ns}
        self.nbytes = sum(int(np.asarray(v).nbytes) for v in tables.values())

    def tables(self) -> dict[str, np.ndarray]:
        """Its tensors by name, as build_tables gives them and a folder stores them."""
        return {f"{part}.{n}": arr for n, arrs in self._t.items()
                for part, arr in zip(TABLE_PARTS, arrs, strict=True)}

    def propose(self, tail: Sequence[int]) -> int | None:
        """The token after the longest stored suffix of ``tail`` (newest last), or None."""
        p = self.params
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            keys, nxt, cnt, tot = self._t[n]
            key = tail_key(tail, n)
            i = int(np.searchsorted(keys, key))
            if i < keys.size and int(keys[i]) == key:
                c = int(cnt[i])
                if c >= p.min_count and c >= p.min_conf * int(tot[i]):
                    return int(nxt[i])
                return None
        return None


def propose_chain(ngrams, store: Datastore | None, tail: list[int], gamma: int  # noqa: ANN001
                  ) -> list[int]:
    """A model-free draft's proposals (the engine's and the replays'): the context lookup's
    token (``ngrams``, lookup.NgramIndex) where the context repeats, else the store's, each
    appended to ``tail`` for the next, up to ``gamma`` while one is found."""
    return led_chain(ngrams, store, tail, gamma)[0]


def led_chain(ngrams, store: Datastore | None, tail: list[int], gamma: int  # noqa: ANN001
              ) -> tuple[list[int], bool]:
    """propose_chain's proposals, and whether the store led them (its token came first: the
    lookup alone would have proposed nothing here, so the gate weighs these iterations
    against a target step, not against the lookup)."""
    props: list[int] = []
    led = False
    while len(props) < gamma:
        tok = ngrams.propose(tail) if ngrams is not None else None
        if tok is None and store is not None:
            tok = store.propose(tail)
            led = led or not props
        if tok is None:
            break
        props.append(tok)
        tail.append(tok)
    return props, led and bool(props)


def tail_width(ngrams, store: Datastore | None) -> int:  # noqa: ANN001
    """How many context tokens the chain reads."""
    return max(ngrams.n_max if ngrams is not None else 0, store.n_max if store else 0)


class StoreRunner:
    """What a bound datastore draft holds in place of a forward: the engine runs no model for
    it (Session._lookup_step), only its lookups."""

    def __init__(self, store: Datastore) -> None:
        self.store = store


def read_store_config(model_dir) -> dict:  # noqa: ANN001
    """A draft folder's config.json as a dict ({} if unreadable); a datastore's says
    ``memspec_kind = "datastore"`` and holds its params."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def store_params(cfg: Mapping) -> StoreParams:
    return StoreParams(min_count=int(cfg.get("min_count", StoreParams.min_count)),
                       min_conf=float(cfg.get("min_conf", StoreParams.min_conf)))
