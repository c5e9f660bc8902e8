"""The predictor's ranking at every position of a trajectory, computed once, offline.

With greedy decoding a snapshot at position p is (prompt, the last T trajectory tokens
before p) whatever the policy did before, so the running predictor's answer is a function
of p alone. Computing it with the same encoder, head and text handling as the predictor
process (procs/predictor/ranker.py, encoder.recent_text) lets the simulator replay memspec
and prediction-only with the very rankings the real runtime would receive. Cached per head
file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from memspec.common.config import PoolConfig
from memspec.common.files import sha256_file
from memspec.common.paths import memspec_home
from memspec.procs.decoder.models import load_tokenizer
from memspec.procs.predictor.encoder import Encoder, recent_text
from memspec.procs.predictor.head import load_head
from memspec.procs.predictor.ranker import head_path_for
from memspec.zoo.train_predictor import EmbeddingCache, Example, head_inputs, view_examples


def _log(msg: str) -> None:
    print(f"[scores] {msg}", file=sys.stderr, flush=True)


def cache_path(head: Path, T: int) -> Path:
    return memspec_home() / "sim_cache" / f"scores-{sha256_file(head)[:16]}-T{T}.json"


def _key(prompt: str, recent: str) -> str:
    return hashlib.sha1(f"{prompt}\0{recent}".encode()).hexdigest()[:20]


def position_scores(pool: PoolConfig, trajs: Sequence[Mapping], prompts: Mapping[str, str],
                    head: Path | None = None, batch: int = 64) -> dict[str, list[list[float]]]:
    """{trajectory id: [probabilities in pool-draft order for p = 0..len-1]}.

    Cached per snapshot input (prompt, recent text), so a longer trace of the same prompts
    only ranks its new positions.
    """
    names = [d.name for d in pool.drafts]
    hpath = head_path_for(pool, head)
    path = cache_path(hpath, pool.T)
    cached: dict[str, list[float]] = {}
    if path.is_file():
        try:
            cached = json.loads(path.read_text())
        except json.JSONDecodeError:
            cached = {}
    tok = load_tokenizer(pool.target)
    keys: dict[str, list[str]] = {}
    todo: dict[str, tuple[str, str]] = {}
    for t in trajs:
        toks, prompt = t["tokens"], prompts[t["id"]]
        row = []
        for p in range(len(toks)):
            recent = recent_text(tok, toks[:p], pool.T)  # as the predictor process does
            k = _key(prompt, recent)
            row.append(k)
            if k not in cached:
                todo[k] = (prompt, recent)
        keys[t["id"]] = row
    if todo:
        rank_head = load_head(hpath, names)
        emb_cache = EmbeddingCache(memspec_home() / "predictor_cache")  # shared with training
        items = list(todo.items())
        exs = [Example("", 0, prompt, recent) for _, (prompt, recent) in items]
        missing = emb_cache.missing(view_examples(exs, rank_head.views))
        _log(f"ranking {len(items)} new snapshot inputs of {len(trajs)} trajectories "
             f"({len(missing)} to embed)")
        emb_cache.embed(Encoder() if missing else None, missing)
        for i in range(0, len(items), batch * 16):
            part = exs[i:i + batch * 16]
            probs = rank_head.probs(head_inputs(emb_cache, part, rank_head.views),
                                    torch.tensor([bool(e.recent) for e in part]))
            for (k, _), row in zip(items[i:i + batch * 16], probs.tolist()):
                cached[k] = row
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached))
    return {tid: [cached[k] for k in row] for tid, row in keys.items()}
