"""The loader process: byte-exact fills, Cancel, bad files, bad frames, pacing, lifecycle.

Every test talks to a real ``python -m memspec.procs.loader.main`` over ZeroMQ, as the
decoder and supervisor do.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from hostile import hostile_frames

from memspec.common import sockets
from memspec.common.manifest import weights_entry
from memspec.common.messages import (
    CONTROL,
    LOADER_REPLIES,
    Cancel,
    Error,
    Heartbeat,
    Load,
    Loaded,
    LoadFailed,
    Ready,
    Shutdown,
    encode,
)
from memspec.common.safetensors_layout import read_layout
from memspec.common.slotmem import SlotMemory, cleanup_shm, new_run_token, shm_name
from memspec.procs.decoder.models import load_causal_lm
from memspec.procs.decoder.slots import SlotBuffer, bind_draft
from memspec.procs.loader import reader as reader_mod
from memspec.procs.loader.pacing import TokenBucket
from memspec.procs.loader.reader import ColdReader, read_ahead

CAP = 1 << 20
TIMEOUT = 30.0  # generous: CI machines are shared
X = torch.tensor([[1, 3, 5, 7, 11, 13, 17]])


class Loader:
    """A spawned loader process plus the decoder-side and supervisor-side sockets."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.run_dir = sockets.make_run_dir()  # short: under pytest's numbered tmp folders
        # an ipc path outgrew sun_path once pytest's counter reached three digits
        self.ctx = zmq.Context()
        self.control = sockets.configure(self.ctx.socket(zmq.PULL))
        control_ep = sockets.endpoint(self.run_dir, "control")
        self.control.bind(control_ep)
        self.endpoint = sockets.endpoint(self.run_dir, "loader")
        self.stderr = open(tmp / "loader.stderr", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "memspec.procs.loader.main", "--endpoint", self.endpoint,
             "--control", control_ep, *args], stderr=self.stderr)
        self.ready = self.next_control(Ready)
        self.dealer = self.connect()

    def connect(self) -> zmq.Socket:
        sock = sockets.configure(self.ctx.socket(zmq.DEALER))
        sock.connect(self.endpoint)
        return sock

    def next_control(self, kind: type, timeout: float = TIMEOUT):
        end = time.monotonic() + timeout
        while self.control.poll(max(1, int((end - time.monotonic()) * 1000))):
            _, msg = sockets.recv(self.control, CONTROL)
            if isinstance(msg, kind):
                return msg
            if time.monotonic() > end:
                break
        raise AssertionError(f"no {kind.__name__} on the control socket")

    def forget_control(self) -> None:
        """Drop what earlier tests left queued on the shared control socket, so the next
        message read was sent from now on (the loader sends a heartbeat every 0.5 s)."""
        while self.control.poll(0):
            self.control.recv_multipart()

    def reply(self, sock: zmq.Socket | None = None, timeout: float = TIMEOUT):
        sock = sock or self.dealer
        assert sock.poll(int(timeout * 1000)), "loader did not reply"
        _, msg = sockets.recv(sock, LOADER_REPLIES)
        return msg

    def silent(self, seconds: float, sock: zmq.Socket | None = None) -> bool:
        return not (sock or self.dealer).poll(int(seconds * 1000))

    def log(self) -> str:
        if not self.stderr.closed:
            self.stderr.flush()
        return Path(self.stderr.name).read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.ctx.destroy(0)
        self.stderr.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode


@pytest.fixture(scope="module")
def loader(tmp_path_factory):
    ld = Loader(tmp_path_factory.mktemp("loader"), "--chunk", "65536")  # many chunks per draft
    yield ld
    assert ld.stop() == 0
    assert "Traceback" not in ld.log()


@pytest.fixture
def slots():
    token = new_run_token()
    made: list[SlotMemory] = []

    def make(capacity: int = CAP) -> SlotMemory:
        made.append(SlotMemory.create(shm_name(token, len(made)), capacity, "shm"))
        return made[-1]

    yield make
    for mem in made:
        mem.close()
    cleanup_shm(f"memspec-{token}-")


def data_section(path: Path) -> bytes:
    lay = read_layout(path)
    return path.read_bytes()[lay.data_offset:lay.file_size]


def load_msg(path: Path, mem: SlotMemory, slot: int = 0, generation: int = 1, **kw) -> Load:
    kw = {"capacity": mem.capacity, "transport": "shm", "handle": mem.handle, **kw}
    return Load(slot=slot, generation=generation, draft=Path(path).parent.name, path=str(path),
                **kw)


def test_ready_and_heartbeats_reach_the_control_socket(loader):
    assert loader.ready.proc == "loader" and loader.ready.pid == loader.proc.pid
    assert loader.ready.info.chunk == 65536 and "shm" in loader.ready.info.transports
    loader.forget_control()
    t0 = time.monotonic()
    beat = loader.next_control(Heartbeat, timeout=5)
    assert beat.proc == "loader" and beat.pid == loader.proc.pid and beat.state == "idle"
    assert time.monotonic() - t0 < 2.0  # a fresh one, every 0.5 s


def test_slot_bytes_equal_file_data_and_bound_draft_matches_normal_load(loader, slots, tiny_dir):
    for i, name in enumerate(("self", "small")):
        path = tiny_dir / name / "model.safetensors"
        want = data_section(path)
        mem = slots()
        mem.tensor.fill_(0xAB)
        sha = hashlib.sha256(want).hexdigest()
        sockets.send(loader.dealer, load_msg(path, mem, slot=i, expected_sha256=sha))
        msg = loader.reply()
        assert isinstance(msg, Loaded), msg
        assert (msg.slot, msg.generation, msg.draft) == (i, 1, name)
        assert msg.nbytes == len(want) and msg.checksum == sha and msg.seconds > 0
        assert mem.tensor[:len(want)].numpy().tobytes() == want
        assert int(mem.tensor[len(want):].min()) == 0xAB  # nothing written past the data

        buf = SlotBuffer(CAP, data=mem.tensor)
        bound = bind_draft(name, tiny_dir / name, buf, read_layout(path))
        normal = load_causal_lm(tiny_dir / name, "draft")
        with torch.inference_mode():
            assert torch.equal(bound.model(X).logits, normal(X).logits)
        del bound, buf


def test_a_kept_slot_mapping_is_dropped_when_the_decoder_recreates_the_segment(
        loader, slots, tiny_dir):
    """The loader keeps each slot's mapping between loads (a fresh one faults in every page
    it writes); a restarted decoder recreates the segment under the same name, and the
    next load must land in the new segment, not in the old one's orphaned memory."""
    path = tiny_dir / "self" / "model.safetensors"
    want = data_section(path)
    mem = slots()

    def load_into(target: SlotMemory, generation: int) -> None:
        target.tensor.fill_(0)
        sockets.send(loader.dealer, load_msg(path, target, slot=5, generation=generation))
        msg = loader.reply()
        assert isinstance(msg, Loaded), msg
        assert target.tensor[:len(want)].numpy().tobytes() == want

    load_into(mem, 1)
    load_into(mem, 2)  # the kept mapping
    name = mem.handle
    mem.close()
    mem.unlink()
    with SlotMemory.create(name, CAP, "shm") as again:
        load_into(again, 3)


def test_cancel_aborts_the_inflight_load_and_drops_queued_ones(loader, slots, tiny_dir):
    path = tiny_dir / "self" / "model.safetensors"
    slow = len(data_section(path)) / 4.0  # ~4 s if it were left alone
    a, b = slots(), slots()
    sockets.send(loader.dealer, load_msg(path, a, slot=0, generation=7, bandwidth_bytes_s=slow,
                                         storage="edge-emulated"))
    sockets.send(loader.dealer, load_msg(path, b, slot=1, generation=3))
    time.sleep(0.3)
    sockets.send(loader.dealer, Cancel(slot=1, generation=3))  # queued behind the slow one
    msg = loader.reply()
    assert isinstance(msg, LoadFailed) and (msg.slot, msg.reason) == (1, "cancelled")
    sockets.send(loader.dealer, Cancel(slot=0, generation=6))  # stale: matches nothing
    sockets.send(loader.dealer, Cancel(slot=0, generation=7))
    msg = loader.reply()
    assert isinstance(msg, LoadFailed), msg
    assert (msg.slot, msg.generation, msg.reason) == (0, 7, "cancelled")
    assert loader.silent(1.0)  # neither load ever reports Loaded


@pytest.mark.parametrize("damage,reason", [
    ("missing", "not found"),
    ("header", "corrupt safetensors header"),
    ("truncated", "truncated"),
    ("trailing", "bytes after its data section"),
    ("checksum", "checksum mismatch"),
    ("manifest-bytes", r"tensor '[^']+' \(bytes \d+-\d+\) differs from its manifest"),
    ("manifest-header", "the header of .* differs from its manifest"),
    ("manifest-ranges", "manifest ranges do not tile the data section"),
    ("too-big", "needs .* bytes but the slot holds"),
    ("bad-handle", "bad slot handle"),
    ("absent-segment", "bad slot handle: cannot open shm segment"),
    ("transport", "unknown transport"),
    ("storage", "unknown storage profile"),
])
def test_bad_loads_fail_with_reason_and_next_load_succeeds(loader, slots, tiny_dir, tmp_path,
                                                           damage, reason):
    src = tiny_dir / "small" / "model.safetensors"
    path = tmp_path / "small" / "model.safetensors"
    path.parent.mkdir()
    raw = src.read_bytes()
    kw: dict = {}
    mem = slots()
    if damage == "header":
        raw = raw[:8] + b"{garbage" + raw[16:]
    elif damage == "truncated":
        raw = raw[:-100]
    elif damage == "trailing":
        raw = raw + b"\0" * 10
    elif damage == "checksum":
        kw["expected_sha256"] = "0" * 64
    elif damage.startswith("manifest"):  # the clean file's manifest, a same-size change
        entry = weights_entry(src, src.name)
        kw.update(header_sha256=entry.header_sha256, ranges=list(entry.ranges))
        if damage == "manifest-bytes":
            mid = entry.data_offset + entry.data_size // 2
            raw = raw[:mid] + bytes(b ^ 0xFF for b in raw[mid:mid + 64]) + raw[mid + 64:]
        elif damage == "manifest-header":
            assert b'"pt"' in raw[:entry.data_offset]
            raw = raw.replace(b'"pt"', b'"pX"', 1)  # still a valid header, not the same one
        else:
            kw["ranges"] = kw["ranges"][1:]
    elif damage == "too-big":
        kw["capacity"] = 1024
    elif damage == "bad-handle":
        kw["handle"] = "../../etc/passwd"
    elif damage == "absent-segment":
        kw["handle"] = shm_name(new_run_token(), 0)
    elif damage == "transport":
        kw["transport"] = "floppy"
    elif damage == "storage":
        kw["storage"] = "tape"
    if damage != "missing":
        path.write_bytes(raw)
    msg = load_msg(path, mem, **kw)
    sockets.send(loader.dealer, msg)
    got = loader.reply()
    assert isinstance(got, LoadFailed), got
    assert (got.slot, got.generation, got.draft) == (0, 1, "small")
    assert "\n" not in got.reason
    assert re.search(reason, got.reason), got.reason
    sockets.send(loader.dealer, load_msg(src, mem, generation=2))
    ok = loader.reply()
    assert isinstance(ok, Loaded) and ok.generation == 2


def test_malformed_frames_get_an_error_and_the_loader_stays_up(loader, slots, tiny_dir):
    other = Loaded(slot=0, generation=0, draft="x", nbytes=0, seconds=0.0, checksum="")
    for frames in [*hostile_frames(other), encode(Shutdown(reason="not a loader message"))]:
        loader.dealer.send_multipart(frames)
        msg = loader.reply()
        assert isinstance(msg, Error) and msg.req_id == "" and msg.message, msg
    assert "Shutdown is not accepted on the loader socket" in msg.message  # SIGTERM stops it
    # over ZeroMQ's MAXMSGSIZE: the connection is dropped, the process lives on
    rogue = loader.connect()
    rogue.send_multipart([b"\x00" * (17 << 20)])
    time.sleep(0.3)
    rogue.close(0)
    assert loader.proc.poll() is None
    mem = slots()
    sockets.send(loader.dealer, load_msg(tiny_dir / "self" / "model.safetensors", mem))
    assert isinstance(loader.reply(), Loaded)
    assert "rejected message" in loader.log()


def test_paced_load_takes_at_least_size_over_bandwidth_and_heartbeats_meanwhile(
        loader, slots, tiny_dir):
    path = tiny_dir / "self" / "model.safetensors"
    n = len(data_section(path))
    bw = n / 1.5  # 1.5 s
    mem = slots()
    loader.forget_control()  # heartbeats of earlier loads must not count
    t0 = time.monotonic()
    sockets.send(loader.dealer, load_msg(path, mem, bandwidth_bytes_s=bw,
                                         storage="edge-emulated"))
    busy = loader.next_control(Heartbeat)
    while not busy.state.startswith("loading"):
        busy = loader.next_control(Heartbeat)
    msg = loader.reply()
    wall = time.monotonic() - t0
    assert isinstance(msg, Loaded), msg
    assert msg.seconds >= 0.8 * n / bw and wall >= 0.8 * n / bw
    assert busy.state == "loading self"


def test_sigterm_during_a_load_fails_it_and_exits_cleanly(tmp_path, slots, tiny_dir):
    ld = Loader(tmp_path)
    path = tiny_dir / "self" / "model.safetensors"
    mem = slots()
    sockets.send(ld.dealer, load_msg(path, mem, bandwidth_bytes_s=len(data_section(path)) / 5))
    sockets.send(ld.dealer, load_msg(path, mem, generation=2))
    time.sleep(0.3)
    ld.proc.send_signal(signal.SIGTERM)
    reasons = {ld.reply().reason, ld.reply().reason}
    assert reasons == {"loader shutting down"}
    assert ld.proc.wait(TIMEOUT) == 0
    log = ld.log()
    assert ld.stop() == 0
    assert re.search(r"INFO loader\[\d+\]: stopped", log) and "Traceback" not in log


def test_sigterm_exits_cleanly(tmp_path):
    ld = Loader(tmp_path)
    ld.proc.send_signal(signal.SIGTERM)
    assert ld.proc.wait(TIMEOUT) == 0
    assert ld.stop() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ipc_slot_filled_by_the_loader_process(loader, tiny_dir):
    path = tiny_dir / "self" / "model.safetensors"
    want = data_section(path)
    mem = SlotMemory.create("gpu-slot", CAP, "cuda-ipc", device="cuda")
    sockets.send(loader.dealer, Load(slot=0, generation=1, draft="self", path=str(path),
                                     transport="cuda-ipc", handle=mem.handle, capacity=CAP))
    msg = loader.reply()
    assert isinstance(msg, Loaded), msg
    assert mem.tensor[:len(want)].cpu().numpy().tobytes() == want
    mem.close()


# --- in-process units ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "buffered"])
@pytest.mark.parametrize("start,size", [(0, 10000), (1, 8191), (4095, 20000), (777, 1)])
def test_cold_reader_returns_the_exact_range(tmp_path, mode, start, size):
    path = tmp_path / "f.bin"
    blob = os.urandom(32768)
    path.write_bytes(blob)
    reader = ColdReader(path, start, size, chunk=8192, mode=mode)
    got = b"".join(bytes(v) for v in reader)
    reader.close()
    assert got == blob[start:start + size]


def test_cold_reader_falls_back_where_o_direct_is_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *args):  # what tmpfs/overlay kernels answer
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(reader_mod.os, "open", no_direct)
    reader_mod._warned.clear()
    path = tmp_path / "f.bin"
    path.write_bytes(b"abcdefgh" * 1000)
    reader = ColdReader(path, 3, 5000, chunk=4096, mode="direct")
    assert b"".join(bytes(v) for v in reader) == (b"abcdefgh" * 1000)[3:5003]
    assert reader.mode == "buffered"
    assert "O_DIRECT refused" in caplog.text  # a warning of the loader's log


def test_read_ahead_surfaces_errors_and_stops_when_closed(tmp_path):
    path = tmp_path / "f.bin"
    blob = os.urandom(40000)
    path.write_bytes(blob)
    reader = ColdReader(path, 5, 39995, chunk=4096, ring=4)
    assert b"".join(bytes(v) for v in read_ahead(reader)) == blob[5:]
    short = ColdReader(path, 5, 50000, chunk=4096, ring=4)  # file shrank under us
    with pytest.raises(EOFError):
        for _ in read_ahead(short):
            pass
    gen = read_ahead(ColdReader(path, 0, 40000, chunk=4096, ring=4))
    next(gen)
    gen.close()  # a cancel mid-load: the thread ends, nothing hangs
    assert not any(t.name == "loader-read-ahead" for t in threading.enumerate())


def test_token_bucket_starts_empty_and_paces_to_rate():
    now = [0.0]
    bucket = TokenBucket(rate=1000.0, burst=500.0, clock=lambda: now[0])
    assert bucket.reserve(500) == pytest.approx(0.5)
    now[0] = 0.5
    assert bucket.reserve(250) == pytest.approx(0.25)
    now[0] = 10.0  # idle time refills only up to the burst
    assert bucket.reserve(500) == 0.0
    assert bucket.reserve(1000) == pytest.approx(1.0)
