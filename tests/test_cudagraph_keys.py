"""CUDA graphs are keyed by the cache memory they write and keep that cache alive
(procs/decoder/forward/cudagraph.py); a stand-in graph class lets this run without a GPU. The
tests marked for a GPU capture real graphs: a capture must not write over what the cache
holds, and a head's replayed steps decode losslessly."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from memspec.procs.decoder.forward import cudagraph
from memspec.procs.decoder.forward.cudagraph import GraphLM, storage_key
from memspec.procs.decoder.forward.lean import KVCache


class _Captured:
    made: list[_Captured] = []

    def __init__(self, lean, cache: KVCache, rows: int, ids: torch.Tensor, pos: int) -> None:
        self.cache = cache  # as the real _Graph does
        _Captured.made.append(self)

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        return torch.zeros(ids.numel(), 4)


def _cache(capacity: int = 64) -> KVCache:
    return KVCache(torch.zeros(2, 1, capacity, 8), torch.zeros(2, 1, capacity, 8))


def test_graphs_follow_cache_memory_and_keep_it_alive(monkeypatch):
    monkeypatch.setattr(cudagraph, "_Graph", _Captured)
    _Captured.made.clear()
    lean = SimpleNamespace(arch=None, vocab=4, device=torch.device("cpu"), act_dtype=None,
                           cache_dtype=None, k_blocked=False)
    g = GraphLM(lean)  # type: ignore[arg-type]
    ids = torch.tensor([1, 2])
    first = _cache()
    g.forward(ids, 0, first)
    g.forward(ids, 5, first)
    same_memory = KVCache(first.k.view_as(first.k), first.v[:], feat=None)  # new objects
    g.forward(ids, 0, same_memory)
    assert len(_Captured.made) == 1  # one graph per memory, not per Python object
    key = storage_key(first)
    ptr = first.k.data_ptr()
    del first, same_memory
    gc.collect()
    assert _Captured.made[0].cache.k.data_ptr() == ptr  # still owned by the graph
    others = [_cache() for _ in range(8)]  # fresh allocations cannot land on its memory
    assert all(storage_key(c) != key for c in others)
    for c in others:
        g.forward(ids, 0, c)
    assert len(_Captured.made) == 9 and len({storage_key(c) for c in others}) == 8


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@GPU
def test_a_capture_after_a_long_prefill_keeps_the_cache(tiny_dir):
    """The first graph call on a cache comes after an eager prefill (more rows than a graph
    holds): capturing there must leave the prefill's K/V and features as they were."""
    from memspec.procs.decoder.models import build_target

    target = build_target(tiny_dir / "target", "bfloat16", "cuda", fast=True)
    assert isinstance(target, GraphLM)
    target.lean.feature_layers = [0, 1]  # as a bound head asks: features are written too
    cache = target.new_cache(64)
    ids = torch.arange(1, 21, device="cuda")
    target.forward(ids, 0, cache)  # 20 rows: eager
    k, v, feat = cache.k[:, :, :20].clone(), cache.v[:, :, :20].clone(), cache.feat[:20].clone()
    target.forward(ids[:1], 20, cache)  # captures, then replays
    torch.cuda.synchronize()
    assert torch.equal(cache.k[:, :, :20], k) and torch.equal(cache.v[:, :, :20], v)
    assert torch.equal(cache.feat[:20], feat)


@GPU
def test_head_steps_replayed_as_graphs_decode_losslessly(tiny_dir, tmp_path):
    from tinymodels import TINY_VOCAB, make_tiny_head

    from memspec.procs.decoder.engine import SpecEngine
    from memspec.procs.decoder.models import build_target
    from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

    head_dir = make_tiny_head(tmp_path / "head", seed=3)
    outs = {}
    for fast in (False, True):
        eng = SpecEngine(build_target(tiny_dir / "target", "bfloat16", "cuda", fast=fast), (),
                         gamma=4)
        bound = load_into_slot("head", head_dir, SlotBuffer(1 << 20, device="cuda"),
                               TINY_VOCAB, eng.target_parts)
        assert (bound.runner.graphs is not None) == fast
        eng.add_draft(bound)
        for prompt in ([1, 5, 9, 22], list(range(3, 40))):
            ref, _ = eng.generate(prompt, 40)
            out, stats = eng.generate(prompt, 40, select=lambda s: "head")
            assert out == ref, (fast, prompt)
            outs[fast, len(prompt)] = stats.summary()["num_accepted_tokens"]
    assert outs  # both settings ran every prompt


class _Step:
    made: list[_Step] = []

    def __init__(self, runner, cache: KVCache, token, pos, hidden) -> None:
        self.cache = cache
        _Step.made.append(self)

    def __call__(self, token, pos, hidden):
        return torch.zeros(1, 4), hidden


def test_head_steps_are_keyed_by_cache_memory_and_keep_at_most_their_limit(monkeypatch):
    """A head's step graphs follow the cache memory they write, like the target's; past
    the limit the oldest is dropped (and with it the cache it kept alive)."""
    monkeypatch.setattr(cudagraph, "_HeadStep", _Step)
    _Step.made.clear()
    steps = cudagraph.HeadSteps(runner=None, limit=2)
    tok, hidden = torch.tensor([1]), torch.zeros(1, 8)
    a, b, c = _cache(), _cache(), _cache()
    steps(tok, 3, a, hidden)
    steps(tok, 4, KVCache(a.k.view_as(a.k), a.v[:]), hidden)  # same memory: same graph
    assert len(_Step.made) == 1
    steps(tok, 3, b, hidden)
    steps(tok, 3, c, hidden)  # a third cache: the oldest graph (a's) goes
    assert len(_Step.made) == 3 and len(steps._graphs) == 2
    assert storage_key(a) not in steps._graphs
    steps(tok, 5, a, hidden)  # a again: captured anew
    assert len(_Step.made) == 4 and storage_key(b) not in steps._graphs
