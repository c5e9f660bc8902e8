"""CUDA graphs are keyed by the cache memory they write and keep that cache alive
(procs/decoder/cudagraph.py); a stand-in graph class lets this run without a GPU."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import torch

from memspec.procs.decoder import cudagraph
from memspec.procs.decoder.cudagraph import GraphLM, storage_key
from memspec.procs.decoder.lean import KVCache


class _Captured:
    made: list[_Captured] = []

    def __init__(self, lean, cache: KVCache, rows: int) -> None:
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
