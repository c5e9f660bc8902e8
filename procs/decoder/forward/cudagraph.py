"""CUDA graphs for the lean forward: every decode call is one replay.

A decode step or verify is a few hundred small kernels; launched one by one from Python,
the launches cost more than the arithmetic on a GPU. The graph is captured once per KV
cache for a fixed number of rows (8: a step, or a verify of up to gamma+1 = 8 tokens, runs
as 8 rows with the rest ignored) over the whole cache, with the positions as device data:
K/V are written with ``index_copy_`` and attention masks keys past each row's position.
Fixed shapes also make every token's logits independent of how many tokens were batched
with it, which keeps speculative decoding token-identical to target-only decoding.
Prompt prefill and long draft catch-ups (more rows) run eagerly.

A graph writes the cache it was captured on by address, so graphs are keyed by the memory
they write (`storage_key`) and each keeps its cache alive: a freed cache whose memory a new
one reuses can never replay a graph into memory it no longer owns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memspec.procs.decoder.forward.lean import KVCache, LeanLM

ROWS = 8
Key = tuple[int, ...]


def storage_key(cache: KVCache) -> Key:
    """The addresses and shapes a graph captured on `cache` writes: equal keys, same memory."""
    parts: list[int] = []
    for t in (cache.k, cache.v, cache.feat):
        parts += [t.data_ptr(), *t.shape] if t is not None else [0]
    return tuple(parts)


def _capture(dev: torch.device, body: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``body`` up twice on a side stream (allocator, cuBLAS handles), then capture it.
    The warm-up runs for real: callers set their static inputs to the first call's own."""
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    return graph, out


class _Graph:
    """Captured on the call that first needs it, with that call's inputs: the warm-up runs
    the body for real, so it writes what that call's replay writes (placeholder inputs
    would write K/V and features over positions the cache already holds)."""

    def __init__(self, lean: LeanLM, cache: KVCache, rows: int, ids: torch.Tensor,
                 pos: int) -> None:
        dev = lean.device
        self.cache = cache  # kept alive: its memory is what the graph writes
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.ids[:ids.numel()].copy_(ids)
        self.pos.fill_(pos)
        self.rows = rows
        keys = cache.capacity
        # the graph reads these by address: they live as long as the graph
        self.cos, self.sin = lean._tables(keys + rows)
        self.offsets = torch.arange(rows, device=dev)

        def body() -> torch.Tensor:
            positions = self.pos + self.offsets
            bias = lean.causal_bias(positions, keys)
            x = lean.layers_forward(lean.embed(self.ids), positions, cache, self.cos[positions],
                                    self.sin[positions], bias, keys)
            return lean.head(x)

        self.graph, self.out = _capture(dev, body)

    def __call__(self, ids: torch.Tensor, pos: int) -> torch.Tensor:
        T = ids.numel()
        self.ids[:T].copy_(ids)
        self.pos.fill_(pos)
        self.graph.replay()
        return self.out[:T]


class GraphLM:
    """Same interface as :class:`LeanLM`; decode calls replay a captured CUDA graph.

    The KV cache holds ``ROWS`` positions more than asked: the padding rows of a replay
    write (ignored) keys just past the valid length."""

    def __init__(self, lean: LeanLM, rows: int = ROWS) -> None:
        self.lean, self.arch, self.vocab = lean, lean.arch, lean.vocab
        self.device, self.act_dtype = lean.device, lean.act_dtype
        self.cache_dtype, self.k_blocked = lean.cache_dtype, lean.k_blocked
        self.rows = rows
        self._graphs: dict[Key, _Graph] = {}

    def new_cache(self, capacity: int) -> KVCache:
        return self.lean.new_cache(capacity + self.rows)

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache,
                last_only: bool = False) -> torch.Tensor:
        T = ids.numel()
        if self.rows < T or pos + self.rows > cache.capacity:
            return self.lean.forward(ids, pos, cache, last_only)
        key = storage_key(cache)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = _Graph(self.lean, cache, self.rows, ids, pos)
        out = graph(ids, pos)
        return out[-1:] if last_only else out

    @property
    def weight_bytes(self) -> int:
        return self.lean.weight_bytes


def accelerate_cuda(lean: LeanLM) -> LeanLM | GraphLM:
    return GraphLM(lean) if lean.device.type == "cuda" else lean


class _HeadStep:
    """One head step captured over one cache, warmed up on its first call's real inputs
    (as :class:`_Graph`)."""

    def __init__(self, runner: Any, cache: KVCache, token: torch.Tensor, pos: int,
                 hidden: torch.Tensor) -> None:
        dev = hidden.device
        self.cache = cache  # kept alive: its memory is what the graph writes
        self.token = token.detach().reshape(1).clone()
        self.pos = torch.full((), pos, dtype=torch.long, device=dev)
        self.hidden = hidden.detach().float().clone()
        self.tables = runner.graph_tables(cache.capacity)

        def body() -> tuple[torch.Tensor, torch.Tensor]:
            return runner.graph_step(self.token, self.pos, cache, self.hidden, self.tables)

        self.graph, self.out = _capture(dev, body)

    def __call__(self, token: torch.Tensor, pos: int, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        self.token.copy_(token.reshape(1))
        self.pos.fill_(pos)
        self.hidden.copy_(hidden)
        self.graph.replay()
        return self.out


class HeadSteps:
    """A draft head's one-token steps as CUDA graph replays, keyed by cache memory like
    :class:`GraphLM`. The outputs are the graph's own buffers, overwritten by the next
    replay: the engine reads a step's proposal before it asks for the next one.

    A decoder binds a head into the same slot (and so the same cache memory) over and
    over, so a few graphs cover a run; past ``limit`` the oldest is dropped, and with it
    the cache it kept alive."""

    def __init__(self, runner: Any, limit: int = 4) -> None:
        self.runner, self.limit = runner, limit
        self._graphs: dict[Key, _HeadStep] = {}

    def __call__(self, token: torch.Tensor, pos: int, cache: KVCache, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        key = storage_key(cache)
        graph = self._graphs.get(key)
        if graph is None:
            while len(self._graphs) >= self.limit:
                self._graphs.pop(next(iter(self._graphs)))
            graph = self._graphs[key] = _HeadStep(self.runner, cache, token, pos, hidden)
        return graph(token, pos, hidden)
