"""The decoder process: owns the target, the slot memory, every KV cache and the hot loop.

Sockets: a ROUTER the supervisor talks to (Submit / Abort / StatusRequest / PeerRestarted /
Shutdown in; Tokens / Done / Error / Status out), DEALERs to the loader and predictor, and
a PUSH for Ready / Heartbeat / Status on the supervisor's control socket.

The main loop is a busy loop over scheduling intervals: one interval of the running
request, then whatever the supervisor sent meanwhile (a status request, an abort, a
shutdown, the next request), so nothing waits for a whole request to finish. Idle, it
blocks on every socket at once. A request error is that request's Error reply; an engine
failure ends the process: the supervisor restarts it and resumes the request it was running
(launch/resume.py). The start-up is timed phase by phase (startup.py), since a restart is
on the serving path.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import signal
import time
from collections import deque

import torch
import zmq

from memspec.common import child
from memspec.common.config import load_pool
from memspec.common.errors import MemspecError
from memspec.common.memory import process_rss_mb, slots_for_budget
from memspec.common.messages import (
    DECODER_REQUESTS,
    LOADER_REPLIES,
    PREDICTOR_REPLIES,
    Abort,
    DecoderInfo,
    Error,
    Heartbeat,
    Message,
    PeerRestarted,
    ProcStatus,
    ProtocolError,
    Ready,
    Shutdown,
    SlotStatus,
    Snapshot,
    Status,
    StatusRequest,
    Submit,
    type_name,
)
from memspec.common.procexit import fast_exit
from memspec.common.slotmem import SlotMemory, choose_transport
from memspec.common.sockets import SUPERVISOR_ID_ENV, RejectLog, configure, recv, send
from memspec.procs.decoder import standby
from memspec.procs.decoder.forward import arena
from memspec.procs.decoder.forward.lean import kv_cache_bytes
from memspec.procs.decoder.forward.native import extension
from memspec.procs.decoder.forward.threads import decoder_threads, make_plan
from memspec.procs.decoder.models import open_engine
from memspec.procs.decoder.oracle import edge_profile
from memspec.procs.decoder.oracle.tablefiles import runtime_key
from memspec.procs.decoder.service import (
    LOG,
    DecoderService,
    EngineSlots,
    log,
    open_drafts,
    prepare_heads,
    verify_target,
)
from memspec.procs.decoder.slots import SlotBuffer
from memspec.procs.decoder.startup import StartupClock

HEARTBEAT_S = 0.5


class SocketChannels:
    """The loop's loader and predictor over ZeroMQ; never blocks on a peer.

    Waiting also watches the supervisor's socket: a PeerRestarted goes to the loop at once
    (a restarted loader has forgotten the load a blocking policy may be waiting for), the
    rest waits in `inbox` for the process's next scheduling point.
    """

    def __init__(self, ctx: zmq.Context, loader: str, predictor: str, control: str,
                 requests: zmq.Socket) -> None:
        self.loader = configure(ctx.socket(zmq.DEALER))
        self.loader.connect(loader)
        self.predictor = configure(ctx.socket(zmq.DEALER))
        self.predictor.setsockopt(zmq.SNDHWM, 4)  # stale snapshots are worth nothing
        self.predictor.connect(predictor)
        self.control = configure(ctx.socket(zmq.PUSH))
        self.control.setsockopt(zmq.SNDHWM, 16)
        self.control.connect(control)
        self.requests = requests
        self.inbox: deque[tuple[bytes, Message | ProtocolError]] = deque()
        self.poller = zmq.Poller()
        for sock in (self.loader, self.predictor, requests):
            self.poller.register(sock, zmq.POLLIN)
        self._last_beat = 0.0
        self.rejected = RejectLog(LOG.warning)
        self.wake: child.SignalWake | None = None

    def wake_on_signals(self) -> None:
        """A signal (SIGTERM) ends a wait at once (child.SignalWake; main thread only)."""
        self.wake = child.SignalWake()
        self.poller.register(self.wake.fd, zmq.POLLIN)

    def send(self, msg: Message) -> None:
        sock = self.predictor if isinstance(msg, Snapshot) else self.loader
        try:
            send(sock, msg)
        except zmq.Again:
            pass  # peer backed up or gone: scheduling goes on without it

    def heartbeat(self, state: str) -> None:
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.push(Heartbeat(proc="decoder", pid=os.getpid(), state=state))

    def push(self, msg: Message) -> None:
        try:
            send(self.control, msg)
        except zmq.Again:
            pass  # the supervisor is busy or gone: it re-syncs on the next one

    def poll(self, timeout_s: float) -> list[Message]:
        """Every loader and predictor reply (and PeerRestarted) arriving within `timeout_s`;
        waiting ends early when anything arrives."""
        out: list[Message] = []
        timeout_ms = math.ceil(timeout_s * 1000) if timeout_s > 0 else 0
        events = dict(self.poller.poll(timeout_ms))
        while events:
            if self.wake is not None and self.wake.fd in events:
                self.wake.drain()
            for sock, codec in ((self.loader, LOADER_REPLIES),
                                (self.predictor, PREDICTOR_REPLIES)):
                if sock in events:
                    _, msg = recv(sock, codec)
                    if isinstance(msg, ProtocolError):
                        self.rejected(f"reply: {msg}")
                    else:
                        out.append(msg)
            if self.requests in events:
                try:
                    ident, req = recv(self.requests, DECODER_REQUESTS, router=True)
                except ValueError:
                    self.rejected("a request without a routing identity")
                else:
                    if isinstance(req, PeerRestarted):
                        out.append(req)
                    else:
                        self.inbox.append((ident or b"", req))
            events = dict(self.poller.poll(0))
        return out


class DecoderProcess:
    """The busy loop: an interval of the running request, then the supervisor's messages."""

    def __init__(self, channels: SocketChannels, service: DecoderService) -> None:
        self.channels, self.service = channels, service
        self.ctl = service.controller
        self.pending: deque[tuple[bytes, Submit]] = deque()
        self.stop = False
        # only the supervisor may stop the decoder: its socket's routing id is a secret
        # it passes in the environment (unset when the decoder is run by hand)
        self.supervisor_id = os.environ.get(SUPERVISOR_ID_ENV, "").encode()

    def status(self) -> Status:
        state = "busy" if self.service.busy else "idle"
        return Status(procs={"decoder": ProcStatus(pid=os.getpid(), state=state,
                                                   rss_mb=process_rss_mb())},
                      slots=[SlotStatus(s.index, s.generation, s.state.value, s.draft)
                             for s in self.ctl.table.slots],
                      quarantined=dict(self.ctl.table.failed))

    def reply(self, ident: bytes, msg: Message) -> None:
        try:
            send(self.channels.requests, msg, ident=ident)
        except zmq.Again:
            pass  # the supervisor is gone; it re-syncs when it returns

    def run(self) -> None:
        served = False  # a request ran since the heap was last trimmed
        while not self.stop:
            if self.service.busy:
                self.service.step()
                self.ctl.drain()  # what arrived during the interval's iterations
                served = True
            else:
                if served and not self.pending and not self.channels.inbox:
                    child.trim_heap()  # idle: a request's freed temporaries go back (~1 ms)
                    served = False
                self.channels.heartbeat("idle")
                self.ctl.drain(HEARTBEAT_S)  # blocks until any socket has something
            self.handle_requests()
            if not self.service.busy and self.pending and not self.stop:
                ident, req = self.pending.popleft()
                self.service.start(req, lambda m, ident=ident: self.reply(ident, m))
        cur = self.service.current
        if cur is not None:
            self.service.abort(cur.req.req_id, "the decoder is shutting down; resubmit it",
                               kind="unavailable")
        for ident, req in self.pending:
            self.reply(ident, Error(req_id=req.req_id, kind="unavailable",
                                    message="the decoder is shutting down; resubmit it"))

    def handle_requests(self) -> None:
        """Everything the supervisor sent since the last scheduling point."""
        inbox = self.channels.inbox
        while inbox:
            ident, msg = inbox.popleft()
            if isinstance(msg, ProtocolError):
                self.channels.rejected(str(msg))
                self.reply(ident, Error(req_id="", message=f"malformed message: {msg}"))
            elif isinstance(msg, Submit):
                self.pending.append((ident, msg))
            elif isinstance(msg, Abort):
                if not self.service.abort(msg.req_id):
                    self._drop_pending(msg.req_id)
            elif isinstance(msg, StatusRequest):
                self.reply(ident, self.status())
            elif isinstance(msg, Shutdown):
                if self.supervisor_id and ident != self.supervisor_id:
                    self.channels.rejected("Shutdown from a peer that is not the supervisor")
                    self.reply(ident, Error(req_id="", message="Shutdown is accepted only "
                                                               "from the supervisor"))
                else:
                    self.stop = True
            else:  # the codec admits nothing else; a new type must be handled above
                self.reply(ident, Error(req_id="", message=f"unhandled {type_name(msg)}"))

    def _drop_pending(self, req_id: str) -> None:
        for item in list(self.pending):
            if item[1].req_id == req_id:
                self.pending.remove(item)
                self.reply(item[0], Error(req_id=req_id, message="aborted"))
                return


def run(args: argparse.Namespace) -> int:
    clock = StartupClock()  # "process": spawn -> here (the interpreter and the imports)
    arena.start_from_env()  # the target's block faulted in beside the next 0.1 s (arena.py)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pool = load_pool(args.pool)
    torch.manual_seed(0)
    threads = decoder_threads()
    if args.device == "cpu":
        torch.set_num_threads(threads[0])  # the start-up calibration runs with every core
    ctx = zmq.Context.instance()
    requests = configure(ctx.socket(zmq.ROUTER))
    requests.bind(args.endpoint)
    channels = SocketChannels(ctx, args.loader, args.predictor, args.control, requests)
    channels.wake_on_signals()
    t0 = time.perf_counter()
    device = args.device
    clock.mark("config")
    verify_target(pool.target)
    clock.mark("verify")
    if device == "cpu":
        extension()  # the native forward's module (loaded once; open_engine uses it)
        clock.mark("native")
    engine, tokenizer, dtype = open_engine(pool, device, phases=clock.mark, serving=True)
    files, quarantined = open_drafts(pool, engine.vocab)
    clock.mark("drafts")
    prepare_heads(engine, pool, files)
    clock.mark("heads")
    capacity = max((f.layout.data_size for f in files.values()), default=0)
    k = pool.K
    if pool.memory_budget_mb is not None:  # too small for one draft: error at start
        budget_k = slots_for_budget(pool.memory_budget_mb, capacity, len(pool.drafts),
                                    kv_cache_bytes(engine.target, pool.max_context))
        k = budget_k if pool.K_from_budget else k
    k = min(k, len(files))  # quarantined drafts need no slot
    transport = args.transport or choose_transport(device)
    token = args.run_token or secrets.token_hex(4)
    mems = [SlotMemory.create(f"memspec-{token}-slot{i}", capacity, transport, device)
            for i in range(k)] if capacity else []
    buffers = [SlotBuffer(capacity, data=m.tensor) for m in mems]
    clock.mark("slots")
    bandwidth = 0.0
    if pool.storage == "edge-emulated" and buffers:
        if pool.bandwidth_mb_s:
            bandwidth = pool.bandwidth_mb_s * 1e6
        else:
            iter_s, cached = edge_profile.iteration_s(engine, tokenizer, pool, buffers[0], files,
                                                      runtime_key(pool, engine.device))
            unit = files[edge_profile.unit_draft(pool, files).name]
            bandwidth = unit.layout.data_size / (pool.load_iter_ratio * iter_s)
            log(f"edge-emulated: SD iteration {iter_s * 1e3:.1f} ms"
                f"{' (cached)' if cached else ''} -> {bandwidth / 1e6:.2f} MB/s "
                f"(load/iteration = {pool.load_iter_ratio})")
        clock.mark("edge_profile")
    handles = [m.handle for m in mems]
    slots = EngineSlots(pool, engine, buffers, handles, transport, files, bandwidth)
    service = DecoderService(pool, engine, tokenizer, slots, channels,
                             cold_start=args.cold_start, quarantined=quarantined,
                             oracle_tables=args.oracle_tables)
    clock.mark("calibration")
    service.controller.loads_busy = bandwidth <= 0
    preloaded = False
    if not args.cold_start:  # a cold-start run (the paper's measurement) starts empty
        preloaded = service.preload(pool.general)
        clock.mark("preload")
    if args.device == "cpu":
        service.controller.on_helpers = make_plan(threads, engine.target)
    proc = DecoderProcess(channels, service)
    # the supervisor caches the slots for `memspec status`
    service.controller.on_slots_changed = lambda: channels.push(proc.status())
    child.freeze_heap(collect=False)  # (a collection here would delay the first answer)
    clock.mark("ready")
    send(channels.control, flags=0, msg=Ready(proc="decoder", pid=os.getpid(), info=DecoderInfo(
        load_s=time.perf_counter() - t0, K=k, transport=transport, dtype=dtype,
        isa=getattr(engine.target, "isa", ""),
        slot_bytes=capacity,
        bandwidth_bytes_s=bandwidth, handles=handles, startup=clock.split)))
    log(f"ready: target in {dtype} on {getattr(engine.target, 'isa', 'torch')} kernels "
        f"({threads[0]} threads, {threads[1]} while a helper works), K={k} slots of "
        f"{capacity / 2**20:.1f} MB ({transport}), {clock.total:.2f}s: {clock.line()}")
    if quarantined or preloaded:  # the supervisor shows them in status and metrics (and
        channels.push(proc.status())  # logs the quarantined)

    def on_signal(signum, frame):  # noqa: ANN001
        proc.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proc.run()
    except Exception as exc:  # an engine failure: the state may be corrupt, so end here;
        # the supervisor restarts the decoder and resumes the request it was running (and
        # fails it alone if it is running at the next crash too)
        cur = service.current
        LOG.exception(f"error: engine failure ({type(exc).__name__}: {exc})"
                      + (f" in request {cur.req.req_id}" if cur else "")
                      + "; exiting for a restart")
        return 1
    finally:
        for m in mems:
            m.close()
            m.unlink()
        ctx.destroy(linger=0)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="memspec-decoder")
    ap.add_argument("--pool", default=None)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--loader", required=True)
    ap.add_argument("--predictor", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transport", default=None, choices=[None, "shm", "cuda-ipc"])
    ap.add_argument("--run-token", default=None)
    ap.add_argument("--cold-start", action="store_true",
                    help="empty the slots before every request (the paper's evaluation method)")
    ap.add_argument("--no-oracle-tables", dest="oracle_tables", action="store_false",
                    help="leave a traced pool's oracle tables unread until an oracle request")
    ap.add_argument("--standby", action="store_true",
                    help="do the start-up work that does not depend on the run, then wait on "
                         "stdin for the supervisor's go (standby.py)")
    args = ap.parse_args(argv)
    child.start("decoder")
    try:
        if args.standby:
            standby.prepare(args.pool, args.device)
            child.freeze_heap()  # it may wait for hours: its start-up's garbage freed first
            standby.announce(args.control)
            if not standby.wait_for_go():
                return 0  # retired before it was needed
        return run(args)
    except MemspecError as exc:
        LOG.error(f"error: {exc}")
        return 2


if __name__ == "__main__":
    fast_exit(main())  # cleanup is done in main; skip the slow torch teardown
