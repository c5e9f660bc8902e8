"""The predictor process: answers Snapshot with Ranking, heartbeats, never dies on input.

    python -m memspec.procs.predictor.main --endpoint E --control C [--pool P]

Binds a ROUTER at E (the decoder connects a DEALER) before loading, so early snapshots
queue instead of failing; connects PUSH to the supervisor's control endpoint C and sends
Ready once the head, tokenizer and encoder are loaded, then a Heartbeat every 0.5 s. When
several snapshots of one request are queued only the newest is answered: a stale ranking
is worthless to the decoder and answering it would only add latency to the fresh one; the
same holds for a finished request's snapshot once the next request's is queued.
Only Snapshot is accepted on the ROUTER; SIGTERM stops the process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import zmq  # noqa: E402

from memspec.common import child  # noqa: E402
from memspec.common.config import load_pool  # noqa: E402
from memspec.common.errors import MemspecError, ModelError  # noqa: E402
from memspec.common.limits import rank_text, recent_window, valid_req_id  # noqa: E402
from memspec.common.messages import (  # noqa: E402
    PREDICTOR_REQUESTS,
    Error,
    Heartbeat,
    PredictorInfo,
    ProtocolError,
    Ranking,
    Ready,
    Snapshot,
)
from memspec.common.procexit import fast_exit  # noqa: E402
from memspec.common.sockets import RejectLog, configure, recv, send  # noqa: E402
from memspec.procs.predictor import FALLBACK  # noqa: E402

PROC = "predictor"
HEARTBEAT_S = 0.5
MAX_DRAIN = 256  # messages read per wake-up before answering; bounds one round's latency
ENCODER_DTYPES = ("auto", "float32")  # encoder.ENCODER_DTYPES less bfloat16: numpy has none
# the thread counts of the BLAS numpy may be built with (OpenBLAS, its OpenMP build, MKL)
BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")

LOG = logging.getLogger(f"memspec.{PROC}")  # not __name__: run as __main__
log = LOG.info


def cap_blas_threads(n: int) -> int:
    """Cap the encoder's BLAS at ``n`` threads (0: leave its default), as the torch encoder
    capped torch's: the predictor shares the cores with the decoder. BLAS libraries read
    their thread count once, as they load, so this runs before numpy is imported (nothing
    this module imports at the top imports numpy). Returns the count BLAS will use."""
    if n > 0:
        for var in BLAS_THREAD_VARS:
            os.environ[var] = str(n)
        return n
    for var in BLAS_THREAD_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


def newest_per_peer(items: list[tuple[bytes, Snapshot]]) -> list[tuple[bytes, Snapshot]]:
    """Keep each peer's last-arrived snapshot, in first-seen order of the peers. A decoder
    runs one request at a time and ignores rankings of any other, so once a new request's
    first snapshot is queued the previous request's last one is worthless; answering it
    would delay the ranking that the new request's initial loads wait for."""
    latest: dict[bytes, tuple[bytes, Snapshot]] = {}
    for ident, snap in items:
        latest[ident] = (ident, snap)
    return list(latest.values())


def bounded(snap: Snapshot, T: int) -> Snapshot:
    """The part of a snapshot the encoder reads, cut before anything is tokenised or checked
    (whatever a peer sends, a ranking costs what a well-formed one does): the prompt's head
    and tail (`rank_text`) and the last `T` recent ids."""
    return Snapshot(req_id=snap.req_id, seq=snap.seq, prompt=rank_text(snap.prompt),
                    recent_ids=recent_window(snap.recent_ids, T))


class Server:
    """The poll loop; the ranker is injected so the loop logic is testable on its own."""

    def __init__(self, router: zmq.Socket, control: zmq.Socket, ranker) -> None:
        self.router, self.control, self.ranker = router, control, ranker
        self.pid = os.getpid()
        self.stop = False
        self.rejected = RejectLog(LOG.warning)
        self.dropped_stale = 0

    def reject(self, ident: bytes | None, req_id: str, reason: str) -> None:
        self.rejected(reason)
        if ident is not None:
            send(self.router, Error(req_id=req_id, message=f"{PROC}: {reason}"), ident=ident)

    def drain(self) -> list[tuple[bytes, Snapshot]]:
        snaps: list[tuple[bytes, Snapshot]] = []
        for _ in range(MAX_DRAIN):
            try:
                ident, msg = recv(self.router, PREDICTOR_REQUESTS, router=True,
                                  flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:  # no routing identity: cannot be answered
                self.reject(None, "", "no routing identity")
                continue
            if isinstance(msg, ProtocolError):
                self.reject(ident, "", str(msg))
            else:
                snaps.append((ident, msg))
        return snaps

    def answer(self, snaps: list[tuple[bytes, Snapshot]]) -> None:
        fresh = newest_per_peer(snaps)
        self.dropped_stale += len(snaps) - len(fresh)
        good = []
        for ident, snap in fresh:
            if not valid_req_id(snap.req_id):
                self.reject(ident, "", "a snapshot's req_id outside the request limits")
                continue
            snap = bounded(snap, self.ranker.T)
            if self.ranker.bad_ids(snap.recent_ids):
                self.reject(ident, snap.req_id, "recent_ids outside the target vocabulary")
            else:
                good.append((ident, snap))
        if not good:
            return
        try:
            scores, seconds = self.ranker.rank([s.prompt for _, s in good],
                                               [s.recent_ids for _, s in good])
        except Exception as exc:  # a bad input must cost one reply, never the process
            for ident, snap in good:
                self.reject(ident, snap.req_id, f"ranking failed ({type(exc).__name__}: {exc})")
            return
        for (ident, snap), row in zip(good, scores):
            send(self.router, Ranking(req_id=snap.req_id, seq=snap.seq, drafts=self.ranker.names,
                                      scores=row, latency_s=seconds), ident=ident)

    def heartbeat(self, state: str) -> None:
        try:  # a supervisor that stopped reading must never end the predictor
            send(self.control, Heartbeat(proc=PROC, pid=self.pid, state=state))
        except zmq.Again:
            pass

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        wake = child.SignalWake()  # a SIGTERM ends a wait at once, not at the next beat
        poller.register(wake.fd, zmq.POLLIN)
        next_beat = time.monotonic()
        while not self.stop:
            now = time.monotonic()
            if now >= next_beat:
                self.heartbeat("idle")
                next_beat = now + HEARTBEAT_S
            try:
                events = dict(poller.poll(max(0.0, next_beat - now) * 1000))
            except zmq.ZMQError as exc:  # EINTR from a signal: re-check the stop flag
                if exc.errno != zmq.EINTR:
                    raise
                continue
            if wake.fd in events:
                wake.drain()
            if self.router in events:
                snaps = self.drain()
                if snaps and not self.stop:
                    self.answer(snaps)
                    child.trim_heap()  # the answer is out: the temporaries' pages go back


def _control_error(control: zmq.Socket, message: str) -> None:
    """Tell the supervisor why we are exiting; linger briefly so the message leaves."""
    control.setsockopt(zmq.LINGER, 1000)
    send(control, Error(req_id="", message=f"{PROC}: {message}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="memspec predictor process")
    ap.add_argument("--endpoint", required=True, help="ROUTER bind address for snapshots")
    ap.add_argument("--control", required=True, help="supervisor PULL address (Ready/Heartbeat)")
    ap.add_argument("--pool", type=Path, default=None, help="pool.toml (default: embedded)")
    ap.add_argument("--head", type=Path, default=None,
                    help="head.safetensors (default: pool.predictor_head, else the pool's "
                         "own P.head.safetensors, else predictor/; none that fits the pool's "
                         "drafts: a similarity ranking)")
    ap.add_argument("--device", default="cpu", choices=("cpu",),
                    help="the encoder runs in numpy, on the CPU")
    ap.add_argument("--dtype", default="auto", choices=ENCODER_DTYPES,
                    help="encoder precision: float32 (auto: the same; the numpy encoder has "
                         "no bfloat16)")
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS threads (default 1: leave the cores to the decoder; 0: the "
                         "BLAS library's default)")
    args = ap.parse_args(argv)
    threads = cap_blas_threads(args.threads)  # before numpy is imported: BLAS reads it once
    child.start(PROC)

    ctx = zmq.Context()
    control = configure(ctx.socket(zmq.PUSH))
    control.connect(args.control)
    router = configure(ctx.socket(zmq.ROUTER))
    server: Server | None = None

    def on_signal(_signum: int, _frame) -> None:
        if server is not None:
            server.stop = True
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        t0 = time.perf_counter()
        pool = load_pool(args.pool, check=False)
        # checked before the encoder loads: the commonest setup mistake fails in a blink
        named = args.head or pool.predictor_head  # else the pool's own, the committed one
        if named is not None and not Path(named).is_file():
            raise ModelError(f"predictor head not found at {named}",
                             "train one: memspec predictor train, or unset predictor_head")
        try:
            router.bind(args.endpoint)
        except zmq.ZMQError as exc:
            raise MemspecError(f"cannot bind {args.endpoint} ({exc})",
                               "pick a free endpoint") from None
        # only now (numpy, tokenizers): a missing head or a busy endpoint fails in a blink
        from memspec.procs.predictor.ranker import Ranker, head_path_for

        ranker = Ranker.load(pool, args.head)
        if ranker.encoder is not None:
            ranker.encoder.warm()
        if ranker.notice:
            LOG.warning(ranker.notice)  # once: the supervisor repeats it in its own log
        elif ranker.warning:
            LOG.warning(ranker.warning)
        load_s = time.perf_counter() - t0
        server = Server(router, control, ranker)
        child.freeze_heap()
        child.trim_heap()  # what loading the weights freed
        head = f"{FALLBACK}{ranker.notice}" if ranker.notice else str(head_path_for(pool,
                                                                                   args.head))
        send(control, Ready(proc=PROC, pid=os.getpid(), info=PredictorInfo(
            drafts=ranker.names, load_s=round(load_s, 3), head=head, device=args.device,
            threads=threads, T=ranker.T)))
        log(f"ready in {load_s:.1f}s: ranking {', '.join(ranker.names)} "
            f"(encoder float32, numpy, {threads} BLAS thread{'s' if threads != 1 else ''})")
        server.serve()
        return 0
    except MemspecError as exc:
        LOG.error(f"error: {exc}")
        _control_error(control, str(exc))
        return 2
    except KeyboardInterrupt:
        return 0
    finally:
        router.close()
        control.close()
        ctx.term()


if __name__ == "__main__":
    fast_exit(main())  # cleanup is done in main; skip the interpreter's slow teardown
