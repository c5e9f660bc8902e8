"""The decode hot loop: batch-1 speculative decoding with swappable, slot-bound drafts.

The engine owns the target and the per-request KV caches. A controller (a policy, the
multi-process decoder, or a test) picks the draft for each iteration by calling
:meth:`Session.step`; the engine never decides *which* draft, only runs it losslessly.

Cache invariants (L = committed tokens, prompt included):
- the target cache holds the first L-1 tokens; the last committed token is fed with the
  proposals, so one forward verifies gamma proposals and yields gamma+1 distributions;
- each draft keeps its own cache of some committed prefix; when it becomes active it
  prefills only the missing suffix (catch-up), so switching back is cheap.
Caches are static (written in place at a position), so rejecting proposals is only a
change of the valid length; tokens live in a preallocated tensor and greedy acceptance
costs one host sync per iteration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from memspec.common.errors import ModelError, RequestError
from memspec.common.limits import MAX_TOP_LOGPROBS
from memspec.common.metrics import IterationRecord, LogprobRow, RunStats
from memspec.common.tuned import knob
from memspec.procs.decoder.drafts.datastore import (
    DATASTORE_KIND,
    Datastore,
    led_chain,
    tail_width,
)
from memspec.procs.decoder.drafts.head import (
    HEAD_KIND,
    TargetParts,
    first_floor,
    stop_floor,
    unsure,
)
from memspec.procs.decoder.drafts.lookup import NgramIndex
from memspec.procs.decoder.drafts.lookup_depth import LookupDepth
from memspec.procs.decoder.forward.runners import Runner, as_runner, set_feature_layers
from memspec.procs.decoder.sched.acceptance import (
    SamplingParams,
    argmax_index,
    greedy_accept,
    greedy_accept_host,
    host_argmax,
    host_rows,
    sample,
    speculative_accept,
    warp,
)
from memspec.procs.decoder.sched.constraint import Constraint
from memspec.procs.decoder.sched.costs import LOOKUP
from memspec.procs.decoder.sched.gate import Line
from memspec.procs.decoder.slots import BoundDraft

TokenCallback = Callable[[list[int]], None]
Between = Callable[[], bool]  # called between prefill chunks; False: the rest in one piece
DEFAULT_MAX_CONTEXT = 2048
# Prefill piece while a caller waits on something (the first ranking): the smallest piece
# that costs at most 3% over one whole prefill on dev (each piece is another pass over the
# weights: measured on AVX-512, 32-token pieces cost 15% more, 128-token ones 0.5%)
PREFILL_CHUNK = knob("engine.PREFILL_CHUNK")  # `memspec bench tune` (tuned.json)
# forced tokens one verify takes: the grammar allows nothing else there, so each is accepted
# and a whole run (a key and its quotes) costs rows, not iterations (dev, in process, the 20
# prompts of `bench json`, 3 runs each: gamma's 4 3.2% [1.7, 4.6] slower than 12; 8, 12
# and 24 within 1% of each other)
FORCED_MAX = 16


def prefill_pieces(n: int, chunk: int, between: Between | None) -> Iterator[tuple[int, int]]:
    """The [a, b) pieces of an `n`-token prefill: `chunk` tokens while `between` (called
    after each piece but the last) asks for more, then the rest at once. The engine and the
    simulator cut a prompt with this one rule."""
    step = chunk if between is not None and chunk > 0 else n
    a = 0
    while a < n:
        b = n if n - a <= step else a + step
        yield a, b
        a = b
        if a < n and between is not None and not between():
            step = n


class _Proposer:
    """The draft's latest logits and how to advance it by one proposal."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits
        # (draft index, or None for a token outside the draft's vocabulary; target id; position)
        self.next: Callable[[torch.Tensor | None, torch.Tensor, int], None] = \
            lambda d_idx, t_id, pos: None


@dataclass
class _DraftCache:
    generation: int
    cache: Any
    length: int  # committed tokens held in the cache


def lookup_first_match(device: torch.device | str = "cpu") -> int:
    """``engine.LOOKUP_FIRST`` (tuned.json, chosen on dev): the shortest context-suffix
    match at which a model draft's iteration runs the lookup alone (0: never). On a CPU a
    draft's steps are a fifth of a target step and buy little where the lookup already
    proposes; on a GPU, where extra verify rows are free and the sweep never ran, the
    draft always drafts (as ``head.STOP``)."""
    if torch.device(device).type != "cpu":
        return 0
    return int(knob("engine.LOOKUP_FIRST") or 0)


class SpecEngine:
    """Target runner + registered drafts; :meth:`start` opens a request."""

    def __init__(self, target: Runner | torch.nn.Module, eos_ids: tuple[int, ...] | list[int],
                 gamma: int = 4, max_context: int = DEFAULT_MAX_CONTEXT, lookup: int = 0) -> None:
        """``lookup``: shortest context suffix whose earlier successor replaces a draft's
        greedy proposal (procs/decoder/drafts/lookup.py); 0 turns the lookup off."""
        if gamma < 1:
            raise ValueError("gamma must be >= 1")
        if lookup < 0:
            raise ValueError("lookup must be >= 0")
        self.lookup = int(lookup)
        self.target = as_runner(target)
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.gamma = gamma
        self.device = self.target.device
        self.vocab = int(self.target.vocab)
        limit = getattr(self.target, "max_pos", None) or getattr(
            getattr(self.target, "arch", None), "max_pos", None) or max_context
        self.max_len = min(int(limit), int(max_context))
        self.drafts: dict[str, BoundDraft] = {}
        self._parts: TargetParts | None = None
        # a target step and a verify of gamma+1 rows (the decoder's calibration): with them
        # each context-lookup proposal is as long as pays for its rows (lookup_depth.py);
        # without, it is gamma tokens
        self.depth_costs: tuple[Line, Line] | None = None
        self.lookup_first = lookup_first_match(self.device) if self.lookup else 0

    @property
    def exact_chunks(self) -> bool:
        """Does a prompt prefilled in chunks leave a bit-identical cache (native forward)?"""
        return bool(getattr(self.target, "exact_chunks", False))

    @property
    def target_parts(self) -> TargetParts:
        """What head drafts read from the target (built on first use)."""
        if self._parts is None:
            self._parts = TargetParts(self.target)
        return self._parts

    def use_features(self, layers: tuple[int, ...] | list[int]) -> None:
        """Keep the target's residual stream after ``layers`` per position (head drafts'
        input). Every head of a pool must read the same layers."""
        layers = list(layers)
        current = list(getattr(getattr(self.target, "lean", self.target), "feature_layers",
                               []) or [])
        if current == layers:
            return
        if current:
            raise ModelError(f"head drafts read different target layers ({current} vs "
                             f"{layers})", "train every head of a pool on the same layers")
        set_feature_layers(self.target, layers)

    def add_draft(self, draft: BoundDraft) -> None:
        if draft.kind == HEAD_KIND:
            self.use_features(draft.runner.arch.feature_layers)
        self.drafts[draft.name] = draft

    def remove_draft(self, name: str) -> None:
        self.drafts.pop(name, None)

    def start(self, prompt_ids: list[int], max_new_tokens: int,
              params: SamplingParams | None = None,
              on_tokens: TokenCallback | None = None, between: Between | None = None,
              constraint: Constraint | None = None, logprobs: int | None = None
              ) -> Session:
        """Open a request (prefill). ``between`` lets the caller act during a long prefill
        (the decoder issues the initial loads once the first ranking lands); it is called
        only where chunks give bit-identical caches (``exact_chunks`` runners), so output
        never depends on when a ranking arrived. ``constraint``: the output grammar;
        ``logprobs``: record each emitted token's log-probability and this many
        alternatives (None: none)."""
        return Session(self, prompt_ids, max_new_tokens, params or SamplingParams(), on_tokens,
                       between, constraint, logprobs)

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams | None = None,
                 select: Callable[[Session], str | None] | None = None,
                 on_tokens: TokenCallback | None = None,
                 tick: Callable[[], None] | None = None,
                 constraint: Constraint | None = None, logprobs: int | None = None
                 ) -> tuple[list[int], RunStats]:
        """Run to completion; ``select`` names the draft for each iteration (None: target
        only); ``tick`` runs before the prefill and every iteration (the thread plan)."""
        t0 = time.perf_counter()
        if tick is not None:
            tick()
        s = self.start(prompt_ids, max_new_tokens, params, on_tokens,
                       constraint=constraint, logprobs=logprobs)
        s.force_ahead = select is not None  # (no selector: the target-only baseline)
        while not s.done:
            if tick is not None:
                tick()
            s.step(select(s) if select else None)
        s.stats.t_e2e = time.perf_counter() - t0
        return s.generated, s.stats


def _lookup_index(tok: int | None, bound: BoundDraft, device: torch.device
                  ) -> torch.Tensor | None:
    """The draft-vocabulary index of a looked-up target token (None: none, or outside the
    draft's vocabulary, where the draft's own guess stands)."""
    if tok is None:
        return None
    if bound.to_target is None:
        return torch.tensor([tok], dtype=torch.long, device=device)
    if bound.to_draft is None or tok >= bound.to_draft.numel():
        return None
    idx = bound.to_draft[tok]
    return idx.view(1) if int(bound.to_target[idx]) == tok else None


class Session:
    """One request in flight; :meth:`step` is the body of the hot loop."""

    def __init__(self, engine: SpecEngine, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams, on_tokens: TokenCallback | None,
                 between: Between | None = None, constraint: Constraint | None = None,
                 logprobs: int | None = None) -> None:
        if not prompt_ids:
            raise RequestError("empty prompt", "send at least one token")
        if max_new_tokens < 1:
            raise RequestError(f"max_new_tokens {max_new_tokens} < 1", "ask for at least 1")
        # (under a grammar a verify holds up to gamma forced tokens and gamma more)
        need = len(prompt_ids) + max_new_tokens + engine.gamma * (1 + bool(constraint)) + 1
        if need > engine.max_len:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the "
                f"target's context of {engine.max_len}", "shorten the prompt or lower max_new_tokens")
        if any(not 0 <= t < engine.vocab for t in prompt_ids):
            raise RequestError("prompt has token ids outside the target's vocabulary",
                               f"use ids in [0, {engine.vocab})")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs {logprobs} is out of range",
                               f"ask for 0 to {MAX_TOP_LOGPROBS}")
        # the output grammar: every emitted token is the target's choice among the tokens
        # it allows; drafts propose only legal tokens, the tokens it forces are proposed
        # without a draft (while `force_ahead`: a target-only baseline sets it False)
        self.constraint = constraint
        self.force_ahead = True
        self.logprobs = logprobs
        self.engine = engine
        self.params = params
        self.max_new_tokens = max_new_tokens
        self.on_tokens = on_tokens
        self.tokens: list[int] = [int(t) for t in prompt_ids]
        self.prompt_len = len(self.tokens)
        self.done = False
        self.stats = RunStats(prompt_tokens=self.prompt_len)
        self.gen = None
        if not params.greedy:
            self.gen = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                     else torch.seed())
        self._ngrams = NgramIndex(engine.lookup, self.tokens) \
            if engine.lookup and params.greedy else None
        self._depth = LookupDepth.tuned(*engine.depth_costs, engine.gamma) \
            if engine.depth_costs is not None and self._ngrams is not None else None
        # oracle-dynamic's exact proposals: (draft or LOOKUP, tokens committed) -> how many
        # to propose (those the target will accept; for the lookup 0 is a plain step, a
        # draft proposes one at least). It knows the trajectory; proposals are made one
        # after another, so fewer are a prefix of more and the output is the same whatever
        # it says: only the draft's steps and the verify's rows change
        self.propose: Callable[[str, int], int] | None = None
        self._drafts: dict[str, _DraftCache] = {}
        # greedy heads stop proposing where they are unsure (sampling drafts gamma)
        self._head_stop = stop_floor(engine.device) if params.greedy else 0.0
        self._head_first = first_floor(engine.device) if params.greedy else 0.0  # (its
        # first proposal: below it a head's iteration is a target step)
        self._lookup_first = engine.lookup_first if self._ngrams is not None else 0
        self._last_draft: str | None = None  # the last draft that ran (switch count)
        self._prev: str | None = None  # the draft the previous iteration ran (None: the
        # target; the lookup where it ran in a model draft's place)
        self._dev = engine.device
        self._cap = need
        self._tok = torch.zeros(need, dtype=torch.long, device=self._dev)
        self._tok[:self.prompt_len] = torch.tensor(self.tokens, dtype=torch.long)
        # the same ids through numpy on a CPU: a commit's write costs ~1 us, not torch.tensor's ~20
        self._tok_host = self._tok.numpy() if self._dev.type == "cpu" else None
        t0 = time.perf_counter()
        self._tcache = engine.target.new_cache(engine.max_len)
        self._prefill(between if engine.exact_chunks else None)
        self._sync()
        self.stats.t_prefill = time.perf_counter() - t0

    def _prefill(self, between: Between | None) -> None:
        """The prompt but its last token into the target cache; in PREFILL_CHUNK pieces
        while ``between`` asks for more, then the rest at once."""
        with torch.inference_mode():
            for a, b in prefill_pieces(self.prompt_len - 1, PREFILL_CHUNK, between):
                self.engine.target.forward(self._tok[a:b], a, self._tcache, last_only=True)

    @property
    def token_logprobs(self) -> list[LogprobRow]:
        """One per generated token, where asked for (``logprobs``)."""
        return self.stats.token_logprobs

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def _sync(self) -> None:
        if self._dev.type == "cuda":
            torch.cuda.synchronize(self._dev)

    def _commit(self, new: list[int], rows: torch.Tensor | None = None,
                checked: bool = False) -> int:
        """Append emitted tokens (up to the budget and the end of sequence). ``rows``: the
        target's logits each was chosen from (log-probabilities, where asked for);
        ``checked``: the grammar has already advanced past them."""
        room = self.max_new_tokens - len(self.generated)
        out: list[int] = []
        for tok in new[:room]:
            out.append(tok)
            if tok in self.engine.eos_ids:
                self.done = True
                break
        if self.constraint is not None:
            if out and not checked:
                self.constraint.commit(out)
            self.stats.t_grammar = self.constraint.seconds
        if out and self.logprobs is not None and rows is not None:
            self._record_logprobs(out, rows[:len(out)])
        if out:
            L = len(self.tokens)
            if self._tok_host is not None:
                self._tok_host[L:L + len(out)] = out
            else:
                self._tok[L:L + len(out)] = torch.tensor(out, dtype=torch.long)
            self.tokens.extend(out)
            if self._ngrams is not None:
                self._ngrams.extend(out)
        if len(self.generated) >= self.max_new_tokens:
            self.done = True
        if out and self.on_tokens:
            self.on_tokens(out)
        return len(out)

    def _record_logprobs(self, tokens: list[int], rows: torch.Tensor) -> None:
        """Each token's log-probability under the target's own distribution (temperature
        1, before any filter or grammar: what it thinks, as OpenAI and vLLM report it) and
        the `logprobs` most likely tokens."""
        lp = torch.log_softmax(rows.float(), dim=-1)
        chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
        if self.logprobs:
            vals, ids = torch.topk(lp, self.logprobs, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        self.token_logprobs.extend(zip(tokens, chosen, tops))

    def _pick(self, logits: torch.Tensor) -> int:
        c = self.constraint
        if self.params.greedy and c is not None:
            return c.pick_greedy(logits.float().cpu().numpy())
        if self.params.greedy:
            return host_argmax(logits) if host_rows(logits) else int(logits.argmax().item())
        if c is not None:
            logits = c.restrict(logits.float().cpu())
        return sample(warp(logits.cpu(), self.params), self.gen)

    def _accept_constrained(self, props: list[int], logits: torch.Tensor) -> tuple[int, int]:
        """Greedy acceptance under the grammar: row i's choice is the target's best token
        among those legal after the accepted props[:i] (the grammar advances as it goes)."""
        c = self.constraint
        assert c is not None
        rows = logits.float().cpu().numpy()
        first = rows.argmax(-1)
        eos = self.engine.eos_ids
        n = 0
        while True:
            tok = c.pick_greedy(rows[n], int(first[n]))
            c.commit([tok])
            if n < len(props) and tok == props[n] and tok not in eos:
                n += 1
                continue
            return n, tok

    def _legal_after(self, head: list[int], more: list[int]) -> list[int]:
        """The tokens of `more` the grammar allows after `head` (legal itself)."""
        if not more or self.constraint is None:
            return more
        return more[:self.constraint.legal_prefix(head + more) - len(head)]

    def _legal(self, props: list[int]) -> list[int]:
        """The proposals up to the first the grammar forbids (it could never be accepted)."""
        if self.constraint is None or not props:
            return props
        return props[:self.constraint.legal_prefix(props)]

    @torch.inference_mode()
    def step(self, draft: str | None, desired: bool = True) -> IterationRecord:
        """One iteration with the named resident draft, or a target-only step for None."""
        if self.done:
            raise RuntimeError("session is finished")
        if draft is not None and draft != LOOKUP and draft not in self.engine.drafts:
            raise KeyError(f"draft '{draft}' is not resident")
        t0 = time.perf_counter()
        c = self.constraint
        forced = c.forced()[:self._forced_room()] \
            if c is not None and self.force_ahead and self.params.greedy else []
        if forced:  # the grammar's own proposal: a verify, no draft (booked as the lookup's)
            rec = self._lookup_step(t0, forced=forced)
            draft = LOOKUP
        elif draft is None or (c is not None and not self.params.greedy):
            rec = self._target_step(t0)  # (sampling under a grammar: target steps only)
        elif draft == LOOKUP:
            rec = self._lookup_step(t0)
        elif self.engine.drafts[draft].kind == DATASTORE_KIND:
            rec = self._lookup_step(t0, draft, self.engine.drafts[draft].runner.store)
        elif self._lookup_matches():
            rec = self._lookup_step(t0)
        else:
            rec = self._spec_step(draft, t0)
        rec.desired = desired
        if draft is not None and draft != LOOKUP:  # (the lookup has no cache to switch)
            if self._last_draft is not None and draft != self._last_draft:
                self.stats.switches += 1
            self._last_draft = draft
        # what ran, not what was asked for: after the lookup ran in a draft's place, the
        # draft's next iteration is a resumption whose catch-up is booked as catch-up (as
        # the draft's own draft time, a fresh head's first iteration after lookup-first ones
        # carried its catch-up over the whole prompt, ~15 ms, and that one timing closed the
        # gate on it for the rest of the request)
        self._prev = rec.draft
        self.stats.records.append(rec)
        return rec

    def _forced_room(self) -> int:
        """How many forced tokens the next verify takes: up to FORCED_MAX where the token
        buffer (sized for gamma forced tokens and gamma more) leaves room for the lookup's
        chain after them, never fewer than gamma."""
        room = self._cap - len(self.tokens) - self.engine.gamma - 1
        return max(self.engine.gamma, min(FORCED_MAX, room))

    def _lookup_matches(self) -> bool:
        """A model draft's iteration runs the lookup alone instead (a verify, no draft
        steps; recorded as the lookup's): the context ends with a suffix of at least
        ``LOOKUP_FIRST`` tokens seen before. There the lookup proposes first anyway, so the
        draft's steps buy only the tokens after its chain ends, and on a 2-core CPU they
        cost more than they bring (dev, in process: general-static 8% faster). Oracle
        plans choose their own iterations (``propose``), and the draft catches up on the
        skipped tokens at its next iteration, as its own draft time."""
        if not self._lookup_first or self.propose is not None:
            return False
        if self.constraint is not None:  # under a grammar, the lookup in every model
            return True  # draft's place on a CPU (dev, in process, 10 prompts of `bench
            # json`: lookup 1.35x constrained target-only, the general head 1.28x, the head
            # with LOOKUP_FIRST 1 1.28x: inside JSON strings the heads accept less)
        ng = self._ngrams
        assert ng is not None  # (LOOKUP_FIRST is on only with the lookup)
        return ng.match(self.tokens[-ng.n_max:]) >= self._lookup_first

    def _target_step(self, t0: float) -> IterationRecord:
        L = len(self.tokens)
        logits = self.engine.target.forward(self._tok[L - 1:L], L - 1, self._tcache)
        tok = self._pick(logits[-1])
        self._sync()
        emitted = self._commit([tok], logits[-1:])
        t1 = time.perf_counter()  # after the commit (streaming), as a speculative step's
        return IterationRecord(None, 0, 0, emitted, t0, t_verify=t1 - t0, context=L)

    def _lookup_step(self, t0: float, name: str = LOOKUP, store: Datastore | None = None,
                     forced: list[int] | None = None) -> IterationRecord:
        """A draft with no model: the context lookup (what followed the context's suffix
        before), then a resident datastore's continuation (what followed it in the domain's
        text), one proposal after another up to gamma while either finds one; none (or
        sampling) is a plain target step. Nothing runs but the verify. ``forced``: the
        grammar's forced tokens as the proposal instead."""
        ng, L = self._ngrams, len(self.tokens)
        props: list[int] = list(forced or [])
        led = False
        exact = self.propose  # (a datastore's table follows this very chain)
        depth = self._depth if store is None and exact is None else None  # (a datastore's
        match = 0  # chain: its own)
        if props:  # the grammar's tokens, then what the context lookup finds after them
            depth = None
            self.stats.forced += len(props)
            if ng is not None:  # (up to gamma of them: forced tokens cost no draft step)
                more, _ = led_chain(ng, None, self.tokens[-ng.n_max:] + props,
                                    self.engine.gamma)
                props += self._legal_after(props, more)
        elif self.params.greedy and (ng is not None or store is not None):
            tail = self.tokens[-tail_width(ng, store):]
            match = ng.match(tail) if ng is not None else 0
            k = exact(name, L - self.prompt_len) if exact is not None else \
                depth.choose(L, match) if depth else self.engine.gamma
            if k > 0:
                props, led = led_chain(ng, store, tail, min(k, self.engine.gamma))
                props = self._legal(props)
        if not props:
            rec = self._target_step(t0)
            rec.draft = name
            return rec
        t_draft_end = time.perf_counter()
        if self._tok_host is not None:  # the proposals where they would be committed: the
            self._tok_host[L:L + len(props)] = props  # verify reads one slice (later commits
            verify = self._tok[L - 1:L + len(props)]  # write over what is not accepted)
        else:
            verify = torch.cat([self._tok[L - 1:L],
                                torch.tensor(props, dtype=torch.long, device=self._dev)])
        logits = self.engine.target.forward(verify, L - 1, self._tcache)
        if self.constraint is not None:
            n, nxt = self._accept_constrained(props, logits)
        elif host_rows(logits):
            n, nxt = greedy_accept_host(props, logits)
        else:
            n_t, nxt_t = greedy_accept(verify[1:], logits)
            n, nxt = int(n_t), int(nxt_t)
        emitted = self._commit(props[:n] + [nxt], logits, checked=self.constraint is not None)
        self._sync()
        t1 = time.perf_counter()
        if depth is not None:
            depth.observe(len(props), n, match)
        return IterationRecord(name, len(props), n, emitted, t0, t_draft=t_draft_end - t0,
                               t_verify=t1 - t_draft_end, context=L, store_led=led,
                               match=match)

    def _draft_cache(self, bound: BoundDraft) -> _DraftCache:
        dc = self._drafts.get(bound.name)
        if dc is None or dc.generation != bound.generation:  # slot rewritten: old KV is garbage
            dc = _DraftCache(bound.generation, bound.new_cache(self.engine.max_len), 0)
            self._drafts[bound.name] = dc
        return dc

    def _spec_step(self, name: str, t0: float) -> IterationRecord:
        eng, g = self.engine, self.engine.gamma
        bound = eng.drafts[name]
        dc = self._draft_cache(bound)
        to_target = bound.to_target
        L = len(self.tokens)
        n_missing = L - dc.length
        head = bound.kind == HEAD_KIND
        draft = self._head_proposals(bound, dc, L) if head else \
            self._model_proposals(bound, dc, L)
        t_catch = time.perf_counter()
        # (re)activation: the draft's cache catches up on what it did not see through its
        # own last iteration (a switch, or target steps since: a gate's probe pays this)
        resumed = name != self._prev
        catch = t_catch - t0 if resumed else 0.0
        props: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        ng = self._ngrams
        tail = self.tokens[-ng.n_max:] if ng is not None else []
        stop, first = (self._head_stop, self._head_first) if head else (0.0, 0.0)
        limit = g if self.propose is None else \
            max(1, min(g, self.propose(name, L - self.prompt_len)))
        grammar = self.constraint
        legal: list[int] = []  # (under a grammar: the proposals so far, as ints)
        for i in range(limit):
            row = draft.logits[-1] if to_target is not None else draft.logits[-1, :eng.vocab]
            t_id: torch.Tensor | None = None  # the proposal as a target id
            if ng is not None:  # greedy: the context's own continuation, else the draft's
                tok = ng.propose(tail)
                d_idx = _lookup_index(tok, bound, self._dev)
                if d_idx is None and tok is not None and head:
                    # a head embeds target ids: it reads a looked-up token outside its
                    # (output) vocabulary as well as any other
                    t_id = torch.tensor([tok], dtype=torch.long, device=self._dev)
                elif d_idx is None:
                    if unsure(row, stop if i else first):
                        break
                    d_idx = argmax_index(row)
                    tok = int(d_idx) if to_target is None else int(to_target[d_idx])
                tail.append(tok)
            elif self.params.greedy:
                if unsure(row, stop if i else first):
                    break
                d_idx = argmax_index(row)
            else:  # sampling runs on the CPU generator: seeded runs repeat on any device
                q_sub = warp(row.cpu(), self.params)
                d_idx = torch.multinomial(q_sub, 1, generator=self.gen).to(self._dev)
                qs.append(self._to_target_space(q_sub, to_target))
            if t_id is None:
                t_id = d_idx if to_target is None else to_target[d_idx]
            if grammar is not None:  # a token the grammar forbids ends the proposal
                legal.append(int(t_id))
                if grammar.legal_prefix(legal) < len(legal):
                    break
            props.append(t_id)
            if i < limit - 1:
                draft.next(d_idx, t_id, L + i)
        if not props:  # its first proposal illegal (a grammar) or unsure (head.FIRST): a
            rec = self._target_step(t0)  # target step after the draft's own pass, booked
            own = t_catch - t0  # as its iterations' are, so the gate prices it
            rec.draft, rec.t_draft, rec.t_catchup = name, own - catch, catch
            rec.catchup_tokens = n_missing if resumed else 0
            rec.t_verify -= own
            return rec
        prop = torch.cat(props)
        self._sync()
        t_draft_end = time.perf_counter()
        verify = torch.cat([self._tok[L - 1:L], prop])
        logits = eng.target.forward(verify, L - 1, self._tcache)
        if grammar is not None:
            proposals = prop.tolist()
            n, nxt = self._accept_constrained(proposals, logits)
        elif self.params.greedy and host_rows(logits):
            proposals = prop.tolist()
            n, nxt = greedy_accept_host(proposals, logits)
        elif self.params.greedy:
            n_t, nxt_t = greedy_accept(prop, logits)
            n, nxt, *proposals = torch.cat([n_t.view(1), nxt_t.view(1), prop]).tolist()
        else:  # (the iteration's one host sync, above)
            p = warp(logits, self.params).cpu()
            proposals = prop.tolist()
            n, nxt = speculative_accept(prop.cpu(), torch.stack(qs).cpu(), p, self.gen)
        emitted = self._commit(proposals[:n] + [nxt], logits, checked=grammar is not None)
        # a head keeps only positions it saw with the target's features (re-run the accepted
        # ones next time, as EAGLE does); a model draft keeps its accepted proposals
        dc.length = L if head else min(L + min(n, limit - 1), len(self.tokens) - 1)
        self._sync()
        t1 = time.perf_counter()
        return IterationRecord(name, len(proposals), n, emitted, t0,
                               t_draft=(t_draft_end - t0) - catch,
                               t_verify=t1 - t_draft_end, t_catchup=catch,
                               catchup_tokens=n_missing if resumed else 0, context=L)

    def _model_proposals(self, bound: BoundDraft, dc: _DraftCache, L: int) -> _Proposer:
        """An independent draft model: catch up on committed tokens, then self-feed."""
        missing = self._tok[dc.length:L]
        if bound.to_draft is not None:
            missing = bound.to_draft[missing]
        runner = bound.runner
        out = _Proposer(runner.forward(missing, dc.length, dc.cache, last_only=True))
        dc.length = L
        self._sync()

        def nxt(d_idx: torch.Tensor | None, t_id: torch.Tensor, pos: int) -> None:
            out.logits = runner.forward(d_idx, pos, dc.cache)

        out.next = nxt
        return out

    def _head_proposals(self, bound: BoundDraft, dc: _DraftCache, L: int) -> _Proposer:
        """A head: committed tokens with the target's features of the positions before them,
        then its own outputs in place of features for its proposals."""
        head = bound.runner
        start = dc.length
        feats = self._tfeat(start - 1, L - 1)
        logits, hidden = head.teacher(self._tok[start:L], start, dc.cache, feats)
        out = _Proposer(logits)
        dc.length = L
        self._sync()
        state = {"hidden": hidden}

        def nxt(d_idx: torch.Tensor | None, t_id: torch.Tensor, pos: int) -> None:
            out.logits, state["hidden"] = head.step(t_id, pos, dc.cache, state["hidden"])

        out.next = nxt
        return out

    def _tfeat(self, first: int, end: int) -> torch.Tensor:
        """The target's feature rows for positions first..end-1 (position -1: zeros)."""
        feat = getattr(self._tcache, "feat", None)
        if feat is None:
            raise RequestError("a head draft needs the target's features",
                               "run the target in a lean dtype (not float32) with heads")
        rows = feat[max(first, 0):end]
        if first < 0:
            rows = torch.cat([torch.zeros_like(feat[:1]), rows])
        return rows

    def _to_target_space(self, q_sub: torch.Tensor, to_target: torch.Tensor | None) -> torch.Tensor:
        V = self.engine.vocab
        if to_target is None and q_sub.numel() == V:
            return q_sub
        q = torch.zeros(V, dtype=q_sub.dtype, device=q_sub.device)
        if to_target is None:
            k = min(V, q_sub.numel())
            q[:k] = q_sub[:k]
        else:
            q[to_target.to(q.device)] = q_sub
        return q
