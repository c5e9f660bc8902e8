"""Build an engine from a pool and serve one request inside this process.

The multi-process runtime reuses the same pieces; this path exists for `memspec generate`
before the pipeline, for benchmarks that compare against it, and for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memspec.common.config import PoolConfig
from memspec.common.draftfiles import draft_weights_file
from memspec.common.errors import ConfigError, ModelError
from memspec.common.manifest import read_manifest
from memspec.common.messages import logprobs_json
from memspec.common.safetensors_layout import read_layout
from memspec.procs.decoder.detok import logprob_entries
from memspec.procs.decoder.engine import SpecEngine, TokenCallback
from memspec.procs.decoder.forward.threads import ThreadPlan
from memspec.procs.decoder.models import encode_prompt, open_engine
from memspec.procs.decoder.sched.acceptance import SamplingParams
from memspec.procs.decoder.sched.constraint import GrammarTokenizer
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.slots import SlotBuffer, load_into_slot

IN_PROCESS_POLICIES = ("target-only", "lookup-only", "general-static")


@dataclass
class LocalRuntime:
    pool: PoolConfig
    engine: SpecEngine
    tokenizer: Any
    slots: list[SlotBuffer] = field(default_factory=list)
    dtype: str = "float32"
    load_s: dict[str, float] = field(default_factory=dict)
    grammar: GrammarTokenizer | None = None  # built at the first constrained request

    def ensure_resident(self, name: str) -> SlotBuffer:
        """Load a draft into a free (or the least recently filled) slot, in-process."""
        for slot in self.slots:
            if slot.draft == name:
                return slot
        slot = next((s for s in self.slots if s.draft is None), None)
        if slot is None:
            slot = min(self.slots, key=lambda s: s.generation)
            self.engine.remove_draft(slot.draft or "")
        spec = self.pool.draft(name)
        t0 = time.perf_counter()
        bound = load_into_slot(name, spec.path, slot, target_vocab=self.engine.vocab,
                               parts=self.engine.target_parts)
        check_slot(name, spec.path, slot)  # before it runs, as the loader process checks
        self.load_s[name] = time.perf_counter() - t0
        self.engine.add_draft(bound)
        return slot


def check_slot(name: str, model_dir: Path, slot: SlotBuffer) -> None:
    """The slot's bytes against the draft's manifest, when it has one; a mismatch frees the
    slot and is a one-line ModelError."""
    man = read_manifest(model_dir)
    if man is None:
        return
    entry = man.entry(draft_weights_file(model_dir))
    try:
        entry.check_bytes(slot.data[:entry.data_size].cpu().numpy(), f"draft '{name}'")
    except ModelError:
        slot.draft = None
        raise


def slot_capacity(pool: PoolConfig) -> int:
    """Every slot is as large as the largest draft, so any draft fits any slot."""
    sizes = [read_layout(draft_weights_file(d.path)).data_size for d in pool.drafts]
    return max(sizes, default=0)


def build_local(pool: PoolConfig, device: str = "cpu", with_drafts: bool = True,
                dtype: str | None = None, fast: bool = True) -> LocalRuntime:
    engine, tokenizer, dtype = open_engine(pool, device, dtype, fast)
    slots: list[SlotBuffer] = []
    if with_drafts and pool.drafts:
        cap = slot_capacity(pool)
        slots = [SlotBuffer(cap, device=device) for _ in range(min(pool.K, len(pool.drafts)))]
    return LocalRuntime(pool, engine, tokenizer, slots, dtype)


def run_request(rt: LocalRuntime, prompt: str, policy: str, max_new_tokens: int,
                params: SamplingParams | None = None,
                on_tokens: TokenCallback | None = None,
                threads: ThreadPlan | None = None, response_format: str = "",
                json_schema: str = "", logprobs: int | None = None) -> dict[str, Any]:
    """Serve one prompt with an in-process policy; returns the `generate --json` object.
    With a thread plan the forwards' threads follow the free CPU, as in the decoder;
    `response_format` / `json_schema` / `logprobs` as Submit's."""
    constraint = None
    if response_format:
        if rt.grammar is None:
            rt.grammar = GrammarTokenizer.of(rt.tokenizer, rt.engine.vocab, rt.engine.eos_ids)
        constraint = rt.grammar.compile(response_format, json_schema)
    if policy not in IN_PROCESS_POLICIES:
        raise ConfigError(f"policy '{policy}' needs the multi-process runtime",
                          f"use one of: {', '.join(IN_PROCESS_POLICIES)}")
    t0 = time.perf_counter()
    select = None
    loads = 0
    bytes_loaded = 0
    if policy == "general-static":
        if not rt.pool.drafts:
            raise ConfigError("general-static needs at least one draft in the pool",
                              "add a [[drafts]] section or use --policy target-only")
        name = rt.pool.general
        if name not in {s.draft for s in rt.slots}:
            path = draft_weights_file(rt.pool.draft(name).path)
            loads, bytes_loaded = 1, read_layout(path).data_size
        rt.ensure_resident(name)
        select = lambda _session: name  # noqa: E731 - the engine's per-iteration selector
    elif policy == "lookup-only":
        select = lambda _session: LOOKUP  # noqa: E731
    ids = encode_prompt(rt.tokenizer, prompt)
    with torch.inference_mode():
        token_ids, stats = rt.engine.generate(
            ids, max_new_tokens, params, select, on_tokens,
            tick=None if threads is None else lambda: threads(False),
            constraint=constraint, logprobs=logprobs)
    stats.t_e2e = time.perf_counter() - t0
    stats.loads, stats.bytes_loaded = loads, bytes_loaded
    summary = stats.summary()
    summary["policy"] = policy
    out = {"text": rt.tokenizer.decode(token_ids, skip_special_tokens=True),
           "token_ids": token_ids, "stats": summary}
    if logprobs is not None:
        out["logprobs"] = logprobs_json(logprob_entries(rt.tokenizer, stats.token_logprobs))
    return out
