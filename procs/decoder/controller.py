"""The MemSpec runtime loop (paper Alg. 3) around the engine, for one request at a time.

Every N iterations: send a snapshot to the predictor, take the newest ranking that has
arrived, let the policy (and its cache manager, Alg. 2) decide loads and evictions, and run
the best *resident* draft. Loads complete in the loader process; the decoder only learns
of them at scheduling points and never waits for one (mab-sync is the one policy that
chooses to block, which is what it is there to show).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from memspec.common.config import PoolConfig
from memspec.common.errors import MemspecError, RequestError
from memspec.common.messages import (
    Cancel,
    Done,
    Error,
    Load,
    Loaded,
    LoadFailed,
    Message,
    PeerRestarted,
    Ranking,
    Snapshot,
    Submit,
    Tokens,
)
from memspec.common.metrics import RunStats
from memspec.common.safetensors_layout import Layout, read_layout
from memspec.procs.decoder.acceptance import SamplingParams
from memspec.procs.decoder.engine import Session, SpecEngine
from memspec.procs.decoder.models import encode_prompt
from memspec.procs.decoder.oracle import make_plan
from memspec.procs.decoder.policies import Decision, Policy, SchedView, make_policy
from memspec.procs.decoder.residency import Slot, SlotState, SlotTable
from memspec.procs.decoder.slots import SlotBuffer, bind_draft, draft_weights_file

INITIAL_RANKING_TIMEOUT_S = 2.0
ORACLE_POLICIES = ("oracle-static", "oracle-dynamic")
Emit = Callable[[Message], None]


class Channels(Protocol):
    """How the controller reaches the loader and predictor (sockets in the real process)."""

    def send(self, msg: Message) -> None: ...

    def poll(self, timeout_ms: int) -> list[Message]: ...

    def heartbeat(self, state: str) -> None: ...


@dataclass
class DraftFile:
    path: Path
    layout: Layout
    sha256: str


def _log(msg: str) -> None:
    print(f"[decoder] {msg}", file=sys.stderr, flush=True)


class Controller:
    def __init__(self, pool: PoolConfig, engine: SpecEngine, tokenizer: Any,
                 slot_buffers: list[SlotBuffer], handles: list[str], transport: str,
                 channels: Channels, files: dict[str, DraftFile],
                 bandwidth_bytes_s: float = 0.0, cold_start: bool = False) -> None:
        self.pool, self.engine, self.tokenizer = pool, engine, tokenizer
        self.buffers, self.handles, self.transport = slot_buffers, handles, transport
        self.channels, self.files = channels, files
        self.bandwidth = bandwidth_bytes_s
        self.cold_start = cold_start
        self.table = SlotTable.create(len(slot_buffers))
        self.scores: dict[str, float] | None = None
        self._rank_seq: dict[str, int] = {}
        self._stats: RunStats | None = None
        self._events: list[list] | None = None  # [t, "load"|"loaded"|"failed", draft, slot]
        self._t0 = 0.0
        self._oracle_index: dict[tuple[int, ...], dict[str, list[int]]] | None = None
        self.on_slots_changed: Callable[[], None] | None = None

    # ---- messages from loader / predictor / supervisor -----------------------------------
    def handle(self, msg: Message, req_id: str | None = None) -> None:
        if isinstance(msg, Loaded):
            self._on_loaded(msg)
        elif isinstance(msg, LoadFailed):
            slot = self.table.fail(msg.slot, msg.generation, msg.draft, msg.reason)
            if slot is not None:
                self._event("failed", msg.draft, msg.slot)
            if slot is not None and msg.reason != "cancelled":
                _log(f"draft '{msg.draft}' quarantined: {msg.reason}")
            self._changed()
        elif isinstance(msg, Ranking):
            if req_id is not None and msg.req_id == req_id \
                    and msg.seq >= self._rank_seq.get(req_id, -1):
                self._rank_seq[req_id] = msg.seq
                self.scores = dict(zip(msg.drafts, msg.scores))
        elif isinstance(msg, PeerRestarted) and msg.proc == "loader":
            self._reissue_loads()
        elif isinstance(msg, Error):
            _log(f"peer reported: {msg.message}")

    def _on_loaded(self, msg: Loaded) -> None:
        t_bind = time.perf_counter()
        slot = self.table.complete(msg.slot, msg.generation, msg.draft)
        if slot is None:
            _log(f"ignored stale completion slot={msg.slot} gen={msg.generation} ({msg.draft})")
            return
        buf = self.buffers[slot.index]
        buf.generation, buf.draft = slot.generation, msg.draft
        try:
            spec = self.pool.draft(msg.draft)
            bound = bind_draft(msg.draft, spec.path, buf, self.files[msg.draft].layout,
                               target_vocab=self.engine.vocab)
        except MemspecError as exc:
            self.table.failed[msg.draft] = str(exc)
            self.table.release(slot)
            _log(f"draft '{msg.draft}' quarantined: {exc}")
            self._changed()
            return
        self.engine.add_draft(bound)
        self._event("loaded", msg.draft, slot.index, msg.seconds, time.perf_counter() - t_bind)
        if self._stats is not None:
            self._stats.loads += 1
            self._stats.bytes_loaded += msg.nbytes
        self._changed()

    def _changed(self) -> None:
        if self.on_slots_changed:
            self.on_slots_changed()

    def _reissue_loads(self) -> None:
        for slot in self.table.slots:
            if slot.state == SlotState.LOADING and slot.draft:
                draft = slot.draft
                self.table.release(slot)
                new = self.table.begin_load(draft)
                if new is not None:
                    self._send_load(new)
        _log("loader restarted: pending loads re-issued")

    # ---- residency actions ---------------------------------------------------------------
    def _event(self, kind: str, draft: str, slot: int, *seconds: float) -> None:
        """Trace entry [t, kind, draft, slot, *seconds] (loaded: load and bind seconds)."""
        if self._events is not None:
            self._events.append([time.perf_counter() - self._t0, kind, draft, slot, *seconds])

    def _send_load(self, slot: Slot) -> None:
        self._event("load", slot.draft or "", slot.index)
        f = self.files[slot.draft or ""]
        self.channels.send(Load(
            slot=slot.index, generation=slot.generation, draft=slot.draft or "", path=str(f.path),
            transport=self.transport, handle=self.handles[slot.index],
            capacity=self.buffers[slot.index].capacity, storage=self.pool.storage,
            bandwidth_bytes_s=self.bandwidth, expected_sha256=f.sha256))

    def evict(self, draft: str) -> None:
        slot = self.table.where(draft)
        if slot is None:
            return
        if slot.state == SlotState.LOADING:
            self.channels.send(Cancel(slot=slot.index, generation=slot.generation))
        else:
            self.engine.remove_draft(draft)
            if self._stats is not None:
                self._stats.evictions += 1
        self.table.release(slot)
        self._changed()

    def prefetch(self, draft: str) -> None:
        if draft in self.table.failed or self.table.where(draft) is not None:
            return
        slot = self.table.begin_load(draft)
        if slot is not None:
            self._send_load(slot)
            self._changed()

    def apply(self, decision: Decision) -> None:
        for d in decision.actions.cancel:
            self.evict(d)
        for d in decision.actions.evict:
            self.evict(d)
        for d in decision.actions.prefetch:
            self.prefetch(d)

    # ---- the request loop (Alg. 3) -------------------------------------------------------
    def view(self, iteration: int, active: str | None) -> SchedView:
        return SchedView(
            iteration=iteration, drafts=tuple(d.name for d in self.pool.drafts),
            general=self.pool.general, capacity=len(self.table.slots),
            resident=self.table.resident, loading=self.table.loading,
            failed=frozenset(self.table.failed), active=active, scores=self.scores)

    def drain(self, req_id: str | None, timeout_ms: int = 0) -> None:
        for msg in self.channels.poll(timeout_ms):
            self.handle(msg, req_id)

    def _snapshot(self, req_id: str, seq: int, prompt: str, session: Session | None) -> None:
        recent = session.generated[-self.pool.T:] if session and self.pool.T else []
        self.channels.send(Snapshot(req_id=req_id, seq=seq, prompt=prompt, recent_ids=recent))

    def _wait_initial_ranking(self, req_id: str) -> float:
        t0 = time.perf_counter()
        while self._rank_seq.get(req_id, -1) < 0:
            left = INITIAL_RANKING_TIMEOUT_S - (time.perf_counter() - t0)
            if left <= 0:
                _log("no initial ranking (predictor down?): continuing without one")
                break
            self.drain(req_id, int(min(left, 0.05) * 1000) + 1)
        return time.perf_counter() - t0

    def _wait_resident(self, draft: str, req_id: str) -> float:
        t0 = time.perf_counter()
        while draft not in self.table.resident and draft not in self.table.failed:
            if draft not in self.table.loading:
                self.prefetch(draft)
                if draft not in self.table.loading:
                    break  # no free slot and nothing to evict: give up waiting
            self.channels.heartbeat("busy")
            self.drain(req_id, 20)
        return time.perf_counter() - t0

    def serve(self, req: Submit, emit: Emit) -> None:
        """Run one request; every outcome is a Done or an Error reply, never an exception."""
        try:
            self._serve(req, emit)
        except MemspecError as exc:
            emit(Error(req_id=req.req_id, message=str(exc)))
        except Exception as exc:  # a bug must cost one request, not the process
            traceback.print_exc(file=sys.stderr)
            emit(Error(req_id=req.req_id, message=f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            self._stats = self._events = None

    def oracle_tables(self, policy: str, ids: list[int], params: SamplingParams
                      ) -> dict[str, list[int]]:
        """This prompt's acceptance tables (oracles know the future only for traced prompts)."""
        if not params.greedy:
            raise RequestError(f"policy '{policy}' replays greedy acceptance tables",
                               "use temperature 0, or another policy")
        if self._oracle_index is None:
            self._oracle_index = oracle_index(self.pool)
        tables = self._oracle_index.get(tuple(ids))
        if tables is None:
            raise RequestError(f"policy '{policy}' has no acceptance tables for this prompt",
                               "run `memspec trace` and use a traced prompt "
                               "(prompts/<domain>.jsonl, prompts/train.jsonl), or another policy")
        return tables

    def _serve(self, req: Submit, emit: Emit) -> None:
        t_start = self._t0 = time.perf_counter()
        self._events = [] if req.trace else None
        policy_name = req.policy or self.pool.policy
        params = SamplingParams(req.temperature, req.top_p, req.seed)
        ids = encode_prompt(self.tokenizer, req.prompt)
        where: dict[str, Session] = {}
        plan = None
        if policy_name in ORACLE_POLICIES:
            plan = make_plan(policy_name, self.oracle_tables(policy_name, ids, params),
                             self.pool.gamma, self.pool.N,
                             lambda: len(where["s"].generated) if "s" in where else 0)
        ucb_c = self.pool.ucb_c if req.ucb_c is None else req.ucb_c
        policy: Policy = make_policy(policy_name, ucb_c=ucb_c, oracle_plan=plan)
        max_new = req.max_new_tokens or self.pool.max_new_tokens
        if self.cold_start:
            for d in list(self.table.resident | self.table.loading):
                self.evict(d)
        self.scores = None
        text_so_far = ""

        def stream(new: list[int]) -> None:
            nonlocal text_so_far
            text = self.tokenizer.decode(session.generated, skip_special_tokens=True)
            emit(Tokens(req_id=req.req_id, ids=new, text=text[len(text_so_far):]))
            text_so_far = text

        session = where["s"] = self.engine.start(ids, max_new, params, stream)
        stats = self._stats = session.stats
        stats.loads = stats.evictions = stats.bytes_loaded = 0
        self.drain(req.req_id)
        t_initial = 0.0
        if policy.uses_predictor:
            self._snapshot(req.req_id, 0, req.prompt, None)
            t_initial = self._wait_initial_ranking(req.req_id)
            stats.t_prediction += t_initial
        t_loop = time.perf_counter() - t_start
        active: str | None = None
        iteration, seq, n = 0, 0, self.pool.N
        while not session.done:
            decision = policy.decide(self.view(iteration, active))
            self.apply(decision)
            run = decision.run
            if decision.wait_for is not None:
                t_wait = time.perf_counter()
                waited = self._wait_resident(decision.wait_for, req.req_id)
                stats.t_load_wait += waited
                if self._events is not None:
                    self._events.append([t_wait - t_start, "wait", decision.wait_for, -1,
                                         waited])
                if decision.wait_for in self.table.resident:
                    run = decision.wait_for
            if run is not None and run not in self.engine.drafts:
                run = None  # a policy may only run resident drafts; guard, never block
            desired = run == decision.preferred
            for _ in range(n):
                rec = session.step(run, desired=desired)
                policy.observe(run, rec.proposed, rec.accepted)
                iteration += 1
                if session.done:
                    break
            active = run
            if session.done:
                break
            self.channels.heartbeat("busy")
            if policy.uses_predictor:
                seq += 1
                t0 = time.perf_counter()
                self._snapshot(req.req_id, seq, req.prompt, session)
                stats.t_prediction += time.perf_counter() - t0
            self.drain(req.req_id)
        stats.t_e2e = time.perf_counter() - t_start
        summary = stats.summary()
        summary.update(policy=policy_name, quarantined=dict(self.table.failed),
                       resident_at_end=sorted(self.table.resident))
        if self._events is not None:
            summary["trace"] = {
                "iterations": [[r.t_start - t_start, r.draft, r.accepted, r.duration, r.desired,
                                r.t_catchup, r.emitted, r.catchup_tokens]
                               for r in stats.records],
                "loads": self._events, "loop_start": t_loop, "initial_prediction": t_initial}
        emit(Done(req_id=req.req_id,
                  text=self.tokenizer.decode(session.generated, skip_special_tokens=True),
                  token_ids=session.generated, stats=summary))


def oracle_index(pool: PoolConfig) -> dict[tuple[int, ...], dict[str, list[int]]]:
    """Prompt ids -> per-draft tables, over every traced prompt set whose tables match the
    pool's drafts (empty when none do: oracle requests then get a one-line error)."""
    from memspec.zoo.tablestore import (
        SETS,
        pool_fingerprint,
        read_tables,
        tables_path,
        trajectories_path,
        trajectory_rows,
    )

    fp = pool_fingerprint(pool)
    out: dict[tuple[int, ...], dict[str, list[int]]] = {}
    for which in SETS:
        tt = read_tables(tables_path(pool, which), pool.gamma, fp)
        if tt is None:
            continue
        rows = trajectory_rows(trajectories_path(pool, which), list(tt.rows))
        for pid, row in rows.items():
            out[tuple(row["prompt_ids"])] = tt.rows[pid]["tables"]
    _log(f"oracle tables for {len(out)} traced prompts")
    return out


def draft_files(pool: PoolConfig) -> dict[str, DraftFile]:
    """Header layout and data-section checksum of every draft, read once at start."""
    import hashlib

    out = {}
    for d in pool.drafts:
        path = draft_weights_file(d.path)
        layout = read_layout(path)
        h = hashlib.sha256()
        with path.open("rb") as f:
            f.seek(layout.data_offset)
            left = layout.data_size
            while left and (chunk := f.read(min(1 << 20, left))):
                h.update(chunk)
                left -= len(chunk)
        out[d.name] = DraftFile(path, layout, h.hexdigest())
    return out
