"""The server's edges without models: endpoints, locks, client timeouts, the request queue,
stdin, rate-limited logs and one-line errors (the real-process faults: test_faults.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from memspec.common.errors import MemspecError, RequestError
from memspec.common.messages import (
    CLIENT_REPLIES,
    CLIENT_REQUESTS,
    Done,
    Error,
    Message,
    ProcStatus,
    Queued,
    Status,
    StatusRequest,
    Submit,
    encode,
)
from memspec.common.sockets import RejectLog, configure, free_tcp_port, send
from memspec.launch import client, supervisor
from memspec.launch.cli import main
from memspec.launch.endpoint import EndpointLock, check_endpoint
from memspec.launch.supervisor import ServerBusy, Supervisor
from memspec.launch.up import StdinPrompts

ONE_LINE = re.compile(r"memspec: error: [^\n]+\n")


def memspec(*args: str | bytes, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memspec", *args], capture_output=True,
                          timeout=timeout, **kw)


def one_line_error(res: subprocess.CompletedProcess, *words: str) -> str:
    err = res.stderr.decode()
    assert res.returncode != 0 and ONE_LINE.fullmatch(err), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err
    return err


# ---- command line ------------------------------------------------------------------------
def test_store_sources_without_built_stores_is_one_line(tmp_path):
    res = memspec("zoo", "stores", "--sources", env={**os.environ, "MEMSPEC_HOME": str(tmp_path)})
    one_line_error(res, "no built stores", "memspec zoo stores")


def test_submit_to_a_port_nobody_listens_on_fails_at_once():
    t0 = time.monotonic()
    res = memspec("submit", "--endpoint", f"tcp://127.0.0.1:{free_tcp_port()}", "x",
                  timeout=15)
    one_line_error(res, "no memspec server", "memspec up --endpoint tcp://")
    print(f"submit to a free port exited {res.returncode} in {time.monotonic() - t0:.2f}s")


@pytest.mark.parametrize("cmd", [["up", "--no-stdin"], ["submit", "x"], ["status"]])
def test_a_bad_endpoint_is_one_line(cmd):
    one_line_error(memspec(*cmd, "--endpoint", "foo"), "'foo' is neither ipc://PATH")


def test_a_run_folder_too_deep_for_sockets_is_one_line_and_leaves_nothing(tmp_path):
    """The processes' sockets live in a run folder under XDG_RUNTIME_DIR: one too deep for a
    socket address is named at once (not a child's bind error blaming the endpoint)."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    env = dict(os.environ, XDG_RUNTIME_DIR=str(deep))
    one_line_error(memspec("up", "--no-stdin", "--endpoint", f"ipc://{tmp_path}/m.sock",
                           env=env), "too deep for its ipc sockets", "XDG_RUNTIME_DIR")
    assert list(deep.iterdir()) == []  # its run folder went with it


def test_a_stale_socket_file_is_named(tmp_path):
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "old.sock"))  # bound, never listening: what a SIGKILL leaves
    one_line_error(memspec("status", "--endpoint", f"ipc://{tmp_path}/old.sock"),
                   "stale socket file")
    one_line_error(memspec("status", "--endpoint", f"ipc://{tmp_path}/none.sock"),
                   "no socket file")


@pytest.mark.parametrize("cmd", ["generate", "submit"])
def test_a_prompt_that_is_not_utf8_is_one_line(cmd):
    one_line_error(memspec(cmd, b"caf\xe9"), "not valid UTF-8 (byte 0xe9")


def test_a_tcp_port_in_use_is_one_line_and_leaves_nothing(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
        one_line_error(memspec("up", "--no-stdin", "--endpoint", f"tcp://127.0.0.1:{port}",
                               env=env), "is in use")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("memspec-")]


def test_a_second_server_on_an_endpoint_refuses_naming_the_first(tmp_path):
    ep = f"ipc://{tmp_path}/s.sock"
    lock = EndpointLock(ep)  # as a running `memspec up` holds it
    try:
        one_line_error(memspec("up", "--no-stdin", "--endpoint", ep),
                       f"(pid {os.getpid()}) already serves {ep}")
    finally:
        lock.release()


def test_the_lock_replaces_a_stale_socket_and_refuses_a_live_one(tmp_path):
    path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    lock = EndpointLock(f"ipc://{path}")
    assert not path.exists()  # stale: removed
    lock.release()
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(path))
        live.listen()
        with pytest.raises(MemspecError, match="another process listens"):
            EndpointLock(f"ipc://{path}")


@pytest.mark.parametrize("ep", ["tcp://127.0.0.1", "tcp://:80", "tcp://h:0", "ipc://",
                                "udp://x:1", "ipc:///" + "x" * 120])
def test_endpoint_syntax(ep):
    with pytest.raises(MemspecError):
        check_endpoint(ep)


def test_an_unexpected_exception_is_one_line_with_the_traceback_in_a_file(capsys,
                                                                          monkeypatch,
                                                                          tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))

    def boom(_args: object) -> int:
        raise ZeroDivisionError("division by zero\nsecond line")

    assert main(["status"], run=boom) == 1
    err = capsys.readouterr().err
    assert ONE_LINE.fullmatch(err) and "internal error (ZeroDivisionError: division by zero)" in err
    saved = Path(re.search(r"traceback in (\S+);", err).group(1))
    assert "Traceback" in saved.read_text()
    assert main(["status", "--debug"], run=boom) == 1
    assert "Traceback" in capsys.readouterr().err


# ---- clients never wait forever ------------------------------------------------------------
@contextmanager
def fake_server(behave: Callable[[zmq.Socket, list[bytes]], None]) -> Iterator[str]:
    """A ROUTER on a free port that hands the first request's envelope to `behave`."""
    ctx = zmq.Context()
    router = configure(ctx.socket(zmq.ROUTER))
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        if router.poll(10_000):
            frames = router.recv_multipart()
            behave(router, frames[:1])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        t.join(15)
        ctx.destroy(linger=0)


FAST = client.Timeouts(connect=2, first=0.5, idle=0.5)


@pytest.mark.parametrize("first, error", [(None, "has not answered for 0.5s"),
                                          (Queued(req_id="r", ahead=0),
                                           "has not sent anything for 0.5s")])
def test_a_server_that_stays_silent_times_out(first, error):
    def silent(sock: zmq.Socket, env: list[bytes]) -> None:
        if first is not None:
            send(sock, first, ident=env)
        time.sleep(1.5)

    with fake_server(silent) as ep, pytest.raises(MemspecError, match=error):
        client.submit(ep, "x", timeouts=FAST)


def test_a_server_that_vanishes_mid_request_is_seen_at_once():
    def queued_then_gone(sock: zmq.Socket, env: list[bytes]) -> None:
        send(sock, Queued(req_id="r", ahead=0), ident=env)
        time.sleep(0.2)
        sock.close(linger=0)

    slow = client.Timeouts(connect=2, first=5, idle=20)
    t0 = time.monotonic()
    with fake_server(queued_then_gone) as ep, \
            pytest.raises(MemspecError, match="went away during the request"):
        client.submit(ep, "x", timeouts=slow)
    assert time.monotonic() - t0 < 10  # seen by the monitor, not by the 20 s idle timeout


def test_status_refuses_to_print_a_forged_status():
    forged = Status(procs={"\x1b[2J": ProcStatus(pid=1, state="ready")}, slots=[])

    with fake_server(lambda sock, env: send(sock, forged, ident=env)) as ep, \
            pytest.raises(MemspecError, match="names processes"):
        client.status(ep, FAST)


# ---- the supervisor's request API, without processes -------------------------------------
@pytest.fixture
def idle_sup(tmp_path, monkeypatch) -> Iterator[Supervisor]:
    """A supervisor whose processes never start: requests queue, nothing is dispatched."""
    monkeypatch.setattr(supervisor, "KEEPALIVE_S", 0.1)
    (tmp_path / "run").mkdir()
    s = Supervisor(client_endpoint=f"ipc://{tmp_path}/c.sock", run_dir=tmp_path / "run",
                   max_queue=3)
    yield s
    s.shutdown()


def test_queue_is_bounded_and_requests_are_checked(idle_sup):
    got: list[Message] = []
    for i in range(3):
        idle_sup.submit(Submit(req_id=f"r{i}", prompt="hi"), got.append)
    assert [m.ahead for m in got] == [0, 1, 2] and all(isinstance(m, Queued) for m in got)
    with pytest.raises(ServerBusy, match="server busy: 3 requests are queued"):
        idle_sup.submit(Submit(req_id="r3", prompt="hi"), got.append)
    assert idle_sup.cancel("r1") and not idle_sup.cancel("nope")
    assert got[-1] == Error(req_id="r1", message="cancelled")
    with pytest.raises(RequestError, match="already in use"):
        idle_sup.submit(Submit(req_id="r0", prompt="hi"), got.append)
    with pytest.raises(RequestError, match="cannot be sent"):
        idle_sup.submit(Submit(req_id="bad", prompt="caf\udce9"), got.append)
    idle_sup.shutdown()
    assert {m.req_id for m in got if isinstance(m, Error)} == {"r0", "r1", "r2"}
    assert "server is stopping" in got[-1].message
    assert not Path(idle_sup.client_endpoint[6:]).exists()


def _tick_until(sup: Supervisor, cond: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        sup.tick(10)


def test_a_client_that_leaves_has_its_request_cancelled(idle_sup):
    ctx = zmq.Context()
    try:
        dealer = configure(ctx.socket(zmq.DEALER))
        dealer.connect(idle_sup.client_endpoint)
        send(dealer, Submit(req_id="gone", prompt="hi"), flags=0)
        _tick_until(idle_sup, lambda: len(idle_sup.queue) == 1)
        _tick_until(idle_sup, lambda: dealer.poll(0) > 0)
        assert isinstance(CLIENT_REPLIES.decode(dealer.recv_multipart()), Queued)
        dealer.close(linger=0)
        _tick_until(idle_sup, lambda: not idle_sup.queue)  # the next keep-alive finds it gone
    finally:
        ctx.destroy(linger=0)


def test_req_clients_get_one_reply_per_request(idle_sup):
    ctx = zmq.Context()
    try:
        req = configure(ctx.socket(zmq.REQ))
        req.connect(idle_sup.client_endpoint)
        req.send_multipart(encode(StatusRequest()))
        _tick_until(idle_sup, lambda: req.poll(0) > 0)
        st = CLIENT_REPLIES.decode(req.recv_multipart())
        assert isinstance(st, Status) and set(st.procs) == {"loader", "predictor", "decoder"}
        req.send_multipart(encode(Submit(req_id="q", prompt="hi")))
        _tick_until(idle_sup, lambda: len(idle_sup.queue) == 1)
        for _ in range(20):  # keep-alives are not sent to a REQ socket
            idle_sup.tick(10)
        assert not req.poll(0)
        idle_sup.shutdown()
        assert req.poll(2000)
        end = CLIENT_REPLIES.decode(req.recv_multipart())
        assert isinstance(end, Error) and end.req_id == "q"
    finally:
        ctx.destroy(linger=0)


def test_client_endpoint_accepts_only_requests(idle_sup):
    assert CLIENT_REQUESTS.types == (Submit, StatusRequest)
    assert Done not in CLIENT_REQUESTS.types


# ---- stdin and logs ------------------------------------------------------------------------
class QueueOnly:
    def __init__(self, max_queue: int) -> None:
        self.queue: list[Submit] = []
        self.max_queue = max_queue

    def submit(self, req: Submit, reply: object) -> None:
        self.queue.append(req)


def test_stdin_is_read_as_bytes_with_backpressure_and_survives_eof(capsys):
    r, w = os.pipe()
    os.write(w, b"first\ncaf\xe9\n\n  second  \nthird\nfourth")
    os.close(w)
    fake = QueueOnly(max_queue=2)
    reader = StdinPrompts(fake, "ipc:///x", fd=r)  # type: ignore[arg-type]
    for _ in range(5):
        reader.poll()
    assert [q.prompt for q in fake.queue] == ["first", "second"]  # queue full: reading waits
    fake.queue.clear()
    for _ in range(5):
        reader.poll()
    assert [q.prompt for q in fake.queue] == ["third", "fourth"] and not reader.open
    err = capsys.readouterr().err.splitlines()
    assert err == ["memspec: error: stdin line 2 is not UTF-8 (byte 0xe9 at offset 3); "
                   "line skipped, send UTF-8 text",
                   "[memspec] stdin closed; still serving ipc:///x (Ctrl-C to stop)"]
    os.close(r)


def test_rejected_messages_are_logged_at_a_bounded_rate():
    lines: list[str] = []
    now = [0.0]
    log = RejectLog(lines.append, burst=3, window_s=60, clock=lambda: now[0])
    for _ in range(1000):
        log("junk")
    assert len(lines) == 4 and lines[-1] == "further rejected messages are not logged for 60s"
    now[0] = 61
    log("junk")
    assert lines[4:] == ["997 more rejected messages were not logged", "rejected message: junk"]
    assert log.count == 1001
