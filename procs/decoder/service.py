"""The decoder's side of the scheduling loop: requests in, the engine and slot memory below.

`DecoderService` turns a Submit into a `Job` for the shared loop (procs/decoder/sched/loop.py):
prompt ids, the policy (with an oracle plan from traced tables when asked), and an engine
Session as the loop's Executor. Tokens stream out as the engine commits them and a Done
follows the last interval. A request that cannot be served (bad prompt, an oracle without
tables, sampling an oracle) gets an Error reply; an exception from the engine is not
caught here: the process dies and the supervisor restarts it, because a failed forward
may have left the engine's state corrupt.

A request the supervisor resumes after a crash (`Submit.resume_ids`, launch/resume.py) is
decoded on from the tokens its client has: they are prefilled after the prompt (the greedy
output depends only on the token ids, so it goes on exactly as it would have), the stream's
text state is rebuilt from them (`_Output.prime`: incremental detokenisation and stop
strings pick up at the cut) and the text the client has not yet received is sent first.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memspec.common.config import ORACLE_POLICIES, PoolConfig
from memspec.common.draftfiles import draft_weights_file
from memspec.common.errors import MemspecError, ModelError, RequestError
from memspec.common.limits import check_request, echo_id, rank_text
from memspec.common.manifest import NAME as MANIFEST
from memspec.common.manifest import WeightsEntry, read_manifest, verify, weights_entry
from memspec.common.messages import (
    ChatTurn,
    Done,
    Error,
    ErrorKind,
    Load,
    Message,
    Submit,
    TokenLogprob,
    Tokens,
    ToolCall,
    chat_text,
)
from memspec.common.metrics import IterationRecord, RunStats, Summary
from memspec.common.paths import memspec_home
from memspec.common.safetensors_layout import Layout, read_layout
from memspec.common.toolcalls import (
    CLOSE,
    OPEN,
    call_schema,
    check_template,
    parse_calls,
    parse_tools,
    reads_calls,
)
from memspec.procs.decoder.detok import StreamDecoder, logprob_entries
from memspec.procs.decoder.drafts.head import is_head, scored_rows
from memspec.procs.decoder.engine import Session, SpecEngine
from memspec.procs.decoder.forward.threads import ThreadPlan
from memspec.procs.decoder.models import check_template_roles, encode_chat, encode_prompt
from memspec.procs.decoder.oracle.calibration import gate_costs as calibrated_gate_costs
from memspec.procs.decoder.oracle.draft_prices import price_drafts
from memspec.procs.decoder.oracle.oracle import (
    OracleIndex,
    PlanCostMeter,
    exact_depth,
    make_plan,
    oracle_index,
    plan_costs,
    prompt_tables,
)
from memspec.procs.decoder.oracle.tablefiles import runtime_key, traced_sets
from memspec.procs.decoder.sched.acceptance import SamplingParams
from memspec.procs.decoder.sched.constraint import Constraint, GrammarTokenizer
from memspec.procs.decoder.sched.gate import GateCosts
from memspec.procs.decoder.sched.loop import Channels, Controller, Job, Overhead
from memspec.procs.decoder.sched.policies import make_policy
from memspec.procs.decoder.slots import ID_MAP_KEY, SlotBuffer, bind_draft
from memspec.procs.decoder.stops import StopMatcher

Emit = Callable[[Message], None]
# a test hook: a decoder whose environment sets this kills itself (SIGKILL) during any
# request whose prompt or chat holds the value, after its first tokens (tests/test_faults.py)
CRASH_ON_ENV = "MEMSPEC_TEST_CRASH_ON"
# tokens stream out at most this often after the first ones (and always at the end): each
# message is a detokenisation here and a wake-up of the supervisor and the client on the
# decoder's cores (measured on 2 cores: per-interval messages cost ~7 ms of scheduling a
# 128-token request and ~1% on each step), while 50 ms is below what a reader notices
STREAM_EVERY_S = 0.05


LOG = logging.getLogger(__name__)
log = LOG.info  # the loop's own notes (procs/decoder/sched/loop.py) too


class MonotonicClock:
    """Real time (the engine stamps iterations with the same perf_counter)."""

    def now(self) -> float:
        return time.perf_counter()

    def overhead(self, kind: Overhead) -> None:
        pass


@dataclass
class DraftFile:
    path: Path
    layout: Layout
    entry: WeightsEntry  # header and tensor ranges: what the loader checks while copying

    def fill(self, buf: SlotBuffer, name: str) -> None:
        """Read the data section into `buf` in this process and check its bytes as the
        loader does (start-up only: a request's loads go through the loader)."""
        buf.fill_from_file(self.layout)
        self.entry.check_bytes(buf.data[:self.layout.data_size].cpu().numpy(), f"draft '{name}'")


def open_drafts(pool: PoolConfig, target_vocab: int
                ) -> tuple[dict[str, DraftFile], dict[str, str]]:
    """Every draft checked once at start, against its manifest when it has one (a full read
    of its files, as the loader's later copies are); a draft that fails is quarantined with
    a one-line reason and the rest serve. A draft without a manifest is measured now, so a
    later change of its bytes is still caught, and said once."""
    files: dict[str, DraftFile] = {}
    quarantined: dict[str, str] = {}
    for d in pool.drafts:
        try:
            path = draft_weights_file(d.path)
            layout = read_layout(path)
            man = read_manifest(d.path)
            if man is None:
                LOG.warning(f"draft '{d.name}' has no {MANIFEST}: checked against its bytes at start "
                    f"only (write one: memspec manifest {d.path})")
                entry = weights_entry(path, path.name)
            else:
                entry = man.entry(path)
                entry.check_layout(layout)
                verify(man)
            check_vocab(d.name, d.path, layout, target_vocab)
        except MemspecError as exc:
            quarantined[d.name] = exc.problem
            LOG.warning(f"draft '{d.name}' quarantined: {exc.problem}")
            continue
        files[d.name] = DraftFile(path, layout, entry)
    return files, quarantined


def prepare_heads(engine: SpecEngine, pool: PoolConfig, files: dict[str, DraftFile]) -> None:
    """The target's LM rows for each head's draft vocabulary, built at start (one id map
    read from each head's file) rather than at a request's first bind."""
    from safetensors import safe_open

    maps: dict[tuple[int, int], Any] = {}  # id maps, one per distinct map
    for name, f in files.items():
        if not is_head(pool.draft(name).path):
            continue
        try:
            with safe_open(str(f.path), framework="pt") as sf:
                to_target = sf.get_tensor(ID_MAP_KEY)
        except Exception:  # noqa: BLE001 - a bad file is the bind's to report, as before
            continue
        to_target = scored_rows(to_target)  # the rows a bind will build
        maps.setdefault((to_target.numel(), int(to_target.sum())), to_target)
    for to_target in maps.values():
        engine.target_parts.prepare(to_target)


def verify_target(target: Path) -> None:
    """The target's files against its manifest (written by `memspec zoo target`), hashed
    once per change of a file: a corrupt target is an error at start, never decoded with."""
    man = read_manifest(target)
    if man is None:
        LOG.warning(f"target {target} has no {MANIFEST}: its bytes are not checked "
            f"(write one: memspec manifest {target})")
        return
    verify(man, stamps=memspec_home() / "verified.json")


def check_vocab(name: str, model_dir: Path, layout: Layout, target_vocab: int) -> None:
    """A draft proposes target token ids: either through its id map or because its
    vocabulary covers the target's (extra rows are never proposed)."""
    tensors = {t.name: t for t in layout.tensors}
    if ID_MAP_KEY in tensors or is_head(model_dir):
        return  # the map is checked against the target when the draft is bound
    embed = tensors.get("model.embed_tokens.weight") or tensors.get("lm_head.weight")
    if embed is not None and embed.shape and embed.shape[0] < target_vocab:
        raise ModelError(f"draft '{name}' has a vocabulary of {embed.shape[0]} tokens, the "
                         f"target {target_vocab}, and no id map ({ID_MAP_KEY})",
                         "train it on the target's vocabulary or remove it from the pool")


class EngineSlots:
    """Slot memory shared with the loader; a landed draft is bound as views into its slot."""

    def __init__(self, pool: PoolConfig, engine: SpecEngine, buffers: list[SlotBuffer],
                 handles: list[str], transport: str, files: dict[str, DraftFile],
                 bandwidth_bytes_s: float = 0.0) -> None:
        self.pool, self.engine, self.buffers = pool, engine, buffers
        self.handles, self.transport, self.files = handles, transport, files
        self.bandwidth = bandwidth_bytes_s

    def load_request(self, slot: int, generation: int, draft: str) -> Load:
        f = self.files[draft]
        return Load(slot=slot, generation=generation, draft=draft, path=str(f.path),
                    transport=self.transport, handle=self.handles[slot],
                    capacity=self.buffers[slot].capacity, storage=self.pool.storage,
                    bandwidth_bytes_s=self.bandwidth, header_sha256=f.entry.header_sha256,
                    ranges=list(f.entry.ranges))

    def bind(self, slot: int, generation: int, draft: str) -> None:
        buf = self.buffers[slot]
        buf.generation, buf.draft = generation, draft
        bound = bind_draft(draft, self.pool.draft(draft).path, buf, self.files[draft].layout,
                           target_vocab=self.engine.vocab, parts=self.engine.target_parts)
        self.engine.add_draft(bound)

    def unbind(self, draft: str) -> None:
        self.engine.remove_draft(draft)


class SessionExecutor:
    """An engine Session as the loop's Executor; `stopped` ends it early (a stop string).
    A resumed request's tokens from before the crash (`prior`) count as generated for the
    predictor's recent window."""

    def __init__(self, session: Session, prior: list[int] | None = None) -> None:
        self.session = session
        self.stats: RunStats = session.stats
        self.stopped = False
        self.prior = prior or []

    @property
    def done(self) -> bool:
        return self.session.done or self.stopped

    def step(self, draft: str | None, desired: bool) -> IterationRecord:
        return self.session.step(draft, desired=desired)

    def recent(self, n: int) -> list[int]:
        return (self.prior + self.session.generated)[-n:] if n > 0 else []


class _Output:
    """What a request streams: text decoded incrementally and, with stop strings, cut at
    the first one (the tokens after the one that completed it are not reported)."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.detok = StreamDecoder(tokenizer)
        self.stops = StopMatcher(stops) if stops else None
        self.kept = 0  # tokens reported (by this decoder)
        self.pending: list[int] = []  # committed, to be reported at the interval's end
        self.sent_at = 0.0  # perf_counter() of the last Tokens message
        self.pieces: list[str] = []
        self.executor: SessionExecutor | None = None
        self.prior: list[int] = []  # a resumed request's tokens from before the crash
        self.owed = ""  # their text the client has not received

    def prime(self, prior: list[int], client_chars: int) -> None:
        """Resume after `prior`, of which the client has `client_chars` characters of text:
        the detokeniser and the stop strings take them token by token, as a request's
        stream with stop strings does, so the text they let out is what this stream would
        have sent by then; what of it the client lacks (text a dead decoder held back, or
        decoded but never sent) is owed, and goes out with the next tokens."""
        self.prior = list(prior)
        released = ""
        for tok in prior:
            piece = self.detok.push([tok])
            released += self.stops.push(piece) if self.stops is not None else piece
            if self.hit:
                break
        if self.stops is not None:
            self.pieces.append(released)
        self.owed = released[client_chars:]

    def take_owed(self, text: str) -> str:
        owed, self.owed = self.owed, ""
        return owed + text

    def push(self, new: list[int]) -> tuple[list[int], str]:
        if self.stops is None:
            self.kept += len(new)
            return new, self.detok.push(new)
        kept: list[int] = []
        text = ""
        for tok in new:
            if self.stops.hit:
                break
            kept.append(tok)
            text += self.stops.push(self.detok.push([tok]))
        if self.stops.hit and self.executor is not None:
            self.executor.stopped = True
        self.kept += len(kept)
        self.pieces.append(text)
        return kept, text

    def flush(self) -> str:
        rest = self.detok.flush()
        if self.stops is not None:
            rest = self.stops.push(rest) + self.stops.flush()
            self.pieces.append(rest)
        return self.take_owed(rest)

    @property
    def hit(self) -> bool:
        return self.stops is not None and self.stops.hit


@dataclass
class _Current:
    req: Submit
    emit: Emit
    session: Session
    out: _Output
    prompt_len: int  # the prompt's tokens (a resumed request's session holds more)


def _turn(m: ChatTurn) -> dict:
    """A chat turn as the template reads it (an assistant turn's calls with their
    arguments as objects, as Hermes templates render them)."""
    turn: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = json.loads(m.tool_calls)
        for c in calls:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    pass
        turn["tool_calls"] = calls
    return turn


def _request_text(req: Submit) -> str:
    return req.prompt + "".join(m.content for m in req.messages)


class DecoderService:
    """At most one request on the loop; `step` is one scheduling interval of it."""

    def __init__(self, pool: PoolConfig, engine: SpecEngine, tokenizer: Any,
                 slots: EngineSlots, channels: Channels, cold_start: bool = False,
                 quarantined: dict[str, str] | None = None,
                 gate_costs: GateCosts | None = None, oracle_tables: bool = True) -> None:
        self.pool, self.engine, self.tokenizer = pool, engine, tokenizer
        self.clock = MonotonicClock()
        self.controller = Controller(
            [d.name for d in pool.drafts], pool.general, len(slots.buffers), pool.N, pool.T,
            self.clock, channels, slots, cold_start=cold_start, log=log)
        self.controller.table.failed.update(quarantined or {})  # found at start
        self.current: _Current | None = None
        self.K = len(slots.buffers)
        self.slots = slots
        # what the speculation gate believes an iteration costs, from this decoder's first
        # request on: the target and each draft shape's steps timed at start (cached per
        # machine and build), refined by each request's own iterations
        self.gate_costs = gate_costs if gate_costs is not None else self._calibrate()
        self._plan_prior = plan_costs(pool, {d: f.layout.data_size for d, f in slots.files.items()},
                                      self.gate_costs)
        # oracle-dynamic's beliefs, learnt per policy: no policy learns from another's requests
        self.plan_meters: dict[str, PlanCostMeter] = {}
        # the oracle policies' tables, read at start where this pool was traced (a benchmark
        # machine; ~2 ms a traced prompt, seconds for every set, which the first oracle
        # request would otherwise pay on its clock); elsewhere, or where `oracle_tables` is
        # False (a private run of one request of another policy), on the first oracle request
        self._oracles: OracleIndex | None = self._oracle_index() \
            if oracle_tables and traced_sets(pool, runtime_key(pool, engine.device)) else None
        if self.gate_costs is not None and self.gate_costs.verify is not None:
            engine.depth_costs = (self.gate_costs.target, self.gate_costs.verify)
        self.crash_on = os.environ.get(CRASH_ON_ENV, "")
        self._grammar: GrammarTokenizer | None = None  # built at the first constrained request

    def _constraint(self, req: Submit, prior: list[int], tools: list[dict] | None
                    ) -> Constraint | None:
        """The request's output grammar (a response format, or a tool call the tool_choice
        demands), advanced past a resumed request's earlier tokens."""
        must_call = tools is not None and req.tool_choice not in ("", "auto")
        if not req.response_format and not must_call:
            return None
        if self._grammar is None:
            t0 = time.perf_counter()
            self._grammar = GrammarTokenizer.of(self.tokenizer, self.engine.vocab,
                                                self.engine.eos_ids)
            log(f"grammar vocabulary built ({time.perf_counter() - t0:.2f}s)")
        constraint = self._grammar.compile_tool_call(
            call_schema(tools, req.tool_choice), OPEN, CLOSE) if must_call \
            else self._grammar.compile(req.response_format, req.json_schema)
        constraint.commit(prior)
        return constraint

    def _tools(self, req: Submit) -> list[dict] | None:
        """The tools to render, where the request offers them and may call them; the
        target's template must take them and write calls the server reads back."""
        if not reads_calls(req.tools, req.tool_choice):
            return None
        check_template(getattr(self.tokenizer, "chat_template", None))
        return parse_tools(req.tools)

    def _oracle_index(self) -> OracleIndex:
        t0 = time.perf_counter()
        index = oracle_index(self.pool, runtime_key(self.pool, self.engine.device))
        log(f"oracle tables for {len(index)} traced prompts ({time.perf_counter() - t0:.2f}s)")
        return index

    def _calibrate(self) -> GateCosts | None:
        numerics = runtime_key(self.pool, self.engine.device)
        try:
            costs = calibrated_gate_costs(self.engine, self.pool, numerics, log)
        except (RuntimeError, ValueError, OSError) as exc:  # an engine that cannot be timed
            LOG.warning(f"no start-up calibration ({exc}); the speculation gate is off")
            return None
        buffers = self.slots.buffers
        try:  # each draft shape's steps (a slot is empty before the first load)
            return price_drafts(costs, self.engine, self.pool, buffers[0] if buffers else None,
                                self.slots.files, numerics, log)
        except (MemspecError, RuntimeError, ValueError, OSError) as exc:
            LOG.warning(f"drafts not timed at start ({exc}); priced at a fifth of a target "
                        "step a draft step until a request runs them")
            return costs

    def preload(self, draft: str) -> bool:
        """Make `draft` resident before the first request (read and checked here, at start):
        a fresh decoder's first request can then probe it at once instead of paying a load
        on its own clock, and the gate loads nothing more until a draft pays."""
        table = self.controller.table
        if draft not in self.slots.files or table.where(draft) is not None:
            return False
        slot = table.begin_load(draft)
        if slot is None:
            return False
        try:
            self.slots.files[draft].fill(self.slots.buffers[slot.index], draft)
            self.slots.bind(slot.index, slot.generation, draft)
        except MemspecError as exc:
            table.release(slot)
            LOG.warning(f"draft '{draft}' not preloaded: {exc}")
            return False
        table.complete(slot.index, slot.generation, draft)
        return True

    @property
    def busy(self) -> bool:
        return self.current is not None

    def start(self, req: Submit, emit: Emit) -> None:
        """Open a request; one that cannot be served is answered with an Error at once."""
        try:
            self._start(req, emit)
        except MemspecError as exc:
            self.current = None
            self.controller.abort(req.req_id)
            emit(Error(req_id=echo_id(req.req_id), message=str(exc), kind="request"))

    def _start(self, req: Submit, emit: Emit) -> None:
        t_start = self.clock.now()
        check_request(req)  # the front doors' limits, again: nothing unchecked is tokenised
        check_template_roles(self.tokenizer, req.messages)
        policy_name = req.policy or self.pool.policy
        params = SamplingParams(req.temperature, req.top_p, req.seed, req.top_k, req.min_p)
        tools = self._tools(req)
        turns = req.messages or ([ChatTurn(role="user", content=req.prompt)] if tools else [])
        ids = (encode_chat(self.tokenizer, [_turn(m) for m in turns], tools)
               if turns else encode_prompt(self.tokenizer, req.prompt))
        max_new = req.max_new_tokens or self.pool.max_new_tokens
        prior = list(req.resume_ids)
        if prior:
            self._check_resume(prior, max_new)
            if policy_name in ORACLE_POLICIES:  # its plan is for the prompt alone: the
                policy_name = "target-only"  # same greedy tokens, without the plan
        constraint = self._constraint(req, prior, tools)
        out = _Output(self.tokenizer, req.stop)
        out.prime(prior, req.resume_chars)
        if prior and (len(prior) >= max_new or prior[-1] in self.engine.eos_ids or out.hit):
            self._done_at_once(req, emit, out, len(ids), policy_name, t_start)
            return
        prompt_len = len(ids)
        ids = ids + prior
        max_new -= len(prior)
        # every snapshot carries the predictor's text: cut once to what it reads
        ranked = rank_text(req.prompt or chat_text(req.messages))
        if constraint is not None and self.engine.lookup_first and params.greedy \
                and policy_name != "target-only":
            # under a grammar on a CPU the lookup runs in every model draft's place
            # (engine.Session._lookup_matches): rankings and loads would be spent for
            # nothing, so a drafting policy is served, and reported, as lookup-only
            policy_name = "lookup-only"
        plan = propose = None
        costs = None  # (only oracle-dynamic has beliefs about costs: no other request pays
        if policy_name == "oracle-dynamic":  # for fitting them, ~1 ms with full windows)
            meter = self.plan_meters.get(policy_name)
            if meter is None:
                meter = self.plan_meters[policy_name] = PlanCostMeter(self._plan_prior,
                                                                      gamma=self.pool.gamma)
            costs = meter.costs(self.controller.load_seconds)
        if policy_name in ORACLE_POLICIES:
            if self._oracles is None:
                self._oracles = self._oracle_index()
            tables = prompt_tables(self._oracles, policy_name, ids, params.greedy,
                                   self.engine.lookup, self.pool.gamma)
            plan = make_plan(policy_name, tables, self.pool.gamma, self.pool.N,
                             lambda: len(self.current.session.generated) if self.current else 0,
                             self.K, costs, len(ids))
            if policy_name == "oracle-dynamic" and costs is not None and costs.row > 0:
                propose = exact_depth(tables, self.pool.gamma)  # (as its plan prices them)
        ucb_c = self.pool.ucb_c if req.ucb_c is None else req.ucb_c
        gate = self.pool.spec_gate if req.gate is None else req.gate
        threads = self.controller.on_helpers
        if isinstance(threads, ThreadPlan):  # (a CPU decoder's; every request sets its own)
            threads.limit(req.threads)
        policy = make_policy(policy_name, ucb_c=ucb_c, oracle_plan=plan, costs=costs,
                             gate=gate, gate_costs=self.gate_costs,
                             lookup=bool(self.engine.lookup),
                             lookup_first=bool(self.engine.lookup_first and params.greedy),
                             rank_horizon=(self.pool.rank_horizon if req.rank_horizon is None
                                           else req.rank_horizon))

        def stream(new: list[int]) -> None:
            """The first tokens and, with stop strings, every commit go out at once (time to
            first token; a stop ends the request where it completes); the rest at a
            scheduling point at most every STREAM_EVERY_S (`step`): fewer messages,
            detokenisations and relays keep the decoder's cores on decoding."""
            if out.kept == 0 or out.stops is not None:
                ids, text = out.push(new)
                text = out.take_owed(text)
                if ids or text:
                    emit(Tokens(req_id=req.req_id, ids=ids, text=text,
                                logprobs=self._logprobs(out, len(ids))))
                    out.sent_at = time.perf_counter()
            else:
                out.pending.extend(new)

        def prefill(between: Callable[[], bool] | None) -> SessionExecutor:
            """The target prefills while the initial loads run (the loop calls this); a
            request the engine refuses (too long, bad ids) raises its RequestError here."""
            session = self.engine.start(ids, max_new, params, stream, between,
                                        constraint=constraint, logprobs=req.logprobs)
            session.propose = propose
            session.force_ahead = policy_name != "target-only"  # (the baseline: no proposals)
            out.executor = SessionExecutor(session, prior)
            self.current = _Current(req, emit, session, out, prompt_len)
            return out.executor

        self.controller.start(Job(req.req_id, ranked, policy, None, t_start,
                                  trace=req.trace, prefill=prefill, max_new_tokens=max_new,
                                  chunks=self.engine.exact_chunks))

    def step(self) -> None:
        """One scheduling interval of the running request; its Done after the last one."""
        cur = self.current
        if cur is None:
            return
        summary = self.controller.step()
        out = cur.out
        t0 = time.perf_counter()
        if out.pending and (summary is not None or t0 - out.sent_at >= STREAM_EVERY_S):
            ids, text = out.push(out.pending)
            out.pending = []
            if ids or text:
                cur.emit(Tokens(req_id=cur.req.req_id, ids=ids, text=text,
                                logprobs=self._logprobs(out, len(ids))))
                out.sent_at = t0
            if summary is None:  # streaming is scheduling-point work (a Done is after e2e)
                cur.session.stats.t_sched += time.perf_counter() - t0
        if self.crash_on and out.kept and self.crash_on in _request_text(cur.req):
            LOG.error(f"{CRASH_ON_ENV}: killing the decoder during request {cur.req.req_id}")
            os.kill(os.getpid(), signal.SIGKILL)
        if summary is None:
            return
        self.current = None
        meter, stats = self.plan_meters.get(summary.policy), cur.session.stats
        if meter is not None:
            meter.observe(stats.records)
            meter.observe_binds(stats.loads, stats.t_bind)  # what binding a landed draft costs
            meter.observe_prefill(cur.prompt_len, stats.t_prefill, loads=stats.prefill_loads)
            meter.observe_points(stats.points, stats.t_sched)
        summary.prompt_tokens = cur.prompt_len
        self._done(cur.req, cur.emit, out, cur.session.generated[:out.kept], summary)

    def _done(self, req: Submit, emit: Emit, out: _Output, new: list[int],
              summary: Summary) -> None:
        """The request's Done: every token and the whole text, those from before a crash
        included (after the text still held back or owed to the client)."""
        rest = out.flush()  # text held back for an incomplete character at the end
        if rest:
            emit(Tokens(req_id=req.req_id, ids=[], text=rest))
        ids = out.prior + new
        text = ("".join(out.pieces) if out.stops is not None
                else self.tokenizer.decode(ids, skip_special_tokens=True))
        ended = out.hit or (bool(ids) and ids[-1] in self.engine.eos_ids)
        summary.resumed_tokens = len(out.prior)
        summary.generated_tokens += len(out.prior)
        calls: list[ToolCall] = []
        if reads_calls(req.tools, req.tool_choice):  # the calls read back, the rest content
            text, found = parse_calls(text)
            calls = [ToolCall(id=i, name=n, arguments=a) for i, n, a in found]
        emit(Done(req_id=req.req_id, text=text, token_ids=ids, stats=summary,
                  finish_reason="tool_calls" if calls else "stop" if ended else "length",
                  logprobs=self._logprobs(out, out.kept, end=True), tool_calls=calls))

    def _logprobs(self, out: _Output, n: int, end: bool = False) -> list[TokenLogprob]:
        """The log-probabilities of the `n` tokens just reported (`end`: of every token
        reported), where the request asked for them."""
        session = out.executor.session if out.executor is not None else None
        if not n or session is None or session.logprobs is None:
            return []
        first = 0 if end else out.kept - n
        return logprob_entries(self.tokenizer, session.token_logprobs[first:first + n])

    def _check_resume(self, prior: list[int], max_new: int) -> None:
        if len(prior) > max_new:
            raise RequestError(f"resume_ids holds {len(prior)} tokens, over the request's "
                               f"budget of {max_new}", "send at most max_new_tokens")
        if any(t >= self.engine.vocab for t in prior):
            raise RequestError("resume_ids has token ids outside the target's vocabulary",
                               f"use ids in [0, {self.engine.vocab})")

    def _done_at_once(self, req: Submit, emit: Emit, out: _Output, prompt_len: int,
                      policy: str, t_start: float) -> None:
        """A resumed request whose tokens before the crash already ended it (its Done was
        lost with the decoder): nothing to decode."""
        stats = RunStats(prompt_tokens=prompt_len)
        stats.t_e2e = self.clock.now() - t_start
        summary = stats.report()
        summary.policy = policy
        self._done(req, emit, out, [], summary)

    def abort(self, req_id: str, reason: str = "aborted", kind: ErrorKind = "") -> bool:
        """Stop the running request `req_id` at this scheduling point with an Error reply."""
        cur = self.current
        if cur is None or cur.req.req_id != req_id:
            return False
        self.controller.abort(req_id)
        self.current = None
        cur.emit(Error(req_id=req_id, message=reason, kind=kind))
        return True
