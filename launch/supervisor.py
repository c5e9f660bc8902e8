"""Supervisor: spawns decoder, loader and predictor, watches them, restarts the one that dies.

It also routes requests: prompts from stdin, from in-process code (`submit` / `cancel` /
`status`) or from clients on a ZeroMQ endpoint are queued here (bounded: a full queue is a
`ServerBusy`) and handed to the decoder one at a time. A decoder crash loses no request: the
one in flight goes back to the front of the queue and resumes on the restarted decoder from
the tokens its client already has (`launch/resume.py`); one that is in flight at two crashes
in a row is failed alone, and a process that keeps crashing is restarted after a growing
pause (visible in `status`, /health and /metrics).

Clients may send only Submit and StatusRequest; anything else gets an Error reply. Every
accepted request gets a `Queued` at once and again every few seconds until it ends: the
client tells a long queue from a dead server, and a client that has gone (the send fails)
gets its request cancelled. A REQ client gets exactly one reply per request (its Done,
Error or Status). Only the supervisor stops the server: there is no stop message on the
client endpoint, and the decoder obeys Shutdown only from the supervisor's own socket.
Every request's outcome and every Done's stats add up in `totals` (`status` reports them,
and the HTTP front end's /metrics renders that same Status).

The object is not thread-safe: call it from the thread that calls `tick`. Other threads
(the HTTP server, the Python API) hand it work through `launch/bridge.py`, whose wake-up
descriptor `tick` watches (`add_waker`) beside its sockets.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import zmq

from memspec.common.child import NICE_ENV, NO_GC_ENV, PARENT_ENV, SPAWNED_ENV, renice
from memspec.common.errors import MemspecError, RequestError
from memspec.common.limits import check_fresh, check_request, echo_id
from memspec.common.logs import LEVEL_ENV, level_name, message_of
from memspec.common.memory import process_info
from memspec.common.messages import (
    CLIENT_REQUESTS,
    CONTROL,
    DECODER_REPLIES,
    Abort,
    Codec,
    DecoderInfo,
    Done,
    Error,
    Heartbeat,
    Message,
    PeerRestarted,
    PredictorInfo,
    ProcInfo,
    ProcStatus,
    ProtocolError,
    Queued,
    Ready,
    SlotStatus,
    Status,
    Submit,
    Tokens,
    encode,
)
from memspec.common.metrics import RequestTimes, Totals
from memspec.common.paths import pool_identity
from memspec.common.shmclean import cleanup_shm, owned_run_token, sweep_orphans
from memspec.common.sockets import (
    SUPERVISOR_ID_ENV,
    RejectLog,
    configure,
    endpoint,
    make_run_dir,
    recv,
    recv_routed,
    send,
    sweep_run_dirs,
)
from memspec.launch.endpoint import IPC_PATH_MAX, EndpointLock, check_endpoint
from memspec.launch.resume import STABLE_S, Progress, backoff_s, continuation
from memspec.procs.decoder.forward import arena
from memspec.procs.decoder.standby import go_message
from memspec.procs.predictor import FALLBACK

LOG = logging.getLogger(__name__)
PROCS = ("loader", "predictor", "decoder")
START_ORDER = ("decoder", "loader", "predictor")  # the first answer waits on the decoder only
HELPER_NICE = 10  # loader and predictor run at lower priority (see bench pipeline: interference)
M = TypeVar("M", bound=Message)
HEARTBEAT_TIMEOUT_S = 30.0
START_TIMEOUT_S = 300.0
STOP_GRACE_S = 1.0  # SIGTERM, then SIGKILL: a Ctrl-C must end `generate` within 2 s
KEEPALIVE_S = 2.0  # Queued to every waiting client; a failed send means the client left
MAX_QUEUE = 16  # requests waiting behind the running one
READ_BATCH = 256  # messages read per socket per tick: a flood cannot starve the others
SLOT_STATES = ("free", "loading", "resident")
STANDBY_IDLE_S = 1.0  # a standby decoder starts once the server has been idle this long
# standby "auto": keep one only where a cold decoder start (measured at this server's own
# start) takes longer than this; below it the ~200 MB of an idle interpreter with torch
# buys less than a second of a crash's recovery
RESTART_BUDGET_S = 3.0
STANDBY_MAX_FAILURES = 3  # standbys that died on their own before the supervisor stops trying
Reply = Callable[[Message], None]


def _check_socket_paths(run_dir: Path, eps: dict[str, str]) -> None:
    """The processes' ipc sockets fit a socket address; else one line now, not a child
    that cannot bind its socket (its error blaming the endpoint) seconds later."""
    for name, ep in eps.items():
        path = ep.removeprefix("ipc://") if ep.startswith("ipc://") else ""
        if len(os.fsencode(path)) > IPC_PATH_MAX:
            raise MemspecError(f"the run folder {run_dir} is too deep for its ipc sockets "
                               f"({name}.sock would be over {IPC_PATH_MAX} bytes)",
                               "set XDG_RUNTIME_DIR (or TMPDIR) to a shorter folder, or "
                               "serve on TCP (--tcp)")


class ServerBusy(MemspecError):
    """The request queue is full; the caller may retry later (HTTP 429)."""


def error_kind(exc: MemspecError) -> str:
    """The `Error.kind` of a refused submit: what the client may do about it."""
    if isinstance(exc, ServerBusy):
        return "busy"
    return "request" if isinstance(exc, RequestError) else "unavailable"


@dataclass
class Pending:
    req: Submit
    reply: Reply
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.monotonic()))
    progress: Progress = field(default_factory=Progress)  # what its client has: to resume it


class ClientReply:
    """Replies to one request of a remote client. A client that has gone (ROUTER_MANDATORY
    makes the send fail) or stopped reading gets its request cancelled."""

    def __init__(self, sup: Supervisor, envelope: list[bytes], req_id: str) -> None:
        self.sup, self.envelope, self.req_id = sup, envelope, req_id
        self.one_reply = len(envelope) == 2  # a REQ socket takes one reply per request
        self.gone = False

    def __call__(self, msg: Message) -> None:
        if self.gone or self.sup.client is None:
            return
        if self.one_reply and not isinstance(msg, (Done, Error, Status)):
            return
        try:
            send(self.sup.client, msg, ident=self.envelope)
        except zmq.ZMQError:  # EHOSTUNREACH: disconnected; EAGAIN: not reading
            self.gone = True
            if self.req_id and not isinstance(msg, (Done, Error)):
                self.sup.cancel(self.req_id, "the client went away")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | None = None
    restarts: int = 0
    state: str = "stopped"
    last_beat: float = 0.0
    started: float = 0.0
    ready_at: float = 0.0  # monotonic time of the last Ready
    info: ProcInfo | None = None
    crashes: int = 0  # in a row: reset by STABLE_S ready (or, for the decoder, a request served)
    crashed_at: float | None = None  # the first crash of the current outage
    next_start: float = 0.0  # state "backoff": when it is started again
    recovery_s: float = 0.0  # its last restart: crash noticed -> Ready

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None


class Supervisor:
    def __init__(self, pool: str | None = None, client_endpoint: str | None = None,
                 tcp: bool = False, cold_start: bool = False, quiet_logs: bool = True,
                 run_dir: Path | None = None, max_queue: int = MAX_QUEUE,
                 log_level: str | None = None, standby: bool | str = False,
                 backoff_scale: float = 1.0, oracle_tables: bool = True) -> None:
        self.pool = pool
        # False: the decoder leaves a traced pool's oracle tables unread until an oracle
        # request (a private run of one request that is not one)
        self.oracle_tables = oracle_tables
        self.pool_id = pool_identity(pool)  # what a client compares before reusing us
        # crash-loop pauses (resume.backoff_s) times this: a fault test that kills restarting
        # processes on purpose keeps the pauses' shape at a fraction of their length
        self.backoff_scale = backoff_scale
        # a standby decoder (procs/decoder/standby.py): a long-running server keeps one, so a
        # crashed decoder's successor has its imports and tokenizer done
        self.standby_enabled = standby  # True, False or "auto" (RESTART_BUDGET_S)
        self.cold_decoder_s = 0.0  # the decoder's first start: spawn -> Ready
        self.standby: subprocess.Popen | None = None
        self.standby_token = ""
        self.standby_ready = False  # the standby said it is prepared
        self._standby_failures = 0
        self._last_busy = 0.0
        self.log_level = level_name(log_level)  # the children's (common/logs.py)
        self.client_endpoint = client_endpoint
        self.cold_start = cold_start
        self.quiet_logs = quiet_logs
        self.max_queue = max_queue
        self.procs = {n: Proc(n) for n in PROCS}
        self.queue: deque[Pending] = deque()
        self.in_flight: Pending | None = None
        self.slots: list[SlotStatus] = []
        self.quarantined: dict[str, str] = {}  # the decoder's, as of its last Status
        self._said: set[tuple[str, str]] = set()  # quarantines already logged
        self.decoder_token = ""
        self.supervisor_id = secrets.token_hex(8)
        self.rejected = RejectLog(LOG.warning)
        self.reported = RejectLog(LOG.warning, what="process report")
        self.closed = False
        self.totals = Totals()
        self._aborted: set[str] = set()  # running requests cancelled (their Error is no failure)
        self._wakers: list[int] = []
        self.lock: EndpointLock | None = None
        self.client: zmq.Socket | None = None
        self.run_dir: Path | None = None
        self._next_keepalive = 0.0
        self.ctx = zmq.Context()
        try:  # the client endpoint first: a refusal leaves nothing behind
            if client_endpoint:
                self._bind_client(client_endpoint)
            if run_dir is None:
                sweep_run_dirs()  # what a SIGKILLed supervisor left
                sweep_orphans()
            self.run_dir = run_dir or make_run_dir()
            self.ep = {n: endpoint(self.run_dir, n, tcp)
                       for n in ("control", "decoder", "loader", "predictor")}
            _check_socket_paths(self.run_dir, self.ep)
            self.control = configure(self.ctx.socket(zmq.PULL))
            self.control.bind(self.ep["control"])
            self.decoder = configure(self.ctx.socket(zmq.DEALER))
            self.decoder.setsockopt(zmq.ROUTING_ID, self.supervisor_id.encode())
            self.decoder.connect(self.ep["decoder"])
        except BaseException:
            self._close()
            raise

    def _bind_client(self, ep: str) -> None:
        check_endpoint(ep, serving=True)
        self.lock = EndpointLock(ep)
        self.client = configure(self.ctx.socket(zmq.ROUTER))
        self.client.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.client.bind(ep)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EADDRINUSE:
                raise MemspecError(f"{ep} is in use by another process",
                                   "stop it or pick another --endpoint") from None
            raise MemspecError(f"cannot serve {ep} ({exc.strerror})",
                               "pick another --endpoint") from None

    # ---- processes ------------------------------------------------------------------
    def _cmd(self, name: str, token: str = "") -> list[str]:
        cmd = [sys.executable, "-m", f"memspec.procs.{name}.main",
               "--endpoint", self.ep[name], "--control", self.ep["control"]]
        if self.pool and name != "loader":  # the loader holds no config: Load says it all
            cmd += ["--pool", self.pool]
        if name == "decoder":
            cmd += ["--loader", self.ep["loader"], "--predictor", self.ep["predictor"],
                    "--run-token", token]
            if self.cold_start:
                cmd.append("--cold-start")
            if not self.oracle_tables:
                cmd.append("--no-oracle-tables")
        return cmd

    def log_path(self, name: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / f"{name}.log"

    def spawn(self, name: str, standby: bool = False) -> None:
        """Start `name`; the decoder's successor is the standby when there is one. With
        `standby`, start a standby decoder instead (it waits for `_take_standby`)."""
        p = self.procs[name]
        if name == "decoder" and not standby and self._take_standby(p):
            return
        log = open(self.log_path(name), "ab") if self.quiet_logs else None  # noqa: SIM115
        # The child dies with us, takes its niceness and our log level itself, at start
        # (common/child.py): no preexec_fn, which can deadlock a process with threads.
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1",
                   **{PARENT_ENV: str(os.getpid()), LEVEL_ENV: self.log_level, NICE_ENV: "0",
                      SPAWNED_ENV: repr(time.monotonic()), NO_GC_ENV: "1"})
        helper = name != "decoder"
        if helper:  # one thread each: the decoder owns the cores for its forwards
            # Spinning OpenMP workers of a helper starve the decoder (measured: a verify went
            # from 67 ms to 4 s); the decoder's forward runs on its own pool, whose workers
            # spin briefly between kernels and then sleep (procs/decoder/forward/csrc/pool.h).
            # They also yield the cores: a ranking or a load that lands a little later costs
            # nothing, the decoder's forwards are what the user waits for.
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
                       **{NICE_ENV: str(HELPER_NICE)})
        else:
            env[SUPERVISOR_ID_ENV] = self.supervisor_id
            # numpy's OpenBLAS starts a thread per core at import that spins before it
            # sleeps; the decoder never multiplies with numpy, and that spinner took the core
            # PyTorch's own workers needed while the target was built (0.04 s -> 0.18 s of a
            # fresh start on 2 cores)
            env["OPENBLAS_NUM_THREADS"] = "1"
            env.update(arena.env_for(self.pool_id))  # its target's block, faulted at once
        token = owned_run_token() if name == "decoder" else ""
        cmd = self._cmd(name, token) + (["--standby"] if standby else [])
        popen = subprocess.Popen(cmd, stdin=subprocess.PIPE if standby else subprocess.DEVNULL,
                                 stdout=log or sys.stderr, stderr=log or sys.stderr,
                                 start_new_session=True, env=env)
        if helper:  # its imports already run beside the decoder's at the lower priority
            renice(popen.pid, HELPER_NICE)
        if log:
            log.close()
        if standby:
            self.standby, self.standby_token, self.standby_ready = popen, token, False
            return
        if name == "decoder":
            self.decoder_token = token
        p.popen = popen
        p.state, p.started, p.last_beat = "starting", time.monotonic(), time.monotonic()

    def _take_standby(self, p: Proc) -> bool:
        """Tell the standby decoder to go on as the decoder; False when there is none alive."""
        sb, self.standby, self.standby_ready = self.standby, None, False
        if sb is None:
            return False
        try:
            if sb.poll() is not None:
                raise BrokenPipeError
            sb.stdin.write(go_message(time.monotonic()))
            sb.stdin.close()
        except (BrokenPipeError, OSError, ValueError):
            self._retire(sb)
            return False
        LOG.info(f"the standby decoder (pid {sb.pid}) takes over")
        p.popen, self.decoder_token = sb, self.standby_token
        p.state, p.started, p.last_beat = "starting", time.monotonic(), time.monotonic()
        return True

    @property
    def keeps_standby(self) -> bool:
        """Whether this server keeps a standby decoder (one is, or will be once idle)."""
        if not self.standby_enabled or self._standby_failures >= STANDBY_MAX_FAILURES:
            return False
        # "auto": only where a cold restart exceeds the budget (else no standby's memory)
        return self.standby_enabled != "auto" or self.cold_decoder_s > RESTART_BUDGET_S

    def _keep_standby(self, now: float) -> None:
        """Start a standby decoder while the server is idle: its imports never compete with
        a request's decoding."""
        if self.closed or not self.keeps_standby:
            return
        sb = self.standby
        if sb is not None:
            if sb.poll() is not None:  # it died on its own: its log says why
                self.standby, self.standby_ready = None, False
                self._standby_failures += 1
                cleanup_shm(f"memspec-{self.standby_token}-")
                LOG.warning(f"the standby decoder exited (code {sb.returncode}): "
                            f"{self._last_log_line('decoder')}"
                            + ("; no more standbys" if self._standby_failures
                               >= STANDBY_MAX_FAILURES else ""))
            return
        if not self.idle:
            self._last_busy = now
            return
        dec = self.procs["decoder"]
        if (self._standby_failures < STANDBY_MAX_FAILURES and dec.state == "ready"
                and now - max(self._last_busy, dec.ready_at) >= STANDBY_IDLE_S):
            self.spawn("decoder", standby=True)

    def set_standby(self, enabled: bool) -> None:
        """Keep a standby decoder from now on, or not (the one there is, is retired)."""
        self.standby_enabled = enabled
        if not enabled and self.standby is not None:
            sb, self.standby, self.standby_ready = self.standby, None, False
            self._retire(sb)
            cleanup_shm(f"memspec-{self.standby_token}-")

    @staticmethod
    def _retire(sb: subprocess.Popen) -> None:
        """End a standby decoder (it exits on end of input; a kill if it does not)."""
        try:
            sb.stdin.close()
        except (OSError, ValueError):
            pass
        if sb.poll() is None:
            sb.kill()
        sb.wait()

    def start(self, timeout: float = START_TIMEOUT_S,
              stop: Callable[[], bool] = lambda: False) -> bool:
        """Spawn the three and wait until each is ready; False when `stop()` turned true
        first (a Ctrl-C during the seconds the models take to load)."""
        for name in START_ORDER:
            self.spawn(name)
        deadline = time.monotonic() + timeout
        while any(p.state != "ready" for p in self.procs.values()):
            if stop():
                return False
            if time.monotonic() > deadline:
                late = [p.name for p in self.procs.values() if p.state != "ready"]
                raise MemspecError(
                    f"the processes did not become ready in {timeout:.0f}s (still starting: "
                    + "; ".join(f"{n}, last logged: {self._last_log_line(n)}" for n in late)
                    + ")", f"see the logs in {self.run_dir}")
            for p in self.procs.values():
                if p.popen and p.popen.poll() is not None and p.state == "starting":
                    raise MemspecError(f"{p.name} exited at start (code {p.popen.returncode}): "
                                       f"{self._last_log_line(p.name)}",
                                       "fix the problem it names and start again")
            self._poll_control(50)
        dec = self.procs["decoder"]
        self.cold_decoder_s = max(0.0, dec.ready_at - dec.started)
        if self.standby_enabled == "auto":
            LOG.info(f"the decoder started cold in {self.cold_decoder_s:.1f}s: " + (
                f"keeping a standby decoder (over the {RESTART_BUDGET_S:.0f}s restart budget)"
                if self.cold_decoder_s > RESTART_BUDGET_S else
                f"no standby decoder (within the {RESTART_BUDGET_S:.0f}s restart budget; "
                "--standby keeps one)"))
        return True

    def _last_log_line(self, name: str) -> str:
        try:
            lines = [x for x in self.log_path(name).read_text(errors="replace").splitlines()
                     if x.strip()]
        except OSError:
            return "no log"
        errs = [x for x in lines if "error" in x.lower()]
        return message_of((errs or lines or ["no output"])[-1].strip())[:300]

    def _on_crash(self, p: Proc, why: str) -> None:
        now = time.monotonic()
        if p.popen and p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()
        p.popen = None
        p.crashes += 1
        if p.crashed_at is None:
            p.crashed_at = now
        pause = backoff_s(p.crashes) * self.backoff_scale
        LOG.warning(f"{p.name} {why}; restarting" + (
            f" in {pause:.3g}s ({p.crashes} crashes in a row)" if pause else ""))
        if p.name == "decoder":
            cleanup_shm(f"memspec-{self.decoder_token}-")
            if self.in_flight:
                pending, self.in_flight = self.in_flight, None
                self._resume_or_fail(pending, why)
            self.slots = []
        p.restarts += 1
        if pause:
            p.state, p.next_start = "backoff", now + pause
        else:
            self.spawn(p.name)
            p.state = "restarting"

    def _resume_or_fail(self, pending: Pending, why: str) -> None:
        """The request the dead decoder was running: back to the front of the queue, to go
        on from what its client has; failed alone when it was running at the decoder's last
        crashes in a row too (it may be what kills it) or was being cancelled."""
        rid = pending.req.req_id
        if rid in self._aborted:
            self._ended(rid, "cancelled")
            pending.reply(Error(req_id=rid, message="aborted"))
            return
        prog = pending.progress
        prog.crashed(time.monotonic())
        if prog.poisoned:
            self._ended(rid, "failed")
            LOG.error(f"request {rid} failed: running at {prog.crashes} decoder crashes in a "
                      "row")
            pending.reply(Error(req_id=rid, message=(
                f"request {rid!r} was running at {prog.crashes} decoder crashes in a row (the "
                f"last: {why}), so it is not retried: it may be what crashes the decoder; "
                "check the decoder's log, or resubmit it if the crashes had another cause")))
            return
        self.totals.resumed += 1
        self.queue.appendleft(pending)
        LOG.warning(f"request {rid} resumes after {len(prog.streamed)} tokens once the decoder "
                    "is back")

    def _check_procs(self) -> None:
        now = time.monotonic()
        for p in self.procs.values():
            if p.state == "backoff":
                if now >= p.next_start:
                    self.spawn(p.name)
                    p.state = "restarting"
                continue
            if p.popen is None:
                continue
            code = p.popen.poll()
            if code is not None:
                self._on_crash(p, f"exited with code {code}")
            elif p.state == "ready" and now - p.last_beat > HEARTBEAT_TIMEOUT_S:
                self._on_crash(p, f"sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f}s")
            elif p.state != "ready" and now - p.started > START_TIMEOUT_S:
                self._on_crash(p, "did not become ready")
            elif p.state == "ready" and p.crashes and now - p.ready_at > STABLE_S:
                p.crashes = 0  # stable again: the next crash is a one-off
        self._keep_standby(now)

    # ---- messages -------------------------------------------------------------------
    def _queued(self, sock: zmq.Socket, codec: Codec[M]) -> Iterator[M | ProtocolError]:
        """The messages waiting on `sock` now (at most READ_BATCH), decoded; never blocks."""
        for _ in range(READ_BATCH):
            try:
                yield recv(sock, codec, flags=zmq.NOBLOCK)[1]
            except zmq.Again:
                return

    def _poll_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        for msg in self._queued(self.control, CONTROL):
            if isinstance(msg, ProtocolError):
                self.rejected(f"control: {msg}")
            elif isinstance(msg, Ready) and msg.proc in self.procs:
                self._on_ready(self.procs[msg.proc], msg)
            elif isinstance(msg, Heartbeat) and msg.proc in self.procs:
                p = self.procs[msg.proc]
                if p.pid == msg.pid:  # a forged or stale beat keeps no hung process alive
                    p.last_beat = time.monotonic()
                elif (msg.state == "standby" and self.standby is not None
                      and msg.pid == self.standby.pid):
                    self.standby_ready = True  # prepared: a takeover skips its imports
            elif isinstance(msg, Status):
                self._on_slots(msg)
            elif isinstance(msg, Error):
                self.reported(msg.message)

    def _on_slots(self, msg: Status) -> None:
        """Keep the decoder's slot table for `status`, if it is the decoder's and sane."""
        mine = msg.procs.get("decoder")
        info = self.procs["decoder"].info
        k = getattr(info, "K", 0)
        if (mine is None or mine.pid != self.procs["decoder"].pid or len(msg.slots) > k
                or any(s.state not in SLOT_STATES for s in msg.slots)):
            self.rejected("control: a Status that is not the running decoder's")
            return
        self.slots = msg.slots
        self._on_quarantined(msg.quarantined)

    def _on_quarantined(self, quarantined: dict[str, str]) -> None:
        """Log each quarantine once (a restarted decoder finds the same ones again)."""
        self.quarantined = dict(quarantined)
        for item in sorted(quarantined.items()):
            if item not in self._said:
                self._said.add(item)
                LOG.warning(f"draft '{item[0]}' quarantined: {item[1]}")

    def _on_ready(self, p: Proc, msg: Ready) -> None:
        if p.pid != msg.pid:
            return  # a Ready from a process we already replaced
        restarted = p.state == "restarting"
        if (isinstance(msg.info, PredictorInfo) and msg.info.head.startswith(FALLBACK)
                and p.info is None):  # said once, not at every restart
            LOG.warning(msg.info.head[len(FALLBACK):])
        p.state, p.last_beat, p.info = "ready", time.monotonic(), msg.info
        p.ready_at = p.last_beat
        if p.crashed_at is not None:
            p.recovery_s, p.crashed_at = p.ready_at - p.crashed_at, None
        if restarted:
            LOG.info(f"{p.name} is back (pid {msg.pid}) {p.recovery_s:.1f}s after it crashed")
            if p.name in ("loader", "predictor"):
                try:
                    send(self.decoder, PeerRestarted(proc=p.name, pid=msg.pid))
                except zmq.Again:
                    pass

    def _poll_decoder(self) -> None:
        for msg in self._queued(self.decoder, DECODER_REPLIES):
            if isinstance(msg, ProtocolError):
                self.rejected(f"decoder: {msg}")
                continue
            if isinstance(msg, Status) or self.in_flight is None:
                continue
            pending = self.in_flight
            if msg.req_id in (pending.req.req_id, ""):
                now = time.monotonic()
                pending.progress.relayed(msg, now)
                if isinstance(msg, Tokens) and msg.ids:
                    pending.times.tokens(now)
                elif isinstance(msg, Done):
                    self.in_flight = None
                    self._aborted.discard(pending.req.req_id)
                    pending.progress.stamp(msg.stats)
                    self.totals.served(msg.stats, pending.times, now)
                    self.procs["decoder"].crashes = 0  # it serves: no crash loop
                elif isinstance(msg, Error):
                    self.in_flight = None
                    self._ended(pending.req.req_id, "failed")
                pending.reply(msg)

    def _poll_clients(self) -> None:
        if self.client is None:
            return
        for _ in range(READ_BATCH):
            try:
                envelope, msg = recv_routed(self.client, CLIENT_REQUESTS, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # a frame list without a routing identity cannot be answered
            reply = ClientReply(self, envelope,
                                echo_id(msg.req_id) if isinstance(msg, Submit) else "")
            if isinstance(msg, ProtocolError):
                self.rejected(f"client: {msg}")
                reply(Error(req_id="", message=f"malformed message: {msg}"))
            elif isinstance(msg, Submit):
                try:
                    self.submit(msg, reply)
                except MemspecError as exc:  # never echo a field that broke a limit
                    reply(Error(req_id=echo_id(msg.req_id), message=str(exc),
                                kind=error_kind(exc)))
            else:
                reply(self.status())

    def _dispatch(self) -> None:
        if self.in_flight is None and self.queue and self.procs["decoder"].state == "ready":
            head = self.queue[0]
            try:
                send(self.decoder, continuation(head.req, head.progress))
            except zmq.Again:
                return  # decoder socket not connected yet: try on the next tick
            self.in_flight = self.queue.popleft()
            self.in_flight.times.dispatched = time.monotonic()

    def _keepalive(self) -> None:
        now = time.monotonic()
        if now < self._next_keepalive:
            return
        self._next_keepalive = now + KEEPALIVE_S
        waiting = ([self.in_flight] if self.in_flight else []) + list(self.queue)
        for ahead, pending in enumerate(waiting):
            pending.reply(Queued(req_id=pending.req.req_id, ahead=ahead))

    # ---- public -----------------------------------------------------------------------
    def submit(self, req: Submit, reply: Reply) -> None:
        """Queue `req`. Its replies go to `reply`, called from `tick`: a Queued at once and
        every few seconds, Tokens as they decode, then one Done or Error. Raises ServerBusy
        when `max_queue` requests wait, RequestError when `req` cannot be sent or has a bad
        field (`check_request`: every front door's limits, common/limits.py)."""
        if self.closed:
            raise MemspecError("the server is stopping", "resubmit once it is back")
        try:
            check_request(req)
            check_fresh(req)
        except RequestError:
            self.totals.count("invalid")
            raise
        if len(self.queue) >= self.max_queue:
            self.totals.count("busy")
            raise ServerBusy(f"server busy: {len(self.queue)} requests are queued",
                             "retry in a few seconds")
        try:
            encode(req)
        except (UnicodeEncodeError, ValueError, TypeError, OverflowError) as exc:
            self.totals.count("invalid")
            raise RequestError(f"request {req.req_id!r} cannot be sent ({exc})",
                               "send the prompt as UTF-8 text") from None
        if any(p.req.req_id == req.req_id for p in self._pending()):
            self.totals.count("invalid")
            raise RequestError(f"request id {req.req_id!r} is already in use",
                               "give every request its own req_id")
        self.queue.append(Pending(req, reply))
        reply(Queued(req_id=req.req_id, ahead=len(self.queue) - 1 + (self.in_flight is not None)))

    def run(self, req: Submit, on_reply: Reply | None = None,
            stop: Callable[[], bool] = lambda: False, timeout_s: float | None = None
            ) -> Done | Error | None:
        """Submit `req` and tick until its Done or Error (every reply also goes to
        `on_reply`); None when `stop()` turns true or `timeout_s` passes first (the
        request is then cancelled)."""
        out: list[Done | Error] = []

        def reply(msg: Message) -> None:
            if on_reply is not None:
                on_reply(msg)
            if isinstance(msg, (Done, Error)):
                out.append(msg)

        self.submit(req, reply)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not out:
            if stop() or (deadline is not None and time.monotonic() > deadline):
                self.cancel(req.req_id)
                return None
            self.tick(10)
        return out[0]

    def cancel(self, req_id: str, reason: str = "cancelled") -> bool:
        """Cancel a request: a queued one is dropped (its reply is an Error with `reason`),
        the running one stops at the decoder's next scheduling point (its reply is then an
        Error "aborted"). False when no such request is waiting or running."""
        for pending in list(self.queue):
            if pending.req.req_id == req_id:
                self.queue.remove(pending)
                self.totals.count("cancelled")
                pending.reply(Error(req_id=req_id, message=reason))
                return True
        if self.in_flight is not None and self.in_flight.req.req_id == req_id:
            self._aborted.add(req_id)
            try:
                send(self.decoder, Abort(req_id=req_id))
            except zmq.Again:
                pass  # the decoder is restarting: the request ends with it
            return True
        return False

    def status(self) -> Status:
        now = time.monotonic()
        procs = {n: ProcStatus(pid=p.pid, state=p.state, restarts=p.restarts,
                               crashes=p.crashes, recovery_s=p.recovery_s,
                               ready_s=round(max(0.0, p.ready_at - p.started), 4)
                               if p.ready_at >= p.started > 0 else 0.0,
                               backoff_s=max(0.0, p.next_start - now)
                               if p.state == "backoff" else 0.0,
                               **(process_info(p.pid) if p.pid else {}),
                               **({"standby_pid": self.standby.pid}
                                  if n == "decoder" and self.standby is not None
                                  and self.standby_ready else {}),
                               **({"standby_kept": self.keeps_standby}
                                  if n == "decoder" else {}),
                               **({"isa": p.info.isa, "dtype": p.info.dtype,
                                   "startup": dict(p.info.startup),
                                   "bandwidth_bytes_s": p.info.bandwidth_bytes_s}
                                  if isinstance(p.info, DecoderInfo) else {}))
                 for n, p in self.procs.items()}
        return Status(procs=procs, slots=self.slots, quarantined=self.quarantined,
                      totals=self.totals.snapshot(len(self.queue), int(self.in_flight is not None)),
                      pool_id=self.pool_id)

    @property
    def ready(self) -> bool:
        """All three processes are up and the server is not stopping (HTTP /health)."""
        return not self.closed and all(p.state == "ready" for p in self.procs.values())

    def add_waker(self, fd: int) -> None:
        """`tick` also returns as soon as `fd` is readable (another thread has work)."""
        self._wakers.append(fd)

    def _ended(self, req_id: str, outcome: str) -> None:
        self.totals.count("cancelled" if req_id in self._aborted else outcome)
        self._aborted.discard(req_id)

    def _wait(self, timeout_ms: int) -> None:
        """Until a process, the decoder, a client or a waker has something, or the timeout:
        replies are relayed as soon as they arrive."""
        poller = zmq.Poller()
        for sock in (self.control, self.decoder, self.client):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        for fd in self._wakers:
            poller.register(fd, zmq.POLLIN)
        poller.poll(timeout_ms)

    def tick(self, timeout_ms: int = 50) -> None:
        self._wait(timeout_ms)
        self._poll_control(0)
        self._poll_decoder()
        self._poll_clients()
        self._check_procs()
        self._dispatch()
        self._keepalive()

    @property
    def idle(self) -> bool:
        return self.in_flight is None and not self.queue

    def _pending(self) -> list[Pending]:
        return ([self.in_flight] if self.in_flight else []) + list(self.queue)

    def shutdown(self, reason: str = "the server is stopping",
                 grace_s: float = STOP_GRACE_S) -> None:
        """Tell every waiting client why, stop the three (SIGTERM, then SIGKILL after
        `grace_s`), and remove their shared memory, sockets and run directory."""
        if self.closed:
            return
        self.closed = True
        pending, self.queue, self.in_flight = self._pending(), deque(), None
        for item in pending:
            item.reply(Error(req_id=item.req.req_id, message=f"{reason}; resubmit the request",
                             kind="unavailable"))
        self.set_standby(False)
        procs = [p for p in self.procs.values() if p.popen]
        for p in procs:
            if p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + grace_s
        while any(p.popen.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        for p in procs:
            if p.popen.poll() is None:
                p.popen.kill()
            p.popen.wait()
            p.state = "stopped"
        if self.decoder_token:
            cleanup_shm(f"memspec-{self.decoder_token}-")
        self._close()

    def _close(self) -> None:
        if self.client is not None:
            self.client.close(linger=200)  # the final Errors above still leave
            self.client = None
        self.ctx.destroy(linger=0)
        if self.lock is not None:
            self.lock.release()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
