"""Supervisor: spawns decoder, loader and predictor, watches them, restarts the one that dies.

It also routes requests: prompts from stdin or from clients on a ZeroMQ endpoint are queued
here and handed to the decoder one at a time, so a decoder crash costs only the request in
flight (it gets an Error reply) and the queue is served by the restarted decoder. Clients
may send only Submit and StatusRequest; anything else gets an Error reply.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import zmq

from memspec.common.config import check_submit
from memspec.common.errors import MemspecError
from memspec.common.memory import process_info
from memspec.common.messages import (
    CLIENT_REQUESTS,
    CONTROL,
    DECODER_REPLIES,
    Abort,
    Codec,
    Done,
    Error,
    Heartbeat,
    Message,
    PeerRestarted,
    PredictorInfo,
    ProcInfo,
    ProcStatus,
    ProtocolError,
    Ready,
    SlotStatus,
    Status,
    Submit,
)
from memspec.common.slotmem import cleanup_shm
from memspec.common.sockets import RejectLog, configure, endpoint, make_run_dir, recv, send
from memspec.procs.predictor import FALLBACK

PROCS = ("loader", "predictor", "decoder")
HELPER_NICE = 10  # loader and predictor run at lower priority (see bench pipeline: interference)
M = TypeVar("M", bound=Message)
HEARTBEAT_TIMEOUT_S = 30.0
START_TIMEOUT_S = 300.0
Reply = Callable[[Message], None]


def _log(msg: str) -> None:
    print(f"[supervisor] {msg}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Children get SIGTERM if the supervisor itself is killed: no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _helper_process() -> None:
    """The loader and predictor yield the cores to the decoder: its forwards are what the
    user waits for, while a ranking or a load that lands a little later costs nothing."""
    _die_with_parent()
    try:
        os.nice(HELPER_NICE)
    except OSError:
        pass


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

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None


class Supervisor:
    def __init__(self, pool: str | None = None, client_endpoint: str | None = None,
                 tcp: bool = False, cold_start: bool = False, quiet_logs: bool = True,
                 run_dir: Path | None = None) -> None:
        self.pool = pool
        self.run_dir = run_dir or make_run_dir()
        self.ep = {n: endpoint(self.run_dir, n, tcp) for n in ("control", "decoder", "loader",
                                                                "predictor")}
        self.client_endpoint = client_endpoint
        self.cold_start = cold_start
        self.quiet_logs = quiet_logs
        self.procs = {n: Proc(n) for n in PROCS}
        self.ctx = zmq.Context()
        self.control = configure(self.ctx.socket(zmq.PULL))
        self.control.bind(self.ep["control"])
        self.decoder = configure(self.ctx.socket(zmq.DEALER))
        self.decoder.connect(self.ep["decoder"])
        self.client: zmq.Socket | None = None
        if client_endpoint:
            self.client = configure(self.ctx.socket(zmq.ROUTER))
            self.client.bind(client_endpoint)
        self.queue: deque[tuple[Submit, Reply]] = deque()
        self.in_flight: tuple[Submit, Reply] | None = None
        self.slots: list[SlotStatus] = []
        self.quarantined: dict[str, str] = {}  # the decoder's, as of its last Status
        self._said: set[tuple[str, str]] = set()  # quarantines already logged
        self.decoder_token = ""
        self.rejected = RejectLog(_log)

    # ---- processes ------------------------------------------------------------------
    def _cmd(self, name: str) -> list[str]:
        cmd = [sys.executable, "-m", f"memspec.procs.{name}.main",
               "--endpoint", self.ep[name], "--control", self.ep["control"]]
        if self.pool and name != "loader":  # the loader holds no config: Load says it all
            cmd += ["--pool", self.pool]
        if name == "decoder":
            self.decoder_token = secrets.token_hex(4)
            cmd += ["--loader", self.ep["loader"], "--predictor", self.ep["predictor"],
                    "--run-token", self.decoder_token]
            if self.cold_start:
                cmd.append("--cold-start")
        return cmd

    def log_path(self, name: str) -> Path:
        return self.run_dir / f"{name}.log"

    def spawn(self, name: str) -> None:
        p = self.procs[name]
        log = open(self.log_path(name), "ab") if self.quiet_logs else None  # noqa: SIM115
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TRANSFORMERS_VERBOSITY="error", PYTHONUNBUFFERED="1")
        # Three processes share the cores: spinning OpenMP workers of one starve the others
        # (measured here: a verify went from 67 ms to 4 s); passive waiting avoids that.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        helper = name != "decoder"
        if helper:  # one thread each: the decoder owns the cores for its forwards
            env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        p.popen = subprocess.Popen(self._cmd(name), stdin=subprocess.DEVNULL,
                                   stdout=log or sys.stderr, stderr=log or sys.stderr,
                                   start_new_session=True, env=env,
                                   preexec_fn=_helper_process if helper else _die_with_parent)
        if log:
            log.close()
        p.state, p.started, p.last_beat = "starting", time.monotonic(), time.monotonic()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        for name in PROCS:
            self.spawn(name)
        deadline = time.monotonic() + timeout
        while any(p.state != "ready" for p in self.procs.values()):
            if time.monotonic() > deadline:
                raise MemspecError("processes did not become ready in time",
                                   f"see the logs in {self.run_dir}")
            for p in self.procs.values():
                if p.popen and p.popen.poll() is not None and p.state == "starting":
                    raise MemspecError(f"{p.name} exited at start (code {p.popen.returncode}): "
                                       f"{self._last_log_line(p.name)}",
                                       "fix the problem it names and start again")
            self._poll_control(100)

    def _last_log_line(self, name: str) -> str:
        try:
            lines = [x for x in self.log_path(name).read_text(errors="replace").splitlines()
                     if x.strip()]
        except OSError:
            return "no log"
        errs = [x for x in lines if "error" in x.lower()]
        return (errs or lines or ["no output"])[-1].strip()[:300]

    def _on_crash(self, p: Proc, why: str) -> None:
        _log(f"{p.name} {why}; restarting")
        if p.popen and p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait()
        if p.name == "decoder":
            cleanup_shm(f"memspec-{self.decoder_token}-")
            if self.in_flight:
                req, reply = self.in_flight
                reply(Error(req_id=req.req_id,
                            message=f"decoder crashed ({why}) during this request; resubmit it"))
                self.in_flight = None
            self.slots = []
        p.restarts += 1
        self.spawn(p.name)
        p.state = "restarting"

    def _check_procs(self) -> None:
        now = time.monotonic()
        for p in self.procs.values():
            if p.popen is None:
                continue
            code = p.popen.poll()
            if code is not None:
                self._on_crash(p, f"exited with code {code}")
            elif p.state == "ready" and now - p.last_beat > HEARTBEAT_TIMEOUT_S:
                self._on_crash(p, f"sent no heartbeat for {HEARTBEAT_TIMEOUT_S:.0f}s")
            elif p.state != "ready" and now - p.started > START_TIMEOUT_S:
                self._on_crash(p, "did not become ready")

    # ---- messages -------------------------------------------------------------------
    def _queued(self, sock: zmq.Socket, codec: Codec[M], router: bool = False
                ) -> Iterator[tuple[bytes | None, M | ProtocolError]]:
        """Every message waiting on `sock` now, decoded by its codec; never blocks."""
        while True:
            try:
                yield recv(sock, codec, router=router, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # a frame list without a routing identity cannot be answered

    def _poll_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        for _, msg in self._queued(self.control, CONTROL):
            if isinstance(msg, ProtocolError):
                self.rejected(f"control: {msg}")
            elif isinstance(msg, Ready) and msg.proc in self.procs:
                self._on_ready(self.procs[msg.proc], msg)
            elif isinstance(msg, Heartbeat) and msg.proc in self.procs:
                self.procs[msg.proc].last_beat = time.monotonic()
            elif isinstance(msg, Status):
                self.slots = msg.slots
                self._on_quarantined(msg.quarantined)
            elif isinstance(msg, Error):
                _log(f"a process reported: {msg.message}")

    def _on_quarantined(self, quarantined: dict[str, str]) -> None:
        """Log each quarantine once (a restarted decoder finds the same ones again)."""
        self.quarantined = dict(quarantined)
        for item in sorted(quarantined.items()):
            if item not in self._said:
                self._said.add(item)
                _log(f"draft '{item[0]}' quarantined: {item[1]}")

    def _on_ready(self, p: Proc, msg: Ready) -> None:
        if p.pid != msg.pid:
            return  # a Ready from a process we already replaced
        restarted = p.state == "restarting"
        if (isinstance(msg.info, PredictorInfo) and msg.info.head.startswith(FALLBACK)
                and p.info is None):  # said once, not at every restart
            _log(msg.info.head[len(FALLBACK):])
        p.state, p.last_beat, p.info = "ready", time.monotonic(), msg.info
        p.ready_at = p.last_beat
        if restarted:
            _log(f"{p.name} is back (pid {msg.pid})")
            if p.name in ("loader", "predictor"):
                try:
                    send(self.decoder, PeerRestarted(proc=p.name, pid=msg.pid))
                except zmq.Again:
                    pass

    def _poll_decoder(self) -> None:
        for _, msg in self._queued(self.decoder, DECODER_REPLIES):
            if isinstance(msg, ProtocolError):
                self.rejected(f"decoder: {msg}")
                continue
            if isinstance(msg, Status) or self.in_flight is None:
                continue
            req, reply = self.in_flight
            if msg.req_id in (req.req_id, ""):
                reply(msg)
                if isinstance(msg, (Done, Error)):
                    self.in_flight = None

    def _poll_clients(self) -> None:
        if self.client is None:
            return
        for ident, msg in self._queued(self.client, CLIENT_REQUESTS, router=True):

            def reply(m: Message, ident: bytes | None = ident) -> None:
                try:
                    send(self.client, m, ident=ident)
                except zmq.Again:
                    pass  # the client went away

            if isinstance(msg, ProtocolError):
                self.rejected(f"client: {msg}")
                reply(Error(req_id="", message=f"malformed message: {msg}"))
            elif isinstance(msg, Submit):
                self.submit(msg, reply)
            else:
                reply(self.status())

    def _dispatch(self) -> None:
        if self.in_flight is None and self.queue and self.procs["decoder"].state == "ready":
            try:
                send(self.decoder, self.queue[0][0])
            except zmq.Again:
                return  # decoder socket not connected yet: try on the next tick
            self.in_flight = self.queue.popleft()

    # ---- public -----------------------------------------------------------------------
    def submit(self, req: Submit, reply: Reply) -> None:
        """Queue a request; one with a bad field is answered at once, never queued."""
        try:
            check_submit(req)
        except MemspecError as exc:
            reply(Error(req_id=req.req_id, message=str(exc)))
            return
        self.queue.append((req, reply))

    def run(self, req: Submit, on_reply: Reply | None = None,
            stop: Callable[[], bool] = lambda: False, timeout_s: float | None = None
            ) -> Done | Error | None:
        """Submit `req` and tick until its Done or Error (every reply also goes to
        `on_reply`); None when `stop()` turns true or `timeout_s` passes first."""
        out: list[Done | Error] = []

        def reply(msg: Message) -> None:
            if on_reply is not None:
                on_reply(msg)
            if isinstance(msg, (Done, Error)):
                out.append(msg)

        self.submit(req, reply)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not out and not stop():
            if deadline is not None and time.monotonic() > deadline:
                return None
            self.tick(10)
        return out[0] if out else None

    def abort(self, req_id: str) -> None:
        """Cancel a request: dropped from the queue, or stopped by the decoder at its next
        scheduling point (its reply is then an Error)."""
        for item in list(self.queue):
            if item[0].req_id == req_id:
                self.queue.remove(item)
                item[1](Error(req_id=req_id, message="aborted"))
                return
        if self.in_flight is not None and self.in_flight[0].req_id == req_id:
            try:
                send(self.decoder, Abort(req_id=req_id))
            except zmq.Again:
                pass

    def status(self) -> Status:
        procs = {n: ProcStatus(pid=p.pid, state=p.state, restarts=p.restarts,
                               **(process_info(p.pid) if p.pid else {}))
                 for n, p in self.procs.items()}
        return Status(procs=procs, slots=self.slots, quarantined=self.quarantined)

    def tick(self, timeout_ms: int = 50) -> None:
        self._poll_control(timeout_ms)
        self._poll_decoder()
        self._poll_clients()
        self._check_procs()
        self._dispatch()

    @property
    def idle(self) -> bool:
        return self.in_flight is None and not self.queue

    def shutdown(self) -> None:
        for p in self.procs.values():
            if p.popen and p.popen.poll() is None:
                p.popen.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            if p.popen:
                try:
                    p.popen.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.popen.kill()
                    p.popen.wait()
            p.state = "stopped"
        if self.decoder_token:
            cleanup_shm(f"memspec-{self.decoder_token}-")
        self.ctx.destroy(linger=0)
        if self.client_endpoint and self.client_endpoint.startswith("ipc://"):
            Path(self.client_endpoint[6:]).unlink(missing_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
