"""The decoder process: owns the target, the slot memory, every KV cache and the hot loop.

Sockets: a ROUTER the supervisor talks to (Submit / StatusRequest / PeerRestarted /
Shutdown in; Tokens / Done / Error / Status out), DEALERs to the loader and predictor, and
a PUSH for Ready / Heartbeat on the supervisor's control socket.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import sys
import time

import torch
import zmq

from memspec.common.config import load_pool
from memspec.common.errors import MemspecError
from memspec.common.memory import process_rss_mb, slots_for_budget
from memspec.common.messages import (
    Error,
    Heartbeat,
    Message,
    PeerRestarted,
    ProtocolError,
    Ready,
    Shutdown,
    Snapshot,
    Status,
    StatusRequest,
    Submit,
)
from memspec.common.slotmem import SlotMemory, choose_transport
from memspec.common.sockets import configure, recv, send
from memspec.procs.decoder.controller import Controller, _log, draft_files
from memspec.procs.decoder.engine import SpecEngine
from memspec.procs.decoder.models import encode_prompt, open_engine
from memspec.procs.decoder.slots import SlotBuffer, bind_draft

HEARTBEAT_S = 0.5


class SocketChannels:
    """Controller <-> loader / predictor / supervisor over ZeroMQ; never blocks on a peer."""

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
        self.poller = zmq.Poller()
        self.poller.register(self.loader, zmq.POLLIN)
        self.poller.register(self.predictor, zmq.POLLIN)
        self.poller.register(requests, zmq.POLLIN)
        self.pending_requests: list[tuple[bytes, Message]] = []
        self._last_beat = 0.0
        self.state = "idle"

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
            try:
                send(self.control, Heartbeat(proc="decoder", pid=os.getpid(), state=state))
            except zmq.Again:
                pass

    def poll(self, timeout_ms: int) -> list[Message]:
        """Drain loader/predictor replies; supervisor messages are queued for the main loop."""
        out: list[Message] = []
        events = dict(self.poller.poll(timeout_ms))
        while events:
            for sock in (self.loader, self.predictor):
                if sock in events:
                    _, msg, _ = recv(sock, flags=0)
                    if isinstance(msg, ProtocolError):
                        _log(f"malformed reply dropped: {msg}")
                    else:
                        out.append(msg)
            if self.requests in events:
                ident, msg, _ = recv(self.requests, router=True)
                if isinstance(msg, PeerRestarted):
                    out.append(msg)
                else:
                    self.pending_requests.append((ident or b"", msg))
            events = dict(self.poller.poll(0))
        return out


def _calibrate_iteration_s(engine: SpecEngine, tokenizer, pool, slot: SlotBuffer,
                           files) -> float:
    """Median SD iteration time with the general draft: the unit of the edge-emulated profile."""
    spec = pool.general_draft
    layout = files[spec.name].layout
    slot.fill_from_file(layout)
    engine.add_draft(bind_draft(spec.name, spec.path, slot, layout, target_vocab=engine.vocab))
    ids = encode_prompt(tokenizer, "Describe the ocean in two sentences.")
    _, stats = engine.generate(ids, 40, select=lambda s: spec.name)
    engine.remove_draft(spec.name)
    slot.generation += 1
    durs = [r.duration for r in stats.records[1:]] or [r.duration for r in stats.records]
    return statistics.median(durs)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pool = load_pool(args.pool)
    torch.manual_seed(0)
    ctx = zmq.Context.instance()
    requests = configure(ctx.socket(zmq.ROUTER))
    requests.bind(args.endpoint)
    channels = SocketChannels(ctx, args.loader, args.predictor, args.control, requests)
    t0 = time.perf_counter()
    device = args.device
    engine, tokenizer, dtype = open_engine(pool, device)
    files = draft_files(pool)
    capacity = max((f.layout.data_size for f in files.values()), default=0)
    k = pool.K
    if pool.memory_budget_mb is not None:  # too small for one draft: error at start
        budget_k = slots_for_budget(pool.memory_budget_mb, capacity, len(pool.drafts))
        k = budget_k if pool.K_from_budget else k
    k = min(k, len(pool.drafts))
    transport = args.transport or choose_transport(device)
    token = args.run_token or secrets.token_hex(4)
    mems = [SlotMemory.create(f"memspec-{token}-slot{i}", capacity, transport, device)
            for i in range(k)] if capacity else []
    buffers = [SlotBuffer(capacity, data=m.tensor) for m in mems]
    bandwidth = 0.0
    if pool.storage == "edge-emulated" and buffers:
        if pool.bandwidth_mb_s:
            bandwidth = pool.bandwidth_mb_s * 1e6
        else:
            iter_s = _calibrate_iteration_s(engine, tokenizer, pool, buffers[0], files)
            bandwidth = files[pool.general].layout.data_size / (pool.load_iter_ratio * iter_s)
            _log(f"edge-emulated: SD iteration {iter_s * 1e3:.1f} ms -> "
                 f"{bandwidth / 1e6:.2f} MB/s (load/iteration = {pool.load_iter_ratio})")
    ctl = Controller(pool, engine, tokenizer, buffers, [m.handle for m in mems], transport,
                     channels, files, bandwidth, cold_start=args.cold_start)

    def status() -> Status:
        return Status(procs={"decoder": {"pid": os.getpid(), "rss_mb": process_rss_mb(),
                                         "transport": transport, "K": k,
                                         "bandwidth_bytes_s": bandwidth}},
                      slots=[s.as_dict() for s in ctl.table.slots])

    def push_status() -> None:  # the supervisor caches it for `memspec status`
        try:
            send(channels.control, status())
        except zmq.Again:
            pass

    ctl.on_slots_changed = push_status
    send(channels.control, flags=0, msg=Ready(proc="decoder", pid=os.getpid(), info={
        "load_s": time.perf_counter() - t0, "K": k, "transport": transport, "dtype": dtype,
        "slot_bytes": capacity, "bandwidth_bytes_s": bandwidth,
        "handles": [m.handle for m in mems]}))
    _log(f"ready: target in {dtype}, K={k} slots of {capacity / 2**20:.1f} MB ({transport}), "
         f"{time.perf_counter() - t0:.1f}s")
    stop = False

    def on_signal(signum, frame):  # noqa: ANN001
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop:
            channels.heartbeat("idle")
            for msg in channels.poll(int(HEARTBEAT_S * 1000)):
                ctl.handle(msg)
            while channels.pending_requests and not stop:
                ident, msg = channels.pending_requests.pop(0)

                def emit(m: Message, ident: bytes = ident) -> None:
                    try:
                        send(requests, m, ident=ident)
                    except zmq.Again:
                        pass  # the supervisor is gone; it re-syncs when it returns

                if isinstance(msg, ProtocolError):
                    emit(Error(req_id="", message=f"malformed message: {msg}"))
                    _log(f"malformed request rejected: {msg}")
                elif isinstance(msg, Submit):
                    ctl.serve(msg, emit)
                elif isinstance(msg, StatusRequest):
                    emit(status())
                elif isinstance(msg, Shutdown):
                    stop = True
                else:
                    emit(Error(req_id="", message=f"decoder does not accept {msg.TYPE}"))
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
    args = ap.parse_args(argv)
    try:
        return run(args)
    except MemspecError as exc:
        print(f"memspec decoder: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
